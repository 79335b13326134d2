"""Fused mixture-of-experts: the Triton kernels against the per-token torch reference, the reference against a
dense computation (every expert on every token, masked by the routing) and against transformers' gpt-oss experts,
and the engine's GPU path (``pagoda.layers.moe_gpu``) against ``MoEExperts``' grouped torch path.

Without a GPU the kernels run in Triton's interpreter, whose tiles are 16 rows, 32 columns, 32 deep: H=48 and
I=40 are ragged against them, T=37 tokens x k=2 spreads several row blocks over the busiest expert. Outputs and
the kernel's activation cache come from ``torch.empty``, poisoned with NaN (tests/kernels/conftest.py), so a row
the kernel never writes, or a padding row it reads, shows up.

Tolerances. float32: products are exact and accumulate in float32 in both, only the summation order differs
(K <= 48 terms of O(1)): 1e-5. bfloat16: kernel and reference round the same float32 values to bf16 at the same
steps (gate/up, the activation, the output; the kernel rounds to nearest even in the interpreter too, which on its
own would truncate), so they agree bit for bit except where the two summation orders straddle a rounding boundary
of an intermediate: one bf16 ulp (2**-8 relative) there. Outputs are O(1..30): rtol = atol = 2**-7, and at least
99% of the elements must be equal (a changed rounding step shows up there long before it breaks a tolerance).
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

import pagoda_kernels.fused_moe as fm
from pagoda_kernels.fused_moe import fused_moe, fused_moe_reference, moe_align_block_size

pytestmark = pytest.mark.usefixtures("poisoned_allocations")

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2**-7, atol=2**-7)}
H, INTER, E = 48, 40, 6


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _weights(dtype: torch.dtype, bias: bool, seed: int = 0, gain: float = 1.0) -> dict:
    """w13 [E, 2I, H], w2 [E, H, I] scaled so that every projection is O(gain); biases O(0.5)."""
    g = _gen(seed)
    w13 = gain * torch.randn(E, 2 * INTER, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, INTER, generator=g) / INTER**0.5
    out = {"w13": w13.to(dtype), "w2": w2.to(dtype)}
    if bias:
        out |= {"b13": (0.5 * torch.randn(E, 2 * INTER, generator=g)).to(dtype)}
        out |= {"b2": (0.5 * torch.randn(E, H, generator=g)).to(dtype)}
    return out


def _routing(tokens: int, k: int, seed: int, skew: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights float32, topk_ids int64): k distinct experts per token; ``skew`` > 0 makes expert 0 popular
    and the last expert rare (ragged loads); weights positive, not normalised (the kernel must not assume it)."""
    g = _gen(seed)
    scores = torch.rand(tokens, E, generator=g) - skew * torch.linspace(-1, 1, E)
    ids = torch.topk(scores, k, dim=-1).indices
    return torch.rand(tokens, k, generator=g) + 0.1, ids


def _hidden(tokens: int, dtype: torch.dtype, seed: int = 7) -> torch.Tensor:
    return torch.randn(tokens, H, generator=_gen(seed)).to(dtype)


def _check(tokens: int, k: int, dtype: torch.dtype, activation: str, bias: bool, skew: float, seed: int) -> None:
    x, w = _hidden(tokens, dtype, seed), _weights(dtype, bias, seed, gain=3.0 if activation == "swiglu_oai" else 1)
    weights, ids = _routing(tokens, k, seed, skew)
    out = fused_moe(x, w["w13"], w["w2"], weights, ids, b13=w.get("b13"), b2=w.get("b2"), activation=activation)
    ref = fused_moe_reference(x, **w, topk_weights=weights, topk_ids=ids, activation=activation)
    assert out.shape == (tokens, H) and out.dtype == dtype
    torch.testing.assert_close(out, ref, **TOL[dtype])
    if dtype == torch.bfloat16:  # float32 sums in another order differ in their last bits: no equality there
        assert (out == ref).float().mean() >= 0.99


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("tokens", "k", "skew"),
    [(1, 1, 0.0), (1, 4, 0.0), (37, 2, 1.0)],
    ids=["decode-k1", "decode-k4", "ragged-T37-k2"],
)
def test_kernel_matches_reference(tokens: int, k: int, skew: float, dtype, activation: str, bias: bool) -> None:
    _check(tokens, k, dtype, activation, bias, skew, seed=tokens + k)


def test_ragged_routing_really_is_ragged() -> None:
    """The ragged case above leaves an expert empty and gives one expert more than one 16-row block."""
    _, ids = _routing(37, 2, seed=39, skew=1.0)
    counts = torch.bincount(ids.flatten(), minlength=E)
    assert counts.min() == 0 and counts.max() > 16


