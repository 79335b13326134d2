"""Mixtral (8x7B, 8x22B): the Mistral decoder with eight routed SwiGLU experts per layer, top-2, renormalised.

The Hub checkpoints name the MoE ``block_sparse_moe`` and its expert projections ``w1`` (gate), ``w3`` (up) and
``w2`` (down); the model uses the Qwen-MoE layout (``mlp.gate``, ``mlp.experts.{e}.gate_up_proj``/``down_proj``), and
:meth:`MixtralForCausalLM.load_weights` maps the names.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pagoda.attention.protocol import AttentionBackend
from pagoda.distributed.parallel import SINGLE, TensorParallel
from pagoda.model_config import ModelConfig
from pagoda.models.llama import LlamaForCausalLM
from pagoda.models.qwen3_moe import MoEArgs, MoeCausalLMMixin

# checkpoint name fragment -> this model's (the order matters: the MoE block first, then its experts' projections)
_RENAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))


def mixtral_moe_args(config: ModelConfig) -> MoEArgs:
    """Mixtral's routing: ``num_local_experts`` experts of ``intermediate_size`` on every layer, ``num_experts_per_tok``
    of them per token, weights always renormalised and kept in float32 (transformers' MixtralTopKRouter)."""
    raw = config.raw
    num_experts = int(raw.get("num_local_experts") or 0)
    top_k = int(raw.get("num_experts_per_tok") or 0)
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"config.json needs 1 <= num_experts_per_tok ({top_k}) <= num_local_experts ({num_experts})")
    return MoEArgs(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=config.intermediate_size,
        renormalize=True,
        sparse_layers=frozenset(range(config.num_hidden_layers)),
        weights_in_activation_dtype=False,
    )


def _renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        for old, new in _RENAMES:
            name = name.replace(old, new)
        yield name, tensor


class MixtralForCausalLM(MoeCausalLMMixin, LlamaForCausalLM):
    """Mixtral: Llama attention (Mistral's sliding window from config.json) and routed experts."""

    def __init__(
        self, config: ModelConfig, attn_backend: AttentionBackend, dtype: torch.dtype, tp: TensorParallel = SINGLE
    ) -> None:
        self.moe_args = mixtral_moe_args(config)  # build_mlp reads it during the base constructor
        super().__init__(config, attn_backend, dtype, tp)

    @staticmethod
    def checkpoint_module_name(module: str) -> str:
        """The Hub's name of module ``module`` (as the loader names it, e.g. ``...mlp.experts.3.gate_proj``): where a
        quantized checkpoint keeps that module's tensors."""
        for ours, hubs in reversed(_RENAMES):
            module = (module + ".").replace(hubs, ours)[:-1]
        return module

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """:meth:`LlamaForCausalLM.load_weights` over the Hub names mapped onto this model's."""
        return super().load_weights(_renamed(weights))
