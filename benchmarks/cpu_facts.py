"""Facts about the host a CPU benchmark ran on: CPU model, the ISA flags that decide the kernels, a measured read
bandwidth, and the linear kernels the engine selects for the Qwen3-0.6B shapes.

Hosts of one machine kind differ (a Zen 4 EPYC without AMX, a Xeon with AMX tiles and a third of the bandwidth), so
numbers from two hosts are only comparable next to these facts. ``benchmarks/cpu_compare.py`` prints them beside
its table; on its own:

    python benchmarks/cpu_facts.py            # facts + bandwidth + kernel selection (measured once, then cached)
    python benchmarks/cpu_facts.py --int8     # also the int8 selection
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import QWEN3_SHAPE  # noqa: E402


def read_bandwidth_gbs(megabytes: int = 512, repeats: int = 5) -> float:
    """GB/s of a large float32 sum (reads only) with this process's threads; the median of ``repeats``."""
    x = torch.ones(megabytes * (1 << 20) // 4, dtype=torch.float32)
    x.sum()  # fault the pages in
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        seconds.append(time.perf_counter() - start)
    return x.numel() * 4 / statistics.median(seconds) / 1e9


def qwen3_shapes() -> list[tuple[int, int, str]]:
    """(in_features, out_features, role) of the Qwen3-0.6B-shaped model's linear layers."""
    s = QWEN3_SHAPE
    hidden, inter, head = s["hidden_size"], s["intermediate_size"], s["head_dim"]
    q, kv = s["num_attention_heads"] * head, s["num_key_value_heads"] * head
    return [
        (hidden, q + 2 * kv, "linear"),  # qkv
        (q, hidden, "linear"),  # o
        (hidden, 2 * inter, "gated"),  # gate_up
        (inter, hidden, "linear"),  # down
        (hidden, s["vocab_size"], "logits"),  # lm_head
    ]


def host_facts(bandwidth: bool = True) -> dict[str, object]:
    """CPU model, ISA flags, AMX usability, thread count and (optionally) the measured read bandwidth."""
    from pagoda.cpu.cpu_features import amx_available, cpu_model, isa_flags

    facts: dict[str, object] = {
        "cpu": cpu_model(),
        "isa": [name for name, present in isa_flags().items() if present],
        "amx_usable": amx_available(),
        "torch_threads": torch.get_num_threads(),
    }
    if bandwidth:
        facts["read_gb_s"] = round(read_bandwidth_gbs(), 1)
    return facts


def kernel_selection(quantization: Optional[str] = None) -> list[dict[str, object]]:
    """The engine's kernel choice for each Qwen3-0.6B layer shape (bf16 activations), with measured time ratios."""
    from pagoda.cpu import cpu_ops
    from pagoda.layers.kernel_timing import select_for_shapes

    cpu_ops()  # build or load the native kernels first: their compile time is not the selection's
    start = time.perf_counter()
    chosen = select_for_shapes(qwen3_shapes(), quantization)
    rows = [
        {"shape": key.describe(), "segments": [list(s) for s in sel.segments], "how": sel.how, "text": sel.describe()}
        for key, sel in chosen
    ]
    if rows:
        rows[0]["wall_s"] = round(time.perf_counter() - start, 2)
    return rows


def format_facts(facts: dict[str, object]) -> str:
    """Lines to print beside a table."""
    lines = [
        f"host: {facts['cpu']}, {facts.get('torch_threads')} torch threads",
        f"ISA: {' '.join(facts['isa']) or 'none of note'}; AMX usable: {facts['amx_usable']}",
    ]
    if "read_gb_s" in facts:
        lines.append(f"read bandwidth (large float32 sum, median of 5): {facts['read_gb_s']} GB/s")
    for label, rows in (("bf16", facts.get("kernels")), ("int8", facts.get("kernels_int8"))):
        for row in rows or []:
            lines.append(f"kernels {label}: {row['shape']}: {row['text']}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--int8", action="store_true", help="also the weight-only int8 selection")
    parser.add_argument("--no-bandwidth", action="store_true")
    args = parser.parse_args(argv)
    facts = host_facts(bandwidth=not args.no_bandwidth)
    facts["kernels"] = kernel_selection()
    if args.int8:
        facts["kernels_int8"] = kernel_selection("int8")
    print(format_facts(facts))
    for label in ("kernels", "kernels_int8"):
        if facts.get(label) and "wall_s" in facts[label][0]:
            print(f"{label}: selection took {facts[label][0]['wall_s']} s (0 when cached)")


if __name__ == "__main__":
    main()
