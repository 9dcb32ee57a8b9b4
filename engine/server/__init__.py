"""The engine's HTTP server: OpenAI-compatible API, vLLM-compatible /metrics, probes and SIGTERM drain.

Start with `decodectl engine`, or `serve.make_server(...)` to embed it.
"""
