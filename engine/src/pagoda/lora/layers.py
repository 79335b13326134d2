"""The adapter half of a LoRA-wrapped linear layer: stacked A/B slots and the batched add.

Every wrapped layer keeps ``max_loras`` slots of A and B; a step's tokens carry a slot (or none: the base model),
grouped into contiguous segments because the model runner orders the batch by slot. The layer adds
``x A_slot^T B_slot^T`` to each segment's rows of the base output, so requests for different adapters and the
base model share one forward (S-LoRA / Punica). On CPU each segment is two GEMMs; on CUDA one Triton shrink and
one expand launch cover the whole batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass(slots=True)
class LoRASegments:
    """Which rows of a step's activations belong to which slot.

    ``runs`` are (slot, first row, end row) with one run per slot in use (rows of base-model tokens are in none);
    ``device_mapping`` holds the same as int32 tensors for the Triton kernels (sorted token ids, segment starts,
    segment slots), built only on CUDA.
    """

    num_rows: int
    runs: list[tuple[int, int, int]]
    device_mapping: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None


@dataclass(slots=True)
class LoRAContext:
    """The step's segments, shared by every wrapped layer of the model (set by the LoRA manager per step).

    The last decoder layer runs its output projection and MLP on the sampled rows only, so a second set of
    segments covers those; a layer picks the set whose row count matches its input (the two counts differ
    whenever the runner keeps a subset).
    """

    full: Optional[LoRASegments] = None
    kept: Optional[LoRASegments] = None
    slots_with_weights: set[int] = field(default_factory=set)

    def segments_for(self, num_rows: int) -> Optional[LoRASegments]:
        for segments in (self.full, self.kept):
            if segments is not None and segments.num_rows == num_rows:
                return segments
        return None


class LinearLoRA:
    """Slots of one linear layer: ``lora_a`` [max_loras, num_slices * max_rank, in] and a B buffer whose layout
    depends on the kernel that reads it:

    - ``native`` (CPU, :mod:`pagoda.cpu` built): ``lora_b`` is B transposed, [max_loras, max_rank, out]; one
      native call per layer covers every segment and slice;
    - ``torch`` (CPU without the native ops): ``lora_b`` is block-diagonal, [max_loras, out, num_slices *
      max_rank], so a fused q/k/v or gate/up layer expands all its slices with one GEMM per segment;
    - ``triton`` (CUDA): ``lora_b`` is [max_loras, out, max_rank] with slice rows at their output offsets, the
      layout of ``pagoda_kernels.lora``.
    """

    def __init__(
        self,
        context: LoRAContext,
        in_features: int,
        output_slices: tuple[int, ...],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        mode: Optional[str] = None,  # None: triton on CUDA, native on CPU where built, else torch
    ) -> None:
        self.context = context
        self.in_features = in_features
        self.output_slices = output_slices
        self.max_rank = max_rank
        self.mode = mode or default_mode(device)
        assert self.mode in ("native", "torch", "triton"), self.mode
        if self.mode == "native":
            from pagoda.cpu import cpu_ops

            assert cpu_ops(), "the native CPU ops are not built on this machine"
        num_slices, out = len(output_slices), sum(output_slices)
        self.lora_a = torch.zeros(max_loras, num_slices * max_rank, in_features, dtype=dtype, device=device)
        b_shape = {
            "native": (max_loras, max_rank, out),
            "torch": (max_loras, out, num_slices * max_rank),
            "triton": (max_loras, out, max_rank),
        }[self.mode]
        self.lora_b = torch.zeros(b_shape, dtype=dtype, device=device)
        self.ranks = [0] * max_loras  # the rank of the adapter in each slot, 0: no weights for this layer
        self.offsets = [sum(output_slices[:i]) for i in range(num_slices)]

    def set_slot(self, slot: int, parts: Optional[Mapping[int, tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Copy an adapter's (A [r, in], B [slice_out, r]) per slice into ``slot``; None or {} clears it."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.ranks[slot] = max((a.shape[0] for a, _ in (parts or {}).values()), default=0)
        for part, (a, b) in (parts or {}).items():
            rank, rows = a.shape[0], slice(self.offsets[part], self.offsets[part] + self.output_slices[part])
            self.lora_a[slot, part * self.max_rank : part * self.max_rank + rank].copy_(a)
            if self.mode == "native":
                self.lora_b[slot, :rank, rows].copy_(b.T)
            else:
                column = part * self.max_rank if self.mode == "torch" else 0
                self.lora_b[slot, rows, column : column + rank].copy_(b)

    def active(self, num_rows: int) -> bool:
        """Whether some row of an input with ``num_rows`` rows has an adapter with weights for this layer."""
        segments = self.context.segments_for(num_rows)
        return segments is not None and any(self.ranks[slot] for slot, _, _ in segments.runs)

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """out[rows] += x[rows] A^T B^T for each segment's slot (out: [rows, out], x: [rows, in]), in place."""
        segments = self.context.segments_for(x.shape[0])
        if segments is None or not any(self.ranks[slot] for slot, _, _ in segments.runs):
            return
        if self.mode == "triton":
            self._add_triton(out, x, segments)
        elif self.mode == "native":
            runs = [
                v
                for slot, start, end in segments.runs
                if self.ranks[slot]
                for v in (slot, start, end, self.ranks[slot])
            ]
            x = x if x.stride(-1) == 1 else x.contiguous()
            torch.ops.pagoda_cpu.lora_add_(out, x, self.lora_a, self.lora_b, runs, list(self.output_slices))
        else:
            for slot, start, end in segments.runs:
                if self.ranks[slot]:
                    shrunk = x[start:end] @ self.lora_a[slot].T  # [n, num_slices * max_rank]
                    out[start:end].addmm_(shrunk, self.lora_b[slot].T)  # [n, out] += [n, S*R] @ [S*R, out]

    def _add_triton(self, out: torch.Tensor, x: torch.Tensor, segments: LoRASegments) -> None:
        from pagoda_kernels.lora import lora_expand, lora_shrink

        assert segments.device_mapping is not None, "CUDA segments carry their device mapping"
        sorted_ids, starts, slots = segments.device_mapping
        shrunk = lora_shrink(x, self.lora_a, sorted_ids, starts, slots)  # [rows, num_slices * max_rank] fp32
        lora_expand(out, shrunk, self.lora_b, self.output_slices, sorted_ids, starts, slots)


def default_mode(device: torch.device) -> str:
    """The kernel a layer on ``device`` uses: Triton on CUDA; on CPU the native op where it builds."""
    if device.type == "cuda":
        return "triton"
    from pagoda.cpu import cpu_ops

    return "native" if cpu_ops() else "torch"
