"""Decode steps from CUDA graphs: buckets, padding and static buffers (on CPU, the same buffers run
eager), and on a GPU the captured graphs against the eager engine."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from decodeservice.engine import EngineConfig, SamplingParams
from decodeservice.engine.attention.flex import FlexPagedBackend
from decodeservice.engine.cuda_graphs import BUCKETS, DecodeGraphs, bucket_for, decode_rows, is_decode_step
from decodeservice.engine.engine import Engine
from decodeservice.engine.errors import ConfigError
from decodeservice.engine.runner import ModelRunner
from decodeservice.engine.scheduler import ScheduledSequence, SchedulerPlan
from decodeservice.engine.sequence import Sequence
from tests.conftest import ModelBundle
from tests.engine.attention.test_flex import page_indices_cover
from tests.engine.test_paged_attention import dense_logprobs

CPU = torch.device("cpu")
PROMPTS = [list(range(100, 113)), list(range(500, 502)), list(range(900, 921))]


def test_bucket_is_the_smallest_that_holds_the_batch() -> None:
    assert BUCKETS == (1, 2, 4, 8, 16, 32)
    assert [bucket_for(n) for n in (1, 2, 3, 5, 8, 9, 31, 32, 33)] == [1, 2, 4, 8, 8, 16, 32, 32, None]
    assert bucket_for(3, (1, 2)) is None


def sequences(pool: list[int], *, block_size: int, room: int) -> list[Sequence]:
    seqs = []
    for i, prompt in enumerate(PROMPTS):
        seq = Sequence(request_id=f"s{i}", prompt_token_ids=prompt, params=SamplingParams())
        needed = -(-(len(prompt) + room) // block_size)
        seq.block_ids, pool = pool[:needed], pool[needed:]
        seqs.append(seq)
    return seqs


def decode_items(seqs: list[Sequence]) -> list[ScheduledSequence]:
    return [ScheduledSequence(seq=s, num_new_tokens=1, num_spec_tokens=0) for s in seqs]


def test_decode_rows_pad_with_copies_of_the_first_row() -> None:
    seqs = sequences(list(range(40, 0, -1)), block_size=4, room=4)
    for seq in seqs:  # prompts computed but their last token: that is this decode step's row
        seq.num_computed_tokens = seq.num_tokens - 1
    items = decode_items(seqs)
    assert is_decode_step(items)
    assert not is_decode_step([ScheduledSequence(seq=seqs[0], num_new_tokens=2, num_spec_tokens=1)])
    seqs[2].num_computed_tokens -= 3  # a 1-token prompt chunk that does not finish its prompt: no logits
    assert not is_decode_step(items)
    seqs[2].num_computed_tokens += 3
    rows = decode_rows(items, block_size=4, bucket=4)
    assert rows.num_real == 3
    assert rows.input_ids == [112, 501, 920, 112] and rows.positions == [12, 1, 20, 12]
    # position 12 of the first sequence: block 3 of its table (37), offset 0
    assert rows.slots[0] == seqs[0].block_ids[3] * 4 and rows.slots[3] == rows.slots[0]
    assert rows.tables == [seqs[0].block_ids[:4], seqs[1].block_ids[:1], seqs[2].block_ids[:6], seqs[0].block_ids[:4]]


def test_static_buffers_replayed_eager_equal_the_normal_step_and_dense(tiny: ModelBundle) -> None:
    # On CPU the runner's "replay" is the eager forward over the graph's static buffers. Prefill runs
    # eager (not a decode step), then every decode step of the three sequences takes bucket 4: padded
    # with a copy of the first row, whose duplicate K/V write must corrupt nothing. Logits equal the
    # runner without graphs, and the dense recompute, step after step.
    def runner(graphs: bool) -> ModelRunner:
        return ModelRunner(tiny.model, num_blocks=64, block_size=4, device=CPU, dtype=torch.float32,
                           attention_backend=FlexPagedBackend(num_blocks=64, block_size=4, device=CPU),
                           cuda_graphs=graphs)

    graphed, plain = runner(True), runner(False)
    assert graphed.graphs is not None and plain.graphs is None
    seqs = sequences(torch.randperm(64, generator=torch.Generator().manual_seed(7)).tolist(), block_size=4, room=6)

    def step(items: list[ScheduledSequence]) -> list[torch.Tensor]:
        got = graphed.execute(SchedulerPlan(scheduled=items)).rows
        want = plain.execute(SchedulerPlan(scheduled=items)).rows
        for item, a, b in zip(items, got, want, strict=True):
            assert a is not None and b is not None
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
            item.seq.num_computed_tokens += item.num_new_tokens
            item.seq.output_token_ids.append(int(a[-1].argmax()))
        return [r for r in got if r is not None]

    step([ScheduledSequence(seq=s, num_new_tokens=s.num_tokens, num_spec_tokens=0) for s in seqs])
    bucket = graphed.graphs.graphs[4]
    for _ in range(3):
        rows = step(decode_items(seqs))
        assert bucket.input_ids.tolist() == [s.token_ids[-2] for s in seqs] + [seqs[0].token_ids[-2]]
        assert page_indices_cover(bucket.block_mask, bucket.page_map, 4, 1)  # what the GPU kernel would visit
        for seq, row in zip(seqs, rows, strict=True):
            reference = dense_logprobs(tiny, seq.token_ids[:-1])[-1]
            assert (torch.log_softmax(row[0], dim=-1) - reference).abs().max() < 1e-4


def test_steps_outside_the_buckets_are_left_to_eager(tiny: ModelBundle) -> None:
    flex = FlexPagedBackend(num_blocks=64, block_size=4, device=CPU)
    runner = ModelRunner(tiny.model, num_blocks=64, block_size=4, device=CPU, dtype=torch.float32,
                         attention_backend=flex)
    graphs = DecodeGraphs(model=tiny.model, kv_caches=runner.kv_caches, num_layers=runner.num_layers, flex=flex,
                          buckets=(1, 2))
    seqs = sequences(list(range(64)), block_size=4, room=4)
    assert graphs.run([ScheduledSequence(seq=seqs[0], num_new_tokens=5, num_spec_tokens=0)]) is None  # prefill
    for seq in seqs:
        seq.num_computed_tokens = seq.num_tokens - 1
    assert graphs.run(decode_items(seqs)) is None  # three sequences, above the largest bucket
    hidden = graphs.run(decode_items(seqs[:2]))
    assert hidden is not None and hidden.shape == (2, tiny.model.config.hidden_size)


def test_cuda_graphs_config_needs_cuda_and_flex_pages() -> None:
    with pytest.raises(ConfigError, match="cuda_graphs needs a CUDA device"):
        EngineConfig(cuda_graphs=True)
    with pytest.raises(ConfigError, match="block_size >= 16"):
        EngineConfig(device="cuda", cuda_graphs=True, block_size=8)
    assert not EngineConfig().cuda_graphs
    assert EngineConfig(device="cuda", cuda_graphs=True).cuda_graphs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: graphs are captured and replayed "
                    "only on one; on CPU the static buffers are checked eager above")
def test_cuda_graph_engine_equals_eager_engine(tiny_factory: Callable[..., ModelBundle]) -> None:
    # bf16 on the GPU, greedy: the graphed engine's tokens equal the eager engine's (same flex kernel,
    # captured or not), with batches of 1-3 decoding (buckets 1, 2, 4) beside chunked prefills.
    bundle = tiny_factory(seed=5)
    model = bundle.model.to(device="cuda", dtype=torch.bfloat16)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = []
    for graphs in (True, False):
        config = EngineConfig(device="cuda", cuda_graphs=graphs, block_size=16, max_num_batched_tokens=32,
                              max_model_len=256, num_gpu_blocks_override=64)
        engine = Engine(model=model, tokenizer=bundle.tokenizer, config=config)
        assert (engine.runner.graphs is not None) == graphs
        assert isinstance(engine.runner.attention_backend, FlexPagedBackend)
        outs.append(engine.generate(PROMPTS, params))
    for graphed, eager in zip(*outs, strict=True):
        assert graphed.token_ids == eager.token_ids
        assert graphed.logprobs is not None and eager.logprobs is not None
        assert max(abs(a.logprob - b.logprob) for a, b in zip(graphed.logprobs, eager.logprobs, strict=True)) < 1e-2


def test_warm_up_traces_everything_the_steps_replay(tiny: ModelBundle) -> None:
    # On CUDA each bucket runs its forward twice before capture, because nothing may compile while a
    # graph records. With a compiled flex (traced by dynamo on CPU, a counting backend), the warm-up
    # of every bucket must leave no shape or guard for the real steps to trace again.
    traced: list[torch.fx.GraphModule] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
        traced.append(gm)
        return gm.forward

    flex = FlexPagedBackend(num_blocks=64, block_size=4, device=CPU, compiled=True, compile_backend=counting)
    runner = ModelRunner(tiny.model, num_blocks=64, block_size=4, device=CPU, dtype=torch.float32, attention_backend=flex)
    # Four buckets stand for six: the batch size goes symbolic after its first change either way.
    graphs = DecodeGraphs(model=tiny.model, kv_caches=runner.kv_caches, num_layers=runner.num_layers, flex=flex,
                          buckets=(1, 2, 4, 8))
    for bucket in reversed(graphs.buckets):  # the order DecodeGraphs captures in on CUDA
        graphs.graphs[bucket].forward()
    warm = len(traced)
    assert 0 < warm < 8, "torch.compile's recompile limit is 8"  # measured 3 (8, then symbolic, then 1)
    seqs = sequences(list(range(64)), block_size=4, room=4)
    for seq in seqs:
        seq.num_computed_tokens = seq.num_tokens - 1
    for n in (1, 2, 3):
        assert graphs.run(decode_items(seqs[:n])) is not None
    assert len(traced) == warm
