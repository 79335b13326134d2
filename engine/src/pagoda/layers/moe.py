"""Mixture-of-experts: top-k routing and the routed experts' feed-forward.

Each expert is an ordinary gated MLP built from :class:`~pagoda.layers.linear.MergedLinear` (``gate_up_proj``) and
:class:`~pagoda.layers.linear.Linear` (``down_proj``), so the published per-expert checkpoint names
(``experts.{e}.gate_proj.weight``) load through :mod:`pagoda.models.weights`' fused mapping, quantized experts
(AWQ/GPTQ/FP8, online int8/fp8) go through the quantization package, and on the CPU every expert GEMM runs on the
native packed bf16/int8/int4/fp8 kernels.

The CPU path groups the ``T * k`` (token, expert) pairs by expert and runs each routed expert once over exactly its
tokens (a grouped GEMM per expert, never a loop over tokens); CUDA hands the whole layer to the Triton fused MoE in
``pagoda.layers.moe_gpu`` when that module is present.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn

from pagoda.layers.activation import SiluAndMul
from pagoda.layers.linear import Linear, MergedLinear


def select_experts(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    *,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # (topk_weights float32 [num_tokens, k], topk_ids int64 [num_tokens, k])
    """Softmax over all experts in float32, the ``top_k`` largest, optionally renormalised to sum 1 per token.

    This is the routing of Qwen3-MoE / Qwen2-MoE (``norm_topk_prob``) and Mixtral (always renormalised).
    """
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [num_tokens, num_experts]
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


class ExpertMLP(nn.Module):
    """One expert: ``down_proj(act_and_mul(gate_up_proj(x)))`` (checkpoint names gate_proj/up_proj/down_proj).

    Also a shared expert (Qwen2-MoE), which is the same block run on every token.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        bias: bool = False,
        act_and_mul: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    ) -> None:
        super().__init__()
        # act_and_mul(gate_up [n, 2 * inter]) -> [n, inter]; a SiLU one may run fused in the gate/up kernel.
        self.act_and_mul = act_and_mul if act_and_mul is not None else SiluAndMul("silu")
        self.silu_gated = isinstance(self.act_and_mul, SiluAndMul) and self.act_and_mul.is_silu
        sizes = [intermediate_size, intermediate_size]
        self.gate_up_proj = MergedLinear(hidden_size, sizes, bias, dtype, self.silu_gated)
        self.down_proj = Linear(intermediate_size, hidden_size, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [n, hidden] -> [n, hidden] (unweighted)
        inner = self.gate_up_proj.forward_silu_and_mul(x) if self.silu_gated else None
        if inner is None:
            inner = self.act_and_mul(self.gate_up_proj(x))  # [n, intermediate]
        return self.down_proj(inner)


class MoEExperts(nn.Module):
    """The routed experts of one MoE layer: ``forward(hidden, topk_ids, topk_weights)`` is each token's expert
    outputs weighted by its routing weights and summed, in ``hidden.dtype``.

    Under tensor parallelism each rank builds this with its slice of the expert intermediate dim; the output is
    then a partial sum the caller completes with one all-reduce (together with anything else row-parallel).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        *,
        bias: bool = False,
        act_and_mul: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        # One activation for all experts: act_and_mul(gate_up [n, 2 * inter]) -> [n, inter].
        self.act_and_mul = act_and_mul if act_and_mul is not None else SiluAndMul("silu")
        self.silu_gated = isinstance(self.act_and_mul, SiluAndMul) and self.act_and_mul.is_silu
        act = self.act_and_mul
        self.experts = nn.ModuleList(
            ExpertMLP(hidden_size, intermediate_size, dtype, bias, act) for _ in range(num_experts)
        )
        for expert in self.experts:  # the experts are most of a MoE model's bytes: never two copies of them
            expert.gate_up_proj.one_weight_copy = expert.down_proj.one_weight_copy = True

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]
        topk_ids: torch.Tensor,  # [num_tokens, k] int64
        topk_weights: torch.Tensor,  # [num_tokens, k] float32 (or hidden.dtype: the product is in the wider one)
    ) -> torch.Tensor:  # [num_tokens, hidden] in hidden.dtype
        if hidden.is_cuda:
            fused = _gpu_fused_experts()
            if fused is not None:
                out = fused(self, hidden, topk_ids, topk_weights)
                if out is not None:
                    return out
        return self.grouped_forward(hidden, topk_ids, topk_weights)

    def grouped_forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The portable path: (token, expert) pairs sorted by expert, one GEMM chain per routed expert."""
        # The per-expert row counts come back to the host; the engine runs such models' decode steps eagerly
        # (engine_config.eager_reason), so this only trips when that rule is bypassed.
        assert not (hidden.is_cuda and torch.cuda.is_current_stream_capturing()), "grouped MoE inside a CUDA graph"
        top_k = topk_ids.shape[1]
        flat_ids = topk_ids.reshape(-1)  # [T * k]
        order = torch.argsort(flat_ids, stable=True)  # pairs grouped by expert, token order kept inside a group
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        token_rows = order // top_k  # [T * k]: the token of each sorted pair
        # The product is taken in the wider of the two dtypes and rounded to hidden's, as transformers does
        # (Qwen-MoE hands bf16 weights in, Mixtral float32 ones).
        weights = topk_weights.reshape(-1)[order]  # [T * k]
        out = torch.zeros_like(hidden)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = token_rows[start : start + count]  # distinct tokens: a token picks an expert at most once
            y = self.experts[expert](hidden[rows])  # [count, hidden]
            out.index_add_(0, rows, (y * weights[start : start + count, None]).to(out.dtype))
            start += count
        return out


_GPU_MODULE: list[Any] = []  # [module or None] once looked up


def _gpu_fused_experts() -> Optional[Callable[..., Optional[torch.Tensor]]]:
    """``pagoda.layers.moe_gpu.fused_experts`` when that module exists (imported on first CUDA use only)."""
    if not _GPU_MODULE:
        try:
            _GPU_MODULE.append(importlib.import_module("pagoda.layers.moe_gpu"))
        except ModuleNotFoundError as exc:
            if exc.name != "pagoda.layers.moe_gpu":
                raise  # the module is there but needs something missing: say so rather than run slowly
            _GPU_MODULE.append(None)
    module = _GPU_MODULE[0]
    return None if module is None else getattr(module, "fused_experts", None)
