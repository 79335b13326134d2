"""CUDA graphs of the model forward for pure-decode steps (the Triton backend on CUDA).

A decode step of a small model is dominated by kernel-launch overhead: hundreds of tiny kernels per
step, each costing more to launch than to run. Capturing the whole forward once per batch size and
replaying it removes that overhead. A graph replays fixed device addresses and shapes, so every input
lives in a static buffer sized for the largest batch, and a step of ``n`` sequences runs the graph of
the smallest captured size ``>= n`` with its extra rows marked as padding: slot ``-1`` (``write_kv``
skips it) and context length 0 (decode attention outputs zeros for it). Block tables are padded to
``max_model_len / block_size`` columns and the decode kernel's context split count is fixed per graph,
so nothing captured depends on the step's lengths. Prefill and mixed steps run eagerly.

Sizes follow vLLM: 1, 2, 4, 8, then every multiple of 8 up to ``max_num_seqs`` (plus ``max_num_seqs``
itself, so every decode batch the scheduler can plan has a graph).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import time
from collections import Counter
from typing import Any, Optional

import torch
from torch import nn

from pagoda.attention.protocol import AttentionMetadata
from pagoda.attention.triton_backend import TritonAttentionBackend

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture, ascending: 1, 2, 4, 8, 16, 24, ... capped by (and ending at) max_num_seqs."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeCudaGraphs:
    """Captured forwards of pure-decode batches, replayed with each step's inputs copied into static buffers."""

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],  # per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
        max_num_seqs: int,
        max_model_len: int,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.block_size = kv_caches[0].shape[2]
        self.num_kv_heads = kv_caches[0].shape[3]
        self.max_model_len = max_model_len
        device, max_batch = kv_caches[0].device, self.sizes[-1]
        max_blocks = -(-max_model_len // self.block_size)
        # Static inputs; row i of every buffer belongs to sequence i of the step being replayed.
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)  # [max_batch]
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)  # [max_batch]
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, device=device)  # -1 = padding
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)  # 0 = padding
        self.graphs: dict[int, Any] = {}  # size -> torch.cuda.CUDAGraph
        self.outputs: dict[int, torch.Tensor] = {}  # size -> [size, hidden] written by each replay
        self.num_replays: Counter[int] = Counter()  # size -> replays (for metrics and tests)
        self._stream: Optional[torch.cuda.Stream] = None  # warm-up and capture stream (CUDA only)

    def capture(self) -> None:
        """Capture one graph per size, largest first so the smaller ones reuse its memory pool."""
        start = time.perf_counter()
        pool = None
        # Warm-up and capture share one side stream (as torch.cuda.graph's docs ask), so lazy per-stream
        # state (e.g. cuBLAS workspaces) is created by the warm-up rather than inside a capture.
        self._stream = torch.cuda.Stream(self.seq_lens.device) if self.seq_lens.is_cuda else None
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream())  # the static buffers and caches are zeroed
        for size in reversed(self.sizes):
            meta = self._metadata(size)
            with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
                self._forward(size, meta)  # warm-up: compiles this size's kernels outside the capture
            self.graphs[size], self.outputs[size] = self._capture_one(size, meta, pool)
            pool = self.graphs[size].pool() if pool is None else pool
        if self.seq_lens.is_cuda:
            torch.cuda.synchronize()
        logger.info(
            "captured CUDA graphs for %d decode batch sizes (%s) in %.1f s",
            len(self.sizes),
            _describe(self.sizes),
            time.perf_counter() - start,
        )

    def _capture_one(self, size: int, meta: AttentionMetadata, pool: Optional[tuple]) -> tuple[Any, torch.Tensor]:
        """Capture the forward of ``size`` rows: (graph, its output buffer [size, hidden])."""
        torch.cuda.synchronize()  # the warm-up on the side stream is done
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=self._stream):
            out = self._forward(size, meta)
        return graph, out

    def can_run(self, meta: AttentionMetadata) -> bool:
        """Whether this step is a pure-decode batch that fits a captured size."""
        return meta.num_tokens == meta.num_reqs <= self.sizes[-1]

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay the graph for this step: returns hidden states [num_reqs, hidden] (a view of a static
        buffer, valid until the next replay)."""
        assert self.can_run(meta), (meta.num_tokens, meta.num_reqs)
        n = meta.num_reqs
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        width = meta.block_tables.shape[1]
        assert width <= self.block_tables.shape[1], (width, self.block_tables.shape)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[n:size].fill_(-1)
        # Columns past `width` keep stale block ids: the kernel reads only blocks below each seq_len.
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        self.seq_lens[:n].copy_(torch.tensor(meta.seq_lens, dtype=torch.int32), non_blocking=True)
        self.seq_lens[n:size].fill_(0)
        self.graphs[size].replay()
        self.num_replays[size] += 1
        return self.outputs[size][:n]

    def _metadata(self, size: int) -> AttentionMetadata:
        from pagoda_kernels.decode_attention import default_num_splits

        # Fixed per graph: enough context partitions to fill the GPU at this batch size for the
        # longest context the engine allows (the kernel's result does not depend on the count).
        num_splits = default_num_splits(size, self.num_kv_heads, self.max_model_len, self.seq_lens.device)
        meta = AttentionMetadata(
            query_start_loc=list(range(size + 1)),
            seq_lens=[0] * size,
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            block_size=self.block_size,
        )
        meta.backend_state.update(
            TritonAttentionBackend.decode_state(self.block_tables[:size], self.seq_lens[:size], num_splits)
        )
        return meta

    def _forward(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        # backend_state is already filled, so the model does not call prepare() (host lists) inside the graph
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)


def _describe(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes)) if len(sizes) <= 6 else f"{', '.join(map(str, sizes[:5]))}, ..., {sizes[-1]}"
