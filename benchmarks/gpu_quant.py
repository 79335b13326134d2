"""Quantized GEMMs on a GPU against bf16 ``torch.matmul``: the int4 Triton GEMM (AWQ-like: asymmetric, group 128),
the FP8 GEMM the engine picks (``torch._scaled_mm`` on compute capability >= 8.9, else the w8a16 Triton kernel)
and the w8a16 Triton kernel itself, on the linear layers of a Qwen3-0.6B-shaped and a Llama-3-8B-shaped model
(q/k/v, o, gate/up, down) at M = 1, 16, 256 and 4096 rows. Each time is the median CUDA-graph replay of many calls
rotating over enough weight copies that L2 stays cold. The decode rows add one model's layer times (x layers) at
M = 1 and 16: the GEMM part of a decode step. ``--engine-decode`` also times the engine's decode step on the
Qwen3 shape in bf16 and with ``quantization="fp8"`` (gpu_models' ``decode_step``).

    python benchmarks/gpu_quant.py                  # one GPU
    python benchmarks/gpu_quant.py --smoke          # tiny shapes; on CPU through Triton's interpreter (the logic only)

Also the ``quant`` section of benchmarks/gpu_check.py (``--quant-seconds``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import format_table, log  # noqa: E402 (the benchmarks folder is not a package)
from gpu_common import (  # noqa: E402
    LLAMA8B_KERNEL_SHAPE,
    QWEN3_KERNEL_SHAPE,
    SMOKE_KERNEL_SHAPES,
    Budget,
    Shape,
    time_call,
)
from gpu_models import decode_step  # noqa: E402

ROWS, SMOKE_ROWS = (1, 16, 256, 4096), (1, 3, 20)
NUM_LAYERS = {"qwen3": 28, "llama8b": 32}  # decoder layers of each shape (smoke: 2)
COLD_BYTES = 256 * 2**20  # weight copies rotated per timing: about 5x the H200's 50 MB L2
MAX_COPIES = 64
MIN_SECTION_S = 20
ERROR_ROWS = 16  # each method is checked against its reference at this row count

Kernel = Callable[[torch.Tensor], torch.Tensor]


def layer_shapes(shape: Shape) -> list[tuple[str, int, int]]:
    """(layer, out_features N, in_features K) of one decoder layer's linear projections."""
    attn, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    h, inter = shape.hidden, shape.intermediate
    return [("qkv", attn + 2 * kv, h), ("o", h, attn), ("gate_up", 2 * inter, h), ("down", h, inter)]


@dataclasses.dataclass
class Method:
    """One way to run a layer: fresh copies of its kernel (for rotation) and its reference."""

    name: str
    copy: Callable[[], Kernel]
    reference: Callable[[torch.Tensor], torch.Tensor]
    weight_bytes: int


