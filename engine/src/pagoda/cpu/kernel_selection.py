"""Which CPU linear kernel serves each layer shape, chosen by timing the candidates on this machine.

The native AVX512-BF16 kernels were tuned on one host (Zen 4); on a Xeon with AMX, oneDNN's tile GEMMs run prefill
up to 5x faster. So for every distinct layer shape, :func:`select` times each candidate (``native``: the tile-layout
kernels of :mod:`pagoda.cpu`; ``onednn``: a oneDNN-prepacked weight, AMX where present) at the row counts a step
uses (1, 8 and 32 decodes, a prefill chunk) and keeps:

- one candidate, when it is fastest or within :data:`TOLERANCE` of the fastest at every row count;
- otherwise two, split at a measured crossover row count (:class:`~pagoda.layers.cpu_linear.RowDispatchLinear`
  holds both copies of the weight and picks by ``x.shape[0]``).

Every candidate that stock PyTorch would use is among those timed, so a chosen kernel is never slower than stock
PyTorch's at the measured row counts (up to timing noise). The timings are cached per machine in a JSON file next to
the compiled native kernels (``$PAGODA_CPU_KERNEL_CACHE`` overrides the path), keyed by the CPU model, its flags,
the native kernels' sources, the torch version and the thread count; a cache of another machine, or an unreadable
one, is ignored and rewritten. ``PAGODA_CPU_KERNELS=native|onednn`` skips the timing and forces one kind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from pagoda.cpu import cpu_features

logger = logging.getLogger(__name__)

ENV_KERNELS = "PAGODA_CPU_KERNELS"
ENV_CACHE = "PAGODA_CPU_KERNEL_CACHE"
MODES = ("auto", "native", "onednn")
CANDIDATES = ("native", "onednn")  # preference order on a tie: native keeps its fused epilogues

# A candidate within 3% of the fastest counts as as fast: run-to-run noise on a shared 2-core VM is larger than that,
# and a second copy of the weight for a 3% gain is not worth its memory.
TOLERANCE = 0.03
DECODE_ROWS = (1, 8, 32)
# The prefill row count timed: the benchmarks' 512-token prompt. Beyond a few hundred rows every candidate is
# compute bound and its speed per row is flat, so one prefill point stands for all larger chunks.
PREFILL_ROWS = 512
# Layers smaller than this (weight elements; 512 KB in bf16) are not timed: their GEMMs take microseconds, fit in
# L2, and are dominated by call overhead, so the timing would be noise. They take the preferred candidate.
MIN_TIMED_WEIGHT = 1 << 18
BISECT_STEPS = 2  # extra row counts timed between the two buckets where the winner changes
MAX_PASSES = 3  # of timings over every row count, until two in a row reach the same decision
CACHE_VERSION = 1


def kernel_mode() -> str:
    """``$PAGODA_CPU_KERNELS``: 'auto' (default, measure), 'native' or 'onednn' (forced, for debugging)."""
    mode = (os.environ.get(ENV_KERNELS) or "auto").strip().lower()
    if mode not in MODES:
        raise ValueError(f"{ENV_KERNELS}={mode!r} is not one of {', '.join(MODES)}")
    return mode


@dataclass(frozen=True, slots=True)
class ShapeKey:
    """What a layer's timing depends on. ``role``: 'linear', 'gated' ([gate | up] then SiLU-and-mul, timed as the
    pair) or 'logits' (the lm_head, float32 output; it sees one row per sequence, never a prefill chunk)."""

    in_features: int
    out_features: int
    role: str
    dtype: str  # 'bfloat16'
    quantization: str  # 'none' or 'int8'

    def cache_key(self) -> str:
        return f"{self.dtype}/{self.quantization}/{self.role}/{self.in_features}x{self.out_features}"

    def rows(self) -> tuple[int, ...]:
        return DECODE_ROWS if self.role == "logits" else (*DECODE_ROWS, PREFILL_ROWS)

    def describe(self) -> str:
        quant = "" if self.quantization == "none" else f" {self.quantization}"
        return f"{self.dtype}{quant} {self.role} {self.in_features}->{self.out_features}"


@dataclass(slots=True)
class Selection:
    """The kernels of one shape: ``segments`` [(first row count, candidate), ...], ascending from 1 row."""

    segments: tuple[tuple[int, str], ...]
    timings: dict[str, dict[int, float]] = field(default_factory=dict)  # candidate -> rows -> seconds per call
    # 'measured', 'noisy' (passes disagreed: the preferred kernel), 'cached', 'forced', 'untimed' (a small layer)
    # or 'only' (one candidate)
    how: str = "measured"
    seconds: float = 0.0  # spent timing

    def candidate_for(self, rows: int) -> str:
        chosen = self.segments[0][1]
        for first, candidate in self.segments:
            if rows >= first:
                chosen = candidate
        return chosen

    @property
    def crossover(self) -> Optional[int]:
        """The first row count served by the second kernel; None for a single kernel."""
        return self.segments[1][0] if len(self.segments) > 1 else None

    def describe(self) -> str:
        if self.crossover is None:
            text = self.segments[0][1]
        else:
            text = f"{self.segments[0][1]} below {self.crossover} rows, {self.segments[1][1]} from there (both copies)"
        ratios = _ratio_text(self.timings, self.segments[0][1])
        return f"{text} [{self.how}{f', {self.seconds:.2f} s' if self.seconds else ''}]{ratios}"


def _ratio_text(timings: Mapping[str, Mapping[int, float]], base: str) -> str:
    """' (onednn/native time at 1|8|32|512 rows: 1.31|1.20|1.02|0.55)' for each other candidate."""
    if base not in timings:
        return ""
    rows = sorted(timings[base])
    parts = []
    for other in sorted(timings):
        if other != base and all(r in timings[other] for r in rows):
            values = "|".join(f"{timings[other][r] / timings[base][r]:.2f}" for r in rows)
            parts.append(f"{other}/{base} time at {'|'.join(map(str, rows))} rows: {values}")
    return f" ({'; '.join(parts)})" if parts else ""


# ---- the decision ----------------------------------------------------------------------------------------------


def _normalised_cost(timings: Mapping[str, Mapping[int, float]], plan: Callable[[int], str], rows: Sequence[int]):
    """Sum over ``rows`` of the plan's time / the fastest time: len(rows) for a plan that always wins."""
    return sum(timings[plan(r)][r] / min(t[r] for t in timings.values()) for r in rows)


