"""llama.cpp's aggregate decode over many concurrent streams, the way its server batches them. JSON out.

    .venv/bin/python -P benchmarks/llama_cpp_batched.py [--streams 32] [--threads 1] [--decode-tokens 48]

llama-cpp-python's `Llama` decodes one sequence, and its bundled server serves one request at a time.
llama.cpp's own server (`llama-server -np N`) runs N slots through one context: every step it puts
each active slot's next token into one `llama_batch`, each with its slot's sequence id, and calls
`llama_decode` once. That binary is not built here, so this does the same through the library's C API
(llama-cpp-python's low-level bindings): one context with `n_seq_max = streams`, the prompts prefilled
into their own sequences, then steps of one token per stream, greedy. Like the engine's figure in
engine_vs_peers.py, the clock starts once every stream has its first token. No HTTP on either side.
Needs the optional `bench` extra (llama-cpp-python).
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))  # `python -P` leaves the script's folder off the path
from json_out import emit


def aggregate_tokens_per_s(model_path: Path, prompts: list[str], *, decode_tokens: int, threads: int) -> dict[str, Any]:
    import llama_cpp as lc

    lc.llama_log_set(_quiet, ctypes.c_void_p(0))
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(str(model_path).encode(), lc.llama_model_default_params())
    vocab = lc.llama_model_get_vocab(model)
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    tokenized = [tokenize(lc, vocab, text) for text in prompts]
    streams = len(prompts)
    params = lc.llama_context_default_params()
    params.n_seq_max = streams
    params.n_ctx = streams * (max(map(len, tokenized)) + decode_tokens + 16)
    params.n_batch = params.n_ubatch = 512
    params.n_threads = params.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model, params)
    batch = lc.llama_batch_init(512, 0, 1)
    try:
        # Prefill: each prompt into its own sequence, its last token's logits kept (chunks of <= 512 tokens).
        pending = [(s, pos, tok, pos == len(ids) - 1) for s, ids in enumerate(tokenized) for pos, tok in enumerate(ids)]
        logits_row: dict[int, int] = {}
        next_tokens: dict[int, int] = {}
        for start in range(0, len(pending), 512):
            chunk = pending[start : start + 512]
            fill(batch, chunk)
            check(lc.llama_decode(ctx, batch))
            logits_row.update({s: i for i, (s, _, _, last) in enumerate(chunk) if last})
            next_tokens.update({s: greedy(lc, ctx, i, n_vocab) for s, i in logits_row.items()})
            logits_row.clear()
        positions = [len(ids) for ids in tokenized]
        tokens = [next_tokens[s] for s in range(streams)]  # every stream has its first token now
        first_stream = [tokens[0]]  # returned, so a reader can check it against a single-stream decode
        start_clock, produced = time.perf_counter(), 0
        for _ in range(decode_tokens - 1):
            fill(batch, [(s, positions[s], tokens[s], True) for s in range(streams)])
            check(lc.llama_decode(ctx, batch))
            tokens = [greedy(lc, ctx, s, n_vocab) for s in range(streams)]
            first_stream.append(tokens[0])
            positions = [p + 1 for p in positions]
            produced += streams
        elapsed = time.perf_counter() - start_clock
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        lc.llama_model_free(model)
    return {"streams": streams, "threads": threads, "decode_tokens": decode_tokens, "version": lc.__version__,
            "prompt_tokens": [len(ids) for ids in tokenized], "aggregate_tokens_per_s": produced / elapsed,
            "first_stream_token_ids": first_stream}


def _discard_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    pass


try:  # llama.cpp logs every tensor it loads to stderr; the callback object must outlive the process
    import llama_cpp

    _quiet: Any = llama_cpp.llama_log_callback(_discard_log)
except ImportError:
    _quiet = None


def tokenize(lc: Any, vocab: Any, text: str) -> list[int]:
    raw = text.encode()
    out = (lc.llama_token * (len(raw) + 8))()
    n = lc.llama_tokenize(vocab, raw, len(raw), out, len(out), False, True)
    if n < 0:
        raise RuntimeError(f"llama_tokenize needs {-n} slots")
    return list(out[:n])


def fill(batch: Any, entries: list[tuple[int, int, int, bool]]) -> None:
    """entries: (sequence id, position, token, keep logits)."""
    for i, (seq, pos, tok, keep) in enumerate(entries):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = 1 if keep else 0
    batch.n_tokens = len(entries)


def greedy(lc: Any, ctx: Any, row: int, n_vocab: int) -> int:
    pointer = lc.llama_get_logits_ith(ctx, row)
    logits = np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,))
    return int(logits.argmax())


def check(status: int) -> None:
    if status != 0:
        raise RuntimeError(f"llama_decode returned {status}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--decode-tokens", type=int, default=48)
    parser.add_argument("--prompt", default="Tell me about the history of the city in a few sentences.")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from decodeservice.engine.loader import ensure_model

    path = ensure_model("smollm2-135m", progress=False)
    prompts = [f"{i}: {args.prompt}" for i in range(args.streams)]
    result = aggregate_tokens_per_s(path, prompts, decode_tokens=args.decode_tokens, threads=args.threads)
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