def _int4_weight(n: int, k: int, group: int, device: torch.device):
    from pagoda.quantization.weights import IntWeight

    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=device)
    zeros = torch.randint(0, 16, (k // group, n), dtype=torch.uint8, device=device)
    scales = ((torch.rand(k // group, n, device=device) + 0.5) * 0.02 / 8).half().float()
    return IntWeight(q, scales, zeros, group, 4)


def methods(n: int, k: int, group: int, dtype: torch.dtype, device: torch.device) -> list[Method]:
    """bf16 matmul, int4 Triton, the engine's FP8 layer and (when that is scaled_mm) the w8a16 Triton GEMM."""
    from pagoda.layers.quant_gpu import Fp8GpuLinear, TritonIntLinear
    from pagoda.quantization.weights import quantize_fp8_per_row
    from pagoda_kernels.fp8_gemm import fp8_w8a16_gemm, fp8_w8a16_reference
    from pagoda_kernels.int_gemm import int_gemm_reference

    dense = (torch.randn(n, k, device=device) * 0.02).to(dtype)
    dense_ref = lambda x: (x.float() @ dense.float().T).to(x.dtype)
    int_w = _int4_weight(n, k, group, device)
    int4 = TritonIntLinear.from_int_weight(int_w, None)
    fp8_w = quantize_fp8_per_row(dense)
    fp8 = Fp8GpuLinear.from_fp8_weight(fp8_w, None)

    def dense_copy() -> Kernel:
        w = dense.clone()
        return lambda x: torch.matmul(x, w.t())

    def int4_copy() -> Kernel:
        p = int4.packed
        return dataclasses.replace(int4, packed=dataclasses.replace(p, qweight=p.qweight.clone()))

    def fp8_copy() -> Kernel:
        return dataclasses.replace(fp8, qweight=fp8.qweight.clone())

    def w8a16_copy() -> Kernel:
        q = fp8_w.qweight.clone()
        return lambda x: fp8_w8a16_gemm(x, q, fp8_w.scales)

    fp8_bytes = n * k + 4 * n
    int4_bytes = n * k // 2 + (k // group) * n * (int4.packed.scales.element_size() + 1)
    found = [
        Method("bf16", dense_copy, dense_ref, n * k * dtype.itemsize),
        Method(f"int4-g{group}", int4_copy, lambda x: int_gemm_reference(x, int_w), int4_bytes),
        Method(fp8.name, fp8_copy, _fp8_reference(fp8), fp8_bytes),
    ]
    if fp8.name != "fp8-triton-w8a16":
        w8a16_ref = lambda x: fp8_w8a16_reference(x, fp8_w.qweight, fp8_w.scales)
        found.append(Method("fp8-triton-w8a16", w8a16_copy, w8a16_ref, fp8_bytes))
    return found


def _fp8_reference(layer) -> Callable[[torch.Tensor], torch.Tensor]:
    from pagoda_kernels.fp8_gemm import fp8_scaled_mm_reference, fp8_w8a16_reference

    if layer.name == "fp8-scaled-mm":
        return lambda x: fp8_scaled_mm_reference(x, layer.qweight, layer.scales, layer.input_scale)
    return lambda x: fp8_w8a16_reference(x, layer.qweight, layer.scales)


def time_method(method: Method, m: int, k: int, dtype, device, warmup: int, reps: int) -> dict:
    """Median seconds per call at ``m`` rows (rotating weight copies), and the error against the reference."""
    copies = 1 if device.type != "cuda" else min(MAX_COPIES, max(1, math.ceil(COLD_BYTES / method.weight_bytes)))
    kernels = [method.copy() for _ in range(copies)]
    x = torch.randn(m, k, device=device).to(dtype)
    row: dict = {"method": method.name, "m": m}
    if m == ERROR_ROWS or device.type != "cuda":
        y, ref = kernels[0](x).float(), method.reference(x).float()
        row["max_rel_err"] = ((y - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()
    seconds, how = time_call(lambda kernel: kernel(x), [(kern,) for kern in kernels], device, warmup, reps)
    return row | {"seconds": seconds, "timing": how, "copies": copies}


def run_model(shape: Shape, rows: tuple[int, ...], group: int, timing: tuple, section: Budget, result: dict) -> None:
    """Every layer of one model shape at every row count; fills ``result[layer]`` as it goes.
    ``timing``: (device, warm-up calls, timed repetitions)."""
    (device, warmup, reps), dtype = timing, torch.bfloat16
    for layer, n, k in layer_shapes(shape):
        entry = result.setdefault(layer, {"n": n, "k": k, "times": []})
        if not section.allows(5, f"[quant] {shape.name} {layer}"):
            entry["skipped"] = "out of time"
            continue
        try:
            found = methods(n, k, group, dtype, device)
            entry["fp8_path"] = found[2].name  # the engine's FP8 layer on this GPU
            for m in rows:
                for method in found:
                    t = time_method(method, m, k, dtype, device, warmup, reps)
                    entry["times"].append(t)
                    us = t["seconds"] * 1e6
                    log(f"  [quant] {shape.name} {layer} M={m} {method.name}: {us:.1f} us ({t['timing']})")
        except Exception as exc:  # the next layer still runs
            entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
            log(f"  [quant] {shape.name} {layer} ERROR {entry['error']}")
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def run_quant(args, budget: Budget, result: dict) -> None:
    """The section (gpu_check calls it): both model shapes, or the smoke shapes, within ``--quant-seconds``."""
    seconds = getattr(args, "quant_seconds", 60)
    if seconds <= 0:
        result["skipped"] = "--quant-seconds 0"
        return
    if not budget.allows(MIN_SECTION_S, "quantized GEMMs"):
        result["skipped"] = f"less than {MIN_SECTION_S} s left"
        return
    timing = (torch.device("cuda" if torch.cuda.is_available() else "cpu"), args.warmup, args.reps)
    shapes = SMOKE_KERNEL_SHAPES[:1] if args.smoke else (QWEN3_KERNEL_SHAPE, LLAMA8B_KERNEL_SHAPE)
    rows, group = (SMOKE_ROWS, 16) if args.smoke else (ROWS, 128)
    section = Budget(min(seconds, budget.left()))
    result |= {"rows": list(rows), "group_size": group, "models": {}}
    for shape in shapes:
        run_model(shape, rows, group, timing, section, result["models"].setdefault(shape.name, {}))
    if getattr(args, "engine_decode", False):
        result["engine_decode"] = engine_decode(args)


def engine_decode(args) -> dict:
    """The engine's decode step on the Qwen3-0.6B shape, bf16 against online FP8 (random weights)."""
    from common import QWEN3_SHAPE, ensure_qwen3_shape_checkpoint
    from pagoda import LLM

    path = ensure_qwen3_shape_checkpoint(Path(args.work_dir) / "qwen3-0.6b-shape")
    batch, context, steps = (2, 64, 8) if args.smoke else (16, 1024, 32)
    out: dict = {"batch": batch, "context": context}
    for quantization in (None, "fp8"):
        key = quantization or "bf16"
        try:
            llm = LLM(model=str(path), dtype="bfloat16", max_model_len=context + 1, quantization=quantization)
            out[key] = decode_step(llm, batch, context, steps, QWEN3_SHAPE["vocab_size"], None)
            llm.shutdown()
            del llm
        except Exception as exc:
            out[key] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def _times(entry: dict, m: int) -> dict[str, dict]:
    return {t["method"]: t for t in entry.get("times", []) if t["m"] == m}


def quant_rows(r: dict) -> list[tuple[str, ...]]:
    """Table rows of :func:`run_quant`'s result: per layer and row count the bf16 time and each method's time and
    speed-up over it; then the decode sums and the engine's decode steps."""
    rows: list[tuple[str, ...]] = [("", "", "", "")]
    if "models" not in r:
        status = "SKIPPED" if "skipped" in r else "ERROR"
        return [*rows, ("quant", "quantized GEMMs", status, r.get("skipped") or r.get("error", "not run"))]
    rows.append(
        ("quant", "rows M", "/".join(map(str, r["rows"])), f"bf16 matmul vs int4 (group {r['group_size']}), fp8")
    )
    for model, layers in r["models"].items():
        for layer, e in layers.items():
            label = f"{model} {layer} {e['n']}x{e['k']}"
            for status in ("skipped", "error"):
                rows += [("quant", label, status.upper(), e[status])] if status in e else []
            for m in r["rows"]:
                t = _times(e, m)
                if "bf16" not in t:
                    continue
                base = t["bf16"]["seconds"]
                parts = [
                    f"{name} {x['seconds'] * 1e6:.1f} us ({base / x['seconds']:.2f}x)"
                    for name, x in t.items()
                    if name != "bf16"
                ]
                errs = [
                    f"{name} {x['max_rel_err']:.1e}" for name, x in t.items() if "max_rel_err" in x and name != "bf16"
                ]
                detail = ", ".join(parts) + (f"; rel err {', '.join(errs)}" if errs else "")
                rows.append(("quant", f"{label} M={m}", f"bf16 {base * 1e6:.1f} us", detail))
        rows += _decode_rows(model, layers, r["rows"])
    rows += _engine_rows(r.get("engine_decode"))
    return rows


def _decode_rows(model: str, layers: dict, ms: list[int]) -> list[tuple[str, ...]]:
    """Sum of the four layers' times x the model's layers, at the decode row counts measured."""
    rows = []
    for m in [m for m in ms if m <= 16]:
        per = [_times(e, m) for e in layers.values()]
        names = [name for name in per[0] if all(name in t for t in per)] if per else []
        if "bf16" not in names:
            continue
        total = {name: sum(t[name]["seconds"] for t in per) * NUM_LAYERS.get(model, 2) for name in names}
        parts = [f"{n} {s * 1e3:.3f} ms ({total['bf16'] / s:.2f}x)" for n, s in total.items() if n != "bf16"]
        rows.append(("quant", f"{model} decode GEMMs, M={m}", f"bf16 {total['bf16'] * 1e3:.3f} ms", ", ".join(parts)))
    return rows


def _engine_rows(e: Optional[dict]) -> list[tuple[str, ...]]:
    if not e:
        return []
    rows = []
    for key in ("bf16", "fp8"):
        d = e.get(key, {})
        value = f"{d['median_step_s'] * 1e3:.2f} ms" if "median_step_s" in d else "ERROR"
        rows.append(
            ("quant", f"engine decode step {key}, batch {e['batch']}", value, d.get("error", f"context {e['context']}"))
        )
    return rows


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--smoke", action="store_true", help="tiny shapes (on CPU through Triton's interpreter): the logic only")
    add("--quant-seconds", type=float, default=240, help="cap on the whole run")
    add("--engine-decode", action="store_true", help="also time the engine's decode step, bf16 vs fp8 (Qwen3 shape)")
    add("--work-dir", type=Path, default=Path(tempfile.gettempdir()), help="the engine checkpoint goes here")
    add("--json", type=Path, help="also write the results here (default: $OUT/gpu_quant.json when OUT is set)")
    args = parser.parse_args(argv)
    if args.json is None and os.environ.get("OUT"):
        args.json = Path(os.environ["OUT"]) / "gpu_quant.json"
    args.warmup, args.reps = (1, 2) if args.smoke else (3, 10)
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        if not args.smoke:
            sys.exit("no CUDA device: this benchmark needs a GPU (--smoke runs its logic on CPU)")
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    started, result = time.monotonic(), {}
    run_quant(args, Budget(args.quant_seconds), result)
    print(format_table(("section", "measurement", "value", "detail"), quant_rows(result)), flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"settings": vars(args), "results": result}, indent=2, default=str))
    log(f"done in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
