"""Test support: fakes that tests and the benchmarks in `benchmarks/` use, kept out of the wheel.

Nothing under `decodeservice` imports this package (tests/test_layout.py checks it). Import it as
`tests.support.<module>`; a benchmark script puts the repository root on `sys.path` first.

- `fake_engine`: the one fake OpenAI-compatible engine, in-loop (`serve_loopback`) or as a process.
- `vllm_standin`: a vLLM stand-in served from a recorded contract (`contracts/vllm/<version>.json`).
"""
