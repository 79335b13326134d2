"""MXFP4 expert weights as gpt-oss publishes them (``quantization_config: {"quant_method": "mxfp4", ...}``).

Layout (OCP microscaling FP4): for a projection with ``out`` rows and ``in`` inputs, ``<proj>_blocks`` is uint8
``[..., out, in / 32, 16]``: each block of 32 consecutive inputs is 16 bytes, two e2m1 codes per byte (input
``2j`` in the low nibble, ``2j + 1`` in the high one); ``<proj>_scales`` is uint8 ``[..., out, in / 32]``, an e8m0
exponent per block. ``w = e2m1(code) * 2 ** (scale - 127)``. gpt-oss's experts store ``gate_up_proj`` with
``out = 2 * intermediate`` (gate and up rows interleaved: even rows gate, odd rows up) and ``down_proj`` with
``out = hidden``; the biases are bf16.

Twice an e2m1 value is an integer in ``[-12, 12]``, so a block is exactly an 8-bit integer group of 32 with the
scale ``2 ** (scale - 128)``: :func:`mxfp4_int_weight` gives the engine's canonical :class:`IntWeight` (bits 8,
group 32, zero point 128), which the native CPU group-quantized kernel and the Triton int8 GEMM run unchanged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

import torch

from pagoda.quantization.weights import IntWeight

MXFP4_BLOCK = 32  # inputs per block (one scale)
# e2m1 code -> value (bit 3 is the sign), and twice that value (an integer)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_E2M1_DOUBLED = tuple(int(2 * v) for v in E2M1_VALUES)
_SCALE_BIAS = 127
_ZERO_POINT = 128  # the IntWeight zero point: q = 2 * e2m1 + 128 lies in [116, 140]


@dataclass(frozen=True)
class Mxfp4Config:
    """config.json's ``quantization_config`` of an MXFP4 checkpoint."""

    modules_to_not_convert: tuple[str, ...] = ()

    @staticmethod
    def from_raw(raw: dict[str, Any]) -> Optional[Mxfp4Config]:
        """The MXFP4 config of a parsed config.json; None when the checkpoint is not MXFP4."""
        qc = raw.get("quantization_config")
        if not isinstance(qc, dict) or str(qc.get("quant_method", "")).lower() != "mxfp4":
            return None
        return Mxfp4Config(tuple(str(p) for p in qc.get("modules_to_not_convert") or ()))

    def converts(self, module_name: str) -> bool:
        """Whether the checkpoint quantizes ``module_name`` (e.g. ``model.layers.0.mlp.experts``), by transformers'
        rule: a pattern skips a module it matches from the start up to a module boundary (as a regex, so
        ``model.layers.*.self_attn`` covers every layer), or as a suffix."""
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        return not any(
            re.match(rf"(?:{pattern}){boundary}", module_name) or module_name.endswith(pattern)
            for pattern in self.modules_to_not_convert
        )


def _check(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != MXFP4_BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match: expected "
            f"blocks [..., groups, {MXFP4_BLOCK // 2}] and scales [..., groups]"
        )


def as_uint8(tensor: torch.Tensor) -> torch.Tensor:
    """A checkpoint's uint8 tensor back from the loader's cast to the model dtype (exact: every float dtype holds the
    integers 0..255); ValueError when the values are not bytes."""
    if tensor.dtype == torch.uint8:
        return tensor
    back = tensor.to(torch.uint8)
    if tensor.is_floating_point() and not torch.equal(back.to(tensor.dtype), tensor):
        raise ValueError("MXFP4 blocks/scales must hold bytes (0..255)")
    return back


