"""Group-quantized integer linear layers (AWQ / GPTQ, 4 and 8 bits) on the CPU.

:class:`Int4CpuLinear` serves an :class:`~pagoda.quantization.weights.IntWeight`:

- ``int4-native``: bf16 activations on CPUs with AVX512-BF16. The weight is repacked once into the native kernel's
  layout (``pagoda/cpu/packed_linear_int4.cpp``): tiles of 64 output rows whose groups each carry their 64 scales
  (float16 where exact) and zero points before the group's nibbles, so a decode step reads about a quarter of
  bf16's weight bytes in one sequential stream; prefill runs at the bf16 kernel's speed (both are bound by the same
  bf16 dot products). 8-bit weights use the same layout with a high and a low nibble per input.
- ``int4-native-gated``: the same for a fused [gate | up] projection, rows in
  :func:`~pagoda.layers.cpu_linear.gated_tile_order`; :meth:`Int4CpuLinear.silu_and_mul` writes
  ``silu(gate) * up`` from the GEMM's epilogue.
- ``int4-torch``: any other dtype or machine: the weight is dequantized in the activation dtype on every call
  (no dense copy is kept) and multiplied with ``F.linear``.

With ``perm`` (GPTQ act order) the input is gathered first: ``y = x[..., perm] @ w.T + bias``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from pagoda.layers.cpu_linear import TwoOutputKernel, gated_tile_order, gated_tiles_fit, untile_gated
from pagoda.quantization.weights import IntWeight

_TILE = 64  # output rows per tile of the native kernel
_LINE_BYTES = 64  # one k pair of a tile: 128 nibbles
_SUPPORT_BITS = {4: 1, 8: 2}  # bits of torch.ops.pagoda_cpu.int4_linear_support()


def _native_support() -> int:
    from pagoda.cpu import cpu_ops

    return int(torch.ops.pagoda_cpu.int4_linear_support()) if cpu_ops() else 0


def int4_native_available() -> bool:
    """Whether this machine runs the native group-quantized kernel (a build with AVX512-BF16)."""
    return bool(_native_support() & _SUPPORT_BITS[4])


def _native_serves(weight: IntWeight) -> bool:
    """The native kernel takes 4-bit groups of an even size (whole k pairs) and any 8-bit group."""
    if not int4_native_available() or not _native_support() & _SUPPORT_BITS[weight.bits]:
        return False
    return weight.bits == 8 or weight.group_size % 2 == 0


def _group_pairs(group_size: int, bits: int) -> int:
    """Lines of nibbles per group and tile: 4 bits pack two inputs per lane, 8 bits one input as two nibbles."""
    return group_size // 2 if bits == 4 else group_size


def pack_int_weight(weight: IntWeight) -> torch.Tensor:
    """``weight`` in the native kernel's layout: [ceil(out / 64), groups * (meta + group_pairs * 64)] uint8.

    Per tile and group: 64 scales (float16 where that is exact, as checkpoints' scales are, else float32), 64 uint8
    zero points, then one 64-byte line per k pair whose word i holds, in nibble j, row 16 j + i // 2 at k 2 p + i % 2
    (8 bits: k p's high nibble, then its low one). The kernel tells the scales' width from the tile size. Rows past
    ``out`` are zero (their outputs are never stored).
    """
    q, bits = weight.qweight, weight.bits
    out, inp = q.shape
    tiles = -(-out // _TILE)
    if bits == 8:  # each input becomes a (high, low) nibble pair
        q = torch.stack([q >> 4, q & 15], dim=-1).reshape(out, 2 * inp)
    padded = torch.zeros(tiles * _TILE, q.shape[1], dtype=torch.uint8)
    padded[:out] = q
    pairs = q.shape[1] // 2
    # [tile, j, r, p, h] -> [tile, p, j, word i = 2 r + h]
    nibbles = padded.view(tiles, 4, 16, pairs, 2).permute(0, 3, 1, 2, 4).reshape(tiles, pairs, 4, 32)
    low = nibbles[:, :, 0] | nibbles[:, :, 1] << 4  # the words' low bytes: nibbles 0 and 1 (little-endian)
    high = nibbles[:, :, 2] | nibbles[:, :, 3] << 4
    lines = torch.stack([low, high], dim=-1)  # [tiles, pairs, 32 words, 2 bytes]
    groups = inp // weight.group_size
    lines = lines.reshape(tiles, groups, _group_pairs(weight.group_size, bits) * _LINE_BYTES)
    half = weight.scales.half()
    exact = torch.equal(half.float(), weight.scales)
    scales = _tile_major(half if exact else weight.scales, tiles).view(torch.uint8)  # [tiles, groups, 128 | 256]
    zeros = _tile_major(weight.zeros, tiles)  # [tiles, groups, 64]
    return torch.cat([scales, zeros, lines], dim=-1).reshape(tiles, -1).contiguous()


def _tile_major(per_group: torch.Tensor, tiles: int) -> torch.Tensor:
    """[groups, out] -> [tiles, groups, 64], zero padded past ``out``."""
    groups, out = per_group.shape
    padded = torch.zeros(groups, tiles * _TILE, dtype=per_group.dtype)
    padded[:, :out] = per_group
    return padded.view(groups, tiles, _TILE).transpose(0, 1).contiguous()


def unpack_int_weight(
    packed: torch.Tensor, out: int, inp: int, group_size: int, bits: int, perm: Optional[torch.Tensor]
) -> IntWeight:
    """The :class:`IntWeight` that :func:`pack_int_weight` packed (exact: integers and the same float32 scales)."""
    tiles, groups = packed.shape[0], inp // group_size
    blocks = packed.view(tiles, groups, -1)
    scale_bytes = blocks.shape[-1] - _group_pairs(group_size, bits) * _LINE_BYTES - _TILE
    scale_type = torch.float16 if scale_bytes == _TILE * 2 else torch.float32
    scales = blocks[..., :scale_bytes].contiguous().view(scale_type).float()  # [tiles, groups, 64]
    zeros = blocks[..., scale_bytes : scale_bytes + _TILE]
    raw = blocks[..., scale_bytes + _TILE :].reshape(tiles, -1, 32, 2)  # [tiles, pairs, words, bytes]
    pairs = raw.shape[1]
    nibbles = torch.stack([raw[..., 0] & 15, raw[..., 0] >> 4, raw[..., 1] & 15, raw[..., 1] >> 4], dim=2)
    q = nibbles.view(tiles, pairs, 4, 16, 2).permute(0, 2, 3, 1, 4).reshape(tiles * _TILE, 2 * pairs)[:out]
    if bits == 8:
        q = q.view(out, inp, 2)
        q = q[..., 0] << 4 | q[..., 1]

    def per_group(t: torch.Tensor) -> torch.Tensor:  # [tiles, groups, 64] -> [groups, out]
        return t.transpose(0, 1).reshape(groups, tiles * _TILE)[:, :out].contiguous()

    return IntWeight(q.contiguous(), per_group(scales), per_group(zeros), group_size, bits, perm)


@dataclass(slots=True)
class Int4CpuLinear(TwoOutputKernel):
    """A group-quantized linear layer on the CPU (see the module docstring for the three forms)."""

    packed: Optional[torch.Tensor]  # native layout (pack_int_weight); None: the torch form keeps ``weight``
    weight: Optional[IntWeight]  # the canonical weight where there is no native layout
    out_features: int
    in_features: int
    group_size: int
    bits: int
    perm: Optional[torch.Tensor]  # [in] int64, GPTQ act order
    bias: Optional[torch.Tensor]  # [out]; float32 and in gated tile order on the native kernel
    gated: bool
    name: str

    @staticmethod
    def from_int_weight(weight: IntWeight, bias: Optional[torch.Tensor], gated: bool = False) -> Int4CpuLinear:
        """Repack ``weight`` for this machine; ``gated``: a [gate | up] weight that may get the fused epilogue."""
        native = _native_serves(weight)
        gated = gated and native and gated_tiles_fit(weight.out_features)
        bias = None if bias is None else bias.detach()
        shape = (weight.out_features, weight.in_features, weight.group_size, weight.bits, weight.perm)
        if not native:
            return Int4CpuLinear(None, weight, *shape, bias, False, "int4-torch")
        if gated:
            order = gated_tile_order(weight.out_features)
            weight = weight.select_rows(order)
            bias = None if bias is None else bias[order]
        bias = None if bias is None else bias.float().contiguous()
        name = "int4-native-gated" if gated else "int4-native"
        return Int4CpuLinear(pack_int_weight(weight), None, *shape, bias, gated, name)

    def silu_and_mul(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """``silu(gate) * up`` [..., out / 2] from the epilogue (bf16 x); None where the layer is not gated."""
        if not self.gated or x.dtype != torch.bfloat16:
            return None
        n = self.out_features // 2
        return torch.ops.pagoda_cpu.int4_silu_mul_linear(
            self._gather(x), self.packed, n, self.group_size, self.bits, self.bias
        )

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.perm is None else x.index_select(-1, self.perm)

    def _forward(self, x: torch.Tensor, float_out: bool) -> torch.Tensor:
        if self.packed is not None and x.dtype == torch.bfloat16:
            y = torch.ops.pagoda_cpu.int4_linear(
                self._gather(x), self.packed, self.out_features, self.group_size, self.bits, self.bias, float_out
            )
            return untile_gated(y, self.out_features) if self.gated else y
        # dequantized in x's dtype on every call: exact up to that dtype's rounding of the weight
        bias = None if self.bias is None else self.bias.to(x.dtype)
        y = F.linear(self._gather(x), self.int_weight().dequantize().to(x.dtype), bias)
        y = untile_gated(y, self.out_features) if self.gated else y
        return y.float() if float_out else y

    def int_weight(self) -> IntWeight:
        """The canonical weight (rows in gated tile order when gated); unpacked anew from the native layout."""
        if self.weight is not None:
            return self.weight
        assert self.packed is not None
        return unpack_int_weight(
            self.packed, self.out_features, self.in_features, self.group_size, self.bits, self.perm
        )