def decide(
    timings: Mapping[str, Mapping[int, float]], preference: Sequence[str] = CANDIDATES, tolerance: float = TOLERANCE
) -> tuple[tuple[tuple[int, str], ...], Optional[tuple[int, int]]]:
    """The segments for measured ``timings`` (candidate -> rows -> seconds) and, for a split, the bracket (last row
    count measured for the first kernel, first measured for the second) that :func:`select` narrows down.

    A single candidate within ``tolerance`` of the fastest at every row count wins (the earliest in ``preference``).
    Otherwise two candidates split at one crossover, if each serves only row counts where it is within ``tolerance``
    of the fastest and the pair beats the best single candidate by more than ``tolerance`` in summed time ratios.
    Else the single candidate with the least summed time ratio: winners that alternate between row counts are noise.
    """
    names = [c for c in preference if c in timings] + sorted(c for c in timings if c not in preference)
    rows = sorted(set.intersection(*(set(timings[c]) for c in names)))
    best = {r: min(timings[c][r] for c in names) for r in rows}
    for c in names:
        if all(timings[c][r] <= best[r] * (1 + tolerance) for r in rows):
            return ((1, c),), None
    single = min(names, key=lambda c: _normalised_cost(timings, lambda _r, c=c: c, rows))
    single_cost = _normalised_cost(timings, lambda _r: single, rows)
    split, split_cost = None, math.inf
    for a in names:
        for b in names:
            for k in range(1, len(rows)) if a != b else ():
                plan = lambda r, a=a, b=b, k=k: a if r < rows[k] else b  # noqa: E731
                if any(timings[plan(r)][r] > best[r] * (1 + tolerance) for r in rows):
                    continue  # winners that alternate between row counts are noise, not a crossover
                cost = _normalised_cost(timings, plan, rows)
                if cost < split_cost:
                    split, split_cost = (a, b, k), cost
    if split is None or split_cost >= single_cost - tolerance:
        return ((1, single),), None
    a, b, k = split
    return ((1, a), (rows[k], b)), (rows[k - 1], rows[k])


