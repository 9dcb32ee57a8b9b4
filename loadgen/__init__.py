"""The benchmarking tool that ships with DecodeService: `decodectl bench` and `decodectl demo`.

This package is product: it is installed, documented for users, and drives any OpenAI-compatible
server (ours, vLLM, llama.cpp, ...). `load` (closed-loop concurrency or seeded Poisson arrivals),
`client` (one streamed request, timed), `metrics` (TTFT, TPOT, ITL, goodput as `vllm bench serve`
defines them), `report` (table, JSON, Markdown, PNG), `dataset`/`datasets/` (the bundled workloads),
`runner` (a sweep), `demo` and `procs` (engine + proxy as local processes).

The project's own studies, which compare versions and peers and write JSON into
`benchmarks/results/`, are scripts in the repository's `benchmarks/` folder, not this package.
What only tests and those studies need lives in `tests/support/` (the fake engine, and the Kubernetes
API emulator built on the test-only kmock with its server-side-apply model).
"""
