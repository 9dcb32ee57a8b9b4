#!/usr/bin/env bash
# Set up (or reuse) .venv, then lint, type-check and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check engine proxy operator cli loadgen common router monitoring tests benchmarks
.venv/bin/python scripts/typecheck.py
.venv/bin/python -P -m pytest "$@"
if [ $# -eq 0 ]; then
    # The quantized CPU paths again as a CPU without AVX-512 runs them, on whatever machine this is:
    # ATen's AVX2 dispatch (which packs the int4 kernel's weights differently), oneDNN without
    # native bf16 (so the engine picks fp32 activations) and MKL's AVX2 GEMMs. See engine/quant/cpu.py.
    # The native kernels build for AVX2 there too: the paged-decode attention (fp32 caches), the
    # elementwise passes (RMSNorm, SiLU * up, RoPE: bit for bit the torch ops in fp32 too) and the
    # compiled step over them (where a native call dynamo cannot trace once crashed the trace). There the
    # default engine's KV pool is int8 rows (engine/plan/planner.py: plan_kv).
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 .venv/bin/python -P -m pytest -q \
        tests/engine/quant tests/engine/test_quantized.py tests/engine/attention/test_native_decode.py \
        tests/engine/attention/test_backends.py tests/engine/test_compiled_step.py \
        tests/engine/attention/test_kv_int8.py tests/engine/test_kv_int8_engine.py \
        tests/engine/test_prefix_consistency.py tests/engine/test_deterministic.py tests/engine/test_elementwise.py
fi
