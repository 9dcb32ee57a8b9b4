"""`decodectl engine`: serve a model over the OpenAI API, with vLLM-compatible metrics.

Example:

    decodectl engine --model smollm2-135m --host 127.0.0.1 --port 8001 --kv-cache-gib 1 \\
        --speculative-method ngram --num-speculative-tokens 4
"""

from __future__ import annotations

import argparse
from typing import Any

SPECULATIVE_DEST = "speculative_"  # the speculative group's options land in args.speculative_<field>


def register(subparsers: Any) -> None:
    # Every engine option is generated from the knob table (engine/config.py), torch-free: its flag, type,
    # default, bounds and help live there once; the CRD and the operator's args are generated from it too.
    from decodeservice.cli.common import add_seconds_option, subcommand_kwargs
    from decodeservice.engine.config import EngineConfig, SpeculativeConfig, field_default
    from decodeservice.engine.server.settings import ServerSettings

    def server(name: str) -> Any:
        return field_default(ServerSettings, name)

    parser: argparse.ArgumentParser = subparsers.add_parser(
        "engine", help="serve a model over the OpenAI API (completions, chat, /metrics, /health, /ready)",
        description=__doc__, **subcommand_kwargs(),
    )
    parser.add_argument("--model", default="smollm2-135m", help="known model name, .gguf file or HF model folder")
    parser.add_argument("--served-model-name", help="the name clients send as `model` (default: --model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8001, help="port to listen on (default 8001)")
    parser.add_argument("--explain-plan", action="store_true",
                        help="load the model, print the execution plan (each machine-dependent choice, what decided "
                        "it and where that came from) and exit 0 without serving")
    add_knob_options(parser, EngineConfig)
    add_knob_options(parser.add_argument_group("speculative decoding"), SpeculativeConfig, dest_prefix=SPECULATIVE_DEST)
    parser.add_argument("--max-body-bytes", type=int, default=server("max_body_bytes"),
                        help="request body limit in bytes (default %(default)s)")
    add_seconds_option(parser, "--drain-timeout-seconds", default=server("drain_timeout_s"),
                       help="how long in-flight requests get to finish after SIGTERM", deprecated=("--drain-timeout",))
    parser.set_defaults(func=run)


def add_knob_options(parser: Any, cls: type[Any], *, dest_prefix: str = "") -> None:
    """One option per knob with a flag; the default is the field's, so no flag holds a default of its own."""
    from decodeservice.engine.config import knob_fields

    for kf in knob_fields(cls):
        if kf.knob.flag is None:
            continue
        dest = dest_prefix + kf.name
        if kf.kind is bool:
            parser.add_argument(kf.knob.flag, dest=dest, action=argparse.BooleanOptionalAction,
                                default=kf.default, help=f"{kf.knob.help} (default {'on' if kf.default else 'off'})")
            continue
        shown = "" if kf.default is None else " (default %(default)s)"
        parser.add_argument(kf.knob.flag, dest=dest, type=kf.kind, default=kf.default,
                            choices=list(kf.choices) or None, help=kf.knob.help + shown)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments from the flags (the knobs that have one)."""
    from decodeservice.engine.config import EngineConfig, SpeculativeConfig, knob_fields

    kwargs: dict[str, Any] = {kf.name: getattr(args, kf.name) for kf in knob_fields(EngineConfig) if kf.knob.flag}
    speculative = {kf.name: getattr(args, SPECULATIVE_DEST + kf.name)
                   for kf in knob_fields(SpeculativeConfig) if kf.knob.flag}
    if speculative["method"] == "none" and speculative["draft_model"]:
        speculative["method"] = "draft"  # --draft-model alone asks for draft speculation
    if speculative["method"] != "none":
        kwargs["speculative"] = speculative
    return kwargs


def run(args: argparse.Namespace) -> int:

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
                                  max_body_bytes=args.max_body_bytes, drain_timeout_s=args.drain_timeout_seconds)
        model_path = resolve_model_path(args.model)
        if args.speculative_draft_model:
            resolve_model_path(args.speculative_draft_model)  # a typo fails here, not after minutes of loading
    except (ConfigError, ModelLoadError, ValueError) as exc:
        raise UsageError(str(exc)) from None

    if args.explain_plan:
        engine = Engine.from_pretrained(model_path, **kwargs)
        print("\n".join(engine.plan.explain()))
        return 0
    # Logging is set up once, by decodectl (cli/common.configure_logging): a root handler here as well
    # printed every decodeservice line twice.
    return serve(settings, engine_factory=lambda: Engine.from_pretrained(model_path, **kwargs),
                 host=args.host, port=args.port, log_level=args.log_level)