def test_one_expert_takes_every_token() -> None:
    """k=1 and every token on expert 3 (three row blocks of one expert); the other five experts are empty."""
    x, w = _hidden(40, torch.float32), _weights(torch.float32, bias=True, seed=3)
    ids, weights = torch.full((40, 1), 3), torch.rand(40, 1, generator=_gen(4))
    out = fused_moe(x, w["w13"], w["w2"], weights, ids, b13=w["b13"], b2=w["b2"])
    torch.testing.assert_close(
        out, fused_moe_reference(x, **w, topk_weights=weights, topk_ids=ids), **TOL[torch.float32]
    )


def test_strided_weights_and_token_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights stored transposed (w13 from an [E, H, 2I] tensor, as transformers keeps it) and more tokens than one
    chunk (the chunk shrunk to 8 tokens: 20 tokens run as 8 + 8 + 4)."""
    monkeypatch.setattr(fm, "CHUNK_TOKENS", 8)
    w = _weights(torch.float32, bias=False, seed=5)
    w13 = w["w13"].transpose(1, 2).contiguous().transpose(1, 2)  # [E, 2I, H] with strides (2IH, 1, 2I)
    w2 = w["w2"].transpose(1, 2).contiguous().transpose(1, 2)
    assert not w13.is_contiguous() and not w2.is_contiguous()
    x, (weights, ids) = _hidden(20, torch.float32), _routing(20, 3, seed=6)
    out = fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(
        out, fused_moe_reference(x, **w, topk_weights=weights, topk_ids=ids), **TOL[torch.float32]
    )


def test_no_tokens() -> None:
    w = _weights(torch.float32, bias=False)
    empty = fused_moe(
        _hidden(0, torch.float32), w["w13"], w["w2"], torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.long)
    )
    assert empty.shape == (0, H)


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_align_sorts_pairs_into_single_expert_blocks(block_m: int) -> None:
    _, ids = _routing(37, 2, seed=8, skew=1.0)
    n = ids.numel()
    sorted_ids, block_expert = moe_align_block_size(ids, E, block_m)
    blocks = sorted_ids.view(-1, block_m)
    assert block_expert.shape[0] == blocks.shape[0]
    real = sorted_ids[sorted_ids < n]
    assert torch.equal(real.sort().values, torch.arange(n, dtype=torch.int32))  # every pair exactly once
    flat = ids.flatten()
    for b, expert in enumerate(block_expert.tolist()):
        pairs = blocks[b][blocks[b] < n].long()
        if expert < 0:
            assert pairs.numel() == 0  # blocks past the end hold padding only
        else:
            assert pairs.numel() > 0 and bool((flat[pairs] == expert).all())
            assert torch.equal(pairs, pairs.sort().values)  # pair order kept within an expert
    used = block_expert[block_expert >= 0]
    assert torch.equal(used, used.sort().values)  # experts' runs in expert order
    counts = torch.bincount(flat, minlength=E)
    assert torch.equal(torch.bincount(used.long(), minlength=E), (counts + block_m - 1) // block_m)


def _dense(x, w13, w2, weights, ids, b13, b2, activation: str, alpha=1.702, limit=7.0) -> torch.Tensor:
    """Every expert on every token in float64, each token's row weighted by its routing weight for that expert
    (0 where not routed): a different algorithm from the reference's per-token loop."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    gate_up = torch.einsum("th,eoh->eto", x, w13)  # [E, T, 2I]
    if b13 is not None:
        gate_up = gate_up + b13.double()[:, None, :]
    gate, up = gate_up[..., :INTER], gate_up[..., INTER:]
    if activation == "silu":
        act = torch.nn.functional.silu(gate) * up
    else:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        act = (up + 1) * gate * torch.sigmoid(alpha * gate)
    y = torch.einsum("eti,ehi->eth", act, w2)  # [E, T, H]
    if b2 is not None:
        y = y + b2.double()[:, None, :]
    mask = torch.zeros(x.shape[0], E, dtype=torch.float64).scatter_(1, ids, weights.double())  # [T, E]
    return torch.einsum("te,eth->th", mask, y)


@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
def test_reference_equals_dense_computation(activation: str) -> None:
    x, w = _hidden(24, torch.float32), _weights(torch.float32, bias=True, seed=9, gain=3.0)
    weights, ids = _routing(24, 3, seed=10, skew=0.5)
    ref = fused_moe_reference(x, **w, topk_weights=weights, topk_ids=ids, activation=activation)
    dense = _dense(x, w["w13"], w["w2"], weights, ids, w["b13"], w["b2"], activation)
    torch.testing.assert_close(ref.double(), dense, rtol=1e-5, atol=1e-5)
    gate = torch.einsum("th,eoh->eto", x, w["w13"])[..., :INTER] + w["b13"][:, None, :INTER]
    assert (gate > 7.0).any() and (gate.abs() < 7.0).any()  # swiglu_oai's clamp is engaged on some values


