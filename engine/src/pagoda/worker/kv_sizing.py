"""How many KV blocks fit: an explicit byte budget on CPU, a memory fraction on GPU."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from pagoda.attention.protocol import FP8_KV_DTYPES
from pagoda.config import DEFAULT_CPU_KV_CACHE_MEMORY
from pagoda.startup_failure import InsufficientMemoryError

logger = logging.getLogger(__name__)


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype for ``--kv-cache-dtype``: the model's for 'auto', else the fp8 format named
    (fp8_e4m3 -> float8_e4m3fn, fp8_e5m2 -> float8_e5m2)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in FP8_KV_DTYPES:
        raise ValueError(f"kv_cache_dtype must be auto or one of {', '.join(FP8_KV_DTYPES)}, got {kv_cache_dtype!r}")
    return FP8_KV_DTYPES[kv_cache_dtype]


@dataclass(frozen=True, slots=True)
class KVCacheShape:
    """What one KV block costs a rank: per layer, ``2 x block_size x num_kv_heads x head_dim`` elements of
    ``dtype`` (the cache's: the model's, or a 1-byte fp8 format), where ``num_kv_heads`` are this rank's (under
    tensor parallelism each of ``num_ranks`` ranks holds its heads)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    num_ranks: int = 1

    @property
    def bytes_per_block(self) -> int:
        """On one rank."""
        elem = self.dtype.itemsize
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    @property
    def bytes_per_block_all_ranks(self) -> int:
        """Over every rank (more than one rank's share when KV heads are replicated)."""
        return self.bytes_per_block * self.num_ranks

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


def cpu_num_blocks(shape: KVCacheShape, kv_cache_memory: Optional[int], max_num_seqs: int, max_model_len: int) -> int:
    """Blocks for an explicit CPU budget; by default 4 GiB, or less when fewer blocks already
    hold ``max_num_seqs`` sequences of ``max_model_len`` tokens (nothing could use more). The budget is the
    replica's: under tensor parallelism it covers every rank's cache."""
    if kv_cache_memory is not None:
        return kv_cache_memory // shape.bytes_per_block_all_ranks
    blocks_per_seq = -(-max_model_len // shape.block_size)
    return min(DEFAULT_CPU_KV_CACHE_MEMORY // shape.bytes_per_block_all_ranks, max_num_seqs * blocks_per_seq)


def gpu_num_blocks(
    shape: KVCacheShape, gpu_memory_utilization: float, device: torch.device, profile: Callable[[], None]
) -> int:
    """Blocks that fit in ``gpu_memory_utilization`` of the device after the weights and the
    activation peak of ``profile()`` (a forward over the largest batch the scheduler can plan)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    free_before, total = torch.cuda.mem_get_info(device)
    weights_and_rest = total - free_before  # weights (already loaded) plus anything else on the device
    profile()
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
    budget = int(total * gpu_memory_utilization) - weights_and_rest - activation_peak
    logger.info(
        "GPU memory: total %.2f GiB, in use %.2f GiB, activation peak %.2f GiB, KV budget %.2f GiB",
        total / 2**30,
        weights_and_rest / 2**30,
        activation_peak / 2**30,
        max(budget, 0) / 2**30,
    )
    return max(budget, 0) // shape.bytes_per_block


def check_fits(num_blocks: int, shape: KVCacheShape, max_model_len: int, how_to_grow: str) -> None:
    """Refuse to start when not even one max-length sequence fits in the KV cache."""
    num_tokens = num_blocks * shape.block_size
    if num_tokens < max_model_len:
        raise InsufficientMemoryError(
            f"the KV cache holds {num_blocks} blocks = {num_tokens} tokens "
            f"({shape.bytes_per_block} bytes per block of {shape.block_size} tokens in {shape.dtype}), fewer than one "
            f"sequence of max_model_len={max_model_len} tokens; {how_to_grow} or lower --max-model-len"
        )
