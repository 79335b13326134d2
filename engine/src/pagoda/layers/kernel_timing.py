"""Timing the candidate linear kernels on this machine, and applying :mod:`pagoda.cpu.kernel_selection`'s choice
to a model's layers (called by :func:`pagoda.layers.linear_kernels.prepare_linear_layers`)."""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from pagoda.cpu import kernel_selection as ks
from pagoda.cpu.cpu_features import amx_available
from pagoda.layers.activation import SiluAndMul
from pagoda.layers.cpu_linear import (
    NATIVE_BF16,
    NATIVE_INT8,
    KernelBuilder,
    NativeBf16Linear,
    NativeGatedBf16Linear,
    PackedLinear,
    RowDispatchLinear,
    gated_tiles_fit,
    native_linear_support,
    onednn_packing_available,
)
from pagoda.layers.int8_cpu import Int8OnednnLinear, Int8WeightOnlyLinear

if TYPE_CHECKING:
    from pagoda.layers.linear import Linear, LinearKernel

logger = logging.getLogger(__name__)

WARMUP_CALLS = 2
MIN_REPEATS, MAX_REPEATS = 3, 40
REPEAT_BUDGET_S = 0.1  # per candidate and row count and pass, after warm-up
STANDIN_CACHES = 4  # a stand-in weight of up to this many last-level caches
NOISE_RATIO = 1.5  # a pass whose median call exceeds its fastest by this is not trusted