def _codes(blocks: torch.Tensor) -> torch.Tensor:
    """[..., groups, 16] bytes -> [..., groups * 32] e2m1 codes in input order (int64)."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1)  # [..., groups, 16, 2]: low nibble first
    return codes.reshape(*blocks.shape[:-2], -1).long()


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 ``blocks`` [..., out, groups, 16] and ``scales`` [..., out, groups] -> the weight [..., out, groups * 32].

    Computed in float32, where every product is exact (e2m1 has two significant bits, the scale is a power of two;
    only scale 255 and 254 with |value| >= 2 overflow, as they do in transformers), then cast to ``dtype``:
    exact in bfloat16 too (the same exponent range), rounded in float16.
    """
    _check(blocks, scales)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    values = lut[_codes(blocks)]  # [..., out, in]
    exponents = (scales.to(torch.int32) - _SCALE_BIAS).repeat_interleave(MXFP4_BLOCK, dim=-1)  # [..., out, in]
    return torch.ldexp(values, exponents).to(dtype)


def mxfp4_int_weight(blocks: torch.Tensor, scales: torch.Tensor) -> IntWeight:
    """One projection's MXFP4 ``blocks`` [out, groups, 16] / ``scales`` [out, groups] as an exact 8-bit
    :class:`IntWeight` with groups of 32: ``q = 2 * e2m1 + 128``, zero point 128, scale ``2 ** (scale - 128)``."""
    _check(blocks, scales)
    if blocks.dim() != 3:
        raise ValueError(f"one projection's MXFP4 blocks are [out, groups, 16], got {tuple(blocks.shape)}")
    doubled = torch.tensor(_E2M1_DOUBLED, dtype=torch.int16, device=blocks.device)
    q = (doubled[_codes(blocks)] + _ZERO_POINT).to(torch.uint8)  # [out, in]
    exponents = scales.t().to(torch.int32) - (_SCALE_BIAS + 1)  # [groups, out]
    group_scales = torch.ldexp(torch.ones(exponents.shape, dtype=torch.float32, device=scales.device), exponents)
    zeros = torch.full_like(scales.t(), _ZERO_POINT, dtype=torch.uint8)
    return IntWeight(q.contiguous(), group_scales.contiguous(), zeros.contiguous(), MXFP4_BLOCK, 8)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round ``weight`` [..., out, in] (``in`` a multiple of 32) to MXFP4 -> (blocks [..., out, in/32, 16] uint8,
    scales [..., out, in/32] uint8): each block's exponent is the smallest that keeps its largest magnitude within
    6, each value the nearest e2m1 one. For writing test checkpoints in the published layout."""
    *lead, inp = weight.shape
    if inp % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs the input dimension to be a multiple of {MXFP4_BLOCK}, got {inp}")
    w = weight.detach().float().reshape(*lead, inp // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = w.abs().amax(dim=-1).clamp(min=2.0**-126)  # [..., groups]
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-_SCALE_BIAS, 127).to(torch.int32)
    scaled = w / torch.ldexp(torch.ones_like(amax), exponent).unsqueeze(-1)  # |scaled| <= 6
    magnitudes = torch.tensor(E2M1_VALUES[:8], device=w.device)
    index = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)  # [..., groups, 32]
    codes = (index | ((scaled < 0) & (index > 0)).long() << 3).to(torch.uint8)
    blocks = codes[..., 0::2] | codes[..., 1::2] << 4  # [..., groups, 16]
    return blocks.contiguous(), (exponent + _SCALE_BIAS).to(torch.uint8)


@dataclass
class Mxfp4Source:
    """One expert projection's MXFP4 tensors, held in place of a dense weight until the layer's kernel is built
    (the :class:`~pagoda.quantization.loading.QuantizedSource` protocol of
    :meth:`~pagoda.layers.linear.Linear.hold_quantized_source`: ``build()`` -> canonical weight)."""

    name: str  # the checkpoint tensor prefix, e.g. ``model.layers.0.mlp.experts.down_proj`` (for messages)
    blocks: Optional[torch.Tensor] = None  # [out, groups, 16]
    scales: Optional[torch.Tensor] = None  # [out, groups]

    def build(self) -> IntWeight:
        """The exact 8-bit group-of-32 weight; the MXFP4 tensors are released."""
        if self.blocks is None or self.scales is None:
            raise ValueError(f"MXFP4 checkpoint is missing {self.name}_blocks / {self.name}_scales")
        weight = mxfp4_int_weight(self.blocks, self.scales)
        self.blocks = self.scales = None
        return weight
