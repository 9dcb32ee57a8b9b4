"""Record vLLM's HTTP contract from a pinned release's own source, as test data.

    pip download --no-deps vllm==0.11.0 -d /tmp/vllm_wheel
    python scripts/record_vllm_contract.py --wheel /tmp/vllm_wheel/vllm-0.11.0-*.whl
    python scripts/record_vllm_contract.py --source ~/src/vllm          # a checkout at a release tag

It reads (never imports, never copies) vLLM's source with `ast` and writes
tests/support/contracts/vllm/<version>.json: the OpenAI API server's route table (method, path, handler,
file, line, and the condition a route is registered under), what `/health` answers, the fields of the
request/response models the proxy sends or reads, wire facts of the streaming responses (each checked
against the source by a pattern, so a release that changes one fails here and is reviewed by hand), and
every `vllm:` Prometheus metric with its type, labels and exposed sample names (rendered by
prometheus_client, as vLLM does). vLLM is Apache-2.0; the record holds facts about its interface, with
the files they came from, not its code. tests/support/vllm_standin.py serves what a record says.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import sys
import zipfile
from pathlib import Path
from typing import Any

API = "vllm/entrypoints/openai/api_server.py"
PROTOCOL = "vllm/entrypoints/openai/protocol.py"
CHAT = "vllm/entrypoints/openai/serving_chat.py"
COMPLETION = "vllm/entrypoints/openai/serving_completion.py"
ENGINE = "vllm/entrypoints/openai/serving_engine.py"
UTILS = "vllm/entrypoints/utils.py"
METRICS_V1 = ("vllm/v1/metrics/loggers.py", "vllm/v1/spec_decode/metrics.py")
METRICS_V0 = ("vllm/engine/metrics.py",)
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
_OPTIONAL_SCHEMAS = {"ErrorInfo"}  # before 0.10 the error fields sat flat in ErrorResponse
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
    ("completion_chunk_json", "completion stream chunks are dumped whole, nulls included (`\"usage\":null` "
     "on each)", COMPLETION, r"chunk\.model_dump_json\(exclude_unset=False\)"),
    ("chat_role_chunk", "a chat stream opens with a role-only chunk whose delta content is the empty string",
     CHAT, r'DeltaMessage\(\s*role=role,\s*content="",?\s*\)'),
    ("usage_needs_stream_options", "a stream carries usage only when the request has stream_options "
     "(include_usage, default true inside it) or the server runs with --enable-force-include-usage",
     CHAT, r"include_usage = stream_options\.include_usage\s*\\?\s*or enable_force_include_usage"),
    ("usage_chunk", "the usage chunk comes last before [DONE], with `choices: []`, unset and null fields "
     "left out", CHAT, r"choices=\[\],\s*model=model_name,\s*usage=final_usage\)"),
    ("continuous_usage", "stream_options.continuous_usage_stats puts usage on every chunk", CHAT,
     r"include_continuous_usage = include_usage and\s*\\?\s*stream_options\.continuous_usage_stats"),
    ("prompt_tokens_details", "usage.prompt_tokens_details.cached_tokens only with "
     "--enable-prompt-tokens-details and a prefix-cache hit", CHAT,
     r"if self\.enable_prompt_tokens_details and num_cached_tokens:"),
    ("stream_error_event", "an error inside a stream is the event `data: <error JSON>` (status stays 200), "
     "then [DONE]", CHAT, r'data = self\.create_streaming_error_response\(str\(e\)\)\s*yield f"data: \{data\}\\n\\n"'),
    ("listens_once_loaded", "the server binds its port (no listen) first, builds the engine (loads the model), "
     "and only then serves HTTP: while loading, connections are refused and there is no endpoint to ask", API,
     r"sock\.bind\(addr\)\s*return sock[\s\S]*setup_server\(args\)[\s\S]{0,1500}"
     r"async with build_async_engine_client\([\s\S]{0,2500}serve_http\("),
    ("api_key_only_v1", "with --api-key only paths under /v1 need `Authorization: Bearer`; /health, /tokenize "
     "and /metrics stay open; a refusal is 401 `{\"error\": \"Unauthorized\"}` (a string, not an object)", API,
     r'if url_path\.startswith\("/v1"\) and .*\n(?:.*\n){0,2}.*content=\{"error": "Unauthorized"\}'),
    ("max_tokens_precedence", "the output limit is max_completion_tokens when truthy, else max_tokens, "
     "bounded by the context left", UTILS,
     r'getattr\(request, "max_completion_tokens",\s*None\) or request\.max_tokens'),
)
_OPTIONAL_FACTS = {"max_tokens_precedence"}  # its file moved between releases


class Source:
    """vLLM's files, from a wheel (read in place) or a directory holding `vllm/`."""

    def __init__(self, *, wheel: Path | None = None, root: Path | None = None) -> None:
        self.wheel = wheel
        self.root = root
        self._zip = zipfile.ZipFile(wheel) if wheel else None

    def read(self, name: str) -> str | None:
        if self._zip is not None:
            try:
                return self._zip.read(name).decode("utf-8")
            except KeyError:
                return None
        assert self.root is not None
        path = self.root / name
        return path.read_text(encoding="utf-8") if path.is_file() else None

    def need(self, name: str) -> str:
        text = self.read(name)
        if text is None:
            raise SystemExit(f"{name}: not in this vLLM source; the layout changed, update this script")
        return text

    def license(self) -> str:
        if self._zip is not None:
            for name in self._zip.namelist():
                if name.endswith(".dist-info/METADATA"):
                    meta = self._zip.read(name).decode("utf-8")
                    if m := re.search(r"^License(?:-Expression)?: (.+)$", meta, re.M):
                        return m[1].strip()
        text = self.read("LICENSE") or ""
        return "Apache-2.0" if "Apache License" in text and "Version 2.0" in text else "unknown"

    def origin(self) -> str:
        if self.wheel is not None:
            digest = hashlib.sha256(self.wheel.read_bytes()).hexdigest()
            return f"{self.wheel.name} (sha256 {digest})"
        return f"source tree {self.root}"


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _condition(node: ast.AST, parents: dict[ast.AST, ast.AST], *, functions: bool = True) -> str | None:
    """The `if` tests (and, with `functions`, the enclosing functions) a node sits under; None: always."""
    parts: list[str] = []
    child, up = node, parents.get(node)
    while up is not None:
        if isinstance(up, ast.If):
            test = ast.unparse(up.test)
            parts.append(test if child in up.body else f"not ({test})")
        elif functions and isinstance(up, ast.FunctionDef | ast.AsyncFunctionDef) and child is not node:
            parts.append(f"inside {up.name}()")
        child, up = up, parents.get(up)
    return " and ".join(reversed(parts)) or None


