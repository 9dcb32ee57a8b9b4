"""CPU paged attention: the native paged kernel reads the pool in place; the plain path is the fallback.

Two routes, no more:
- The native kernel (native_decode.py), wherever it is built and takes the cache's dtype and head size:
  every decode and verify of a step (up to `kernel_max_new` new tokens, a kernel row each) and every
  prompt span, in one call per layer. It takes them without a start-up race: on the default configuration
  of both CPU families it beat the plain path by well over the 1.2x a route must earn at every decode
  shape benchmarks/route_audit.py times (`native_kernel_decode` in its JSON). A prompt row is the same
  function whether its prompt was a cache miss or a hit of any number of blocks, and however it was
  chunked: a row per token over its own prefix, read from the pool, in an order that depends only on
  the row's position (benchmarks/prefix_consistency.py showed the torch paths' two roundings of a
  prompt moving the next token's logprobs by up to ~1 nat in bf16).
- The plain path (gather.py's attend_span: copy the sequence's blocks, one SDPA with its causal offset,
  int8 rows dequantized): every other span, and every span where the kernel is not built (no compiler),
  does not apply (float16, head_dim not 32/64/128) or is not given (tests, benchmarks' references).
  The views of the pool merged by log-sum-exp, decode GEMMs and a gathered flash call that this backend
  once also had each served only where the kernel did not, and none won 1.2x over this path there.

In deterministic mode (EngineConfig.deterministic) every span of every step takes the kernel, a row per
token, whatever its length: a row's attention then depends on its own query and prefix alone (the kernel
splits a row's keys by its length and the thread count only).
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

import torch

from decodeservice.engine.attention import native_decode
from decodeservice.engine.attention.gather import attend_span
from decodeservice.engine.attention.metadata import AttentionMetadata
from decodeservice.engine.attention.native_decode import DecodeGroup, build_decode_group


@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedViewsMetadata(AttentionMetadata):
    """AttentionMetadata plus what the CPU backend's plan() built once for every layer of the step."""

    # The step's spans the kernel takes, a row per token.
    decode_group: DecodeGroup | None = None


class PagedViewsBackend:
    """The CPU backend: the native kernel's rows where it is given (see the module's docstring), the plain
    path for the rest. benchmarks/route_audit.py times the kernel against the plain path."""

    name = "paged_views"

    def __init__(self, *, kernel: ModuleType | None = None, kv_int8: bool = False,
                 kernel_max_new: int = native_decode.MAX_NEW, deterministic: bool = False,
                 tile_rows: int = native_decode.TILE_ROWS) -> None:
        """Every choice is the engine's plan (engine/plan), handed down here once; nothing changes after."""
        # native_decode.decode_extension() where it applies to the model (fp32/bf16 caches, int8 pools), or None
        self.kernel = kernel
        # Built for int8 pools (kv_int8.py; the runner refuses a backend that was not): the kernel reads their
        # rows in place, the plain path dequantizes its copy.
        self.kv_int8 = kv_int8
        # Spans of up to this many new tokens (decodes and verifies) take the kernel, a row per token,
        # besides every prompt span; longer ones the plain path. 1: decodes only (an A/B baseline).
        self.kernel_max_new = kernel_max_new
        # Every span through the kernel (the module's docstring); the engine refuses the mode where the
        # kernel is not built.
        self.deterministic = deterministic
        # The kernel's tile height for a span's consecutive rows (the plan's, timed on this CPU; the same
        # bits at any height: engine/plan/attention_tiles.py).
        self.tile_rows = tile_rows

    def plan(self, meta: AttentionMetadata, *, dtype: torch.dtype) -> PagedViewsMetadata:
        fields = {f.name: getattr(meta, f.name) for f in dataclasses.fields(AttentionMetadata)}
        device = meta.slot_mapping.device
        if self.deterministic:
            assert self.kernel is not None and dtype in native_decode.DTYPES, "deterministic needs the native kernel"
            every = max(span.num_new for span in meta.spans)
            return PagedViewsMetadata(**fields, decode_group=build_decode_group(
                meta.spans, device=device, max_new=every, prompts=True))
        group = (build_decode_group(meta.spans, device=device, max_new=self.kernel_max_new, prompts=True)
                 if self.kernel is not None and dtype in native_decode.DTYPES else None)
        return PagedViewsMetadata(**fields, decode_group=group)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # Unplanned metadata (tests, benchmarks) takes the plain path for every sequence.
        group = meta.decode_group if isinstance(meta, PagedViewsMetadata) and self.kernel is not None else None
        if group is not None:
            assert self.kernel is not None
            decoded = group.attend(q, k_cache, v_cache, module=self.kernel, tile_rows=self.tile_rows)  # (B, H, D)
            if len(group.span_indices) == len(meta.spans) and group.covers_all_in_order:
                return decoded  # every token of the step is the kernel's
        out = torch.empty_like(q)  # (N, H, D)
        if group is not None:
            out[group.token_index] = decoded
        for i, span in enumerate(meta.spans):
            if group is not None and i in group.span_indices:
                continue
            s, e = span.token_start, span.token_start + span.num_new
            out[s:e] = attend_span(q[s:e], k_cache, v_cache, span)
        return out
