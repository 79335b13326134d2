"""Mixture-of-experts routing and the grouped expert path against a per-token plain-torch reference.

The reference runs every (token, chosen expert) pair on its own, straight from the expert's weights; the layer
under test groups the pairs by expert and runs one GEMM chain per routed expert. Routing is random with ragged
expert loads and experts no token picks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.layers.linear_kernels import prepare_linear_layers
from pagoda.layers.moe import MoEExperts, select_experts

HIDDEN, INTER, EXPERTS = 32, 24, 8


def random_experts(dtype: torch.dtype, bias: bool = False, seed: int = 0, **kwargs) -> MoEExperts:
    gen = torch.Generator().manual_seed(seed)
    experts = MoEExperts(EXPERTS, HIDDEN, INTER, dtype, bias=bias, **kwargs)
    for param in experts.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return experts


def reference(experts: MoEExperts, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, act) -> torch.Tensor:
    """Per token, per chosen expert, in float32 from the dense weights."""
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for t in range(hidden.shape[0]):
        for j in range(ids.shape[1]):
            expert = experts.experts[int(ids[t, j])]
            gate_up = F.linear(hidden[t].float(), expert.gate_up_proj.weight.float(), _float(expert.gate_up_proj.bias))
            down = F.linear(act(gate_up), expert.down_proj.weight.float(), _float(expert.down_proj.bias))
            out[t] += float(weights[t, j]) * down
    return out


def _float(bias):
    return None if bias is None else bias.float()


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def ragged_routing(num_tokens: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits that favour experts 0-2 heavily and never pick experts 6 and 7 -> (weights, ids)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, EXPERTS, generator=gen)
    logits[:, :3] += 2.0
    logits[:, 6:] = -1e4
    return select_experts(logits, top_k, renormalize=True)


@pytest.mark.parametrize("renormalize", [True, False])
def test_select_experts_is_the_float32_softmax_top_k_optionally_renormalised(renormalize: bool) -> None:
    # distinct logits in every row (exact in bf16): the top 3 are defined without ties
    generator = torch.Generator().manual_seed(3)
    logits = (torch.stack([torch.randperm(EXPERTS, generator=generator) for _ in range(9)]).float() / 4).bfloat16()
    weights, ids = select_experts(logits, 3, renormalize=renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and weights.shape == ids.shape == (9, 3)
    probs = torch.softmax(logits.float(), dim=-1)
    expected_ids = probs.argsort(dim=-1, descending=True)[:, :3]
    assert torch.equal(ids, expected_ids)
    expected = probs.gather(1, expected_ids)
    if renormalize:
        expected = expected / expected.sum(-1, keepdim=True)
        torch.testing.assert_close(weights.sum(-1), torch.ones(9))
    torch.testing.assert_close(weights, expected)


def test_select_experts_refuses_a_top_k_beyond_the_expert_count() -> None:
    with pytest.raises(ValueError, match="top_k must be in"):
        select_experts(torch.randn(2, 4), 5, renormalize=True)


@pytest.mark.parametrize("num_tokens", [1, 5, 37])
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_experts_equal_the_per_token_reference_with_ragged_and_empty_experts(num_tokens, bias) -> None:
    experts = random_experts(torch.float32, bias=bias)
    hidden = torch.randn(num_tokens, HIDDEN)
    weights, ids = ragged_routing(num_tokens, 2, seed=num_tokens)
    assert not (ids >= 6).any()  # experts 6 and 7 get no token
    out = experts(hidden, ids, weights)
    assert out.dtype == torch.float32 and out.shape == hidden.shape
    torch.testing.assert_close(out, reference(experts, hidden, ids, weights, silu_and_mul), atol=1e-5, rtol=1e-5)


def test_no_tokens_give_an_empty_output() -> None:
    experts = random_experts(torch.float32)
    out = experts(torch.empty(0, HIDDEN), torch.empty(0, 2, dtype=torch.int64), torch.empty(0, 2))
    assert out.shape == (0, HIDDEN)


def test_a_custom_activation_replaces_silu() -> None:
    def clamped(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return torch.sigmoid(gate.clamp(max=0.5)) * (up + 1)

    experts = random_experts(torch.float32, act_and_mul=clamped)
    assert not experts.silu_gated
    hidden = torch.randn(11, HIDDEN)
    weights, ids = ragged_routing(11, 3, seed=3)
    torch.testing.assert_close(experts(hidden, ids, weights), reference(experts, hidden, ids, weights, clamped))


@pytest.mark.parametrize("quantization", [None, "int8", "fp8"], ids=["bf16-native", "int8", "fp8"])
def test_bf16_experts_on_the_native_cpu_kernels_route_every_row_to_its_experts(quantization) -> None:
    # Each expert's own kernel on a single row is the reference: grouping must not change which rows meet which
    # expert (bf16 results of the same kernel on a row alone or in a group differ by rounding only).
    experts = random_experts(torch.bfloat16, seed=1)
    prepare_linear_layers(experts, torch.device("cpu"), torch.bfloat16, quantization)
    hidden = torch.randn(23, HIDDEN, dtype=torch.bfloat16)
    weights, ids = ragged_routing(23, 2, seed=5)
    out = experts(hidden, ids, weights.to(torch.bfloat16))
    per_token = torch.zeros(hidden.shape, dtype=torch.float32)
    for t in range(hidden.shape[0]):
        for j in range(2):
            row = experts.experts[int(ids[t, j])](hidden[t : t + 1])[0]
            per_token[t] += (row * weights[t, j].to(torch.bfloat16)).float()
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), per_token, atol=0.05, rtol=0.02)


def test_routed_experts_keep_one_kernel_where_other_layers_would_dispatch_on_row_count() -> None:
    """Row-count dispatch holds two copies of a weight; the experts are most of a MoE model's bytes, so they keep the
    many-rows winner alone while a dense layer of the same shape gets both kernels."""
    from pagoda.cpu.kernel_selection import Selection
    from pagoda.layers import Linear
    from pagoda.layers.cpu_linear import RowDispatchLinear
    from pagoda.layers.kernel_timing import ModelKernelSelector

    built: list[str] = []

    class Kernel(str):
        @property
        def name(self) -> str:
            return str(self)

    def builder(name: str):
        return lambda weight, bias: built.append(name) or Kernel(name)

    selector = ModelKernelSelector(torch.bfloat16, None)
    selector.selection = lambda key, candidates: Selection(((1, "few"), (8, "many")), how="forced")
    candidates = {"few": builder("few"), "many": builder("many")}
    experts = MoEExperts(2, 16, 8, torch.bfloat16)
    expert_layer = experts.experts[0].down_proj
    assert expert_layer.one_weight_copy and not Linear(8, 16, False, torch.bfloat16).one_weight_copy
    assert selector.kernel(expert_layer, "linear", candidates) == "many" and built == ["many"]
    dense = Linear(8, 16, False, torch.bfloat16)
    assert isinstance(selector.kernel(dense, "linear", candidates), RowDispatchLinear) and built[1:] == ["few", "many"]