def routes(text: str) -> list[dict[str, Any]]:
    tree = ast.parse(text)
    parents = _parents(tree)
    out: list[dict[str, Any]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for deco in node.decorator_list:
                if (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)
                        and isinstance(deco.func.value, ast.Name) and deco.func.value.id == "router"
                        and deco.args and isinstance(deco.args[0], ast.Constant)):
                    out.append({"method": deco.func.attr.upper(), "path": deco.args[0].value, "handler": node.name,
                                "file": API, "line": deco.lineno, "condition": _condition(node, parents)})
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Mount"
              and node.args and isinstance(node.args[0], ast.Constant)):
            out.append({"method": "GET", "path": node.args[0].value, "handler": ast.unparse(node.args[1]),
                        "file": API, "line": node.lineno, "condition": None, "mount": True})
    return sorted(out, key=lambda r: (r["path"], r["method"]))


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
                            "on_exception": when})
    return {"file": API, "line": fn.lineno, "answers": answers,
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


def schemas(text: str) -> dict[str, Any]:
    tree = ast.parse(text)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    out: dict[str, Any] = {}
    wanted: list[tuple[str, tuple[str, ...] | None]] = [(n, None) for n in SCHEMAS]
    wanted += list(REQUEST_FIELDS.items())
    for name, only in wanted:
        cls = classes.get(name)
        if cls is None and name in _OPTIONAL_SCHEMAS:
            out[name] = {"file": PROTOCOL, "absent": True}
            continue
        if cls is None:
            raise SystemExit(f"{PROTOCOL}: no class {name}; the protocol changed, update this script")
        fields = _fields(cls, only)
        entry: dict[str, Any] = {"file": PROTOCOL, "line": cls.lineno, "fields": fields}
        if only is not None:
            entry["fields_recorded"] = "only those the proxy reads or writes"
            entry["missing"] = [f for f in only if f not in fields]  # accepted as extra fields (extra="allow")
        out[name] = entry
    return out


def wire(src: Source) -> dict[str, Any]:
    facts: dict[str, Any] = {}
    for key, meaning, name, pattern in WIRE_FACTS:
        text = src.read(name)
        m = re.search(pattern, text or "")
        if m is None:
            if key in _OPTIONAL_FACTS:
                continue
            raise SystemExit(f"{name}: the wire fact {key!r} ({meaning}) no longer matches; review it by hand")
        assert text is not None
        facts[key] = {"fact": meaning, "file": name, "line": text.count("\n", 0, m.start()) + 1}
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


def metrics(text: str, *, file: str, engine: str) -> list[dict[str, Any]]:
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
                                 "samples": _samples(name.value, kind), "engine": engine, "file": file,
                                 "line": node.lineno, "condition": _condition(node, parents, functions=False)}
        if labels is None:
            entry["labels_source"] = ast.unparse(labels_expr) if labels_expr is not None else None
        out.append(entry)
    return out