def test_reference_equals_transformers_gpt_oss_experts() -> None:
    """swiglu_oai is gpt-oss's SwiGLU: transformers' GptOssExperts (gate and up interleaved in its fused tensor,
    weights stored [in, out]) on the same weights gives the same output."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = GptOssConfig(num_local_experts=E, hidden_size=H, intermediate_size=INTER, swiglu_limit=7.0)
    hf = GptOssExperts(config)
    assert hf.alpha == 1.702 and hf.limit == 7.0
    w = _weights(torch.float32, bias=True, seed=11, gain=3.0)
    gate_up = torch.empty(E, 2 * INTER, H)
    gate_up[:, 0::2], gate_up[:, 1::2] = w["w13"][:, :INTER], w["w13"][:, INTER:]
    bias = torch.empty(E, 2 * INTER)
    bias[:, 0::2], bias[:, 1::2] = w["b13"][:, :INTER], w["b13"][:, INTER:]
    with torch.no_grad():
        hf.gate_up_proj.copy_(gate_up.transpose(1, 2))
        hf.gate_up_proj_bias.copy_(bias)
        hf.down_proj.copy_(w["w2"].transpose(1, 2))
        hf.down_proj_bias.copy_(w["b2"])
        x, (weights, ids) = _hidden(16, torch.float32), _routing(16, 4, seed=12)
        expected = hf(x, ids, weights)
    ref = fused_moe_reference(x, **w, topk_weights=weights, topk_ids=ids, activation="swiglu_oai")
    torch.testing.assert_close(ref, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(w2=torch.zeros(E, H, INTER + 1)), "w2"),
        (dict(hidden=torch.zeros(3, H, dtype=torch.float64)), "hidden"),
        (dict(topk_weights=torch.zeros(3, 2, dtype=torch.float16)), "topk_weights"),
        (dict(activation="gelu"), "activation"),
        (dict(b2=torch.zeros(E, H + 1)), "b2"),
    ],
    ids=["w2-shape", "float64", "weights-dtype", "activation", "b2-shape"],
)
def test_bad_arguments_raise_value_error(change: dict, match: str) -> None:
    w = _weights(torch.float32, bias=False)
    args = dict(hidden=_hidden(3, torch.float32), w13=w["w13"], w2=w["w2"], topk_weights=torch.rand(3, 2))
    args |= dict(topk_ids=torch.zeros(3, 2, dtype=torch.long)) | change
    with pytest.raises(ValueError, match=match):
        fused_moe(**args)


def _gpt_oss_swiglu() -> object:
    """gpt-oss's own expert activation, which names itself for the kernel (the attribute pagoda.layers.moe_gpu reads)."""
    from pagoda.models.gpt_oss import ClampedSwiGLU

    return ClampedSwiGLU(alpha=1.702, limit=7.0)


def _moe_experts(act_and_mul: Optional[object], bias: bool):
    from pagoda.layers.moe import MoEExperts  # kernel tests need not import the engine

    experts = MoEExperts(E, H, INTER, torch.float32, bias=bias, act_and_mul=act_and_mul)
    w = _weights(torch.float32, bias, seed=13, gain=3.0)
    with torch.no_grad():
        for e, expert in enumerate(experts.experts):
            expert.gate_up_proj.weight.copy_(w["w13"][e])
            expert.down_proj.weight.copy_(w["w2"][e])
            if bias:
                expert.gate_up_proj.bias.copy_(w["b13"][e])
                expert.down_proj.bias.copy_(w["b2"][e])
    return experts


@pytest.mark.parametrize(("act", "bias"), [(None, False), (_gpt_oss_swiglu(), True)], ids=["silu", "swiglu_oai-bias"])
def test_engine_fused_experts_equal_the_grouped_path(act: Optional[object], bias: bool) -> None:
    """On CPU tensors under the interpreter: same output as MoEExperts' grouped torch path, and the kernel's stacked
    weights are the experts' parameters (a weight copied in later is seen by the next call)."""
    from pagoda.layers.moe_gpu import fused_experts

    experts = _moe_experts(act, bias)
    x, (weights, ids) = _hidden(21, torch.float32), _routing(21, 2, seed=14, skew=1.0)
    out = fused_experts(experts, x, ids, weights)
    assert out is not None
    torch.testing.assert_close(out, experts.grouped_forward(x, ids, weights), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        experts.experts[2].down_proj.weight.mul_(-2.0)  # in place, as the checkpoint loader copies
    torch.testing.assert_close(fused_experts(experts, x, ids, weights), experts.grouped_forward(x, ids, weights))


def test_engine_fused_experts_decline_what_the_kernel_lacks() -> None:
    from pagoda.layers.moe_gpu import fused_experts

    x, (weights, ids) = _hidden(3, torch.float32), _routing(3, 2, seed=15)
    gelu = _moe_experts(lambda gu: torch.nn.functional.gelu(gu[:, :INTER]) * gu[:, INTER:], bias=False)
    assert fused_experts(gelu, x, ids, weights) is None  # an activation without a kernel name
    quantized = _moe_experts(None, bias=False)
    quantized.experts[1].down_proj.set_kernel(lambda t: t)  # its own kernel: the plain weight is released
    assert fused_experts(quantized, x, ids, weights) is None
    assert fused_experts(_moe_experts(None, bias=False), x.bfloat16(), ids, weights) is None  # dtype differs
