"""The native attention kernel before and after a change, in one run: a prompt's rows, one long decode, 16 decodes.

    .venv/bin/python -P benchmarks/prompt_attention.py [--before REV] [--threads 2] [--rounds 15]
        [--tokens 490] [--decode-keys 2600] [--out FILE]

Kernels compared, taking turns round by round (the order rotates) so that the machine's load hits each
alike: `before`, paged_decode.cpp and its headers as of git revision REV (called with the tiles of 16 rows
where its kernel has them), built beside this tree's into the kernel cache; `rows`, this
tree's kernel a row at a time (tile_rows=1); `tiled`, this tree's kernel as the engine calls it.
Workloads, the bundled model's attention shape (9 query heads, 3 K/V heads, D 64, bf16 pools, blocks of 16
scattered over the pool, one pool per layer): `prompt`, the kernel rows of a --tokens prefill (row i sees
keys 0..i), 30 layers; `decode`, one row over --decode-keys keys, 30 layers; `decodes_16`, a decode row
for each of 16 sequences of --tokens to --tokens + 59 keys with their own blocks (a step of 16 streams after
their prompts), 30 layers. Milliseconds per pass of the
30 layers: per kernel the median and min over the rounds, and the per-round ratio to `before` (median,
range). Every kernel's output is checked against `before`'s within bf16 rounding, and `rows` against
`tiled` bit for bit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from decodeservice.engine.attention import native_decode
from decodeservice.engine.cpp_extensions import build_extension
from decodeservice.engine.quant import detect_cpu

sys.path.insert(0, str(Path(__file__).parent))  # `python -P` leaves the script's folder off the path
from json_out import emit

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
FILES = ("engine/attention/paged_decode.cpp", "engine/attention/paged_decode_vectors.h",
         "engine/attention/paged_decode_items.h", "engine/attention/paged_decode_int8_rows.h")


def build_before(rev: str, folder: Path) -> Callable[..., torch.Tensor]:
    """The kernel as of `rev`, built from its files (those it had), called as the engine called it then:
    with the tile width (its TILE_ROWS, 16) where its source takes one, without before the tiles."""
    root = Path(__file__).resolve().parent.parent
    headers = []
    for name in FILES:
        shown = subprocess.run(["git", "show", f"{rev}:{name}"], cwd=root, capture_output=True)
        if shown.returncode == 0:
            (folder / Path(name).name).write_bytes(shown.stdout)
            headers.append(folder / Path(name).name)
    tiled = "int64_t tile_rows" in headers[0].read_text(encoding="utf-8")
    module = build_extension(headers[0], what=f"paged decode attention at {rev}", check=lambda m: True,
                             headers=headers[1:])
    if module is None:
        raise SystemExit(f"the kernel at {rev} did not build")

    def before(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, t: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        tiles = (16,) if tiled else ()
        module.paged_decode(q, k, v, t, n, HEAD_DIM ** -0.5, 256, *tiles, out)
        return out

    return before


def workload(rows: int, first_len: int, gen: torch.Generator) -> list[tuple[torch.Tensor, ...]]:
    """Per layer: q (rows, H, D), K and V pools, tables (rows, M), lengths first_len .. first_len + rows - 1."""
    keys = first_len + rows - 1
    width = -(-keys // BLOCK)
    layers = []
    for _ in range(LAYERS):
        num_blocks = width + 8
        k, v = (torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).bfloat16() for _ in range(2))
        table = torch.randperm(num_blocks, generator=gen)[:width].to(torch.int32)
        q = torch.randn(rows, HEADS, HEAD_DIM, generator=gen).bfloat16()
        lengths = torch.arange(first_len, first_len + rows, dtype=torch.int32)
        layers.append((q, k, v, table.repeat(rows, 1).contiguous(), lengths))
    return layers


def decodes_workload(streams: int, keys: int, gen: torch.Generator) -> list[tuple[torch.Tensor, ...]]:
    """Per layer: one decode row for each of `streams` sequences of keys .. keys + 59 keys, each with its own
    blocks scattered over one pool, as a step of concurrent streams reads them."""
    lengths = torch.randint(keys, keys + 60, (streams,), generator=gen).to(torch.int32)
    width = -(-int(lengths.max()) // BLOCK)
    layers = []
    for _ in range(LAYERS):
        num_blocks = streams * width + 8
        k, v = (torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).bfloat16() for _ in range(2))
        tables = torch.randperm(num_blocks, generator=gen)[: streams * width].view(streams, width).to(torch.int32)
        q = torch.randn(streams, HEADS, HEAD_DIM, generator=gen).bfloat16()
        layers.append((q, k, v, tables.contiguous(), lengths))
    return layers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--before", default="d201a72", help="the revision before the tiles")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--tokens", type=int, default=490)
    parser.add_argument("--decode-keys", type=int, default=2600)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    now = native_decode.decode_extension()
    if now is None:
        raise SystemExit("this tree's kernel did not build")
    with tempfile.TemporaryDirectory() as folder:
        before = build_before(args.before, Path(folder))

    kernels: dict[str, Callable[..., torch.Tensor]] = {
        "before": before,
        "rows": lambda q, k, v, t, n: native_decode.paged_decode(q, k, v, t, n, module=now, tile_rows=1),
        "tiled": lambda q, k, v, t, n: native_decode.paged_decode(q, k, v, t, n, module=now),
    }
    gen = torch.Generator().manual_seed(0)
    workloads = {"prompt": workload(args.tokens, 1, gen), "decode": workload(1, args.decode_keys, gen),
                 "decodes_16": decodes_workload(16, args.tokens, gen)}
    checks = {}
    for name, layers in workloads.items():
        outs = {kernel: run(*layers[0]) for kernel, run in kernels.items()}
        checks[name] = {"rows_equal_tiled_bitwise": torch.equal(outs["rows"], outs["tiled"]),
                        "max_abs_vs_before": float((outs["tiled"].float() - outs["before"].float()).abs().max()),
                        "tiled_equal_before_bitwise": torch.equal(outs["tiled"], outs["before"])}
    times: dict[str, dict[str, list[float]]] = {w: {k: [] for k in kernels} for w in workloads}
    loads = [os.getloadavg()[0]]
    names = list(kernels)
    for r in range(args.rounds + 1):  # round 0 warms up and is dropped
        order = names[r % len(names):] + names[: r % len(names)]
        for name, layers in workloads.items():
            for kernel in order:
                start = time.perf_counter()
                for layer in layers:
                    kernels[kernel](*layer)
                if r:
                    times[name][kernel].append((time.perf_counter() - start) * 1e3)
        loads.append(os.getloadavg()[0])
        print(f"round {r}: " + " ".join(f"{w}/{k} {times[w][k][-1]:.1f}" for w in workloads for k in kernels if r),
              file=sys.stderr, flush=True)

    def summary(w: str) -> dict[str, object]:
        ms = times[w]
        out: dict[str, object] = {k: {"median": round(statistics.median(v), 3), "min": round(min(v), 3)}
                                  for k, v in ms.items()}
        for k in ("rows", "tiled"):
            ratios = [a / b for a, b in zip(ms[k], ms["before"], strict=True)]
            out[f"{k}_vs_before"] = {"median": round(statistics.median(ratios), 3), "min": round(min(ratios), 3),
                                     "max": round(max(ratios), 3)}
        return out

    result = {
        "before": args.before, "threads": args.threads, "rounds": args.rounds, "tokens": args.tokens,
        "decode_keys": args.decode_keys, "layers": LAYERS, "shape": {"heads": HEADS, "kv_heads": KV_HEADS,
                                                                      "head_dim": HEAD_DIM, "block": BLOCK},
        "tile_rows": native_decode.TILE_ROWS, "chunk": native_decode.CHUNK,
        "cpu": torch.backends.cpu.get_cpu_capability(), "cpu_model": detect_cpu().model_name,
        "caps": {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
                 if k in os.environ},
        "load_average_1min": {"min": min(loads), "max": max(loads), "per_round": loads},
        "checks": checks,
        "ms_per_30_layers": {w: summary(w) for w in workloads},
    }
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
