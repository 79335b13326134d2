"""The native group-quantized CPU kernel (``int4-native``) against the native bf16 and int8 kernels.

All 28 layers' linears of the Qwen3-0.6B shape (qkv 1024->4096, o 2048->1024, gate_up 1024->6144 with the fused
SiLU, down 3072->1024), each layer with its own weights so that a step streams them from memory as a model does;
int4 at group 128 (random integers, float16 scales and zero points as in AWQ/GPTQ checkpoints: the kernel's speed
does not depend on the values).
Prints the time per step of every kernel for each row count (the best of the timed steps: on a shared host the
median mostly measures the neighbours, and OpenMP threads waiting for a descheduled peer), the ratio to bf16, and
the weight bytes read per token.

    python benchmarks/int4_kernel.py                      # rows 1, 8, 32, 512
    python benchmarks/int4_kernel.py --rows 1 --bits 8    # GPTQ 8-bit on the same kernel
    python benchmarks/int4_kernel.py --threads 1          # one core: steadier on a busy host
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import QWEN3_SHAPE, format_table  # noqa: E402
from cpu_facts import host_facts  # noqa: E402
from pagoda.layers.cpu_linear import (  # noqa: E402
    NATIVE_BF16,
    NATIVE_INT8,
    NativeBf16Linear,
    NativeGatedBf16Linear,
    native_linear_support,
)
from pagoda.layers.int4_cpu import Int4CpuLinear, int4_native_available  # noqa: E402
from pagoda.layers.int8_cpu import Int8WeightOnlyLinear  # noqa: E402
from pagoda.quantization.weights import IntWeight  # noqa: E402

Layer = dict[str, Callable[[torch.Tensor], torch.Tensor]]


def layer_shapes() -> dict[str, tuple[int, int]]:
    """(in, out) of one decoder layer's linears."""
    s = QWEN3_SHAPE
    hidden, inter, head = s["hidden_size"], s["intermediate_size"], s["head_dim"]
    q, kv = s["num_attention_heads"] * head, s["num_key_value_heads"] * head
    return {"qkv": (hidden, q + 2 * kv), "o": (q, hidden), "gate_up": (hidden, 2 * inter), "down": (inter, hidden)}


def random_int_weight(out: int, inp: int, group_size: int, bits: int) -> IntWeight:
    groups = inp // group_size
    return IntWeight(
        torch.randint(0, 2**bits, (out, inp), dtype=torch.uint8),
        (torch.rand(groups, out) * 0.01).half().float(),  # float16 values, as checkpoints' scales are
        torch.randint(0, 2**bits, (groups, out), dtype=torch.uint8),
        group_size,
        bits,
    )


def build_layers(kind: str, layers: int, group_size: int, bits: int) -> tuple[list[Layer], int]:
    """``layers`` decoder layers of one kernel kind: per layer name -> callable, and the weight bytes they hold."""
    built, nbytes = [], 0
    for _ in range(layers):
        layer: Layer = {}
        for name, (inp, out) in layer_shapes().items():
            gated = name == "gate_up"
            if kind == "int4":
                kernel = Int4CpuLinear.from_int_weight(random_int_weight(out, inp, group_size, bits), None, gated)
                nbytes += kernel.packed.numel()
            else:
                weight = (torch.randn(out, inp) * 0.02).to(torch.bfloat16)
                if kind == "int8":
                    kernel = Int8WeightOnlyLinear.from_weight(weight, None, gated)
                    nbytes += kernel.qweight.numel() + kernel.scales.numel() * 4
                else:
                    kernel = (NativeGatedBf16Linear if gated else NativeBf16Linear).from_weight(weight, None)
                    nbytes += kernel.packed.numel() * 2
            layer[name] = kernel.silu_and_mul if gated else kernel
        built.append(layer)
    return built, nbytes


def step_seconds(models: dict[str, list[Layer]], rows: int, min_seconds: float) -> dict[str, float]:
    """Best seconds of one pass over every layer's linears with ``rows`` activation rows, per kernel kind.

    The kinds take turns step by step, so a change in the load of a shared host touches all of them alike.
    """
    inputs = {name: torch.randn(rows, inp).to(torch.bfloat16) for name, (inp, _) in layer_shapes().items()}

    def step(model: list[Layer]) -> float:
        start = time.perf_counter()
        for layer in model:
            for name, kernel in layer.items():
                kernel(inputs[name])
        return time.perf_counter() - start

    for model in models.values():
        step(model)  # warm-up: page faults, thread pool
    times: dict[str, list[float]] = {kind: [] for kind in models}
    start = time.perf_counter()
    while len(times["bf16"]) < 3 or (
        time.perf_counter() - start < min_seconds * len(models) and len(times["bf16"]) < 50
    ):
        for kind, model in models.items():
            times[kind].append(step(model))
    return {kind: min(values) for kind, values in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 512])
    parser.add_argument("--layers", type=int, default=QWEN3_SHAPE["num_hidden_layers"])
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4)
    parser.add_argument("--min-seconds", type=float, default=2.0, help="time per row count and kernel")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not (int4_native_available() and native_linear_support(NATIVE_BF16)):
        sys.exit("the native kernels need AVX512-BF16 and a compiler: nothing to compare on this machine")
    kinds = ["bf16", "int8", "int4"] if native_linear_support(NATIVE_INT8) else ["bf16", "int4"]
    label = {"bf16": "bf16 native", "int8": "int8 native", "int4": f"int{args.bits}-native g{args.group_size}"}
    models, nbytes = {}, {}
    for kind in kinds:
        models[kind], nbytes[kind] = build_layers(kind, args.layers, args.group_size, args.bits)
    seconds = {}
    for rows in args.rows:
        for kind, s in step_seconds(models, rows, args.min_seconds).items():
            seconds[kind, rows] = s
    table = []
    for rows in args.rows:
        for kind in kinds:
            s = seconds[kind, rows]
            bf16 = seconds["bf16", rows]
            table.append(
                (
                    str(rows),
                    label[kind],
                    f"{s * 1e3:.2f}",
                    f"{bf16 / s:.2f}x",
                    f"{nbytes[kind] / rows / 1e6:.1f}",
                    f"{nbytes[kind] / s / 1e9:.1f}",
                )
            )
        table.append(("",) * 6)
    header = ("rows", "kernel", "best ms/step", "vs bf16", "weight MB/token", "weight GB/s")
    print(format_table(header, table[:-1]))
    print(
        f"{args.layers} layers; weights per step: " + ", ".join(f"{label[k]} {nbytes[k] / 1e6:.0f} MB" for k in kinds)
    )
    print("host:", host_facts())


if __name__ == "__main__":
    main()
