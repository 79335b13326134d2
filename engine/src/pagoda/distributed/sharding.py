"""Which part of each checkpoint tensor a tensor-parallel rank owns (Megatron-style).

q/k/v and gate/up are column-parallel (a rank owns a range of output rows: whole heads, a slice of the
intermediate dim), o and down row-parallel (the matching input columns; the partial products are summed by one
all-reduce). The embedding and lm_head are split by vocabulary rows, the last shard padded with zero rows. With
fewer KV heads than ranks each KV head is replicated on the ranks whose query heads read it. A rank reads only
its slice from the safetensors file (``safe_open(...).get_slice``), so its host memory holds ~1/N of the weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagoda.distributed.parallel import check_shardable
from pagoda.model_config import ModelConfig

# HF module name fragment -> which range of the tensor a rank keeps: (dim, range name). Biases keep dim 0.
_COLUMN = {".q_proj.": "q", ".k_proj.": "kv", ".v_proj.": "kv", ".gate_proj.": "inter", ".up_proj.": "inter"}
_ROW = {".o_proj.": "q", ".down_proj.": "inter"}
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
# Mixture-of-experts projections (Mixtral names them w1/w3/w2), split by their own intermediate dim.
_EXPERT_COLUMN = (".gate_proj.", ".up_proj.", ".w1.", ".w3.")
_EXPERT_ROW = (".down_proj.", ".w2.")


@dataclass(frozen=True)
class ShardLayout:
    """Rank ``rank`` of ``world_size``: the local sizes the model is built with and the ranges it loads."""

    rank: int
    world_size: int
    num_heads: int  # local query heads
    num_kv_heads: int  # local KV heads (1 when replicated)
    head_dim: int
    intermediate_size: int  # local
    vocab_size: int  # the whole vocabulary
    vocab_shard: int  # rows of every rank's embedding / lm_head (the last padded)

    @classmethod
    def for_rank(cls, config: ModelConfig, rank: int = 0, world_size: int = 1) -> ShardLayout:
        check_shardable(config, world_size)
        kv = config.num_key_value_heads
        return cls(
            rank=rank,
            world_size=world_size,
            num_heads=config.num_attention_heads // world_size,
            num_kv_heads=kv // world_size if kv >= world_size else 1,
            head_dim=config.head_dim,
            intermediate_size=config.intermediate_size // world_size,
            vocab_size=config.vocab_size,
            vocab_shard=-(-config.vocab_size // world_size),
        )

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_shard

    def kv_head_start(self, num_kv_heads_total: int) -> int:
        """The first KV head this rank holds: its own range, or the head its query heads share."""
        if num_kv_heads_total >= self.world_size:
            return self.rank * self.num_kv_heads
        return self.rank * num_kv_heads_total // self.world_size

    def _rows(self, kind: str, num_kv_heads_total: int) -> tuple[int, int]:
        if kind == "q":
            size = self.num_heads * self.head_dim
            return self.rank * size, size
        if kind == "kv":
            return self.kv_head_start(num_kv_heads_total) * self.head_dim, self.num_kv_heads * self.head_dim
        size = self.intermediate_size
        return self.rank * size, size

    def read(self, name: str, tensor_slice: Any, num_kv_heads_total: int) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``name``; ``tensor_slice`` is safetensors' lazy slice of it."""
        if self.world_size == 1:
            return tensor_slice[:]
        if name in _VOCAB:
            return self._vocab_rows(tensor_slice)
        for fragment, kind in _COLUMN.items():
            if fragment in name:
                start, size = self._rows(kind, num_kv_heads_total)
                return tensor_slice[start : start + size]
        for fragment, kind in _ROW.items():
            if fragment in name:
                if name.endswith(".bias"):  # added once: rank 0 holds it, the others add zeros
                    bias = tensor_slice[:]
                    return bias if self.rank == 0 else torch.zeros_like(bias)
                start, size = self._rows(kind, num_kv_heads_total)
                return tensor_slice[:, start : start + size]
        return tensor_slice[:]  # norms: every rank holds them whole

    def read_expert(self, name: str, tensor_slice: Any) -> torch.Tensor:
        """This rank's part of an expert (or shared expert) projection: every expert is split along its own
        intermediate dim (``moe_intermediate_size``, not the dense ``intermediate_size``), gate/up by rows and down
        by columns, so the ranks' expert outputs are partial sums like the dense MLP's (no expert parallelism)."""
        if self.world_size == 1:
            return tensor_slice[:]
        row = any(fragment in name for fragment in _EXPERT_ROW)
        if not row and not any(fragment in name for fragment in _EXPERT_COLUMN):
            return tensor_slice[:]  # routers and the shared expert's gate: every rank holds them whole
        if row and name.endswith(".bias"):
            bias = tensor_slice[:]
            return bias if self.rank == 0 else torch.zeros_like(bias)
        shape = tensor_slice.get_shape()
        total = shape[1] if row and len(shape) > 1 else shape[0]
        if total % self.world_size:
            raise ValueError(f"{name}: expert intermediate size {total} is not divisible by {self.world_size} ranks")
        size = total // self.world_size
        start = self.rank * size
        return tensor_slice[:, start : start + size] if row else tensor_slice[start : start + size]

    def _vocab_rows(self, tensor_slice: Any) -> torch.Tensor:
        start = min(self.vocab_start, self.vocab_size)
        end = min(start + self.vocab_shard, self.vocab_size)
        rows = tensor_slice[start:end]
        if rows.shape[0] == self.vocab_shard:
            return rows
        padded = torch.zeros((self.vocab_shard, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
        padded[: rows.shape[0]] = rows
        return padded
