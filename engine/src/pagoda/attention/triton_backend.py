"""Paged attention through the Triton kernels of ``pagoda_kernels`` (the CUDA path).

Batch shapes and their kernels:

- pure decode (every request has one query token, the steady state and the CUDA-graph path):
  ``paged_decode_attention``, flash-decoding with the context split over several programs;
- anything else (prefill chunks, possibly mixed with decodes): ``paged_extend_attention`` over the
  whole flattened batch. The extend kernel handles one-token rows correctly, so a mixed step is a
  single launch per layer with no gather of decode rows into a side batch and no scatter of their
  outputs back; the decodes of a mixed step are few next to the chunk's tokens, so running them
  without context splitting costs little.

The kernel modules import Triton, so they are imported when this backend is constructed, never by
merely importing the engine: CPU-only installs never touch Triton.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from pagoda.attention.protocol import AttentionLayerSpec, AttentionMetadata, check_sinks


class TritonAttentionBackend:
    """Writes K/V with ``write_kv`` and attends with the paged decode/extend kernels.

    Per-step device tensors are built once by :meth:`prepare`. Eager decode steps let the kernel size
    its context split from the step's longest context; CUDA graphs fix it (:meth:`decode_state`).
    """

    name = "triton"

    def __init__(self) -> None:
        from pagoda_kernels.decode_attention import paged_decode_attention
        from pagoda_kernels.extend_attention import paged_extend_attention
        from pagoda_kernels.kv_write import write_kv

        self._decode = paged_decode_attention
        self._extend = paged_extend_attention
        self._write_kv = write_kv

    def prepare(self, meta: AttentionMetadata) -> None:
        """Build the int32 block tables, context lengths and (for prefill) query offsets on the device."""
        device = meta.block_tables.device
        state = meta.backend_state
        state["block_tables"] = meta.block_tables.to(torch.int32)  # [num_reqs, max_blocks]
        state["seq_lens"] = torch.tensor(meta.seq_lens, dtype=torch.int32).to(device, non_blocking=True)
        state["max_seq_len"] = max(meta.seq_lens)
        state["num_splits"] = None  # the kernel's heuristic from max_seq_len
        state["decode"] = meta.num_tokens == meta.num_reqs  # every request has exactly one query token
        if not state["decode"]:
            state["query_start_loc"] = torch.tensor(meta.query_start_loc, dtype=torch.int32).to(
                device, non_blocking=True
            )  # [num_reqs + 1]
            state["max_query_len"] = max(meta.query_len(i) for i in range(meta.num_reqs))

    @staticmethod
    def decode_state(
        block_tables: torch.Tensor, seq_lens: torch.Tensor, num_splits: Optional[int]
    ) -> dict[str, object]:
        """State of a pure-decode step over preallocated device tensors (CUDA-graph buffers).

        block_tables: [batch, max_blocks] int32; seq_lens: [batch] int32 (0 marks a padding row).
        The longest context is left unknown so nothing in the step depends on host-side values.
        """
        return {
            "block_tables": block_tables,
            "seq_lens": seq_lens,
            "max_seq_len": None,
            "num_splits": num_splits,
            "decode": True,
        }

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        kv_cache: Tensor,
        meta: AttentionMetadata,
        spec: AttentionLayerSpec,
        sinks: Optional[Tensor] = None,
    ) -> Tensor:
        """:meth:`AttentionBackend.forward` (shapes there): write this step's K/V (slots < 0 are skipped), then attend
        over each request's context. An fp8 cache (its dtype says so) gets and gives codes through the layer's
        k_scale / v_scale: plain floats, so a captured CUDA graph holds them as launch arguments. The soft cap is a
        float too; sinks are the layer's parameter tensor, read in place (its address is fixed once loaded)."""
        check_sinks(spec, sinks)
        state = meta.backend_state
        self._write_kv(k, v, kv_cache, meta.slot_mapping, spec.k_scale, spec.v_scale)
        out = torch.empty_like(q)
        if state["decode"]:
            return self._decode(
                q,
                kv_cache,
                state["block_tables"],
                state["seq_lens"],
                spec.scale,
                sliding_window=spec.sliding_window,
                max_seq_len=state["max_seq_len"],
                num_splits=state["num_splits"],
                out=out,
                k_scale=spec.k_scale,
                v_scale=spec.v_scale,
                logits_soft_cap=spec.logits_soft_cap,
                sinks=sinks,
            )
        return self._extend(
            q,
            kv_cache,
            state["block_tables"],
            state["query_start_loc"],
            state["seq_lens"],
            state["max_query_len"],
            spec.scale,
            sliding_window=spec.sliding_window,
            out=out,
            k_scale=spec.k_scale,
            v_scale=spec.v_scale,
            logits_soft_cap=spec.logits_soft_cap,
            sinks=sinks,
        )
