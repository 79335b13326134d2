"""The kernel section of benchmarks/gpu_check.py: every Triton kernel against its torch reference (and SDPA for
attention) at the model shapes, with the bytes each must move. Kernel modules are imported inside the case
builders: without a GPU set ``TRITON_INTERPRET=1`` first.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F

from common import log  # noqa: E402 (the benchmarks folder is not a package)
from gpu_common import (  # noqa: E402
    COLD_BYTES,
    LLAMA8B_KERNEL_SHAPE,
    QWEN3_KERNEL_SHAPE,
    SMOKE_KERNEL_SHAPES,
    SMOKE_SIZES,
    ArgSet,
    KernelCase,
    Shape,
    Sizes,
    randn,
    time_call,
)
from gpu_lora import lora_qkv_case  # noqa: E402


def _paged_cache(num_seqs: int, context: int, shape: Shape, sizes: Sizes, dtype, device):
    """A KV cache holding ``num_seqs`` contexts through shuffled block tables."""
    per_seq = -(-context // sizes.block_size)
    num_blocks = num_seqs * per_seq + 1
    kv_cache = randn(2, num_blocks, sizes.block_size, shape.num_kv_heads, shape.head_dim, dtype=dtype, device=device)
    order = torch.randperm(num_blocks, device=device)[: num_seqs * per_seq]
    block_tables = order.view(num_seqs, per_seq).to(torch.int32)  # [num_seqs, blocks per seq]
    return kv_cache, block_tables


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float):
    # enable_gqa only where heads differ: with a mask it would force the math backend
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _dense(s: Shape, num_seqs: int, q_len: int, context: int, mask, scale: float, dtype, device) -> Callable:
    """SDPA's inputs for the same batch, padded dense: q [seqs, heads, q_len, d], k/v [seqs, kv_heads, context, d].
    With a mask, K/V come per query head (as if repeated): masked GQA only runs on SDPA's math backend."""
    kv_heads = s.num_kv_heads if mask is None else s.num_heads

    def make() -> ArgSet:
        q = randn(num_seqs, s.num_heads, q_len, s.head_dim, dtype=dtype, device=device)
        k, v = (randn(num_seqs, kv_heads, context, s.head_dim, dtype=dtype, device=device) for _ in range(2))
        return q, k, v, mask, scale

    return make


