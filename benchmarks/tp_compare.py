"""Tensor parallelism on CPU: TP=2 (2 processes x 1 thread) against TP=1 (1 process x 2 threads).

The Qwen3-0.6B shape in bf16 (random weights, ``.bench/qwen3-0.6b-shape``). Each size runs in its own engine
host process (an ``LLM`` loaded once; a TP=2 host spawns its rank-1 worker as the engine does), so thread counts
and memory stay apart. Measured, repeats interleaved (TP=1 then TP=2, the next repeat the other way round) and
medians reported:

- decode b1 and b32 (32-token prompts, ``--new-tokens`` each, EOS ignored): tokens/s over the steps in which every
  request decodes (prefill excluded), and the median step time;
- prefill 512: time to first token of one 512-token prompt (``max_tokens=1``).

Then what TP=2 pays per step, from micro-benchmarks between two fresh processes (1 thread each): the step
plan's transport (the real ForwardSteps captured from the TP=2 engine, sent the engine's way over a pipe, and by
``TensorParallel.broadcast_object``, gloo's broadcast_object_list, which the issue named as the alternative), and
the model's collectives at its tensor sizes (2 all-reduces per layer + 1 for the embedding, bf16 [tokens, hidden];
the vocab-parallel logits gather, fp32 [sampled rows, vocab / 2]) through the engine's shared-memory exchange and
through gloo, as a fraction of the TP=2 step. Rank 0's time
inside those calls in the engine itself is shown too (it includes waiting for rank 1). And memory per rank: the
weights each rank holds, its KV cache, and each process's resident set (VmRSS after loading, VmHWM at the end).

    python benchmarks/tp_compare.py                 # Qwen3-0.6B shape, 3 repeats (~5 min on 2 cores)
    python benchmarks/tp_compare.py --quick         # toy Qwen3 shape, a smoke test (~1-2 min)
    python benchmarks/tp_compare.py --cpus 0        # all cores: TP=1 x all threads, TP=2 x half each
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import random
import socket
import statistics
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    BENCH_DIR,
    FIRST_PLAIN_TOKEN_ID,
    ensure_qwen3_shape_checkpoint,
    format_table,
    log,
    machine_facts,
)
from pagoda.distributed.shm_comm import segment_path  # noqa: E402
from tp_common import comm_peer, cpu_flags, engine_host, ensure_quick_checkpoint  # noqa: E402

SIZES = (1, 2)
BLOCK = 16  # the engine's default block size


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="toy Qwen3 shape, 16 new tokens, 2 repeats")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per workload and size (default 3)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens per decode request (default 64)")
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32, help="the larger decode batch")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs for every process of the run (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=BENCH_DIR / "tp_compare.json")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (2 if args.quick else 3)
    args.new_tokens = args.new_tokens or (16 if args.quick else 64)
    return args


class Host:
    """An engine host process of one tensor-parallel size (see ``tp_common.engine_host``)."""

    def __init__(self, tp: int, settings: dict) -> None:
        context = multiprocessing.get_context("spawn")
        self.tp = tp
        self.conn, theirs = context.Pipe()
        # Not a daemon: a daemonic process may not start the TP worker.
        self.process = context.Process(target=engine_host, args=(theirs, settings | {"tp": tp}), name=f"tp{tp}")
        self.process.start()
        theirs.close()
        self.info = self._reply()

    def call(self, *command) -> dict:
        self.conn.send(command)
        return self._reply()

    def _reply(self):
        try:
            status, payload = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"TP={self.tp} host exited with code {self.process.exitcode}") from None
        if status == "error":
            raise RuntimeError(f"TP={self.tp} host failed:\n{payload}")
        return payload

    def stop(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError):  # it may have exited already
                self.conn.send(("stop",))
            self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def workloads(args: argparse.Namespace, vocab: int) -> dict[str, tuple[str, list[list[int]], int]]:
    rng = random.Random(args.seed)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(FIRST_PLAIN_TOKEN_ID, vocab) for _ in range(length)]

    return {
        "decode b1": ("decode", [prompt(32)], args.new_tokens),
        f"decode b{args.batch}": ("decode", [prompt(32) for _ in range(args.batch)], args.new_tokens),
        f"prefill {args.prefill_len}": ("prefill", [prompt(args.prefill_len)], 1),
    }


def engine_settings(args: argparse.Namespace, config: dict) -> dict:
    """Enough KV blocks for the batch (every rank's cache together), prefix caching off (prompts repeat)."""
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 2
    max_len = max(args.prefill_len + 1, 32 + args.new_tokens)
    blocks = max(args.batch * -(-(32 + args.new_tokens) // BLOCK), -(-max_len // BLOCK)) + 16
    return dict(
        dtype="bfloat16",
        max_model_len=max_len,
        max_num_seqs=args.batch,
        enable_prefix_caching=False,
        kv_cache_memory=blocks * BLOCK * per_token,
        block_size=BLOCK,
    )


def run_comm_benchmarks(plans: dict, config: dict, args: argparse.Namespace) -> dict:
    """The two peers of ``tp_common.comm_peer`` (ranks 0 and 1, spawned fresh), and rank 0's results."""
    context = multiprocessing.get_context("spawn")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    job = {
        "plans": plans,
        "shm_path": segment_path(),
        "hidden": config["hidden_size"],
        "vocab_shard": -(-config["vocab_size"] // 2),
        "all_reduce_rows": sorted({1, args.batch, args.prefill_len}),
        "gather_rows": sorted({1, args.batch}),
        "transport_iters": 50 if args.quick else 300,
        "collective_rounds": 5 if args.quick else 15,
        "collective_calls": 20 if args.quick else 60,
    }
    a, b = context.Pipe(duplex=True)
    results_out, results_in = context.Pipe(duplex=False)
    peers = [
        context.Process(target=comm_peer, args=(0, init, a, results_in, job), daemon=True),
        context.Process(target=comm_peer, args=(1, init, b, None, job), daemon=True),
    ]
    for peer in peers:
        peer.start()
    try:
        if not results_out.poll(600):
            raise RuntimeError("the communication micro-benchmark gave no result in 600 s")
        return results_out.recv()
    finally:
        for peer in peers:
            peer.join(30)
            if peer.is_alive():
                peer.kill()


def per_step_collectives(
    name: str, comm: dict, config: dict, args: argparse.Namespace, transport: str
) -> tuple[float, str]:
    """Microseconds of one step's collectives through ``transport`` (shm or gloo), composed from the per-call
    times, and how."""
    layers, c = config["num_hidden_layers"], comm["collectives"][transport]
    if name.startswith("decode"):
        rows = 1 if name == "decode b1" else args.batch
        count = 2 * layers + 1
        return count * c[f"all_reduce {rows}"] + c[f"gather {rows}"], f"{count} AR [{rows}] + gather [{rows}]"
    # prefill: the last layer's two all-reduces carry the sampled row only (output_rows)
    n, count = args.prefill_len, 2 * layers - 1
    total = count * c[f"all_reduce {n}"] + 2 * c["all_reduce 1"] + c["gather 1"]
    return total, f"{count} AR [{n}] + 2 AR [1] + gather [1]"


def _median(runs: list[dict], key: str) -> Optional[float]:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def _mib(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f} MiB"


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    allowed = sorted(os.sched_getaffinity(0))
    if args.cpus:
        if len(allowed) < args.cpus:
            raise SystemExit(f"--cpus {args.cpus}: only {len(allowed)} CPUs are available")
        os.sched_setaffinity(0, allowed[: args.cpus])  # every process of the run inherits it
    cpus = len(os.sched_getaffinity(0))
    if args.quick:
        model_dir = ensure_quick_checkpoint(BENCH_DIR / "qwen3-tiny-tp")
    else:
        model_dir = ensure_qwen3_shape_checkpoint()
    config = json.loads((model_dir / "config.json").read_text())
    facts = machine_facts()
    loads = workloads(args, config["vocab_size"])
    settings = {"model": str(model_dir), "engine": engine_settings(args, config)}
    hosts: dict[int, Host] = {}
    try:
        for tp in SIZES:
            log(f"loading TP={tp} ({model_dir.name}, bf16, {cpus} CPUs)")
            hosts[tp] = Host(tp, settings)
        log("warm-up: every workload once on each size")
        plans = {}
        for name, (kind, prompts, max_tokens) in loads.items():
            results = {tp: hosts[tp].call("run", kind, prompts, max_tokens) for tp in SIZES}
            plans[name] = results[2]["plan"]  # the TP=2 engine's ForwardStep of a timed step
        log("micro-benchmarks: step-plan transport and collectives, 2 processes x 1 thread over gloo")
        comm = run_comm_benchmarks(plans, config, args)
        runs: dict[tuple[str, int], list[dict]] = {}
        for repeat in range(args.repeats):
            order = SIZES if repeat % 2 == 0 else SIZES[::-1]
            for name, (kind, prompts, max_tokens) in loads.items():
                for tp in order:
                    result = hosts[tp].call("run", kind, prompts, max_tokens)
                    runs.setdefault((name, tp), []).append(result)
                    value = (
                        f"{result['decode_tok_s']:.1f} tok/s"
                        if kind == "decode"
                        else f"{result['ttft_s'] * 1e3:.0f} ms"
                    )
                    log(f"repeat {repeat + 1}/{args.repeats} {name} TP={tp}: {value}")
        memory = {tp: hosts[tp].call("memory") for tp in SIZES}
    finally:
        for host in hosts.values():
            host.stop()
    facts["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    report(args, facts, config, model_dir, hosts, loads, runs, comm, memory, cpus)


def report(args, facts, config, model_dir, hosts, loads, runs, comm, memory, cpus) -> None:
    med = {k: {m: _median(v, m) for m in ("decode_tok_s", "step_s_median", "ttft_s")} for k, v in runs.items()}
    rows = []
    for name, (kind, _, _) in loads.items():
        one, two = med[(name, 1)], med[(name, 2)]
        if kind == "decode":
            tok = (one["decode_tok_s"], two["decode_tok_s"])
            rows.append((name, "decode tok/s", f"{tok[0]:.1f}", f"{tok[1]:.1f}", f"{tok[1] / tok[0]:.2f}x"))
            step = (one["step_s_median"] * 1e3, two["step_s_median"] * 1e3)
            rows.append(("", "step ms (median)", f"{step[0]:.1f}", f"{step[1]:.1f}", f"{step[0] / step[1]:.2f}x"))
        else:
            ttft = (one["ttft_s"] * 1e3, two["ttft_s"] * 1e3)
            rows.append((name, "TTFT ms", f"{ttft[0]:.1f}", f"{ttft[1]:.1f}", f"{ttft[0] / ttft[1]:.2f}x"))
            tok = [args.prefill_len / t * 1e3 for t in ttft]
            rows.append(("", "prefill tok/s", f"{tok[0]:.1f}", f"{tok[1]:.1f}", ""))
        a, b = runs[(name, 1)][-1]["tokens"], runs[(name, 2)][-1]["tokens"]
        same = sum(x == y for x, y in zip(a, b))
        rows.append(("", "greedy output = TP=1's", "", f"{same}/{len(a)}", ""))
    info1, info2 = hosts[1].info, hosts[2].info
    shape = "Qwen3-tiny shape (--quick)" if args.quick else "Qwen3-0.6B shape"
    print(f"\nTensor parallelism on CPU, {shape} ({model_dir.name}), bf16 random weights, median of {args.repeats}")
    print(
        f"{facts['cpu']}, {cpus} of {facts['cpus']} CPUs used; flags: {cpu_flags()}; torch {facts['torch']}; "
        f"load avg {facts['load_avg_1m_start']} -> {facts['load_avg_1m_end']}"
    )
    print(f"linear kernels: {', '.join(f'{k} x{v}' for k, v in info1['kernels'].items())}")
    if facts["load_avg_1m_start"] > 0.5:
        print(
            f"WARNING: load average {facts['load_avg_1m_start']} at start: other processes compete for the "
            f"{cpus} CPUs, and a 2-thread OpenMP step (TP=1) suffers far more from that than two 1-thread ranks"
        )
    print()
    header = (
        "workload",
        "metric",
        f"TP=1 (1 x {info1['threads']} thr)",
        f"TP=2 (2 x {info2['threads']}/{info2['worker_threads']} thr)",
        "TP=2 speed-up",
    )
    print(format_table(header, rows))
    print("greedy output = TP=1's: equal sequences in the last repeat (bf16: the ranks' partial sums round apart)")

    rows = []
    for name, plan in comm["transport"].items():
        coll_us, how = per_step_collectives(name, comm, config, args, "shm")
        gloo_us, _ = per_step_collectives(name, comm, config, args, "gloo")
        step_s = med[(name, 2)]["step_s_median"] if name.startswith("decode") else med[(name, 2)]["ttft_s"]
        probe = runs[(name, 2)]
        keys = ("all_reduce_s", "gather_to_first_s", "broadcast_s", "all_reduce_calls")
        in_engine = {k: _median([r["per_step"] for r in probe], k) or 0.0 for k in keys}
        waits = (in_engine["all_reduce_s"] + in_engine["gather_to_first_s"]) * 1e3
        total = coll_us + plan["pipe_us"]
        rows.append(
            (
                name,
                f"{plan['bytes']:,}",
                f"{plan['pipe_us']:.0f}",
                f"{plan['gloo_us']:.0f}",
                f"{plan['gloo_us'] / plan['pipe_us']:.1f}x",
                f"{coll_us:.0f} ({how})",
                f"{gloo_us:.0f} ({gloo_us / coll_us:.1f}x)",
                f"{total / 1e3:.2f} ms = {total / 1e6 / step_s:.1%}",
                f"{waits:.2f} ({in_engine['all_reduce_calls']:.0f} AR); send {in_engine['broadcast_s'] * 1e6:.0f} us",
            )
        )
    print("\nTP=2 per-step overhead (micro-benchmarks: 2 fresh processes x 1 thread; one-way = half a ping-pong)")
    header = (
        "workload",
        "plan bytes",
        "pipe us",
        "gloo bcast us",
        "gloo / pipe",
        "collectives us (shared memory)",
        "same through gloo us",
        "pipe + collectives, of TP=2 step",
        "in engine, rank 0: collectives ms (incl. waits); plan send",
    )
    print(format_table(header, rows))
    for transport, calls in comm["collectives"].items():
        per_call = ", ".join(f"{k} {v:.0f} us" for k, v in calls.items())
        print(f"per call, {transport}: {per_call}")
    print(f"(all_reduce: bf16 [n, {config['hidden_size']}]; gather: fp32 [n, vocab/2]; the engine uses shared memory)")

    rows = []
    columns = [(1, "rank 0"), (2, "rank 0"), (2, "rank 1")]
    weights = {1: info1["weights"], 2: info2["weights"]}
    rows.append(
        ("weights: params", *(_mib(weights[tp]["params"]) if r == "rank 0" else "= rank 0" for tp, r in columns))
    )
    rows.append(
        (
            "weights: packed kernels",
            *(_mib(weights[tp]["packed"]) if r == "rank 0" else "= rank 0" for tp, r in columns),
        )
    )
    rows.append(("KV cache", *(_mib(hosts[tp].info["kv_bytes"]) for tp, _ in columns)))
    rows.append(
        (
            "RSS before loading",
            _mib(info1["rank0_before_load"]["VmRSS"]),
            _mib(info2["rank0_before_load"]["VmRSS"]),
            "-",
        )
    )
    rows.append(("RSS after loading", *(_mib(hosts[tp].info["memory"][r]["VmRSS"]) for tp, r in columns)))
    rows.append(("peak RSS (VmHWM, end)", *(_mib(memory[tp][r]["VmHWM"]) for tp, r in columns)))
    total = {tp: sum(weights[tp].values()) for tp in SIZES}
    print(
        f"\nMemory per rank (weights of one rank: {total[2] / total[1]:.1%} of TP=1's; rank 1's shard has rank 0's "
        "shapes; rank 0 also holds the tokenizer, scheduler and sampler)"
    )
    print(format_table(("", "TP=1 rank 0", "TP=2 rank 0", "TP=2 rank 1"), rows))

    args.json.parent.mkdir(parents=True, exist_ok=True)
    strip = {
        f"{name} TP={tp}": [{k: v for k, v in r.items() if k not in ("plan", "tokens")} for r in rs]
        for (name, tp), rs in runs.items()
    }
    info = {tp: hosts[tp].info for tp in SIZES}
    args.json.write_text(
        json.dumps(
            {"machine": facts, "runs": strip, "comm": comm, "hosts": info, "memory": memory}, indent=2, default=str
        )
    )
    print(f"\nresults: {args.json}")


if __name__ == "__main__":
    main()
