"""How a :class:`~pagoda.layers.linear.Linear` multiplies once its weights are loaded.

A plain ``F.linear`` in bf16 on the CPU hands oneDNN a weight in PyTorch's row-major layout, and
oneDNN re-blocks it on every call; decode at small batch is memory bound, so that costs about a
third of the achievable bandwidth. After loading, :func:`prepare_linear_layers` replaces each
layer's weight with a kernel object:

- :class:`NativeBf16Linear`: bf16 on CPUs with AVX512-BF16. The weight is repacked into the
  native kernel's tile layout (:mod:`pagoda.cpu`, ``packed_linear.cpp``), which streams it at
  close to the machine's read bandwidth at batch 1 and matches oneDNN in compute-bound prefill.
- :class:`NativeGatedBf16Linear`: the same kernel for a fused [gate | up] projection followed by
  SiLU: rows are packed so that each tile holds matching gate and up rows, and ``silu(gate) * up``
  is computed in the GEMM's epilogue instead of as a second pass over a [tokens, 2 x intermediate]
  output.
- :class:`PackedLinear`: the weight reordered once into oneDNN's blocked layout (bf16 without the
  native kernel, fp16). Results are bit-identical to ``F.linear`` (the same oneDNN GEMM, minus the
  reorder).
- :class:`Int8WeightOnlyLinear` (``--quantization int8``): symmetric per-output-channel int8
  weights, bf16/fp32 activations, ``y = (x @ q^T) * scale``: half the bytes of bf16 per token,
  read by the native AVX-512 kernel at decode batch sizes; gated [gate | up] layers get the same
  SiLU epilogue as the bf16 kernel.

- :class:`Int8OnednnLinear`: int8 values as bf16 in oneDNN's layout (AMX tiles where present), a candidate for int8.
- :class:`RowDispatchLinear`: two of the above, picked per call by row count.

For bf16 (and int8 with bf16 activations) the choice per layer shape is measured on this machine
(:mod:`pagoda.layers.kernel_selection`). fp32 on the CPU keeps ``F.linear`` (MKL's sgemm, which oneDNN's packed path does not reproduce
bit for bit), and so does every dtype on CUDA, where cuBLAS needs no help.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from pagoda.capabilities import QUANTIZATION_DEVICES
from pagoda.config import QUANTIZATIONS

if TYPE_CHECKING:
    from pagoda.layers.linear import Linear, LinearKernel

logger = logging.getLogger(__name__)

_INT8_MAX = 127


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
    from pagoda.cpu import cpu_ops

    return cpu_ops() and bool(torch.ops.pagoda_cpu.packed_linear_support() & kind)


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
class Int8WeightOnlyLinear(TwoOutputKernel):
    """Weight-only int8: ``q = round(w / scale)`` per output row, ``scale = max|w_row| / 127``.

    Activations are never quantized to 8 bits: the native kernel holds each activation row as 16-bit
    fixed point with its own scale (finer than bf16's mantissa near the row's maximum), so a
    request's result does not depend on the rest of its batch.

    A gated [gate | up] layer (bf16 models) stores its rows, scales and bias in :func:`gated_tile_order`, and
    :meth:`silu_and_mul` runs ``silu(gate) * up`` in the kernel's epilogue, as :class:`NativeGatedBf16Linear` does.
    """

    qweight: torch.Tensor  # native: tile layout [ceil(out/64), ceil(in/2), 64, 2]; else [out, in]; int8
    scales: torch.Tensor  # [out] float32 (tile order when gated)
    bias: Optional[torch.Tensor]  # [out] (tile order when gated)
    native: bool  # qweight is in the native kernel's layout and that kernel serves small batches
    in_features: int
    gated: bool = False
    name: str = "int8-weight-only"

    @staticmethod
    def from_weight(weight: torch.Tensor, bias: Optional[torch.Tensor], gated: bool = False) -> Int8WeightOnlyLinear:
        """Quantize ``weight`` [out, in]; ``gated``: a [gate | up] weight that may get the fused epilogue."""
        qweight, scales = quantize_int8_per_channel(weight)  # per row, so permuting rows later commutes with it
        native = native_linear_support(NATIVE_INT8)
        gated = gated and native and native_linear_support(NATIVE_BF16) and gated_tiles_fit(weight.shape[0])
        if gated:
            order = gated_tile_order(weight.shape[0])
            qweight, scales = qweight[order], scales[order].contiguous()
            bias = None if bias is None else bias[order].contiguous()
        if native:
            qweight = torch.ops.pagoda_cpu.pack_linear_weight(qweight)
        name = "int8-weight-only-gated" if gated else "int8-weight-only"
        return Int8WeightOnlyLinear(qweight, scales, bias, native, weight.shape[1], gated, name)

    def silu_and_mul(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """``silu(gate) * up`` [..., intermediate] from the epilogue (bf16 x); None where the layer is not gated."""
        if not self.gated or x.dtype != torch.bfloat16:
            return None
        n = self.scales.shape[0] // 2
        return torch.ops.pagoda_cpu.int8_silu_mul_linear(x, self.qweight, self.scales, n, self.bias)

    def _forward(self, x: torch.Tensor, float_out: bool) -> torch.Tensor:
        out_features = self.scales.shape[0]
        if self.native:
            # Every batch size: float32/fp16 activations take the 16-bit fixed-point path at 2.7-27x the speed of
            # a dequantized MKL GEMM (1-512 rows, 2-core Zen 4; 2x a cached float32 weight's at 2048 rows). bf16
            # activations from 192 rows on widen each weight chunk to bf16 in cache (exact for |q| <= 127).
            y = torch.ops.pagoda_cpu.int8_linear(x, self.qweight, self.scales, out_features, self.bias, float_out)
            return untile_gated(y, out_features) if self.gated else y
        # no AVX512-VNNI: dequantized GEMM, x @ q^T in the activation dtype, then the per-column scale
        y = torch.nn.functional.linear(x, self.dense_qweight().to(x.dtype)) * self.scales.to(x.dtype)
        y = y if self.bias is None else y + self.bias
        return y.float() if float_out else y

    def dense_qweight(self) -> torch.Tensor:
        """The int8 weight as [out, in] in the order of ``scales`` (a copy when it is stored in the native layout)."""
        if not self.native:
            return self.qweight
        return torch.ops.pagoda_cpu.unpack_linear_weight(self.qweight, self.scales.shape[0], self.in_features)


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 of weight [out, in] -> (q [out, in] int8, scales [out] float32)."""
    w32 = weight.detach().float()
    amax = w32.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny)  # [out]; an all-zero row stays 0
    scales = amax / _INT8_MAX
    q = torch.round(w32 / scales.unsqueeze(1)).clamp(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return q.contiguous(), scales.contiguous()


def validate_quantization(quantization: Optional[str], device: torch.device) -> None:
    """Raise ValueError for a quantization this engine cannot run on ``device``."""
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not supported (supported: {', '.join(QUANTIZATIONS)})")
    devices = QUANTIZATION_DEVICES[quantization]
    if device.type not in devices:
        raise ValueError(
            f"quantization {quantization!r} runs on {' and '.join(devices)} only, not {device.type}; "
            f"drop it or use --device {devices[0]}"
        )


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
class Int8OnednnLinear:
    """Weight-only int8 for bf16 activations through oneDNN: ``y = (x @ q^T) * scale``, with q held as bf16 (exact,
    |q| <= 127) in oneDNN's packed layout, so the GEMM runs on AMX tiles where the CPU has them. Twice the bytes of
    the int8 weight; the selection keeps it only for the row counts where it is faster (prefill on AMX hosts).
    The GEMM output is rounded to bf16 before the scale (one more rounding than the native kernel).
    """

    packed: PackedLinear  # q as bf16, no bias
    scales: torch.Tensor  # [out] float32
    bias: Optional[torch.Tensor]  # [out]
    name: str = "int8-onednn"

    @staticmethod
    def from_weight(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> Int8OnednnLinear:
        qweight, scales = quantize_int8_per_channel(weight)
        bias = None if bias is None else bias.detach().float()
        return Int8OnednnLinear(PackedLinear.from_weight(qweight.to(torch.bfloat16), None), scales, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] bf16 -> [..., out]
        y = self.packed(x).float() * self.scales
        return (y if self.bias is None else y + self.bias).to(x.dtype)

    def float_output(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).float()


@dataclass(slots=True)
class RowDispatchLinear:
    """Two kernels of one layer (each with its own copy of the weight): ``small`` below ``crossover`` rows, ``large``
    from there. Chosen by :mod:`pagoda.layers.kernel_selection` where one kernel wins decode and another prefill;
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


def prepare_linear_layers(
    model: nn.Module, device: torch.device, dtype: torch.dtype, quantization: Optional[str]
) -> dict[str, int]:
    """Give every Linear of ``model`` its kernel; return how many layers got which kernel.

    bf16 on the CPU (and int8 with bf16 activations) chooses between the native and oneDNN kernels per layer shape by
    timing them here (:mod:`pagoda.layers.kernel_selection`; ``$PAGODA_CPU_KERNELS`` forces one kind).
    """
    from pagoda.layers.kernel_timing import ModelKernelSelector
    from pagoda.layers.linear import Linear, MergedLinear
    from pagoda.quantization.kernels import online_quant_config, quantized_layer_kernel

    validate_quantization(quantization, device)
    # load_model sets quant_config: the method resolved for the checkpoint (a model built otherwise: the argument)
    quant = getattr(model, "quant_config", None) or online_quant_config(quantization)
    method = quant.method if quant is not None else None
    dense_quantization = "int8" if method == "int8" else None  # the other methods leave some layers dense (lm_head)
    cpu = device.type == "cpu"
    pack = cpu and onednn_packing_available(dtype)
    native_bf16 = cpu and dtype == torch.bfloat16 and native_linear_support(NATIVE_BF16)
    selector = ModelKernelSelector(dtype, dense_quantization) if cpu and dtype == torch.bfloat16 else None
    counts: dict[str, int] = {}
    for module_name, layer in model.named_modules():
        if not isinstance(layer, Linear):
            continue
        gated = isinstance(layer, MergedLinear) and layer.gated
        quantized = quantized_layer_kernel(layer, module_name, quant, device, gated and dtype == torch.bfloat16)
        if quantized is not None:
            kernel = quantized
        elif selector is not None:
            role = "gated" if gated else "logits" if module_name.rsplit(".", 1)[-1] == "lm_head" else "linear"
            kernel = selector.kernel(layer, role, candidate_kernels(layer.out_features, gated, dense_quantization))
        else:
            kernel = _kernel_for(layer, pack, native_bf16, dense_quantization, gated)
        if kernel is not None:
            layer.set_kernel(kernel)
        name = kernel.name if kernel is not None else "torch-linear"
        counts[name] = counts.get(name, 0) + 1
    if selector is not None:
        selector.finish()
    logger.info("linear kernels: %s", ", ".join(f"{n} x{c}" for n, c in sorted(counts.items())))
    return counts


KernelBuilder = Callable[[torch.Tensor, Optional[torch.Tensor]], "LinearKernel"]


def candidate_kernels(out_features: int, gated: bool, quantization: Optional[str]) -> dict[str, KernelBuilder]:
    """The kernels that can serve a bf16 CPU layer of ``out_features`` rows, by selection name, preferred first."""
    pack = onednn_packing_available(torch.bfloat16)
    native_bf16 = native_linear_support(NATIVE_BF16)
    candidates: dict[str, KernelBuilder] = {}
    if quantization == "int8":
        candidates["native"] = lambda w, b: Int8WeightOnlyLinear.from_weight(w, b, gated)
        if pack and native_linear_support(NATIVE_INT8):  # without the native kernel int8 stays as it was
            candidates["onednn"] = Int8OnednnLinear.from_weight
        return candidates
    if native_bf16 and gated and gated_tiles_fit(out_features):
        candidates["native"] = NativeGatedBf16Linear.from_weight
    elif native_bf16:
        candidates["native"] = NativeBf16Linear.from_weight
    if pack:
        candidates["onednn"] = PackedLinear.from_weight
    return candidates


def _kernel_for(
    layer: Linear, pack: bool, native_bf16: bool, quantization: Optional[str], gated: bool
) -> Optional[NativeBf16Linear | NativeGatedBf16Linear | PackedLinear | Int8WeightOnlyLinear]:
    """fp32 and fp16 models and CUDA: the fixed choice (no timing)."""
    bias = None if layer.bias is None else layer.bias.detach()
    if quantization == "int8":  # the fused epilogue takes bf16 activations: other dtypes keep checkpoint order
        return Int8WeightOnlyLinear.from_weight(layer.weight, bias, gated and layer.weight.dtype == torch.bfloat16)
    if native_bf16 and gated and gated_tiles_fit(layer.out_features):
        return NativeGatedBf16Linear.from_weight(layer.weight, bias)
    if native_bf16:
        return NativeBf16Linear.from_weight(layer.weight, bias)
    if pack:
        return PackedLinear.from_weight(layer.weight, bias)
    return None