def decode_case(shape: Shape, sizes: Sizes, dtype: torch.dtype, device: torch.device) -> KernelCase:
    """One query token per sequence over a full paged context; SDPA gets the same batch dense."""
    from pagoda_kernels.decode_attention import paged_decode_attention as kernel
    from pagoda_kernels.decode_attention import paged_decode_attention_reference as reference

    batch, context, s = sizes.decode_batch, sizes.decode_context, shape
    scale = s.head_dim**-0.5

    def paged() -> ArgSet:
        kv_cache, block_tables = _paged_cache(batch, context, s, sizes, dtype, device)
        q = randn(batch, s.num_heads, s.head_dim, dtype=dtype, device=device)  # [seqs, heads, head_dim]
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        return q, kv_cache, block_tables, seq_lens, scale, None, context

    elem = torch.empty((), dtype=dtype).element_size()
    kv_bytes = 2 * batch * context * s.num_kv_heads * s.head_dim * elem
    q_and_out = 2 * batch * s.num_heads * s.head_dim * elem
    tables = batch * (-(-context // sizes.block_size)) * 4 + batch * 4
    label = f"{s.name} {s.num_heads}/{s.num_kv_heads} heads, batch {batch} x ctx {context}, block {sizes.block_size}"
    dense = _dense(s, batch, 1, context, None, scale, dtype, device)
    variants = {"triton": (kernel, paged), "reference": (reference, paged), "sdpa dense": (_sdpa, dense)}
    flops = 4 * batch * s.num_heads * context * s.head_dim
    return KernelCase("decode attention", label, kv_bytes + q_and_out + tables, flops, variants, kv_bytes)


def extend_case(shape: Shape, sizes: Sizes, dtype: torch.dtype, device: torch.device) -> KernelCase:
    """Chunks of new tokens on cached prefixes (causal); SDPA gets the same batch dense with a mask."""
    from pagoda_kernels.extend_attention import paged_extend_attention as kernel
    from pagoda_kernels.extend_attention import paged_extend_attention_reference as reference

    reqs, chunk, prefix, s = sizes.extend_requests, sizes.extend_chunk, sizes.extend_prefix, shape
    context, scale = prefix + chunk, s.head_dim**-0.5

    def paged() -> ArgSet:
        kv_cache, block_tables = _paged_cache(reqs, context, s, sizes, dtype, device)
        q = randn(reqs * chunk, s.num_heads, s.head_dim, dtype=dtype, device=device)  # [tokens, heads, head_dim]
        query_start_loc = (torch.arange(reqs + 1, device=device) * chunk).to(torch.int32)
        seq_lens = torch.full((reqs,), context, dtype=torch.int32, device=device)
        return q, kv_cache, block_tables, query_start_loc, seq_lens, chunk, scale

    elem = torch.empty((), dtype=dtype).element_size()
    kv_bytes = 2 * reqs * context * s.num_kv_heads * s.head_dim * elem
    q_and_out = 2 * reqs * chunk * s.num_heads * s.head_dim * elem
    label = f"{s.name} {s.num_heads}/{s.num_kv_heads} heads, {reqs} x {chunk}-tok chunks on {prefix}-tok prefixes"
    # query i sits at position prefix + i and sees keys 0..prefix + i
    mask = torch.arange(context, device=device)[None, :] <= (prefix + torch.arange(chunk, device=device))[:, None]
    dense = _dense(s, reqs, chunk, context, mask, scale, dtype, device)
    variants = {"triton": (kernel, paged), "reference": (reference, paged), "sdpa dense, kv per q head": (_sdpa, dense)}
    flops = 4 * reqs * s.num_heads * s.head_dim * (chunk * prefix + chunk * (chunk + 1) // 2)
    return KernelCase("extend attention", label, kv_bytes + q_and_out, flops, variants, kv_bytes + q_and_out)


def write_kv_case(shape: Shape, sizes: Sizes, dtype: torch.dtype, device: torch.device) -> KernelCase:
    """This step's keys and values scattered into shuffled slots of a cache twice their size."""
    from pagoda_kernels.kv_write import write_kv, write_kv_reference

    tokens, s = sizes.tokens, shape
    num_blocks = -(-2 * tokens // sizes.block_size)

    def inputs() -> ArgSet:
        key, value = (randn(tokens, s.num_kv_heads, s.head_dim, dtype=dtype, device=device) for _ in range(2))
        kv_cache = randn(2, num_blocks, sizes.block_size, s.num_kv_heads, s.head_dim, dtype=dtype, device=device)
        slot_mapping = torch.randperm(num_blocks * sizes.block_size, device=device)[:tokens]
        return key, value, kv_cache, slot_mapping

    elem = torch.empty((), dtype=dtype).element_size()
    kv_bytes = 2 * tokens * s.num_kv_heads * s.head_dim * elem
    label = f"{s.name} {tokens} tok x {s.num_kv_heads} kv heads x {s.head_dim}"
    variants = {"triton": (write_kv, inputs), "reference": (write_kv_reference, inputs)}
    return KernelCase("write_kv", label, 2 * kv_bytes + 8 * tokens, 0, variants, 2 * kv_bytes)


def elementwise_cases(shape: Shape, sizes: Sizes, dtype: torch.dtype, device: torch.device) -> list[KernelCase]:
    """rms_norm, fused_add_rms_norm, apply_rotary and silu_and_mul over ``sizes.tokens`` tokens."""
    from pagoda_kernels import activation, rms_norm, rotary

    t, d, h, i, eps = sizes.tokens, shape.head_dim, shape.hidden, shape.intermediate, (1e-6,)
    nh, nkv, elem = shape.num_heads, shape.num_kv_heads, torch.empty((), dtype=dtype).element_size()
    act, heads, cos_sin = t * h * elem, t * (nh + nkv) * d * elem, 2 * t * d * elem
    rope_inputs = [(t, nh, d), (t, nkv, d), (t, d), (t, d)]  # q, k, cos, sin
    specs = [  # name, what, bytes moved, input shapes, trailing arguments, module
        ("rms_norm", f"hidden {h}", 2 * act, [(t, h), (h,)], eps, rms_norm),
        ("fused_add_rms_norm", f"hidden {h}", 4 * act, [(t, h), (t, h), (h,)], eps, rms_norm),
        ("apply_rotary", f"{nh}/{nkv} heads x {d}", 2 * heads + cos_sin, rope_inputs, (), rotary),
        ("silu_and_mul", f"intermediate {i}", 3 * t * i * elem, [(t, 2 * i)], (), activation),
    ]
    cases = []
    for name, what, moved, shapes, extra, module in specs:
        inputs = lambda shapes=shapes, extra=extra: (*(randn(*x, dtype=dtype, device=device) for x in shapes), *extra)
        kernel, reference = getattr(module, name), getattr(module, f"{name}_reference")
        variants = {"triton": (kernel, inputs), "reference": (reference, inputs)}
        cases.append(KernelCase(name, f"{shape.name} {t} tok, {what}", moved, 0, variants, moved))
    return cases


def _moe_grouped_torch(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """The per-expert torch loop (pairs sorted by expert, two F.linear per routed expert): the prefill baseline,
    since the per-token reference is too slow at prefill sizes. Syncs once (the expert counts)."""
    inter, flat = w2.shape[2], topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    rows, weights = order // topk_ids.shape[1], topk_weights.reshape(-1)[order]
    out, start = torch.zeros(x.shape, dtype=torch.float32, device=x.device), 0
    for e, count in enumerate(counts):
        if count:
            sel = rows[start : start + count]
            gate_up = F.linear(x[sel], w13[e])
            y = F.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w2[e]).float()
            out.index_add_(0, sel, y * weights[start : start + count, None])
            start += count
    return out.to(x.dtype)


def fused_moe_cases(sizes: Sizes, dtype: torch.dtype, device: torch.device) -> list[KernelCase]:
    """The Triton fused MoE at a Qwen3-30B-A3B expert shape (E=128, k=8, H=2048, I=768; tiny on CPU): decode
    (``sizes.decode_batch`` tokens, against the per-token reference) and prefill (``sizes.tokens``, against the
    per-expert torch loop). Bytes: the expected distinct experts' weights plus activations."""
    from pagoda_kernels.fused_moe import fused_moe, fused_moe_reference

    e, k, h, i = (128, 8, 2048, 768) if device.type == "cuda" else (8, 2, 32, 48)
    elem = torch.empty((), dtype=dtype).element_size()
    cases, phases = [], (("decode", sizes.decode_batch, fused_moe_reference), ("prefill", sizes.tokens, None))
    for phase, tokens, baseline in phases:

        def make(tokens=tokens) -> ArgSet:
            w13 = randn(e, 2 * i, h, dtype=dtype, device=device) / h**0.5
            w2 = randn(e, h, i, dtype=dtype, device=device) / i**0.5
            logits = torch.randn(tokens, e, device=device)
            topk_weights, topk_ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
            return randn(tokens, h, dtype=dtype, device=device), w13, w2, topk_weights, topk_ids

        touched = e * (1 - (1 - k / e) ** tokens)  # expected distinct experts routed to
        moved = int(touched * 3 * i * h * elem + 2 * tokens * h * elem)
        reference = baseline or _moe_grouped_torch
        label = f"E={e} k={k} H={h} I={i}, {tokens} tok ({'per-token' if baseline else 'per-expert torch'} reference)"
        variants = {"triton": (fused_moe, make), "reference": (reference, make)}
        case = KernelCase(f"fused_moe {phase}", label, moved, 6 * tokens * k * h * i, variants, e * 3 * i * h * elem)
        cases.append(case)
    return cases


def kernel_cases(shapes: tuple[Shape, ...], sizes: Sizes, dtype: torch.dtype, device: torch.device) -> list[Callable]:
    """Builders of every case, in the order they are measured (built lazily: inputs cost memory)."""
    builders: list[Callable] = [lambda: fused_moe_cases(sizes, dtype, device)]  # first: its own shape, not per model
    for shape in shapes:
        for make in (decode_case, extend_case, write_kv_case):
            builders.append(lambda make=make, shape=shape: [make(shape, sizes, dtype, device)])
        builders.append(lambda shape=shape: elementwise_cases(shape, sizes, dtype, device))
        builders.append(lambda shape=shape: lora_qkv_case(shape, sizes, dtype, device))
    return builders


def _outputs(fn: Callable, args: ArgSet) -> list[torch.Tensor]:
    """What a call produces: its returned tensor(s), or the tensors it wrote in place (on clones)."""
    cloned = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    out = fn(*cloned)
    if out is None:
        return [a for a in cloned if isinstance(a, torch.Tensor)]
    return list(out) if isinstance(out, tuple) else [out]


def max_error(case: KernelCase) -> float:
    """Largest |triton - reference| over every output element, on one shared input set."""
    (kernel, make), (reference, _) = case.variants["triton"], case.variants["reference"]
    torch.manual_seed(0)
    args = make()
    pairs = zip(_outputs(kernel, args), _outputs(reference, args))
    return max((a.float() - b.float()).abs().max().item() for a, b in pairs)


def measure_case(case: KernelCase, device: torch.device, warmup: int, reps: int, copy_gbps: float) -> list[dict]:
    """Time every variant of one case; one result dict per variant ("error" where one failed: the others count)."""
    copies = 1 if device.type != "cuda" else min(16, max(1, math.ceil(COLD_BYTES / max(case.input_bytes, 1))))
    results = []
    for variant, (fn, make) in case.variants.items():
        row = {"kernel": case.name, "label": case.label, "variant": variant, "max_err_vs_reference": None}
        results.append(row)
        try:
            if variant == "triton":
                row["max_err_vs_reference"] = max_error(case)
            sets = [make() for _ in range(copies)]
            seconds, row["method"] = time_call(fn, sets, device, warmup, reps)
            del sets
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            log(f"    {case.name} [{variant}] ERROR {row['error']}")
            continue
        gbps = case.bytes_moved / seconds / 1e9
        row |= {"seconds": seconds, "bytes": case.bytes_moved, "gb_per_s": gbps, "pct_of_copy": 100 * gbps / copy_gbps}
        row["tflops"] = case.flops / seconds / 1e12 if case.flops else None
        log(f"    {case.name} [{variant}] {seconds * 1e6:.1f} us, {gbps:.0f} GB/s ({row['method']})")
    return results


def run_kernels(smoke: bool, seconds: float, warmup: int, reps: int, device: torch.device, copy_gbps: float) -> dict:
    """Every kernel case (tiny ones for ``smoke``), until ``seconds`` are spent."""
    dtype = torch.float32 if smoke else torch.bfloat16  # the interpreter's bf16 tl.dot is wrong
    shapes = SMOKE_KERNEL_SHAPES if smoke else (QWEN3_KERNEL_SHAPE, LLAMA8B_KERNEL_SHAPE)
    sizes = SMOKE_SIZES if smoke else Sizes()
    stop_at, results, errors, skipped = time.monotonic() + seconds, [], [], 0
    builders = kernel_cases(shapes, sizes, dtype, device)
    for i, build in enumerate(builders):
        if time.monotonic() > stop_at:
            skipped = len(builders) - i
            log(f"SKIP the last {skipped} kernel case groups: the kernels' {seconds:.0f} s are spent")
            break
        try:
            for case in build():
                log(f"  kernel {case.name}: {case.label}")
                results += measure_case(case, device, warmup, reps, copy_gbps)
        except Exception as exc:  # one broken kernel must not lose the others
            errors.append(f"case group {i}: {type(exc).__name__}: {exc}"[:300])
            log(f"  ERROR {errors[-1]}")
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"dtype": str(dtype).removeprefix("torch."), "results": results, "errors": errors, "skipped_groups": skipped}


def kernel_rows(section: dict) -> list[tuple[str, ...]]:
    """The table rows of ``run_kernels``' result (or of its failure)."""
    rows = []
    for r in section.get("results", []):
        if "error" in r:
            rows.append(("kernels", f"{r['kernel']} [{r['variant']}]", "ERROR", f"{r['error']}; {r['label']}"))
            continue
        err, tflops = r["max_err_vs_reference"], f", {r['tflops']:.1f} TFLOP/s" if r["tflops"] else ""
        detail = f"{r['gb_per_s']:.0f} GB/s = {r['pct_of_copy']:.0f}% of copy{tflops}, {r['method']}"
        detail += "" if err is None else f", max err {err:.2g}"
        rows.append(
            ("kernels", f"{r['kernel']} [{r['variant']}]", f"{r['seconds'] * 1e6:.1f} us", f"{detail}; {r['label']}")
        )
    errors = section.get("errors", []) + ([section["error"]] if "error" in section else [])
    rows += [("kernels", "ERROR", "", e) for e in errors]
    skipped = section.get("skipped_groups")
    rows += [("kernels", "SKIPPED", f"{skipped} case groups", "out of time (or --kernel-seconds 0)")] if skipped else []
    return rows
