"""Which attention runs: the backend for a device (:func:`resolve_attention_backend`), and on the CPU which kernel
serves prefill attention, chosen by timing both on this machine (:func:`choose_prefill_attention`).

The native paged-attention kernel (``cpu/paged_attention.cpp``) computes QK^T and PV with AVX512-BF16 dot products,
tuned on a Zen 4 host. PyTorch's SDPA runs those two products through oneDNN, which uses the AMX tile units where the
CPU has them (an order of magnitude more bf16 compute than ``vdpbf16ps``). Prefill attention is compute bound, so on
such a host SDPA may win; decode attention reads the cache and stays native. At start-up the runner times one
layer's prefill attention both ways (a synthetic prompt chunk on a scratch cache, the model's own head layout) and
keeps SDPA for steps with prompt rows only if it is clearly faster in two passes. ``PAGODA_CPU_KERNELS=native``
keeps native, ``onednn`` forces SDPA, ``auto`` (default) measures. The choice does not change collectives, so
tensor-parallel ranks may differ.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from pagoda.attention.protocol import AttentionLayerSpec, build_metadata
from pagoda.attention.torch_backend import TorchAttentionBackend, native_attention_applies
from pagoda.cpu.kernel_selection import TOLERANCE, kernel_mode
from pagoda.kernel_loading import check_triton_usable, triton_available

logger = logging.getLogger(__name__)

PREFILL_TOKENS = 512  # the benchmarks' prompt; attention cost per token grows with it
_BLOCK_SIZE = 16
_CALLS = 3


def resolve_attention_backend(choice: str, device: torch.device) -> str:
    """The backend that runs for ``choice`` (auto | torch | triton) on ``device``: 'torch' or 'triton'.

    auto picks triton on CUDA (torch, with a warning, when Triton is not installed) and torch on
    CPU. An explicit 'triton' that cannot run raises ValueError rather than silently degrading.
    """
    if choice == "torch":
        return "torch"
    if choice == "triton":
        check_triton_usable(device)
        return "triton"
    assert choice == "auto", choice
    if device.type != "cuda":
        return "torch"
    if not triton_available():
        logger.warning("Triton is not installed: using the (slower) torch attention backend on CUDA")
        return "torch"
    return "triton"


def choose_prefill_attention(
    backend: TorchAttentionBackend,
    spec: AttentionLayerSpec,
    dtype: torch.dtype,
    tokens: int = PREFILL_TOKENS,
    timer: Callable[[Callable[[], object]], float] | None = None,
    cache_dtype: torch.dtype | None = None,
) -> str:
    """Set and return ``backend.prefill_kernel`` ('native' or 'sdpa') for layers like ``spec`` in ``dtype``, over a
    KV cache of ``cache_dtype`` (default ``dtype``; an fp8 cache changes what both kernels read)."""
    probe = torch.empty(1, spec.num_heads, spec.head_dim, dtype=dtype)
    if not native_attention_applies(probe, spec):
        return backend.prefill_kernel  # float32 or no native build: SDPA serves every step already
    mode = kernel_mode()
    if mode != "auto":
        backend.prefill_kernel = "native" if mode == "native" else "sdpa"
        logger.info("prefill attention: %s (forced by PAGODA_CPU_KERNELS=%s)", backend.prefill_kernel, mode)
        return backend.prefill_kernel
    timer = timer or _fastest_call
    run = _prefill_call(backend, spec, dtype, tokens, cache_dtype)
    passes = []
    for _ in range(2):  # leaving the native kernel needs two passes that agree
        native, sdpa = timer(lambda: run("native")), timer(lambda: run("sdpa"))
        passes.append((native, sdpa))
        if sdpa >= native * (1 - TOLERANCE):
            break
    chosen = "sdpa" if all(s < n * (1 - TOLERANCE) for n, s in passes) and len(passes) == 2 else "native"
    backend.prefill_kernel = chosen
    ratios = ", ".join(f"{s / n:.2f}" for n, s in passes)
    logger.info("prefill attention (%d tokens): %s (sdpa/native time: %s)", tokens, chosen, ratios)
    return chosen


def _prefill_call(
    backend: TorchAttentionBackend,
    spec: AttentionLayerSpec,
    dtype: torch.dtype,
    tokens: int,
    cache_dtype: torch.dtype | None = None,
) -> Callable[[str], torch.Tensor]:
    """One layer's attention over a ``tokens``-long first prompt chunk, through the kernel named."""
    num_blocks = -(-tokens // _BLOCK_SIZE)
    cache = torch.zeros(2, num_blocks, _BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, dtype=cache_dtype or dtype)
    q = torch.randn(tokens, spec.num_heads, spec.head_dim).to(dtype)
    k = torch.randn(tokens, spec.num_kv_heads, spec.head_dim).to(dtype)
    v = torch.randn(tokens, spec.num_kv_heads, spec.head_dim).to(dtype)

    def run(kernel: str) -> torch.Tensor:
        meta = build_metadata([tokens], [tokens], [list(range(num_blocks))], _BLOCK_SIZE)
        before, backend.prefill_kernel = backend.prefill_kernel, kernel
        try:
            backend.prepare(meta)
            return backend.forward(q, k, v, cache, meta, spec)
        finally:
            backend.prefill_kernel = before

    return run


def _fastest_call(call: Callable[[], object]) -> float:
    """The fastest of a few calls after one warm-up (other processes only ever add time)."""
    call()
    best = float("inf")
    for _ in range(_CALLS):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best
