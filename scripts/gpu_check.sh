#!/usr/bin/env bash
# The GPU checks, for a lent CUDA machine (under 8 minutes): the CUDA tests (flex attention against the
# dense reference, CUDA graphs against eager, the CUDA precision rules), then decode tokens/s at 1, 8
# and 32 streams against HF transformers on the same GPU, eager and with CUDA graphs.
#
#   bash scripts/gpu_check.sh [OUT_DIR]
#
# Uses the machine's own python3 with its CUDA torch (never the CPU pin of scripts/setup.sh), with the
# project installed without dependencies on top; wheels the machine lacks can sit in .whl/ (see the
# device tool's notes). Results: OUT_DIR/gpu_tests.log and OUT_DIR/gpu_decode*.json.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$out"
python3 -m venv --system-site-packages /tmp/gpu-venv
py=/tmp/gpu-venv/bin/python
if [ -d .whl ]; then $py -m pip install --quiet --no-index --find-links .whl/ .whl/*.whl; fi
$py -m pip install --quiet --no-deps --no-build-isolation -e . || exit 2
$py -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" || exit 2
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
status=0
timeout 240 $py -P -m pytest -q -p no:cacheprovider -o filterwarnings=default \
    tests/engine/attention/test_flex.py tests/engine/test_cuda_graphs.py \
    "tests/engine/test_quantized.py::test_cuda_auto_runs_bf16" 2>&1 | tee "$out/gpu_tests.log" || status=1
timeout 120 $py -P benchmarks/gpu_decode.py --streams 1,8,32 > "$out/gpu_decode.json" || status=1
timeout 120 $py -P benchmarks/gpu_decode.py --streams 1,8,32 --cuda-graphs > "$out/gpu_decode_graphs.json" || status=1
cat "$out"/gpu_decode*.json
exit $status