def select(
    key: ShapeKey,
    candidates: Sequence[str],
    time_fn: Callable[[str, int], float],
    mode: str = "auto",
    cache: Optional[SelectionCache] = None,
) -> Selection:
    """The kernels for ``key`` among ``candidates`` (names of :data:`CANDIDATES` that can run here).

    ``time_fn(candidate, rows)`` returns seconds per call, measured anew on each call with the same arguments; it is
    called only when the choice is measured (mode 'auto', two or more candidates, a large enough layer, no cache
    entry). A ``time_fn`` whose ``noisy`` attribute is true (it saw other processes on the cores) can confirm the
    preferred candidate but not move away from it.
    """
    assert candidates, key
    if mode != "auto":
        chosen = mode if mode in candidates else candidates[0]
        if chosen != mode:
            logger.warning("%s=%s: no %s kernel for %s here; using %s", ENV_KERNELS, mode, mode, key.describe(), chosen)
        return Selection(((1, chosen),), how="forced")
    if len(candidates) == 1:
        return Selection(((1, candidates[0]),), how="only")
    if key.in_features * key.out_features < MIN_TIMED_WEIGHT:
        return Selection(((1, candidates[0]),), how="untimed")
    if cache is not None and (hit := cache.get(key, candidates)) is not None:
        return hit
    start = time.perf_counter()
    how = "measured"
    timings = {c: {r: time_fn(c, r) for r in key.rows()} for c in candidates}
    segments, bracket = decide(timings, candidates)
    last = segments
    for _ in range(MAX_PASSES - 1):
        if segments == ((1, candidates[0]),):
            break
        # Leaving the preferred kernel (or keeping two copies) on one pass of timings could be a slow spell of a
        # shared machine: another pass must reach the same decision on its own, and each time is the least seen.
        again = {c: {r: time_fn(c, r) for r in key.rows()} for c in candidates}
        agreed, last = decide(again, candidates)[0] == last, decide(again, candidates)[0]
        timings = {c: {r: min(t, again[c][r]) for r, t in rows.items()} for c, rows in timings.items()}
        segments, bracket = decide(timings, candidates)
        if agreed:
            break
    else:
        if segments != ((1, candidates[0]),):  # the passes disagreed: too noisy to leave the preferred kernel
            segments, bracket, how = ((1, candidates[0]),), None, "noisy"
    if getattr(time_fn, "noisy", False):
        # the timer saw other processes on the cores: keep the preferred kernel, and measure again at the next start
        segments, bracket, how = ((1, candidates[0]),), None, "noisy"
    if bracket is not None:  # narrow the crossover down between the two measured row counts
        (_, a), (_, b) = segments
        lo, hi = bracket
        for _ in range(BISECT_STEPS):
            mid = min(max(round(math.sqrt(lo * hi)), lo + 1), hi - 1)
            if mid <= lo:
                break
            t_a, t_b = time_fn(a, mid), time_fn(b, mid)
            timings[a][mid], timings[b][mid] = t_a, t_b
            lo, hi = (lo, mid) if t_b < t_a else (mid, hi)
        segments = ((1, a), (hi, b))
    selection = Selection(segments, timings, how, time.perf_counter() - start)
    if cache is not None and how == "measured":  # a noisy start-up measures again next time
        cache.put(key, selection)
    return selection


# ---- the per-machine cache -------------------------------------------------------------------------------------


def _native_sources_hash() -> str:
    """The native kernels' sources: a rebuilt kernel may be faster or slower, so its old timings are void."""
    digest = hashlib.sha256()
    here = Path(cpu_features.__file__).resolve().parent
    for path in sorted([*here.glob("*.cpp"), *here.glob("*.h")]):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def machine_identity() -> dict[str, Any]:
    """What a cached timing is valid for."""
    flags = cpu_features.cpu_flags()
    return {
        "version": CACHE_VERSION,
        "cpu": cpu_features.cpu_model(),
        "isa": sorted(f for f in cpu_features.ISA_FLAGS if f in flags),
        "flags": hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:16],
        "kernels": _native_sources_hash(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def default_cache_path() -> Path:
    """``$PAGODA_CPU_KERNEL_CACHE``, else next to the compiled native kernels (one directory per torch and CPU)."""
    if override := os.environ.get(ENV_CACHE):
        return Path(override)
    from pagoda.cpu import _build_dir

    return _build_dir() / "kernel_selection.json"


class SelectionCache:
    """Measured selections in a JSON file, valid for one :func:`machine_identity`."""

    def __init__(self, path: Path, identity: Optional[dict[str, Any]] = None) -> None:
        self.path = path
        self.identity = machine_identity() if identity is None else identity
        self.entries: dict[str, Any] = {}
        self.dirty = False
        try:
            data = json.loads(path.read_text())
            if data.get("identity") == self.identity and isinstance(data.get("entries"), dict):
                self.entries = data["entries"]
            else:
                logger.info("kernel selection cache %s is for another machine or version; re-measuring", path)
        except FileNotFoundError:
            pass
        except (OSError, ValueError, AttributeError) as exc:
            logger.warning("ignoring unreadable kernel selection cache %s (%s)", path, exc)

    def get(self, key: ShapeKey, candidates: Sequence[str]) -> Optional[Selection]:
        entry = self.entries.get(key.cache_key())
        try:
            segments = tuple((int(first), str(name)) for first, name in entry["segments"])
            timings = {c: {int(r): float(t) for r, t in rows.items()} for c, rows in entry["timings"].items()}
        except (TypeError, KeyError, ValueError, AttributeError):
            return None  # absent or malformed: measure again
        if not segments or segments[0][0] != 1 or any(name not in candidates for _, name in segments):
            return None  # a candidate that is no longer available here
        return Selection(segments, timings, "cached")

    def put(self, key: ShapeKey, selection: Selection) -> None:
        timings = {c: {str(r): t for r, t in rows.items()} for c, rows in selection.timings.items()}
        self.entries[key.cache_key()] = {"segments": [list(s) for s in selection.segments], "timings": timings}
        self.dirty = True

    def save(self) -> None:
        """Write the file atomically (another engine process may be reading it); a failure only costs a re-measure."""
        if not self.dirty:
            return
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"identity": self.identity, "entries": self.entries}, indent=1))
            os.replace(tmp, self.path)
            self.dirty = False
        except OSError as exc:
            logger.warning("could not write the kernel selection cache %s (%s)", self.path, exc)
