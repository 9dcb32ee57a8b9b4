"""Serving plumbing shared by the engine server and the proxy, so each mechanism exists once.

- `lifecycle`: the loading -> ready -> draining (or failed) state machine and the in-flight count;
- `server`: `DrainingServer`, uvicorn with SIGTERM meaning "drain, then exit 0";
- `body`: reading a request body under a size limit (413);
- `errors`: `OpenAIError` and its subclasses, the one OpenAI error vocabulary and renderer;
- `camel_model`: `CamelModel`, the pydantic base of the proxy policy and the DecodeService spec;
- `stats`: `percentile`, the one percentile rule (the proxy's SLOs, `decodectl bench`, the studies).
"""
