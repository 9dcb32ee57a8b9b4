"""engine/elementwise.py: the native passes (RMSNorm with its residual add, SiLU * up, the rotary embedding)
give torch's bits, alone and through a whole model's forward, in bf16 and fp32; the native greedy token is
torch.max's index, ties, NaNs and infinities included."""

from __future__ import annotations

import platform
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from decodeservice.engine import elementwise
from decodeservice.engine.config import ModelConfig
from decodeservice.engine.model import LlamaModel

DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(scope="module")
def module() -> ModuleType:
    built = elementwise.elementwise_extension()
    if built is None and platform.machine() in ("x86_64", "AMD64") and torch.backends.cpu.get_cpu_capability() != "DEFAULT":
        pytest.fail("the elementwise kernel did not build or disagreed with torch on an x86 CPU with AVX2")
    if built is None:
        pytest.skip("no AVX2 here: the torch ops run")
    return built


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 490])
def test_each_pass_equals_the_torch_ops(module: ModuleType, dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x, residual = ((torch.randn(rows, 576, generator=gen) * 4).to(dtype) for _ in range(2))
    weight = (torch.randn(576, generator=gen) * 0.2 + 1).to(dtype)
    assert torch.equal(elementwise.rms_norm(x, weight, 1e-5, module), elementwise.rms_norm_torch(x, weight, 1e-5))
    total, normed = elementwise.add_rms_norm(x, residual, weight, 1e-5, module)
    assert torch.equal(total, x + residual)
    assert torch.equal(normed, elementwise.rms_norm_torch(x + residual, weight, 1e-5))
    gate_up = (torch.randn(rows, 2 * 1536, generator=gen) * 4).to(dtype)
    gate, up = gate_up.split(1536, dim=-1)
    assert torch.equal(elementwise.silu_and_mul(gate_up, 1536, module), F.silu(gate) * up)
    qk = (torch.randn(rows, 15, 64, generator=gen) * 3).to(dtype)[:, 3:]  # strided rows: a view of qkv
    angles = torch.randn(rows, 1, 64, generator=gen)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    assert torch.equal(elementwise.rotate(qk, cos, sin, module), elementwise.rotate_torch(qk, cos, sin))


def test_every_bf16_input_through_silu(module: ModuleType) -> None:
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    every = every[every.isfinite()].view(-1, 256)
    up = torch.ones_like(every)
    gate_up = torch.cat([every, up], dim=1)
    assert torch.equal(elementwise.silu_and_mul(gate_up, 256, module), F.silu(every))


def test_the_plan_takes_the_passes_on_cpu_in_fp32_and_bf16_only(module: ModuleType) -> None:
    assert elementwise.plan_elementwise("cpu", torch.bfloat16).kernel is module
    assert elementwise.plan_elementwise("cpu", torch.float16).kernel is None
    assert elementwise.plan_elementwise("cuda", torch.bfloat16).kernel is None


def test_the_check_at_load_refuses_a_kernel_that_differs(module: ModuleType) -> None:
    class OffByOne:
        def __getattr__(self, name: str) -> object:
            kernel = getattr(module, name)

            def call(*args: torch.Tensor | float) -> None:
                kernel(*args)
                out = args[-1]
                assert isinstance(out, torch.Tensor)
                out.view(-1)[0] = torch.nextafter(out.view(-1)[0].float(), torch.tensor(float("inf"))).to(out.dtype)
            return call

    assert elementwise._agrees_with_torch(module)
    assert not elementwise._agrees_with_torch(OffByOne())  # type: ignore[arg-type]


# Few distinct values (ties), and the special ones, at any position of rows long enough for vectors and a tail.
_LOGIT = st.sampled_from([-3.0, -0.0, 0.0, 1.5, 2.0, float("inf"), float("-inf"), float("nan")])


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.lists(_LOGIT, min_size=1, max_size=70), min_size=1, max_size=4).filter(
    lambda rows: len({len(r) for r in rows}) == 1))
def test_the_greedy_token_is_torch_max_index(module: ModuleType, rows: list[list[float]]) -> None:
    logits = torch.tensor(rows, dtype=torch.float32)
    assert torch.equal(elementwise.greedy_tokens(logits, module), logits.max(dim=-1).indices)


@pytest.mark.parametrize("rows", [1, 16, 64])
def test_the_greedy_token_over_a_vocabulary(module: ModuleType, rows: int) -> None:
    logits = torch.randn(rows, 49152, generator=torch.Generator().manual_seed(rows)).bfloat16().float()
    logits[0, 40000] = logits[0, 7] = logits[0].max() + 1  # a tie far apart: the first one
    assert torch.equal(elementwise.greedy_tokens(logits, module), logits.max(dim=-1).indices)
    assert elementwise.greedy_tokens(logits, module)[0] == 7


def test_the_check_at_load_refuses_a_greedy_token_that_differs(module: ModuleType) -> None:
    class LastOfTies:  # every other pass as built; the greedy token the last maximal index
        def __getattr__(self, name: str) -> object:
            return getattr(module, name)

        @staticmethod
        def argmax_rows(logits: torch.Tensor, out: torch.Tensor) -> None:
            flipped = logits.flip(-1).max(dim=-1).indices
            out.copy_(logits.shape[-1] - 1 - flipped)

    assert not elementwise._agrees_with_torch(LastOfTies())  # type: ignore[arg-type]


def tiny_model(dtype: torch.dtype, *, qk_norm: bool, plan: elementwise.ElementwisePlan) -> LlamaModel:
    cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=160, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=128, qk_norm=qk_norm)
    torch.manual_seed(0)
    model = LlamaModel(cfg, elementwise_plan=plan)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.3 + (1.0 if param.dim() == 1 else 0.0))
    return model.to(dtype).eval()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3_qk_norm"])
def test_a_forward_gives_the_same_bits_native_or_torch(module: ModuleType, dtype: torch.dtype, qk_norm: bool) -> None:
    """The layers' loop (residual adds fused with the norms after them) and the reference path, each with
    the native passes and with torch's ops: four equal results."""
    plan = elementwise.plan_elementwise("cpu", dtype)
    assert plan.kernel is module
    ids = torch.randint(0, 97, (21,), generator=torch.Generator().manual_seed(1))

    def attend_layer(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(  # as forward_dense calls it
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
            is_causal=True, enable_gqa=True)
        return out[0].transpose(0, 1)

    def both(model: LlamaModel) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            hidden = model.run_layers(ids, torch.arange(ids.numel()), torch.arange(ids.numel()), attend_layer,
                                      num_layers=3)
            return model.compute_logits(hidden), model.forward_dense(ids)

    native = both(tiny_model(dtype, qk_norm=qk_norm, plan=plan))
    reference = both(tiny_model(dtype, qk_norm=qk_norm, plan=elementwise.TORCH_OPS))
    for got in (*native, reference[0]):
        assert torch.equal(got, reference[1])
