"""`pagoda router` against straight-to-the-Service, same host, one run: prefix hit rate, TTFT, router overhead.

Two `pagoda serve` replicas of the built-in stories260K model, each with a KV cache of ``--kv-cache-memory`` (room
for a little more than half of the sessions' prompts), behind

- the router (``python -m pagoda_operator.router --static-models``: the same picker a cluster deployment runs), and
- "the Service": each request to a replica chosen at random, as kube-proxy's iptables mode spreads connections.

Workload: ``--sessions`` sessions, each a long prefix of its own (``--prefix-tokens`` random token ids) and
``--turns`` turns that extend it; each round sends every session's next turn in a shuffled order, ``--concurrency``
at a time (streaming completions, token-id prompts). Both paths get the same sessions' shapes, with distinct prefixes
(so neither profits from the other's cache). Reported per path: TTFT p50/p99 and the replicas' own prefix-cache hit
rate (``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total``, summed over replicas, before/after).

Router overhead: one replica alone, ``--overhead-requests`` tiny requests (one output token) at concurrency 32,
straight to it and through the router; the difference of the p50 end-to-end latencies is the router's added latency.

    python benchmarks/router_bench.py
    python benchmarks/router_bench.py --sessions 16 --turns 4 --prefix-tokens 200 --kv-cache-memory 3MiB
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import aiohttp
import yaml

from common import format_table, log, machine_facts, percentile
from serve_bench import free_port
from serve_common import HTTP_TIMEOUT, Client, RequestResult

REPO = Path(__file__).resolve().parents[1]
MODEL = "stories"
VOCAB = 512


def start(command: list[str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "w") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)


async def wait_ready(url: str, process: subprocess.Popen, path: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"{url} exited with {process.returncode}")
            try:
                async with session.get(url + path) as reply:
                    if reply.status == 200:
                        return
            except (TimeoutError, aiohttp.ClientError):
                pass
            await asyncio.sleep(0.3)
    raise RuntimeError(f"{url} was not ready within {timeout:.0f} s")


async def start_replica(directory: Path, index: int, kv_memory: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "pagoda.cli", "serve", "--served-model-name", MODEL, "--host", "127.0.0.1"]
    command += ["--port", str(port), "--kv-cache-memory", kv_memory, "--log-level", "warning"]
    process = start(command, directory / f"replica{index}.log")
    url = f"http://127.0.0.1:{port}"
    await wait_ready(url, process, "/ready")
    return process, url


async def start_router(directory: Path, endpoints: list[str], name: str) -> tuple[subprocess.Popen, str]:
    models = directory / f"{name}.yaml"
    models.write_text(yaml.safe_dump({"models": [{"name": MODEL, "endpoints": endpoints}]}))
    port = free_port()
    command = [sys.executable, "-m", "pagoda_operator.router", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--static-models", str(models)]
    process = start(command, directory / f"{name}.log")
    url = f"http://127.0.0.1:{port}"
    await wait_ready(url, process, "/health")
    return process, url


async def counter(session: aiohttp.ClientSession, url: str, family: str) -> float:
    async with session.get(url + "/metrics") as reply:
        text = await reply.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(family))


def sessions_rounds(seed: int, args: argparse.Namespace) -> list[list[list[int]]]:
    """Per round, every session's prompt (token ids) in a shuffled order."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(args.prefix_tokens)] for _ in range(args.sessions)]
    turns = [[[rng.randrange(3, VOCAB) for _ in range(args.turn_tokens)] for _ in range(args.turns)] for _ in prefixes]
    rounds = []
    for turn in range(args.turns):
        order = list(range(args.sessions))
        rng.shuffle(order)
        rounds.append([prefixes[s] + sum(turns[s][: turn + 1], []) for s in order])
    return rounds


async def run_rounds(pick, rounds: list[list[list[int]]], concurrency: int) -> list[RequestResult]:
    """``pick(i)``: the Client for the i-th request."""
    results: list[RequestResult] = []
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, prompt: list[int]) -> None:
        async with gate:
            results.append(await pick(i).complete(prompt, 2))

    index = 0
    for prompts in rounds:
        await asyncio.gather(*(one(index + i, p) for i, p in enumerate(prompts)))
        index += len(prompts)
    return results


