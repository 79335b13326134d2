"""CPU kernels of dense linear layers, and what every CPU linear kernel shares.

A plain ``F.linear`` in bf16 on the CPU hands oneDNN a weight in PyTorch's row-major layout, and oneDNN re-blocks it
on every call; decode at small batch is memory bound, so that costs about a third of the achievable bandwidth. The
kernels here hold the weight in a layout prepared once:

- :class:`NativeBf16Linear`: bf16 on CPUs with AVX512-BF16. The weight is repacked into the native kernel's tile
  layout (:mod:`pagoda.cpu`, ``packed_linear.cpp``), which streams it at close to the machine's read bandwidth at
  batch 1 and matches oneDNN in compute-bound prefill.
- :class:`NativeGatedBf16Linear`: the same kernel for a fused [gate | up] projection followed by SiLU: rows are
  packed so that each tile holds matching gate and up rows (:func:`gated_tile_order`), and ``silu(gate) * up`` is
  computed in the GEMM's epilogue instead of as a second pass over a [tokens, 2 x intermediate] output. The
  quantized CPU kernels (int8, int4, fp8) use the same tile order for their gated layers.
- :class:`PackedLinear`: the weight reordered once into oneDNN's blocked layout (bf16 without the native kernel,
  fp16). Results are bit-identical to ``F.linear`` (the same oneDNN GEMM, minus the reorder).
- :class:`RowDispatchLinear`: two kernels of one layer, picked per call by row count.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from pagoda.cpu import cpu_ops

if TYPE_CHECKING:
    from pagoda.layers.linear import LinearKernel


@dataclass(slots=True)
class PackedLinear:
    """A bf16/fp16 weight pre-reordered into oneDNN's blocked layout."""

    weight: torch.Tensor  # opaque mkldnn tensor, logically [out, in]
    bias: Optional[torch.Tensor]  # [out]
    name: str = "onednn-packed"

    @staticmethod
    def from_weight(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> PackedLinear:
        # The batch-size hint only tunes the blocking; any number of rows works afterwards.
        return PackedLinear(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def float_output(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).float()


NATIVE_BF16 = 1  # bits of torch.ops.pagoda_cpu.packed_linear_support()
NATIVE_INT8 = 2


def native_linear_support(kind: int) -> bool:
    """Whether the compiled native linear kernels of this machine include ``kind`` (a support bit)."""
    return cpu_ops() and bool(torch.ops.pagoda_cpu.packed_linear_support() & kind)


def onednn_packing_available(dtype: torch.dtype) -> bool:
    """Whether this CPU build and machine can run oneDNN's packed linear in ``dtype``."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


@dataclass(slots=True)
class NativeBf16Linear:
    """A bf16 weight in the native kernel's tile layout: [ceil(out/64), ceil(in/2), 64, 2]."""

    packed: torch.Tensor
    out_features: int
    bias: Optional[torch.Tensor]  # [out]
    name: str = "native-bf16"

    @staticmethod
    def from_weight(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> NativeBf16Linear:
        assert native_linear_support(NATIVE_BF16), "the native bf16 kernel is not built for this machine"
        packed = torch.ops.pagoda_cpu.pack_linear_weight(weight.detach())
        return NativeBf16Linear(packed, weight.shape[0], bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        return torch.ops.pagoda_cpu.bf16_linear(x, self.packed, self.out_features, self.bias)

    def float_output(self, x: torch.Tensor) -> torch.Tensor:  # self(x).float() in one pass
        return torch.ops.pagoda_cpu.bf16_linear(x, self.packed, self.out_features, self.bias, True)


_GATED_TILE_ROWS = 32  # gate rows per tile of the native kernels (the other 32 of its 64 are the matching up rows)


def gated_tiles_fit(out_features: int) -> bool:
    """Whether a [gate | up] projection of ``out_features`` rows splits into whole gated tiles."""
    return out_features % (2 * _GATED_TILE_ROWS) == 0


def gated_tile_order(out_features: int) -> torch.Tensor:
    """Row i of a gated packed weight is row ``gated_tile_order(out)[i]`` of [gate | up]: each 64-row tile holds
    gate rows 32t..32t+31 and then the same up rows."""
    inter = out_features // 2
    return torch.arange(out_features).view(2, inter // _GATED_TILE_ROWS, _GATED_TILE_ROWS).transpose(0, 1).reshape(-1)


def untile_gated(y: torch.Tensor, out_features: int) -> torch.Tensor:
    """[..., out] columns in gated tile order -> [gate | up] (a copy)."""
    lead = y.shape[:-1]
    tiles = out_features // (2 * _GATED_TILE_ROWS)
    return y.reshape(-1, tiles, 2, _GATED_TILE_ROWS).transpose(1, 2).reshape(*lead, out_features)


@dataclass(slots=True)
class NativeGatedBf16Linear:
    """A [gate | up] bf16 weight in the native tile layout, rows in :func:`gated_tile_order`: :meth:`silu_and_mul`
    writes ``silu(gate) * up`` from the GEMM's epilogue, bit-identical to ``silu_and_mul`` over
    :class:`NativeBf16Linear`'s output.
    """

    packed: torch.Tensor  # [2 * intermediate / 64, ceil(in/2), 64, 2]
    out_features: int  # 2 * intermediate
    bias: Optional[torch.Tensor]  # [out], in tile order
    name: str = "native-bf16-gated"

    @staticmethod
    def from_weight(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> NativeGatedBf16Linear:
        assert native_linear_support(NATIVE_BF16), "the native bf16 kernel is not built for this machine"
        assert gated_tiles_fit(weight.shape[0]), weight.shape
        order = gated_tile_order(weight.shape[0])
        packed = torch.ops.pagoda_cpu.pack_linear_weight(weight.detach()[order])
        return NativeGatedBf16Linear(packed, weight.shape[0], None if bias is None else bias[order].contiguous())

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., intermediate]
        return torch.ops.pagoda_cpu.bf16_silu_mul_linear(x, self.packed, self.out_features // 2, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out], [gate | up] as stored
        tiled = torch.ops.pagoda_cpu.bf16_linear(x, self.packed, self.out_features, self.bias)
        return untile_gated(tiled, self.out_features)

    def float_output(self, x: torch.Tensor) -> torch.Tensor:
        tiled = torch.ops.pagoda_cpu.bf16_linear(x, self.packed, self.out_features, self.bias, True)
        return untile_gated(tiled, self.out_features)


class TwoOutputKernel:
    """``__call__`` and ``float_output`` of a kernel whose ``_forward(x, float_out)`` writes the activation dtype or
    float32 (the logits) in one pass."""

    __slots__ = ()

    def _forward(self, x: torch.Tensor, float_out: bool) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        return self._forward(x, float_out=False)

    def float_output(self, x: torch.Tensor) -> torch.Tensor:  # self(x).float(), in one pass on the native kernels
        return self._forward(x, float_out=True)


@dataclass(slots=True)
class RowDispatchLinear:
    """Two kernels of one layer (each with its own copy of the weight): ``small`` below ``crossover`` rows, ``large``
    from there. Chosen by :mod:`pagoda.cpu.kernel_selection` where one kernel wins decode and another prefill;
    each call's result is bit-identical to the member that served it."""

    small: LinearKernel
    large: LinearKernel
    crossover: int  # the first row count served by ``large``
    name: str

    @staticmethod
    def of(small: LinearKernel, large: LinearKernel, crossover: int) -> RowDispatchLinear:
        return RowDispatchLinear(small, large, crossover, f"{small.name}<{crossover}|{large.name}")

    def member(self, x: torch.Tensor) -> LinearKernel:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        return self.large if rows >= self.crossover else self.small

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.member(x)(x)

    def float_output(self, x: torch.Tensor) -> torch.Tensor:
        return self.member(x).float_output(x)

    def silu_and_mul(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The member's fused ``silu(gate) * up`` where it has one for ``x``; None: the caller applies the op."""
        fused = getattr(self.member(x), "silu_and_mul", None)
        return None if fused is None else fused(x)


KernelBuilder = Callable[[torch.Tensor, Optional[torch.Tensor]], "LinearKernel"]
