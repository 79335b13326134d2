"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): the Qwen3 decoder with mixture-of-experts feed-forwards.

The MoE pieces every routed family here shares live in this module too: :class:`MoEArgs` (the routing fields of
config.json) and :class:`SparseMoeBlock` (router ``gate`` + ``experts.{e}``, named as the published checkpoints name
them, so per-expert tensors, quantized experts and tensor-parallel slices load by name). Mixtral and Qwen2-MoE
reuse them (and :class:`MoeCausalLMMixin`) from their own modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from pagoda.attention.protocol import AttentionBackend
from pagoda.distributed.parallel import SINGLE, TensorParallel
from pagoda.layers import Linear, SiluAndMul
from pagoda.layers.moe import ExpertMLP, MoEExperts, select_experts
from pagoda.model_config import ModelConfig
from pagoda.models.llama import LlamaForCausalLM
from pagoda.models.qwen3 import Qwen3ForCausalLM


@dataclass(frozen=True)
class MoEArgs:
    """The routing of an MoE checkpoint, parsed from config.json (``ModelConfig.raw``)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one routed expert
    renormalize: bool  # top-k weights rescaled to sum 1 (Qwen's norm_topk_prob; Mixtral always)
    sparse_layers: frozenset[int]  # the layers whose feed-forward is the MoE (the others: a dense MLP)
    # transformers' Qwen routers round the top-k weights to the activation dtype; Mixtral's keep float32.
    weights_in_activation_dtype: bool = True
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert (0: none)

    def check_tensor_parallel(self, world_size: int) -> None:
        """ValueError when an expert cannot be split evenly over ``world_size`` ranks."""
        for what, size in (
            ("moe_intermediate_size", self.intermediate_size),
            ("shared_expert_intermediate_size", self.shared_expert_intermediate_size),
        ):
            if size % world_size:
                raise ValueError(f"{what} {size} is not divisible by tensor parallel size {world_size}")


def _int_field(raw: dict[str, Any], key: str) -> int:
    value = raw.get(key)
    if value is None or int(value) <= 0:
        raise ValueError(f"config.json needs a positive {key!r} for a mixture-of-experts model, has {value!r}")
    return int(value)


def qwen_moe_args(config: ModelConfig) -> MoEArgs:
    """Qwen3-MoE / Qwen2-MoE routing: ``num_experts`` (or ``num_local_experts``), ``num_experts_per_tok``, ``moe_intermediate_size``,
    ``norm_topk_prob``; layer i is sparse unless listed in ``mlp_only_layers`` or (i + 1) is not a multiple of
    ``decoder_sparse_step``, exactly transformers' rule."""
    raw = config.raw
    # The Hub configs say num_experts; transformers 5 writes it as num_local_experts (its attribute_map).
    num_experts = _int_field(raw, "num_experts" if raw.get("num_experts") is not None else "num_local_experts")
    top_k = _int_field(raw, "num_experts_per_tok")
    if top_k > num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} exceeds num_experts {num_experts}")
    step = int(raw.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in raw.get("mlp_only_layers") or ()}
    sparse = frozenset(i for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
    shared = int(raw.get("shared_expert_intermediate_size") or 0)  # Qwen2-MoE only
    return MoEArgs(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=_int_field(raw, "moe_intermediate_size"),
        renormalize=bool(raw.get("norm_topk_prob", False)),
        sparse_layers=sparse,
        shared_expert_intermediate_size=shared,
    )


class SparseMoeBlock(MoEExperts):
    """A layer's MoE feed-forward: router ``gate`` [experts, hidden] (replicated), ``experts.{e}`` (split by their
    intermediate dim under tensor parallelism), and an optional sigmoid-gated ``shared_expert`` (Qwen2-MoE)."""

    def __init__(self, args: MoEArgs, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel = SINGLE) -> None:
        args.check_tensor_parallel(tp.world_size)
        act = SiluAndMul(config.hidden_act)
        hidden = config.hidden_size
        super().__init__(args.num_experts, hidden, args.intermediate_size // tp.world_size, dtype, act_and_mul=act)
        self.args = args
        self.tp = tp
        self.gate = Linear(hidden, args.num_experts, bias=False, dtype=dtype)
        self.gate.keep_dense = True  # the router: never quantized at load
        self.shared_expert: Optional[ExpertMLP] = None
        self.shared_expert_gate: Optional[Linear] = None
        if args.shared_expert_intermediate_size:
            shared = args.shared_expert_intermediate_size // tp.world_size
            self.shared_expert = ExpertMLP(hidden, shared, dtype, act_and_mul=act)
            self.shared_expert_gate = Linear(hidden, 1, bias=False, dtype=dtype)
            self.shared_expert_gate.keep_dense = True

    def forward(  # type: ignore[override]
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]
        topk_ids: Optional[torch.Tensor] = None,  # [num_tokens, k]: routing decided elsewhere; None: the router's
        topk_weights: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:  # [num_tokens, hidden], summed over the ranks
        if topk_ids is None or topk_weights is None:
            topk_weights, topk_ids = select_experts(
                self.gate(hidden), self.args.top_k, renormalize=self.args.renormalize
            )
            if self.args.weights_in_activation_dtype:
                topk_weights = topk_weights.to(hidden.dtype)
        out = super().forward(hidden, topk_ids, topk_weights)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            # sigmoid(gate) is the same on every rank, so gating each rank's partial sum gates the whole.
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return self.tp.all_reduce(out)


class MoeCausalLMMixin:
    """Decoder layers whose feed-forward is a :class:`SparseMoeBlock` where ``moe_args`` says so; set
    ``moe_args`` before ``LlamaForCausalLM.__init__`` runs."""

    moe_args: MoEArgs
    config: ModelConfig
    tp: TensorParallel
    shard: Any
    routed_experts = True  # the engine's start-up checks read it (CUDA graphs, tensor parallelism)

    @classmethod
    def check_tensor_parallel(cls, config: ModelConfig, world_size: int) -> None:
        """ValueError before any rank starts when ``world_size`` does not divide the experts' widths."""
        for field in ("moe_intermediate_size", "shared_expert_intermediate_size"):
            size = config.raw.get(field)
            if size and int(size) % world_size:
                raise ValueError(f"--tensor-parallel-size {world_size} does not divide {field} {size}")

    def build_mlp(self, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        """The MoE block on sparse layers, the dense SwiGLU MLP elsewhere."""
        if layer_idx in self.moe_args.sparse_layers:
            return SparseMoeBlock(self.moe_args, self.config, dtype, self.tp)
        return LlamaForCausalLM.build_mlp(self, layer_idx, dtype)  # type: ignore[arg-type]

    def read_shard(self, name: str, tensor_slice: Any) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``name``: experts by their own intermediate dim."""
        if ".experts." in name or ".shared_expert." in name:
            return self.shard.read_expert(name, tensor_slice)
        return self.shard.read(name, tensor_slice, self.config.num_key_value_heads)


class Qwen3MoeForCausalLM(MoeCausalLMMixin, Qwen3ForCausalLM):
    """Qwen3-MoE: Qwen3 attention (per-head q/k norms) and routed experts."""

    def __init__(
        self, config: ModelConfig, attn_backend: AttentionBackend, dtype: torch.dtype, tp: TensorParallel = SINGLE
    ) -> None:
        self.moe_args = qwen_moe_args(config)  # build_mlp reads it during the base constructor
        super().__init__(config, attn_backend, dtype, tp)
