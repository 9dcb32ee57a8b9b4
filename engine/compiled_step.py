"""Decode steps (one token per sequence, or a short verify) as one torch.compile graph (inductor, CPU).

Eager, a layer at one row is four weight-only matmuls among a dozen small elementwise kernels, each
paying Python and dispatch. Compiled, the elementwise work between two attentions fuses into a few
kernels, and the whole step, all layers, is one graph: one guard check and one call from Python.

Attention stays outside inductor: it reads the step's Python metadata (which blocks, which spans) and
writes the pool. It is one opaque op, `decodeservice::paged_attention(q, k, v, layer)`, which finds the
step's caches and metadata in a context variable the step sets around the call (vLLM compiles its
models the same way, with attention as a custom op reading a per-step forward context). The op's only
side effect is on layer `layer`'s pool, which nothing else in the graph touches, so the graph may
reorder freely around it.

Shapes: one graph for one row (a single stream), one with a symbolic row count for 2..MAX_ROWS rows;
a branch on the row count inside a projection (W8A8 from W8A8_ROWS rows) splits the latter in two.
Steps with prompt rows run eager, short ones too (a short prompt, a prefix hit's tail): their rows take
the projections' prompt path (quant/step_rows.py), which would be a second set of graphs for one step
per request; long chunks spend their time in large GEMMs, where fusion saves nothing. The runner
compiles every graph at start-up (runner._warm_up, on decode rows): cold, minutes on 2 cores for the bundled
model (the generated C++ of 30 unrolled layers is what takes the time), seconds from inductor's on-disk
cache (benchmarks/decode_compile.py records the compile time).

Numerics: inductor emulates eager's bf16 roundings (emulate_precision_casts), so the compiled step's
logits equal eager's bit for bit (tests/engine/test_compiled_step.py), and speculation stays exact.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import torch

from decodeservice.engine.attention import StepAttention, attend
from decodeservice.engine.errors import ConfigError
from decodeservice.engine.model import ForwardBatch, Linear, LlamaModel

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]

# Steps of at most this many rows run compiled: decode batches up to max_num_seqs' default, and verifies.
MAX_ROWS = 64

# The step's data (caches, metadata) for the op, set around each call; it chooses no kernel (the plan did,
# at construction). Handing it to the op as an argument instead (torch's opaque reference objects: a graph
# input with no guards) does not build with cpp_wrapper on torch 2.13 (its C++ wrapper cannot pass an
# opaque object to a custom op); without cpp_wrapper it does, and a verify's step took longer
# (benchmarks/results/compiled_step_opaque_arg.json, plan_before_after.py --compile).
_STEP: ContextVar[tuple[KVCaches, StepAttention]] = ContextVar("decodeservice_compiled_step")


@torch.library.custom_op("decodeservice::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """q (N, H, D), k/v (N, Hkv, D) -> (N, H, D), contiguous: layer `layer`'s attention of the running step."""
    kv_caches, step = _STEP.get()
    return attend(q, k, v, *kv_caches[layer], step).contiguous()


@paged_attention.register_fake
def _paged_attention_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _attend_through_op(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = torch.ops.decodeservice.paged_attention(q, k, v, layer)
    return out


# Dynamo settings for the step, applied around every call (they act while dynamo compiles, which can be
# any call). Guards run before every call: by default they check each of the model's weight tensors and
# every module's attributes, a tenth of a one-row step. The weights never change after loading, so
# modules are checked by their dicts' version tags instead, about a third of that cost.
# Graphs cache on `run_layers`' code, shared by every engine in the process (tests build several): more
# entries than dynamo's default 8 are allowed, and running out fails loudly instead of falling back to
# eager unnoticed.
_STEP_DYNAMO_CONFIG = torch._dynamo.config.patch(
    guard_nn_modules=False, use_recursive_dict_tags_for_guards=True,
    max_saved_pointers_for_recursive_dict_tags_check=4096, recompile_limit=64, fail_on_recompile_limit_hit=True)


class CompiledStep:
    """`model.forward` for steps of at most MAX_ROWS rows, compiled. Same contract."""

    def __init__(self, model: LlamaModel) -> None:
        if any(isinstance(m, Linear) and m.packed is not None for m in model.modules()):
            # Inductor's lowering of mkldnn._linear_pointwise asserts on weights it did not pack itself.
            raise ConfigError("compile needs quantized weights (int4 or int8), or fp32 without oneDNN "
                              "packing (pack_cpu_weights=False): inductor cannot compile the packed ones")
        compilers = [os.environ.get("CXX", ""), "g++", "c++", "clang++"]
        if not any(shutil.which(c) for c in compilers if c):
            raise ConfigError("compile needs a C++ compiler on PATH (inductor builds the step's kernels at "
                              "start-up): install g++, or set CXX, or turn compile off")
        self.model = model
        with warnings.catch_warnings():
            # torch 2.13's inductor imports torch.utils.mkldnn, which uses its own deprecated
            # torch.jit.script_method at import time: nothing this engine calls.
            warnings.filterwarnings("ignore", message=r"`torch\.jit\.script_method` is deprecated",
                                    category=DeprecationWarning)
            import torch._inductor.compile_fx
        # cpp_wrapper: the graph's calls (120 matmuls, 30 attention ops, the fused kernels) are made from
        # generated C++, not from a Python wrapper: a faster one-row step for a longer cold compile (see
        # the module docstring; benchmarks/decode_compile.py times the step).
        # emulate_precision_casts: a fused kernel rounds to bf16 wherever eager would (a norm's output, each
        # residual add), so the compiled step is bit-identical to eager (decode_compile.py checks
        # `logits_bit_identical`). Without it greedy tokens parted from eager's at a near-tie, and with it
        # the step was no slower.
        # fullgraph: a graph break (code dynamo cannot trace, added to the model later) is an error at
        # start-up, not a silently slower step.
        compile_fn: Callable[[Any], Any] = torch.compile(
            dynamic=False, fullgraph=True, options={"cpp_wrapper": True, "emulate_precision_casts": True})
        self._run_layers = compile_fn(model.run_layers)

    @staticmethod
    def applies_to(batch: ForwardBatch) -> bool:
        """Decode and verify steps of up to MAX_ROWS rows: no prompt row among them."""
        return batch.input_ids.shape[0] <= MAX_ROWS and batch.rows.prompt_rows is None

    @torch.inference_mode()
    def __call__(self, batch: ForwardBatch, kv_caches: KVCaches, *, num_layers: int | None = None) -> torch.Tensor:
        rows = (batch.input_ids, batch.positions, batch.logits_index)
        if batch.input_ids.shape[0] > 1:
            # One graph for every batch size (dynamic=False above makes single rows their own graph).
            for tensor in rows:
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
        token = _STEP.set((kv_caches, batch.attn))
        try:
            with _STEP_DYNAMO_CONFIG:
                # batch.rows: the step's row split (prompt rows take their one path), an argument of the
                # graph like the step's tensors, so a prompt chunk compiles to its own graph.
                hidden: torch.Tensor = self._run_layers(
                    *rows, _attend_through_op,
                    num_layers=self.model.layers_to_run(num_layers, kv_caches), rows=batch.rows)
        finally:
            _STEP.reset(token)
        return hidden