async def measure_path(session, name, pick, replicas, rounds, args) -> dict:
    families = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
    before = [sum([await counter(session, u, f) for u in replicas]) for f in families]
    served = [await counter(session, u, "vllm:request_success_total") for u in replicas]
    results = await run_rounds(pick, rounds, args.concurrency)
    await asyncio.sleep(0.5)  # the engines count a step's cache hits after it
    after = [sum([await counter(session, u, f) for u in replicas]) for f in families]
    served = [int(await counter(session, u, "vllm:request_success_total") - s) for u, s in zip(replicas, served)]
    failed = [r.error for r in results if not r.ok]
    ttfts = [r.ttft for r in results if r.ttft is not None]
    hit_rate = (after[0] - before[0]) / max(1.0, after[1] - before[1])
    log(
        f"{name}: hit rate {hit_rate:.3f}, TTFT p50 {percentile(ttfts, 50) * 1e3:.1f} ms, failed {len(failed)}, "
        f"requests per replica {served}"
    )
    return {
        "hit_rate": hit_rate,
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p99": percentile(ttfts, 99),
        "failed": len(failed),
    }


async def overhead(session, replica: str, router: str, args: argparse.Namespace) -> dict:
    prompts = [[random.Random(i).randrange(3, VOCAB) for _ in range(16)] for i in range(args.overhead_requests)]
    out = {}
    for name, url in (("direct", replica), ("router", router)):
        client = Client(session, url, MODEL, 1)
        await run_rounds(lambda i, c=client: c, [prompts[:32]], 32)  # warm-up
        results = await run_rounds(lambda i, c=client: c, [prompts], 32)
        e2e = [r.e2e for r in results if r.e2e is not None]
        out[name] = percentile(e2e, 50)
    out["added_p50"] = out["router"] - out["direct"]
    return out


async def bench(args: argparse.Namespace, directory: Path) -> dict:
    processes: list[subprocess.Popen] = []
    try:
        replicas = []
        for index in range(2):
            process, url = await start_replica(directory, index, args.kv_cache_memory)
            processes.append(process)
            replicas.append(url)
        router_process, router_url = await start_router(directory, replicas, "router")
        processes.append(router_process)
        solo_process, solo_url = await start_router(directory, replicas[:1], "router-solo")
        processes.append(solo_process)
        async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as session:
            direct = [Client(session, url, MODEL, 2) for url in replicas]
            routed = Client(session, router_url, MODEL, 2)
            rng = random.Random(0)
            service = await measure_path(
                session,
                "service (random replica)",
                lambda i: rng.choice(direct),
                replicas,
                sessions_rounds(1, args),
                args,
            )
            router = await measure_path(session, "router", lambda i: routed, replicas, sessions_rounds(2, args), args)
            added = await overhead(session, replicas[0], solo_url, args)
        return {"service": service, "router": router, "overhead": added}
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


def report(result: dict, args: argparse.Namespace) -> str:
    rows = []
    for name in ("service", "router"):
        r = result[name]
        rows.append(
            (name, f"{r['hit_rate']:.3f}", f"{r['ttft_p50'] * 1e3:.1f}", f"{r['ttft_p99'] * 1e3:.1f}", str(r["failed"]))
        )
    ratio = result["router"]["hit_rate"] / max(1e-9, result["service"]["hit_rate"])
    o = result["overhead"]
    lines = [
        format_table(("path", "prefix hit rate", "TTFT p50 ms", "TTFT p99 ms", "failed"), rows),
        f"hit rate router / service: {ratio:.2f}x   TTFT p50 router / service: "
        f"{result['router']['ttft_p50'] / result['service']['ttft_p50']:.2f}x",
        f"router overhead at concurrency 32 ({args.overhead_requests} requests, 1 output token): p50 direct "
        f"{o['direct'] * 1e3:.1f} ms, through the router {o['router'] * 1e3:.1f} ms, added {o['added_p50'] * 1e3:.1f} ms",
    ]
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prefix-tokens", type=int, default=200)
    parser.add_argument("--turn-tokens", type=int, default=12)
    parser.add_argument(
        "--kv-cache-memory", default="3MiB", help="each replica's KV cache (3MiB: 153 blocks of 16 tokens, ~9 sessions)"
    )
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--overhead-requests", type=int, default=256)
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    facts = machine_facts()
    flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f" {f}" in flags]
    log(f"host: {facts['cpu']}, {os.cpu_count()} cpus, flags {' '.join(isa)}")
    with tempfile.TemporaryDirectory(prefix="router_bench_") as directory:
        result = asyncio.run(bench(args, Path(directory)))
    print(report(result, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
