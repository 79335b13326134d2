"""gpt-oss (``GptOssForCausalLM``: gpt-oss-20b / 120b), numerically as transformers' ``modeling_gpt_oss``.

The Llama decoder (fused q/k/v with biases, rotate-half RoPE, here YaRN) with:

- attention sinks: a learned logit per query head, an extra softmax column whose probability is dropped
  (``Attention(..., sinks=True)``), and sliding-window (128) and full attention alternating per ``layer_types``;
- the MoE MLP: a router with bias, top-k on the logits and a softmax over those k; experts with biases and the
  clamped SwiGLU ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, l)`` (alpha 1.702, l 7);
- RMSNorm weights in float32 (transformers keeps the norms in float32) and ``(w * x).to(dtype)`` rounding.

The checkpoint stores each layer's experts fused and transposed against ``nn.Linear``: ``mlp.experts.gate_up_proj``
[E, hidden, 2 * inter] with gate and up columns interleaved (even gate, odd up), ``down_proj`` [E, inter, hidden],
biases [E, 2 * inter] / [E, hidden]. Loading splits them into :class:`~pagoda.layers.moe.MoEExperts`' per-expert
``[gate | up]`` / down layers. MXFP4 checkpoints (the published ones) store ``<proj>_blocks`` / ``<proj>_scales``
instead (:mod:`pagoda.quantization.mxfp4`): each expert projection gets the exact 8-bit group-of-32 weight, which
:func:`~pagoda.layers.linear_kernels.prepare_linear_layers` hands to the native CPU kernel (Triton int8 on CUDA).
Under tensor parallelism the experts shard by intermediate dim (the interleaved columns of a rank's range are
contiguous), the sinks by head; expert parallelism is not implemented.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import nn

from pagoda.attention.protocol import AttentionBackend
from pagoda.distributed.parallel import SINGLE, TensorParallel
from pagoda.distributed.sharding import ShardLayout
from pagoda.layers import Linear, RMSNorm
from pagoda.layers.linear import linear_weights_on_meta
from pagoda.layers.moe import MoEExperts
from pagoda.model_config import ModelConfig
from pagoda.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from pagoda.models.weights import load_named_weights
from pagoda.quantization.mxfp4 import MXFP4_BLOCK, Mxfp4Config, Mxfp4Source, as_uint8

_EXPERT_TENSOR = re.compile(r"^(model\.layers\.(\d+)\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")


@dataclass(frozen=True)
class GptOssConfig:
    """The gpt-oss fields of config.json."""

    num_experts: int
    top_k: int
    swiglu_alpha: float
    swiglu_limit: float
    mxfp4: Optional[Mxfp4Config]  # the checkpoint's experts are MXFP4 (None: bf16/fp32)

    @staticmethod
    def from_raw(raw: dict[str, Any]) -> GptOssConfig:
        num_experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
        top_k = int(raw.get("num_experts_per_tok") or raw.get("experts_per_token") or 0)
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"gpt-oss needs 1 <= num_experts_per_tok <= num_local_experts, got {top_k}, {num_experts}")
        return GptOssConfig(
            num_experts=num_experts,
            top_k=top_k,
            swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
            mxfp4=Mxfp4Config.from_raw(raw),
        )


class ClampedSwiGLU(nn.Module):
    """gpt-oss's expert activation over ``[gate | up]`` (de-interleaved at load): [n, 2 * inter] -> [n, inter]."""

    moe_activation = "swiglu_oai"  # what the Triton fused MoE kernel calls it (pagoda.layers.moe_gpu)

    def __init__(self, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha = alpha
        self.limit = limit
        self.swiglu_alpha, self.swiglu_limit = alpha, limit  # the kernel's names for the two constants

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class GptOssRMSNorm(RMSNorm):
    """RMSNorm with a float32 weight and transformers' gpt-oss rounding: ``(w * x32 * rsqrt(...)).to(dtype)``; the
    residual add (``residual`` given) is rounded to the activation dtype first, as transformers' separate add."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps, torch.float32)

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        if residual is None:
            return self._normalize(x)
        x = x + residual
        return self._normalize(x), x

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., hidden]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32).to(x.dtype)


class GptOssAttention(LlamaAttention):
    """Llama attention (q/k/v/o biases from ``attention_bias``) whose softmax has a learned sink per head."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        backend: AttentionBackend,
        dtype: torch.dtype,
        shard: ShardLayout,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__(config, layer_idx, backend, dtype, shard, tp, sinks=True)


class GptOssMLP(nn.Module):
    """Router (replicated under tensor parallelism) and experts (this rank's slice of each expert's inter dim)."""

    def __init__(
        self,
        config: ModelConfig,
        family: GptOssConfig,
        dtype: torch.dtype,
        shard: ShardLayout,
        tp: TensorParallel,
        quantized: bool,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.top_k = family.top_k
        self.router = Linear(config.hidden_size, family.num_experts, True, dtype)
        self.router.keep_dense = True  # never quantized at load: its logits pick the experts
        act = ClampedSwiGLU(family.swiglu_alpha, family.swiglu_limit)
        # MXFP4 experts never get a dense weight: each projection holds its checkpoint tensors (Mxfp4Source).
        with linear_weights_on_meta() if quantized else contextlib.nullcontext():
            self.experts = MoEExperts(
                family.num_experts, config.hidden_size, shard.intermediate_size, dtype, bias=True, act_and_mul=act
            )
        self.mxfp4: dict[str, list[Mxfp4Source]] = {}
        if quantized:
            for proj in ("gate_up_proj", "down_proj"):
                sources = [Mxfp4Source(f"experts.{e}.{proj}") for e in range(family.num_experts)]
                for expert, source in zip(self.experts.experts, sources):
                    getattr(expert, proj).hold_quantized_source(source)
                self.mxfp4[proj] = sources

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, hidden]
        logits = self.router(x)  # [num_tokens, num_experts]
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        # transformers: softmax over the k logits in the activation dtype
        weights = torch.softmax(top, dim=-1, dtype=top.dtype).float()
        return self.tp.all_reduce(self.experts(x, ids, weights))


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss-20b / gpt-oss-120b; forward, logits and the KV cache spec are the Llama decoder's."""

    routed_experts = True  # the engine's start-up checks read it (CUDA graphs, tensor parallelism)

    @classmethod
    def check_tensor_parallel(cls, config: ModelConfig, world_size: int) -> None:
        """ValueError before any rank starts when MXFP4 expert groups of 32 would straddle two ranks."""
        if Mxfp4Config.from_raw(config.raw) is not None and (config.intermediate_size // world_size) % MXFP4_BLOCK:
            raise ValueError(
                f"--tensor-parallel-size {world_size} splits gpt-oss's MXFP4 experts ({config.intermediate_size} wide) "
                f"inside groups of {MXFP4_BLOCK}; use a size that keeps intermediate_size / size a multiple of "
                f"{MXFP4_BLOCK} (2 for gpt-oss-20b and 120b)"
            )

    def __init__(  # noqa: PLR0913 (the model constructor of every family)
        self, config: ModelConfig, attn_backend: AttentionBackend, dtype: torch.dtype, tp: TensorParallel = SINGLE
    ) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.family = GptOssConfig.from_raw(config.raw)
        self.dtype = dtype
        self.attn_backend = attn_backend
        self.tp = tp
        self.shard = ShardLayout.for_rank(config, tp.rank, tp.world_size)
        mx = self.family.mxfp4
        layers = []
        for i in range(config.num_hidden_layers):
            quantized = mx is not None and mx.converts(f"model.layers.{i}.mlp.experts")
            mlp = GptOssMLP(config, self.family, dtype, self.shard, tp, quantized)
            layer = LlamaDecoderLayer(
                GptOssAttention(config, i, attn_backend, dtype, self.shard, tp), mlp, config, dtype
            )  # type: ignore[arg-type]
            layer.input_layernorm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)
            layer.post_attention_layernorm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)
            layers.append(layer)
        self.model = LlamaModel(config, layers, dtype, self.shard, tp)
        self.model.norm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)
        tied = self.model.embed_tokens.weight if config.tie_word_embeddings else None
        self.lm_head = Linear(config.hidden_size, self.shard.vocab_shard, bias=False, dtype=dtype, shared_weight=tied)

    @torch.inference_mode()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names, fused experts as published) into the parameters; MXFP4 expert
        tensors go to their projections' sources. ValueError for unknown names, shapes and missing weights."""
        skip: Optional[set[str]] = {"lm_head.weight"} if self.config.tie_word_embeddings else None
        return load_named_weights(self, self._per_expert(weights), skip_names=skip)

    def _per_expert(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint stream with each fused expert tensor split into per-expert parameter names."""
        for name, tensor in weights:
            if name.endswith(".self_attn.sinks"):
                yield name.replace(".self_attn.sinks", ".self_attn.attn.sinks"), tensor.float()
                continue
            match = _EXPERT_TENSOR.match(name)
            if match is None:
                yield name, tensor
                continue
            prefix, layer, proj, kind = match.group(1), int(match.group(2)), match.group(3), match.group(4) or ""
            mlp = self.model.layers[layer].mlp
            if kind in ("_blocks", "_scales"):
                self._take_mxfp4(mlp, name, proj, kind, tensor)
                continue
            if proj in mlp.mxfp4 and kind == "":
                raise ValueError(f"{name}: config.json says these experts are MXFP4, the checkpoint has them dense")
            for e, part in enumerate(_split_experts(proj, kind, tensor)):
                yield f"{prefix}.experts.{e}.{proj}.{'bias' if kind else 'weight'}", part

    def _take_mxfp4(self, mlp: GptOssMLP, name: str, proj: str, kind: str, tensor: torch.Tensor) -> None:
        sources = mlp.mxfp4.get(proj)
        if sources is None:
            raise ValueError(f"{name}: MXFP4 tensor for experts that config.json's quantization_config leaves dense")
        rows = as_uint8(tensor)  # [E, out, groups(, 16)]
        if proj == "gate_up_proj":  # interleaved gate/up rows -> [gate | up]
            rows = torch.cat([rows[:, 0::2], rows[:, 1::2]], dim=1)
        if rows.shape[0] != len(sources):
            raise ValueError(f"{name} holds {rows.shape[0]} experts, config.json says {len(sources)}")
        for source, expert_rows in zip(sources, rows):
            setattr(source, kind[1:], expert_rows.contiguous())

    def read_shard(self, name: str, tensor_slice: Any) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``name``: experts by intermediate dim, sinks by head."""
        if self.tp.world_size == 1:
            return tensor_slice[:]
        if name.endswith(".self_attn.sinks"):
            start = self.tp.rank * self.shard.num_heads
            return tensor_slice[start : start + self.shard.num_heads]
        match = _EXPERT_TENSOR.match(name)
        if match is None:
            return self.shard.read(name, tensor_slice, self.config.num_key_value_heads)
        return _expert_shard(match.group(3), match.group(4) or "", tensor_slice, self.shard, self.tp.rank)


def _split_experts(proj: str, kind: str, tensor: torch.Tensor) -> list[torch.Tensor]:
    """A fused expert tensor -> each expert's Linear weight [out, in] (or bias [out]), gate/up de-interleaved."""
    if kind == "":  # [E, in, out] -> [E, out, in]
        tensor = tensor.transpose(1, 2)
    if proj == "gate_up_proj":  # interleaved outputs (dim 1) -> [gate | up]
        tensor = torch.cat([tensor[:, 0::2], tensor[:, 1::2]], dim=1)
    return [t.contiguous() for t in tensor]


def _expert_shard(proj: str, kind: str, tensor_slice: Any, shard: ShardLayout, rank: int) -> torch.Tensor:
    """A rank's slice of a fused expert tensor (``kind``: "", "_bias", "_blocks" or "_scales")."""
    size = shard.intermediate_size
    start = rank * size
    if proj == "gate_up_proj":  # gate/up columns interleaved: the range's 2 * size outputs are contiguous
        if kind == "":  # [E, hidden, 2 * inter]
            return tensor_slice[:, :, 2 * start : 2 * (start + size)]
        return tensor_slice[:, 2 * start : 2 * (start + size)]  # bias [E, 2I], blocks/scales [E, 2I, G(, 16)]
    if kind == "_bias":  # added once after the all-reduce's sum: rank 0 holds it, the others add zeros
        bias = tensor_slice[:]
        return bias if rank == 0 else torch.zeros_like(bias)
    if kind == "":  # [E, inter, hidden]
        return tensor_slice[:, start : start + size]
    if start % MXFP4_BLOCK or size % MXFP4_BLOCK:
        raise ValueError(
            f"MXFP4 down_proj blocks of {MXFP4_BLOCK} inputs cannot be split at the tensor-parallel slice "
            f"[{start}, {start + size}) of the intermediate dim; use a tensor-parallel size that keeps "
            f"intermediate_size / tp a multiple of {MXFP4_BLOCK}"
        )
    return tensor_slice[:, :, start // MXFP4_BLOCK : (start + size) // MXFP4_BLOCK]  # [E, hidden, G(, 16)]
