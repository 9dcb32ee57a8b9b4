"""The offline engine: add requests, step, read outputs. `generate` is the batch convenience."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from decodeservice.engine import elementwise
from decodeservice.engine.config import CPU_KV_CACHE_GIB, EngineConfig, ModelConfig, SpeculativeConfig
from decodeservice.engine.detokenizer import IncrementalDetokenizer
from decodeservice.engine.errors import ConfigError, InvalidRequestError, PromptTooLongError
from decodeservice.engine.kv_cache import KVCacheManager
from decodeservice.engine.loader.fused import fuse_hf_weights
from decodeservice.engine.model import LlamaModel
from decodeservice.engine.outputs import (
    EngineStats,
    OutputTotals,
    RequestMetrics,
    RequestOutput,
    SpecDecodeStats,
)
from decodeservice.engine.plan import ExecutionPlan
from decodeservice.engine.plan.planner import execution_plan, plan_attention, plan_kv, plan_speculation
from decodeservice.engine.quant import ActivationChoice, Int4Weight, plan_kernels, resolve_precision
from decodeservice.engine.runner import ModelRunner, kv_bytes_per_block
from decodeservice.engine.sampler import make_generator, process_logits, sample_token, token_logprob
from decodeservice.engine.sampling_params import SamplingParams
from decodeservice.engine.scheduler import ScheduledSequence, Scheduler
from decodeservice.engine.sequence import Sequence, SequenceStatus
from decodeservice.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from decodeservice.engine.spec_decode.decoder import SpeculativeDecoder

log = logging.getLogger(__name__)

Prompt = str | Seq[int]


@dataclass(frozen=True)
class EncodedPrompt:
    """A prompt that `Engine.encode_prompt` tokenized and checked. The engine takes it as it is, so a
    front that validates at its edge (the server, before answering) does not pay for it twice."""

    token_ids: list[int]


class Engine:
    def __init__(self, *, model: LlamaModel, tokenizer: Tokenizer, config: EngineConfig,
                 draft: LlamaModel | None = None) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.model_config: ModelConfig = model.config
        self.device = torch.device(config.device)
        self.dtype = model.activation_dtype
        # The KV pool's: the activations', or int8 rows (attention/kv_int8.py). A draft's pool keeps `dtype`.
        kv = plan_kv(config, weight_format=model.weight_format, activations=self.dtype, head_dim=model.config.head_dim)
        self.kv_dtype, self.kv_dtype_reason = kv.dtype, kv.reason
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        num_blocks = self._num_blocks()
        if num_blocks * config.block_size < self.max_model_len:
            raise ConfigError(
                f"the KV cache holds {num_blocks * config.block_size} tokens, less than one sequence of "
                f"max_model_len={self.max_model_len}; raise kv_cache_gib or lower max_model_len")
        if self.device.type == "cpu" and config.pack_cpu_weights:
            for weights_owner in (model, draft):
                if weights_owner is not None:
                    weights_owner.pack_weights_for_cpu()
        self.kv = KVCacheManager(num_blocks=num_blocks, block_size=config.block_size,
                                 enable_prefix_caching=config.enable_prefix_caching)
        attention = plan_attention(config, model.config, activations=self.dtype, kv=kv, num_blocks=num_blocks)
        self.runner = ModelRunner(model, num_blocks=num_blocks, block_size=config.block_size,
                                  device=self.device, dtype=self.dtype, attention=attention,
                                  compile_step=config.compile, cuda_graphs=config.cuda_graphs, kv_dtype=self.kv_dtype,
                                  deterministic=config.deterministic, kernels=model.kernel_plan)
        self.scheduler = Scheduler(kv=self.kv, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens)
        self.spec: SpeculativeDecoder | None = None
        if config.speculative is not None:
            from decodeservice.engine.spec_decode.decoder import SpeculativeDecoder

            self.spec = SpeculativeDecoder.create(config.speculative, target=model, draft=draft,
                                                  num_blocks=num_blocks, block_size=config.block_size,
                                                  device=self.device, dtype=self.dtype,
                                                  deterministic=config.deterministic)
        speculation = plan_speculation(config, self.runner, num_blocks=num_blocks)
        if self.spec is not None and speculation is not None and speculation.curve is not None:
            self.spec.use_measured(speculation.curve, row_cost=speculation.row_cost)
            log.info("speculation: one more draft row costs %.3f of a decode step here (%d drafts; step "
                     "times by batch size and draft rows, measured in %.1f s [%s]: %s)", speculation.row_cost,
                     config.speculative.num_tokens if config.speculative else 0, speculation.seconds,
                     speculation.source, speculation.curve.describe())
        # Every machine-dependent choice, made above and handed to each component as it was built.
        self.plan: ExecutionPlan = execution_plan(
            config, activations=self.dtype, activations_reason=_activations_reason(model, config), kv=kv,
            attention=attention, kernels=model.kernel_plan, elementwise=model.elementwise_plan, speculation=speculation)
        for line in self.plan.explain():
            log.info("plan: %s", line)
        self._requests: dict[str, Sequence] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, name_or_path: str | Path = "smollm2-135m", **config: Any) -> Engine:
        """A known model name (pulled on first use), a .gguf file or a HF model directory."""
        from decodeservice.engine.loader import load_model
        from decodeservice.engine.loader.registry import resolve_model_path

        if "speculative" in config:
            config["speculative"] = SpeculativeConfig.parse(config["speculative"])
        engine_config = EngineConfig(**config)
        if engine_config.num_threads:
            torch.set_num_threads(engine_config.num_threads)
        quantizing = engine_config.quantization != "none"
        # Quantizing: 4-bit GGUF tensors stay 4-bit; the rest arrives fp32, the most exact source.
        dtype = torch.float32 if quantizing else resolve_precision(engine_config, source_has_int4=False).activations
        native_int4 = engine_config.quantization in ("int4", "auto")
        loaded = load_model(resolve_model_path(str(name_or_path)), dtype=dtype, native_int4=native_int4)
        model = build_model(loaded.config, loaded.weights, engine_config, int4=loaded.int4)
        draft = None
        spec = engine_config.speculative
        if spec is not None and spec.method == "draft":
            assert spec.draft_model is not None
            draft_loaded = load_model(resolve_model_path(spec.draft_model), dtype=dtype, native_int4=native_int4)
            if draft_loaded.config.vocab_size != loaded.config.vocab_size:
                raise ConfigError("the draft model must share the target's vocabulary")
            draft = build_model(draft_loaded.config, draft_loaded.weights, engine_config, int4=draft_loaded.int4)
        return cls(model=model, tokenizer=loaded.tokenizer, config=engine_config, draft=draft)

    def _num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_gpu_blocks_override is not None:
            return cfg.num_gpu_blocks_override
        layers = self.model_config.num_layers
        per_block = kv_bytes_per_block(self.model_config, cfg.block_size, self.kv_dtype, layers)
        if cfg.speculative is not None and cfg.speculative.method != "ngram":
            # room for a draft model's cache of similar size, in the activations' dtype (n-gram lookup has none)
            per_block += kv_bytes_per_block(self.model_config, cfg.block_size, self.dtype, layers)
        if cfg.kv_cache_gib is not None:
            budget = cfg.kv_cache_gib * 2**30
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = max(free - (1 - cfg.gpu_memory_fraction) * total, 0)
        else:
            budget = CPU_KV_CACHE_GIB * 2**30
        return int(budget // per_block)

    # -- requests ----------------------------------------------------------------------------------
    def add_request(self, prompt: Prompt | EncodedPrompt, params: SamplingParams, *, request_id: str | None = None,
                    priority: int = 0, cache_salt: str | None = None) -> str:
        """Queue a request; bad input raises `InvalidRequestError` here, before anything is queued.

        This is the library's edge: a raw prompt (text or token ids) is checked here, once. An
        `EncodedPrompt` was checked when `encode_prompt` made it and is taken as it is.
        `cache_salt`: only requests with the same salt (or all without one) share cached prefixes."""
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidRequestError("cache_salt must be a string", param="cache_salt")
        params.check_vocab(self.model_config.vocab_size)
        prompt_ids = (prompt if isinstance(prompt, EncodedPrompt) else self.encode_prompt(prompt)).token_ids
        seq = Sequence(request_id=request_id, prompt_token_ids=prompt_ids, params=params, priority=priority,
                       cache_salt=cache_salt, generator=make_generator(params, self.device))
        self._requests[request_id] = seq
        self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, params)
        self.scheduler.add(seq)
        self.prompt_tokens_total += len(prompt_ids)
        return request_id

    def encode_prompt(self, prompt: Prompt, *, add_special_tokens: bool = True) -> EncodedPrompt:
        """Tokenize and check a prompt: the one place its rules live. `add_special_tokens=False` for
        text that already holds them (a rendered chat template)."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            ids = [int(t) for t in prompt]
            if any(not 0 <= t < self.model_config.vocab_size for t in ids):
                raise InvalidRequestError("prompt token ids must be in [0, vocab_size)", param="prompt")
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens; this model's context is {self.max_model_len} tokens, "
                f"and at least one must be left for the answer", param="prompt")
        return EncodedPrompt(ids)

    def abort_request(self, request_id: str) -> bool:
        seq = self._requests.pop(request_id, None)
        self._detokenizers.pop(request_id, None)
        if seq is None:
            return False
        self._finish(seq, "abort")
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.spec is not None:
            # Penalties and min_tokens change each row by the tokens before it: such requests decode plainly.
            self.spec.propose([s for s in self.scheduler.running if not s.params.processes_logits],
                              batch_size=len(self.scheduler.running), waiting=len(self.scheduler.waiting))
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        logits = self.runner.execute(plan)
        outputs = []
        argmax = logits.argmax or [None] * len(logits.rows)
        for item, rows, row_argmax in zip(plan.scheduled, logits.rows, argmax, strict=True):
            new_tokens = self._advance(item, rows, row_argmax)
            if new_tokens or item.seq.is_finished:
                outputs.append(self._output(item.seq, new_tokens))
        return outputs

    def _advance(self, item: ScheduledSequence, rows: torch.Tensor | None, row_argmax: list[int] | None) -> list[int]:
        """`row_argmax`: the argmax of each of `rows`, which the runner finds for every greedy sequence."""
        seq = item.seq
        if rows is None:  # a prompt chunk; the prompt continues next step
            seq.num_computed_tokens += item.num_new_tokens
            self.kv.cache_full_blocks(seq)
            return []
        seq.num_computed_tokens += item.num_new_tokens - item.num_spec_tokens
        if item.num_spec_tokens:  # the decoder settles its drafts: verify, roll back what was rejected
            assert self.spec is not None
            candidates = self.spec.settle(item, rows, row_argmax, kv=self.kv)
        elif seq.params.processes_logits:
            row = process_logits(rows[0], seq.params, prompt_token_ids=seq.prompt_token_ids,
                                 output_token_ids=seq.output_token_ids, eos_token_ids=self.tokenizer.eos_token_ids)
            candidates = [sample_token(row, seq.params, seq.generator)]
        elif seq.params.greedy and row_argmax is not None:
            candidates = [row_argmax[0]]
        else:
            candidates = [sample_token(rows[0], seq.params, seq.generator)]
        now = time.monotonic()
        if seq.first_token_time is None:
            seq.first_token_time = now
        new_tokens: list[int] = []
        reason = None
        for position, token in enumerate(candidates):
            seq.output_token_ids.append(token)
            new_tokens.append(token)
            if seq.params.logprobs is not None:
                seq.logprobs.append(token_logprob(rows[position], token, seq.params.logprobs))
            reason = self._stop_reason(seq, token)
            if reason is not None:
                break
        self.generation_tokens_total += len(new_tokens)
        # Publish before finishing too: the last chunk of a prompt that ends here (one-token answers,
        # a stop at once) would otherwise never reach the prefix cache, and a follow-up on the same
        # long prompt would recompute up to a whole chunk of it.
        self.kv.cache_full_blocks(seq)
        if reason is not None:
            self._finish(seq, reason)
        return new_tokens

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if len(seq.output_token_ids) < params.min_tokens:  # the sampler kept EOS and stop ids out
            return "length" if seq.num_tokens >= self.max_model_len else None
        if token in params.stop_token_ids:
            return "stop"
        if not params.ignore_eos and token in self.tokenizer.eos_token_ids:
            return "stop"
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.is_finished:
            return
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason  # type: ignore[assignment]
        seq.finished_time = time.monotonic()
        self.scheduler.remove(seq)
        if self.spec is not None:
            self.spec.free(seq)

    def _output(self, seq: Sequence, new_tokens: list[int]) -> RequestOutput:
        """This step's delta, built from the new tokens alone; the totals only once, when it finishes."""
        detok = self._detokenizers.get(seq.request_id)
        new_text = ""
        if detok is not None:
            new_text, hit_stop = detok.update(seq.output_token_ids, finished=seq.is_finished)
            if hit_stop and not seq.is_finished:
                self._finish(seq, "stop")
        want_logprobs = seq.params.logprobs is not None
        totals = None
        if seq.is_finished:
            self._requests.pop(seq.request_id, None)
            self._detokenizers.pop(seq.request_id, None)
            totals = OutputTotals(token_ids=list(seq.output_token_ids), text=detok.text if detok is not None else "",
                                  logprobs=list(seq.logprobs) if want_logprobs else None)
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            new_token_ids=new_tokens,
            new_text=new_text,
            new_logprobs=seq.logprobs[len(seq.logprobs) - len(new_tokens):] if want_logprobs else None,
            num_output_tokens=len(seq.output_token_ids),
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            metrics=RequestMetrics(arrival_time=seq.arrival_time, first_scheduled_time=seq.first_scheduled_time,
                                   first_token_time=seq.first_token_time, finished_time=seq.finished_time,
                                   num_cached_tokens=seq.num_cached_prompt_tokens),
            totals=totals,
        )

    # -- conveniences ------------------------------------------------------------------------------
    def generate(self, prompts: Seq[Prompt] | Prompt, params: SamplingParams | Seq[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in prompt order."""
        prompt_list: list[Prompt]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompt_list = [prompts]  # type: ignore[list-item]
        else:
            prompt_list = list(prompts)  # type: ignore[arg-type]
        if isinstance(params, Seq):
            param_list = list(params)
        else:
            param_list = [params or SamplingParams()] * len(prompt_list)
        if len(param_list) != len(prompt_list):
            raise InvalidRequestError("need one SamplingParams per prompt, or a single one")
        encoded = [self.encode_prompt(p) for p in prompt_list]  # all checked before any is queued
        ids = [self.add_request(p, sp) for p, sp in zip(encoded, param_list, strict=True)]
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(ids):
            for out in self.step():
                if out.finished:
                    finished[out.request_id] = out
            if not self.has_unfinished_requests() and len(finished) < len(ids):
                raise RuntimeError("engine went idle with requests unfinished")  # an invariant broke
        return [finished[i] for i in ids]

    def stats(self) -> EngineStats:
        spec = self.spec.stats() if self.spec is not None else SpecDecodeStats()
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv.usage,
            num_blocks=self.kv.num_blocks,
            num_free_blocks=self.kv.num_free_blocks,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens_total,
            generation_tokens=self.generation_tokens_total,
            spec_decode=spec,
        )


def build_model(cfg: ModelConfig, weights: Mapping[str, torch.Tensor], config: EngineConfig, *,
                int4: Mapping[str, Int4Weight] | None = None) -> LlamaModel:
    """The model at the precision `config` resolves to (see engine/quant); `int4` are 4-bit weights
    as loaded (GGUF Q4_0/Q4_1), by HF name."""
    precision = resolve_precision(config, source_has_int4=bool(int4), hidden_size=cfg.hidden_size,
                                  intermediate_size=cfg.intermediate_size)
    passes = elementwise.plan_elementwise(config.device, precision.activations)
    with torch.device("meta"):
        model = LlamaModel(cfg, elementwise_plan=passes).to(dtype=precision.activations)
    # Built on the meta device, so no time goes into random init of weights we overwrite; the memory
    # of projections about to be replaced by quantized modules is never touched, so never resident.
    model = model.to_empty(device=config.device)
    model.tie_weights()
    fused = fuse_hf_weights(cfg, weights, int4=int4)
    kernels = None
    if precision.weights != "none":  # quantized weights run on CPU only (EngineConfig refuses the rest)
        # Planned from the projections' shapes before any is built: each is built with its part.
        kernels = plan_kernels(fused.projection_shapes(weight_format=precision.weights, w8a8=config.w8a8),
                               activations=ActivationChoice(dtype=precision.activations, reason=precision.reason),
                               deterministic=config.deterministic, compiled=config.compile)
    model.load_fused(fused, weight_format=precision.weights, w8a8=config.w8a8, kernels=kernels)
    model.rotary.reset_tables(config.device)
    return model.eval()


def _activations_reason(model: LlamaModel, config: EngineConfig) -> str:
    if model.kernel_plan is not None:
        return model.kernel_plan.activations.reason
    return f"dtype {config.dtype}" + (" (float32 on CPU, bfloat16 on CUDA, for dense weights)" if config.dtype == "auto" else "")
