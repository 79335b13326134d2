"""Attention over the paged KV cache: the metadata of one step and the backend interface.

The model code calls :meth:`AttentionBackend.forward` and nothing else; which backend runs
(torch on CPU, Triton on CUDA) is chosen once by the model runner. Per-step data that is the
same for every layer (gather indices, masks) is built once by :meth:`AttentionBackend.prepare`
and stored on the metadata object, which is passed explicitly through the forward call.

KV cache layout, one tensor per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 holds keys, 1 values). Token ``t`` of a request lives in slot
``block_table[t // block_size] * block_size + t % block_size``.

The cache holds the model's dtype, or fp8 (``--kv-cache-dtype fp8_e4m3 | fp8_e5m2``: float8_e4m3fn /
float8_e5m2, one byte per element). An fp8 cache stores ``k / k_scale`` and ``v / v_scale`` (per-tensor scales of
the layer, :class:`AttentionLayerSpec`), saturated to the format's largest finite value and rounded to nearest;
every reader widens the codes to float and multiplies by the scale. Which form a cache has is its tensor's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs to know about one flattened (varlen) batch.

    Requests are laid out back to back: request ``i`` owns query tokens
    ``query_start_loc[i]:query_start_loc[i + 1]`` and, after this step, has ``seq_lens[i]``
    tokens of context in the cache (its cached prefix plus this step's tokens).
    """

    query_start_loc: list[int]  # [num_reqs + 1]
    seq_lens: list[int]  # [num_reqs]
    block_tables: torch.Tensor  # [num_reqs, max_num_blocks] int64, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_size: int
    # Filled by AttentionBackend.prepare(); private to the backend that built it.
    backend_state: dict[str, Any] = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    def query_len(self, i: int) -> int:
        return self.query_start_loc[i + 1] - self.query_start_loc[i]


@dataclass(frozen=True, slots=True)
class AttentionLayerSpec:
    """Per-layer constants of an attention layer.

    Scores are ``scale * q.k``; with ``logits_soft_cap`` they become ``cap * tanh(score / cap)`` (Gemma 2) before
    the causal / sliding-window mask. With ``has_sinks`` the backend's ``sinks`` argument holds one learned logit per
    query head (gpt-oss): an extra softmax column whose probability is dropped, so a row's weights sum below 1.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: Optional[int] = None  # attend to at most this many most recent keys
    k_scale: float = 1.0  # fp8 caches only: a cached key is code * k_scale
    v_scale: float = 1.0  # fp8 caches only: a cached value is code * v_scale
    logits_soft_cap: Optional[float] = None  # scores -> cap * tanh(scores / cap), before masking
    has_sinks: bool = False  # forward() gets sinks: float32 [num_heads]

    @property
    def plain_softmax(self) -> bool:
        """Whether scores go straight into a softmax (no soft cap, no sink column): what SDPA and the native CPU
        kernel compute."""
        return self.logits_soft_cap is None and not self.has_sinks


FP8_KV_DTYPES: dict[str, torch.dtype] = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is one of the fp8 KV cache formats."""
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """fp8 codes (``dtype``) of ``x / scale``: saturated to the format's largest finite value (448 for e4m3fn,
    57344 for e5m2), rounded to nearest even; NaN stays NaN. The spec every cache writer follows."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(dtype)


def dequantize_kv(codes: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``codes * scale`` (computed in float32) in ``dtype``."""
    return (codes.float() * scale).to(dtype)


def check_sinks(spec: AttentionLayerSpec, sinks: Optional[torch.Tensor]) -> None:
    """Raise ValueError unless ``sinks`` is given exactly when the layer has them, as one logit per query head."""
    if spec.has_sinks != (sinks is not None):
        raise ValueError(f"layer has_sinks={spec.has_sinks} but sinks {'not ' if sinks is None else ''}given")
    if sinks is not None and tuple(sinks.shape) != (spec.num_heads,):
        raise ValueError(f"sinks must be [num_heads={spec.num_heads}], got {tuple(sinks.shape)}")


class AttentionBackend(Protocol):
    """One interface for every device: write this step's K/V, then attend."""

    name: str

    def prepare(self, meta: AttentionMetadata) -> None:
        """Precompute per-step state shared by all layers (called once per step)."""

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        spec: AttentionLayerSpec,
        sinks: Optional[torch.Tensor] = None,  # [num_heads] float32, given exactly when spec.has_sinks
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write k/v through the slot mapping, then attend causally over each request's context."""


def token_positions(query_lens: torch.Tensor, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Position of every query token in its sequence, and the index of its request.

    query_lens, seq_lens: [num_reqs] int64. Returns (positions [num_tokens], req_index [num_tokens]).
    """
    req_index = torch.repeat_interleave(torch.arange(len(query_lens)), query_lens)
    starts = torch.cumsum(query_lens, 0) - query_lens  # first flat index of each request
    offsets = torch.arange(len(req_index)) - starts[req_index]
    positions = (seq_lens - query_lens)[req_index] + offsets
    return positions, req_index


def build_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
) -> AttentionMetadata:
    """Build metadata from per-request query lengths, context lengths and block tables.

    The query tokens of request ``i`` are its positions ``seq_lens[i] - query_lens[i]``
    .. ``seq_lens[i] - 1``; their slots follow from the block table.
    """
    assert len(query_lens) == len(seq_lens) == len(block_tables)
    for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
        assert 0 < q_len <= s_len <= len(table) * block_size, (q_len, s_len, len(table))
    max_blocks = max((len(t) for t in block_tables), default=0)
    padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
    tables = torch.tensor(padded, dtype=torch.int64).reshape(len(block_tables), max_blocks)
    positions, req_index = token_positions(
        torch.tensor(query_lens, dtype=torch.int64), torch.tensor(seq_lens, dtype=torch.int64)
    )
    slot_mapping = tables[req_index, positions // block_size] * block_size + positions % block_size
    query_start_loc = [0]
    for q_len in query_lens:
        query_start_loc.append(query_start_loc[-1] + q_len)
    return AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=list(seq_lens),
        block_tables=tables,
        slot_mapping=slot_mapping,
        block_size=block_size,
    )