def _samples(name: str, kind: str) -> list[str]:
    """The sample names prometheus_client exposes for such a metric (vLLM disables the _created ones)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    registry = CollectorRegistry(auto_describe=True)
    cls = {"gauge": Gauge, "counter": Counter, "histogram": Histogram}[kind]
    cls(name, "doc", registry=registry)
    text = generate_latest(registry).decode()
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    return sorted(n for n in names if not n.endswith("_created"))


def version(src: Source) -> str:
    text = src.need(VERSION_FILE)
    m = re.search(r"^__version__ = version = '([^']+)'", text, re.M) or re.search(r"version = ['\"]([^'\"]+)", text)
    if m is None:
        raise SystemExit(f"{VERSION_FILE}: no version found")
    return m[1]


def record(src: Source) -> dict[str, Any]:
    names = (API, PROTOCOL, CHAT, COMPLETION, ENGINE, UTILS, *METRICS_V1, *METRICS_V0)
    files = {name: src.read(name) for name in names}
    found = {name: text for name, text in files.items() if text is not None}
    metric_list: list[dict[str, Any]] = []
    for name in METRICS_V1:
        if name in found:
            metric_list += metrics(found[name], file=name, engine="v1")
    for name in METRICS_V0:
        if name in found:
            metric_list += metrics(found[name], file=name, engine="v0")
    return {
        "vllm_version": version(src),
        "recorded_from": src.origin(),
        "license": f"{src.license()}: vLLM's own license; this file records facts about its HTTP interface, "
                   "taken from the files named per item, and holds none of its code",
        "recorded_by": "scripts/record_vllm_contract.py",
        "files": {name: hashlib.sha256(text.encode()).hexdigest() for name, text in sorted(found.items())},
        "routes": routes(src.need(API)),
        "health": health(src.need(API)),
        "schemas": schemas(src.need(PROTOCOL)),
        "wire": wire(src),
        "metrics": sorted(metric_list, key=lambda m: (m["engine"], m["name"])),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--wheel", type=Path, help="a vllm-*.whl from `pip download --no-deps vllm==X`")
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
