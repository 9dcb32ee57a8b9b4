"""`decodectl engine`: serve a model over the OpenAI API, with vLLM-compatible metrics.

Example:

    decodectl engine --model smollm2-135m --host 127.0.0.1 --port 8001 --kv-cache-gib 1 \\
        --speculative-method ngram --num-speculative-tokens 4
"""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    # Every default below is read from the config dataclasses, the one place each lives (torch-free).
    from decodeservice.engine.config import CPU_KV_CACHE_GIB, EngineConfig, SpeculativeConfig, field_default
    from decodeservice.engine.server.settings import ServerSettings

    def engine(name: str) -> Any:
        return field_default(EngineConfig, name)

    def spec(name: str) -> Any:
        return field_default(SpeculativeConfig, name)

    def server(name: str) -> Any:
        return field_default(ServerSettings, name)

    parser: argparse.ArgumentParser = subparsers.add_parser(
        "engine", help="serve a model over the OpenAI API (completions, chat, /metrics, /health, /ready)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="smollm2-135m", help="known model name, .gguf file or HF model folder")
    parser.add_argument("--served-model-name", help="the name clients send as `model` (default: --model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8001, help="port to listen on (default 8001)")
    parser.add_argument("--kv-cache-gib", type=float, help=f"KV cache size in GiB (default: {CPU_KV_CACHE_GIB:g} "
                        "on CPU, --gpu-memory-fraction of free memory on GPU)")
    parser.add_argument("--gpu-memory-fraction", type=float, default=engine("gpu_memory_fraction"),
                        help="GPU memory share (default %(default)s)")
    parser.add_argument("--max-num-seqs", type=int, default=engine("max_num_seqs"),
                        help="max sequences per batch (default %(default)s)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=engine("max_num_batched_tokens"),
                        help="tokens per step (default %(default)s)")
    parser.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    parser.add_argument("--dtype", default=engine("dtype"), choices=["auto", "float32", "float16", "bfloat16"],
                        help="activations and KV cache (default %(default)s: bfloat16 with int8/int4 weights or on "
                             "CUDA, else float32)")
    parser.add_argument("--device", default=engine("device"), help="torch device, e.g. cpu or cuda (default %(default)s)")
    parser.add_argument("--quantization", default=engine("quantization"), choices=["auto", "none", "int8", "int4"],
                        help="weight format (default %(default)s: the model's own, int4 for a Q4_0/Q4_1 GGUF on "
                             "CPU); int8 and int4 run on CPU")
    parser.add_argument("--w8a8", action=argparse.BooleanOptionalAction, default=engine("w8a8"),
                        help="int8/int4 weights: run batches and prompt chunks of 6+ rows as int8 activations "
                             "x int8 weights (int4 keeps an int8 copy: +1 byte a weight); default %(default)s")
    parser.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    parser.add_argument("--num-threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--compile", action="store_true",
                        help="CPU: run decode steps as one torch.compile graph, compiled at start-up (needs a C++ "
                             "compiler; minutes the first time, seconds from inductor's cache; one int4 stream "
                             "about 1.25x faster)")
    group = parser.add_argument_group("speculative decoding")
    group.add_argument("--speculative-method", choices=["none", "ngram", "draft", "self_draft"], default="none")
    group.add_argument("--num-speculative-tokens", type=int, default=spec("num_tokens"),
                       help="most draft tokens per step, k (default %(default)s)")
    group.add_argument("--draft-model", help="draft model for --speculative-method draft")
    group.add_argument("--speculative-disable-batch-size", type=int,
                       help=f"turn speculation off at this many running sequences (default {spec('disable_batch_size')})")
    group.add_argument("--speculative-draft-row-cost", type=float,
                       help=f"cost of verifying one more draft, as a fraction of a decode step (default "
                            f"{spec('draft_row_cost')}, measured for int4 on CPU; about 0.04 for fp32); sets how fast k shrinks with low "
                            "acceptance and large batches")
    parser.add_argument("--max-body-bytes", type=int, default=server("max_body_bytes"),
                        help="request body limit in bytes (default %(default)s)")
    parser.add_argument("--drain-timeout", type=float, default=server("drain_timeout_s"),
                        help="seconds in-flight requests get to finish after SIGTERM (default %(default)s)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    parser.set_defaults(func=run)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments from the flags."""
    kwargs: dict[str, Any] = {
        "kv_cache_gib": args.kv_cache_gib, "gpu_memory_fraction": args.gpu_memory_fraction,
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len, "dtype": args.dtype, "device": args.device,
        "quantization": args.quantization, "enable_prefix_caching": not args.no_prefix_caching,
        "num_threads": args.num_threads, "compile": args.compile, "w8a8": args.w8a8,
    }
    if args.speculative_method != "none":
        spec: dict[str, Any] = {"method": args.speculative_method, "num_tokens": args.num_speculative_tokens,
                                "draft_model": args.draft_model}
        if args.speculative_disable_batch_size is not None:
            spec["disable_batch_size"] = args.speculative_disable_batch_size
        if args.speculative_draft_row_cost is not None:
            spec["draft_row_cost"] = args.speculative_draft_row_cost
        kwargs["speculative"] = spec
    elif args.draft_model:
        kwargs["speculative"] = {"method": "draft", "num_tokens": args.num_speculative_tokens,
                                 "draft_model": args.draft_model}
    return kwargs


def run(args: argparse.Namespace) -> int:
    import logging

    from decodeservice.cli.main import UsageError
    from decodeservice.engine import ConfigError, Engine, EngineConfig, ModelLoadError, SpeculativeConfig
    from decodeservice.engine.loader.registry import resolve_model_path
    from decodeservice.engine.server.serve import serve
    from decodeservice.engine.server.settings import ServerSettings

    if not 0 <= args.port < 65536:
        raise UsageError(f"--port {args.port} is not a TCP port")
    kwargs = engine_kwargs(args)
    try:
        # Check everything a user can get wrong before listening: a bad flag is exit 2, not a crash loop.
        EngineConfig(**{**kwargs, "speculative": SpeculativeConfig.parse(kwargs.get("speculative"))})
        settings = ServerSettings(served_model_name=args.served_model_name or args.model,
                                  max_body_bytes=args.max_body_bytes, drain_timeout_s=args.drain_timeout)
        model_path = resolve_model_path(args.model)
        if args.draft_model:
            resolve_model_path(args.draft_model)  # a typo fails here, not after minutes of loading
    except (ConfigError, ModelLoadError, ValueError) as exc:
        raise UsageError(str(exc)) from None

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve(settings, engine_factory=lambda: Engine.from_pretrained(model_path, **kwargs),
                 host=args.host, port=args.port, log_level=args.log_level)
