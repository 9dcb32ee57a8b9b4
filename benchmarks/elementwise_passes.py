"""The native elementwise passes (engine/elementwise.py) against the torch ops they replace, in one engine.

    .venv/bin/python -P benchmarks/elementwise_passes.py [--threads 2] [--rounds 6] [--steps 40] [--out FILE]

One engine at its defaults over the bundled model; the passes are switched on and off between blocks of
work (the order alternating by round), so both sides see the same machine, caches and contexts:
`prefill`, one step that prefills a fresh ~490-token prompt (ms); `decode_N`, a block of --steps decode
steps of N streams whose contexts start at ~490 tokens (ms per step). Both sides give the same bits (the
kernel's load check; tests/engine/test_elementwise.py), so only time is compared: per round the native
over torch ratio, and its median and range. Run it once per CPU dispatch (the caps of scripts/test.sh).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from decodeservice.engine import Engine, SamplingParams, elementwise

sys.path.insert(0, str(Path(__file__).parent))  # `python -P` leaves the script's folder off the path
from dispatches import caps_in_effect, cpu_name
from json_out import emit

PROMPT = list(range(300, 789))  # 489 tokens after a distinct first one


def switch(native: Callable[[ModuleType | None, torch.Tensor], ModuleType | None], on: bool) -> None:
    """Every module's passes on or off at once (the engine's plan hands them to the modules at build)."""
    elementwise._native = native if on else (lambda kernel, x: None)  # type: ignore[assignment]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--streams", default="1,16")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    native = elementwise._native
    engine = Engine.from_pretrained("smollm2-135m", max_model_len=4096)
    if engine.plan.elementwise.kernel is None:
        raise SystemExit(f"the engine runs the torch ops here ({engine.plan.elementwise.why}): nothing to compare")
    times: dict[str, dict[str, list[float]]] = {}
    loads = [os.getloadavg()[0]]
    fresh = iter(range(1, 10**6))

    def request(max_tokens: int) -> None:
        engine.add_request([next(fresh), *PROMPT], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                  ignore_eos=True))

    def rounds(name: str, block: Callable[[], float]) -> None:
        times[name] = {"native": [], "torch": []}
        for r in range(args.rounds + 1):  # round 0 warms both sides up and is dropped
            for side in ("native", "torch") if r % 2 == 0 else ("torch", "native"):
                switch(native, side == "native")
                ms = block()
                if r:
                    times[name][side].append(ms)
            loads.append(os.getloadavg()[0])

    def prefill() -> float:
        request(1)
        start = time.perf_counter()
        engine.step()
        return (time.perf_counter() - start) * 1e3

    rounds("prefill", prefill)
    for streams in (int(s) for s in args.streams.split(",")):
        for _ in range(streams):
            request(10**6)
        while engine.scheduler.waiting or any(seq.in_prefill for seq in engine.scheduler.running):
            engine.step()

        def decode() -> float:
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            return (time.perf_counter() - start) * 1e3 / args.steps

        rounds(f"decode_{streams}", decode)
        for seq in list(engine.scheduler.running):
            engine.abort_request(seq.request_id)
    switch(native, True)

    def summary(ms: dict[str, list[float]]) -> dict[str, object]:
        ratios = [a / b for a, b in zip(ms["native"], ms["torch"], strict=True)]
        return {"native_ms": {"median": round(statistics.median(ms["native"]), 3), "min": round(min(ms["native"]), 3)},
                "torch_ms": {"median": round(statistics.median(ms["torch"]), 3), "min": round(min(ms["torch"]), 3)},
                "native_over_torch": {"median": round(statistics.median(ratios), 3), "min": round(min(ratios), 3),
                                      "max": round(max(ratios), 3)}}

    emit({"cpu": cpu_name(), "cpu_capability": torch.backends.cpu.get_cpu_capability(), "caps": caps_in_effect(),
          "threads": args.threads, "rounds": args.rounds, "steps_per_block": args.steps,
          "activations": str(engine.model.activation_dtype).removeprefix("torch."),
          "load_average_1min": {"min": min(loads), "max": max(loads)},
          "command": "benchmarks/elementwise_passes.py " + " ".join(sys.argv[1:]),
          "results": {name: summary(ms) for name, ms in times.items()}}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