def last_level_cache_bytes() -> int:
    """The CPU's last-level cache (sysfs), 32 MiB where it cannot be read."""
    for index in (3, 2):
        try:
            text = Path(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        return int(text.rstrip("KMG")) * scale
    return 32 << 20


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


class KernelTimer:
    """``time_fn`` for :func:`select` over real kernels built from a same-shape stand-in weight.

    Decode is memory bound, so timing one weight over and over would measure the cache, not DRAM: the calls cycle
    through enough copies to exceed twice the last-level cache. At each row count the candidates' calls interleave, so
    a slow spell of a shared machine lands on all of them.
    """

    def __init__(
        self, key: ks.ShapeKey, builders: Mapping[str, Callable[[torch.Tensor], Callable[[torch.Tensor], Any]]]
    ) -> None:
        dtype = getattr(torch, key.dtype)
        llc = last_level_cache_bytes()
        # A weight far larger than the cache streams at the same bytes/s whatever its length: an lm_head is timed on a
        # slice of whole 64-row tiles (4x the cache), and its times scaled up, at a fraction of the packing cost.
        row_bytes = key.in_features * torch.finfo(dtype).bits // 8
        out = min(key.out_features, max(64, (STANDIN_CACHES * llc // row_bytes) // 64 * 64))
        self.scale = key.out_features / out
        # Kernel speed does not depend on weight values; one random row repeated is cheap.
        weight = (torch.randn(1, key.in_features) * 0.02).expand(out, key.in_features).to(dtype).contiguous()
        copies = max(1, min(8, math.ceil(2 * llc / (weight.numel() * weight.element_size()))))
        self.kernels = {name: [build(weight.clone()) for _ in range(copies)] for name, build in builders.items()}
        self.key, self.dtype = key, dtype
        self.measured: dict[int, list[dict[str, float]]] = {}  # rows -> passes
        self.asked: dict[tuple[str, int], int] = {}
        self.noisy = False  # some pass ran while other processes held the cores: its minimum is not the kernel's

    def __call__(self, candidate: str, rows: int) -> float:
        """The candidate's time at ``rows``; asked again, from a fresh pass over all candidates."""
        passes = self.measured.setdefault(rows, [])
        asked = self.asked.get((candidate, rows), 0)
        self.asked[(candidate, rows)] = asked + 1
        if asked >= len(passes):
            passes.append(self._measure(rows))
        return passes[asked][candidate]

    @torch.inference_mode()
    def _measure(self, rows: int) -> dict[str, float]:
        """Per candidate, the fastest of several calls: other processes only ever add time to a call (a preempted
        OpenMP thread stalls the rest at the barrier for a whole time slice, 4-10 ms against a 0.3 ms GEMV), so the
        minimum estimates the kernel's own cost where a median, on a busy 2-core machine, measured the neighbours."""
        x = (torch.randn(rows, self.key.in_features) * 0.5).to(self.dtype)
        warm: dict[str, float] = {}
        for name, kernels in self.kernels.items():
            for i in range(WARMUP_CALLS):
                start = time.perf_counter()
                kernels[i % len(kernels)](x)
                warm[name] = time.perf_counter() - start  # the last warm-up sizes the repeats
        repeats = max(MIN_REPEATS, min(MAX_REPEATS, int(REPEAT_BUDGET_S / max(max(warm.values()), 1e-6))))
        samples: dict[str, list[float]] = {name: [] for name in self.kernels}
        for i in range(repeats):  # the candidates interleave, so a slow spell lands on all of them
            for name, kernels in self.kernels.items():
                kernel = kernels[i % len(kernels)]
                start = time.perf_counter()
                kernel(x)
                samples[name].append(time.perf_counter() - start)
        # When most calls took far longer than the best one, the cores were shared: the few clean calls decide by
        # luck (measured under a load of 4 on 2 cores: 4-8 ms calls of a 0.1-0.3 ms kernel, winners at random).
        self.noisy |= any(statistics.median(s) > NOISE_RATIO * min(s) for s in samples.values())
        return {name: min(s) * self.scale for name, s in samples.items()}


class ModelKernelSelector:
    """Selections per layer shape for one model, the shared cache, and the summary log lines."""

    def __init__(self, dtype: torch.dtype, quantization: Optional[str]) -> None:
        self.mode = ks.kernel_mode()
        self.dtype, self.quantization = dtype, quantization or "none"
        self.cache: Optional[ks.SelectionCache] = None
        self.selections: dict[ks.ShapeKey, ks.Selection] = {}
        self.layers: dict[ks.ShapeKey, int] = {}
        self.extra_bytes = 0  # second copies held by RowDispatchLinear
        self.single_copy_layers = 0  # layers that kept the few-rows kernel alone (Linear.one_weight_copy)
        amx_available()  # logs what this CPU offers, and asks Linux for AMX tile data where it has tiles

    def kernel(self, layer: Linear, role: str, candidates: dict[str, KernelBuilder]) -> Optional[LinearKernel]:
        """``layer``'s kernel: one candidate, or a :class:`RowDispatchLinear` of two; None without candidates."""
        if not candidates:
            return None
        key = ks.ShapeKey(
            layer.in_features, layer.out_features, role, str(self.dtype).split(".")[-1], self.quantization
        )
        selection = self.selection(key, candidates)
        self.layers[key] = self.layers.get(key, 0) + 1
        bias = None if layer.bias is None else layer.bias.detach()
        if selection.crossover is not None and layer.one_weight_copy:
            # The many-rows winner alone. Measured on the Qwen3-30B-A3B shape (AMX Xeon, 2 threads): the engine with
            # onednn experts decoded 20.1 / 55.0 / 103.7 tok/s at b1 / b8 / b32 against 17.5 / 45.3 / 90.4 with
            # native<8|onednn dispatch, and prefilled 1298 tok/s against 633 with native experts alone.
            self.single_copy_layers += 1
            return candidates[selection.segments[1][1]](layer.weight, bias)
        first = candidates[selection.segments[0][1]](layer.weight, bias)
        if selection.crossover is None:
            return first
        second = candidates[selection.segments[1][1]](layer.weight, bias)
        self.extra_bytes += _kernel_bytes(second)
        return RowDispatchLinear.of(first, second, selection.crossover)

    def selection(self, key: ks.ShapeKey, candidates: dict[str, KernelBuilder]) -> ks.Selection:
        """The (memoised) selection of one shape among ``candidates``."""
        if key not in self.selections:
            if self.cache is None and self.mode == "auto":
                self.cache = ks.SelectionCache(ks.default_cache_path())
            timer = _LazyTimer(key, candidates, key.role)
            self.selections[key] = ks.select(key, list(candidates), timer, self.mode, self.cache)
        return self.selections[key]

    def finish(self) -> None:
        if self.cache is not None:
            self.cache.save()
        for key, selection in self.selections.items():
            log = logger.debug if selection.how in ("untimed", "only") else logger.info
            count = self.layers.get(key, 0)
            log("linear kernel for %s (x%d): %s", key.describe(), count, selection.describe())
        if self.extra_bytes:
            logger.info("row-count dispatch holds a second weight copy: +%.1f MiB", self.extra_bytes / 2**20)
        if self.single_copy_layers:
            logger.info("%d expert layers keep one kernel (no second weight copy)", self.single_copy_layers)
        spent = sum(s.seconds for s in self.selections.values())
        if spent:
            logger.info("linear kernel selection timed %d shapes in %.1f s", len(self.selections), spent)


class _LazyTimer:
    """Builds the :class:`KernelTimer` (and its weight copies) on the first call
    only: a cached, forced or untimed selection never pays for them."""

    def __init__(self, key: object, candidates: dict[str, KernelBuilder], role: str) -> None:
        self.key, self.candidates, self.role = key, candidates, role
        self.timer: Optional[Callable[[str, int], float]] = None

    def __call__(self, candidate: str, rows: int) -> float:
        if self.timer is None:
            builders = {name: _timed_call(build, self.role) for name, build in self.candidates.items()}
            self.timer = KernelTimer(self.key, builders)
        return self.timer(candidate, rows)

    @property
    def noisy(self) -> bool:
        return self.timer is not None and self.timer.noisy


def _timed_call(build: KernelBuilder, role: str) -> Callable[[torch.Tensor], Callable[[torch.Tensor], object]]:
    """What a step runs with the kernel: the lm_head writes float32 logits, a gated layer is timed together with its
    SiLU-and-mul (fused into the native kernel's epilogue, a separate op after the others)."""

    def make(weight: torch.Tensor) -> Callable[[torch.Tensor], object]:
        kernel = build(weight, None)
        if role == "logits":
            return kernel.float_output
        if role == "gated":
            act = SiluAndMul()

            def gated(x: torch.Tensor) -> torch.Tensor:
                fused = getattr(kernel, "silu_and_mul", None)
                out = fused(x) if fused is not None else None
                return out if out is not None else act(kernel(x))

            return gated
        return kernel

    return make


def _kernel_bytes(kernel: object) -> int:
    """Bytes of the tensors a kernel holds (its weight copy, scales and bias)."""
    total = 0
    for value in (getattr(kernel, name, None) for name in getattr(kernel, "__slots__", ())):
        if isinstance(value, PackedLinear):
            value = value.weight
        if isinstance(value, torch.Tensor):
            try:
                total += value.numel() * value.element_size()
            except RuntimeError:  # an opaque mkldnn tensor: count its logical size
                total += value.nelement() * value.element_size()
    return total


def select_for_shapes(
    shapes: list[tuple[int, int, str]], quantization: Optional[str] = None
) -> list[tuple[ks.ShapeKey, ks.Selection]]:
    """What the engine picks for bf16 layers of these (in_features, out_features, role) shapes on this machine
    (measured, or from the same cache the engine uses): for benchmarks and reports."""
    selector = ModelKernelSelector(torch.bfloat16, quantization)
    result = []
    for in_features, out_features, role in shapes:
        key = ks.ShapeKey(in_features, out_features, role, "bfloat16", quantization or "none")
        candidates = candidate_kernels(out_features, role == "gated", quantization)
        if candidates:
            result.append((key, selector.selection(key, candidates)))
    selector.finish()
    return result
