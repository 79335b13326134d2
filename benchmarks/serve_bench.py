"""Serving benchmark of `pagoda serve`, in the spirit of `vllm bench serve`.

For each model it starts a real `pagoda serve` process on 127.0.0.1 (or uses ``--base-url``),
streams greedy ``/v1/completions`` requests with token-id prompts at fixed concurrency (closed
loop) and at a Poisson arrival rate (open loop), then runs a prefix-sharing workload and reads the
prefix cache's hit rate from ``/metrics``. Prints one table; writes JSON. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402 (the benchmarks folder is not a package)
    BENCH_DIR,
    QWEN3_SHAPE_NAME,
    REPO_ROOT,
    ensure_qwen3_shape_checkpoint,
    format_table,
    log,
    machine_facts,
    make_workload,
    random_tokens,
)
from serve_common import (  # noqa: E402
    HTTP_TIMEOUT,
    Client,
    ScenarioStats,
    closed_loop,
    fetch_metric_sums,
    fmt_ms,
    poisson,
    sequential,
    summarize,
)

HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
PREFIX_SUFFIX_LEN = 16
PREFIX_OUTPUT_LEN = 8
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One benchmarked model, how to serve it, and its default workload sizes."""

    key: str
    label: str
    serve_args: tuple[str, ...]
    vocab_size: int
    prompt_len: int
    output_len: int
    min_requests: int  # closed loop: requests = clamp(concurrency * per_worker, min, max)
    per_worker: int
    max_requests: int
    rate_requests: int
    request_rate: float  # req/s of the Poisson scenario; below saturation on this machine
    prefix_len: int
    prefix_requests: int

    def closed_loop_requests(self, concurrency: int) -> int:
        return max(self.min_requests, min(self.max_requests, concurrency * self.per_worker))


def model_specs(bench_dir: Path) -> dict[str, ModelSpec]:
    """The two models of the issue, keyed by their ``--models`` name."""
    stories = ModelSpec(
        key="stories",
        label="stories260K (fp32)",
        serve_args=(),
        vocab_size=512,
        prompt_len=64,
        output_len=64,
        min_requests=16,
        per_worker=4,
        max_requests=128,
        rate_requests=64,
        request_rate=16.0,
        prefix_len=400,  # stories260K has 512 positions
        prefix_requests=8,
    )
    qwen3 = ModelSpec(
        key="qwen3",
        label="Qwen3-0.6B shape, random bf16",
        serve_args=(str(bench_dir / QWEN3_SHAPE_NAME), "--dtype", "bfloat16", "--max-model-len", "4096"),
        vocab_size=151936,
        prompt_len=64,
        output_len=16,
        min_requests=4,
        per_worker=2,
        max_requests=32,
        rate_requests=16,
        request_rate=0.5,
        prefix_len=2000,
        prefix_requests=6,
    )
    return {"stories": stories, "qwen3": qwen3}


# ---- the server process --------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(slots=True)
class ServerProcess:
    """A `pagoda serve` subprocess; its output goes to a log file, not a pipe that could fill up."""

    process: subprocess.Popen
    base_url: str
    log_path: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


async def start_server(
    spec: ModelSpec,
    bench_dir: Path,
    timeout: float = 300,
    extra_args: tuple[str, ...] = (),
    engine_src: Optional[Path] = None,
    name: str = "serve_bench",
) -> ServerProcess:
    """Start `pagoda serve` on a free loopback port and wait until ``/ready`` answers 200.

    ``engine_src`` is the ``engine/src`` folder whose code runs (default: this checkout's), so that another
    revision of the engine can be measured by the same client in the same session."""
    port = free_port()
    log_path = bench_dir / f"{name}_{spec.key}.log"
    command = [sys.executable, "-m", "pagoda.cli", "serve", *spec.serve_args, *extra_args]
    command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    env = dict(os.environ)
    src = engine_src or REPO_ROOT / "engine" / "src"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), env.get("PYTHONPATH")]))
    log(f"{spec.key}: starting {' '.join(command[1:])} (log: {log_path})")
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
    server = ServerProcess(process, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"pagoda serve exited with {process.returncode}; see {log_path}")
            try:
                async with session.get(f"{server.base_url}/ready") as response:
                    if response.status == 200:
                        return server
            except (TimeoutError, aiohttp.ClientError):
                pass
            await asyncio.sleep(0.5)
    server.stop()
    raise RuntimeError(f"pagoda serve was not ready within {timeout:.0f} s; see {log_path}")


def check_base_url(url: str) -> str:
    """Only loopback servers: the benchmark floods its target with requests."""
    parsed = urlparse(url)
    if parsed.scheme != "http" or parsed.hostname not in LOOPBACK_HOSTS:
        raise ValueError(f"--base-url must be http:// on a loopback address ({', '.join(LOOPBACK_HOSTS)}); got {url}")
    return f"{parsed.scheme}://{parsed.netloc}"


# ---- scenarios ---------------------------------------------------------------------------


async def served_model(session: aiohttp.ClientSession, base_url: str) -> tuple[str, Optional[int]]:
    async with session.get(f"{base_url}/v1/models") as response:
        response.raise_for_status()
        card = (await response.json())["data"][0]
    return card["id"], card.get("max_model_len")


def _progress(spec: ModelSpec, stats: ScenarioStats) -> None:
    log(
        f"{spec.key} {stats.scenario}: {stats.requests - stats.failed}/{stats.requests} ok in {stats.seconds:.1f} s, "
        f"{stats.request_throughput:.2f} req/s, {stats.output_throughput:.1f} out tok/s, "
        f"TTFT p50 {fmt_ms(stats.ttft_p50)}, TPOT p50 {fmt_ms(stats.tpot_p50)}"
        + (f"; errors: {stats.errors}" if stats.errors else "")
    )


def _prompts(spec: ModelSpec, seed: int, count: int) -> list[list[int]]:
    """Random token-id prompts of the model's prompt length (ids the tokenizer treats as plain)."""
    return make_workload(seed, count, (spec.prompt_len, spec.prompt_len), (1, 1), spec.vocab_size).prompts


async def run_load(client: Client, spec: ModelSpec, args: argparse.Namespace) -> list[ScenarioStats]:
    """Warm-up, then each closed-loop concurrency and the Poisson rate, on fresh random prompts."""
    out = []
    seed = args.seed
    warmup = _prompts(spec, seed + 999, 2)
    await closed_loop(replace(client, output_len=4), warmup, 2)
    for concurrency in args.concurrency:
        count = args.num_requests or spec.closed_loop_requests(concurrency)
        seed += 1
        prompts = _prompts(spec, seed, count)
        log(f"{spec.key}: concurrency {concurrency}, {count} requests")
        results, seconds = await closed_loop(client, prompts, concurrency)
        out.append(summarize(f"concurrency {concurrency}", results, seconds, {"concurrency": concurrency}))
        _progress(spec, out[-1])
    rate = spec.request_rate if args.request_rate is None else args.request_rate
    if rate > 0:
        count = args.num_requests or spec.rate_requests
        prompts = _prompts(spec, seed + 1, count)
        log(f"{spec.key}: Poisson {rate:g} req/s, {count} requests")
        results, seconds = await poisson(client, prompts, rate, args.seed)
        out.append(summarize(f"Poisson {rate:g} req/s", results, seconds, {"request_rate": rate}))
        _progress(spec, out[-1])
    return out


async def run_prefix(
    client: Client, spec: ModelSpec, args: argparse.Namespace, max_model_len: Optional[int]
) -> ScenarioStats:
    """Requests sharing one long prefix, sent one at a time; hit rate from the server's counters."""
    prefix_len = spec.prefix_len
    if max_model_len is not None:
        prefix_len = min(prefix_len, max_model_len - PREFIX_SUFFIX_LEN - PREFIX_OUTPUT_LEN)
    prefix = random_tokens(args.seed + 7, prefix_len, spec.vocab_size)
    count = args.prefix_requests or spec.prefix_requests
    prompts = [prefix + random_tokens(args.seed + 100 + i, PREFIX_SUFFIX_LEN, spec.vocab_size) for i in range(count)]
    log(f"{spec.key}: prefix sharing, {count} requests of {prefix_len}+{PREFIX_SUFFIX_LEN} tokens, one at a time")
    before = await fetch_metric_sums(client.session, client.base_url, [HITS, QUERIES])
    results, seconds = await sequential(client, prompts, PREFIX_OUTPUT_LEN)
    after = await fetch_metric_sums(client.session, client.base_url, [HITS, QUERIES])
    hits, queries = after[HITS] - before[HITS], after[QUERIES] - before[QUERIES]
    warm = [r.ttft for r in results[1:] if r.ok and r.ttft is not None]
    extra = {
        "prefix_len": prefix_len,
        "suffix_len": PREFIX_SUFFIX_LEN,
        "output_len": PREFIX_OUTPUT_LEN,
        "prefix_cache_hits": int(hits),
        "prefix_cache_queries": int(queries),
        "hit_rate": hits / queries if queries else None,
        "ttft_first_s": results[0].ttft if results and results[0].ok else None,
        "ttft_rest_p50_s": sorted(warm)[(len(warm) - 1) // 2] if warm else None,
    }
    stats = summarize(f"prefix {prefix_len}+{PREFIX_SUFFIX_LEN}, seq", results, seconds, extra)
    _progress(spec, stats)
    log(f"{spec.key}: prefix cache {int(hits)}/{int(queries)} tokens hit")
    return stats


async def bench_model(spec: ModelSpec, args: argparse.Namespace) -> dict:
    """All scenarios against one server (started here unless ``--base-url`` names one)."""
    server = None
    if args.base_url is None:
        if spec.key == "qwen3":
            ensure_qwen3_shape_checkpoint(args.bench_dir / QWEN3_SHAPE_NAME)
        server = await start_server(spec, args.bench_dir, extra_args=tuple(args.serve_arg), engine_src=args.engine_src)
    base_url = server.base_url if server else args.base_url
    try:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT, connector=connector) as session:
            model_name, max_model_len = await served_model(session, base_url)
            output_len = args.output_len or spec.output_len
            client = Client(session, base_url, model_name, output_len)
            scenarios = await run_load(client, spec, args)
            if not args.skip_prefix:
                scenarios.append(await run_prefix(client, spec, args, max_model_len))
    finally:
        if server is not None:
            server.stop()
    return {
        "label": spec.label,
        "served_model": model_name,
        "serve_args": list(spec.serve_args),
        "prompt_len": spec.prompt_len,
        "output_len": output_len,
        "scenarios": [s.to_json() for s in scenarios],
    }


# ---- report --------------------------------------------------------------------------------

HEADER = ("model", "scenario", "reqs", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "notes")


def table_rows(key: str, result: dict) -> list[tuple[str, ...]]:
    rows = []
    for s in result["scenarios"]:
        notes = []
        if s["failed"]:
            notes.append(f"{s['failed']} failed")
        extra = s["extra"]
        if "hit_rate" in extra:
            rate = extra["hit_rate"]
            notes.append(f"hit rate {rate:.1%}" if rate is not None else "hit rate -")
            notes.append(f"cold TTFT {fmt_ms(extra['ttft_first_s'])}, warm p50 {fmt_ms(extra['ttft_rest_p50_s'])}")
        rows.append(
            (
                key,
                s["scenario"],
                str(s["requests"]),
                f"{s['request_throughput']:.2f}",
                f"{s['output_throughput']:.1f}",
                fmt_ms(s["ttft_p50"]),
                fmt_ms(s["ttft_p99"]),
                fmt_ms(s["tpot_p50"]),
                fmt_ms(s["tpot_p99"]),
                "; ".join(notes),
            )
        )
    return rows


def server_parser(description: str, models: str, bench_dir_help: str) -> argparse.ArgumentParser:
    """A parser with the options of every benchmark that serves the models itself: ``--models`` (default
    ``models``), ``--bench-dir``, ``--serve-arg`` and ``--engine-src``; the caller adds its own."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=models, help="comma-separated: stories, qwen3")
    parser.add_argument("--bench-dir", type=Path, default=BENCH_DIR, help=bench_dir_help)
    parser.add_argument(
        "--serve-arg", action="append", default=[], help="an extra `pagoda serve` flag (repeatable; '=' form)"
    )
    parser.add_argument(
        "--engine-src",
        type=Path,
        help="engine/src of another checkout to serve (default: this one's), for before/after",
    )
    return parser


def parse_server_args(
    parser: argparse.ArgumentParser,
    argv: Optional[list[str]],
    check: Callable[[argparse.Namespace], None] = lambda args: None,
) -> argparse.Namespace:
    """``argv`` parsed by a :func:`server_parser`: ``--models`` becomes a list of stories and/or qwen3, then
    ``check`` looks at the rest. Every ValueError on the way is a usage error."""
    args = parser.parse_args(argv)
    try:
        args.models = [m.strip() for m in args.models.split(",") if m.strip()]
        if set(args.models) - {"stories", "qwen3"} or not args.models:
            raise ValueError(f"--models takes stories and/or qwen3; got {args.models}")
        check(args)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = server_parser(__doc__, "stories,qwen3", "checkpoint, logs and JSON")
    parser.add_argument("--base-url", help="an already running server on loopback, e.g. http://127.0.0.1:8000")
    parser.add_argument("--num-requests", type=int, help="requests per load scenario (default: per model)")
    parser.add_argument("--output-len", type=int, help="output tokens per request (default: 64 stories, 16 qwen3)")
    parser.add_argument("--concurrency", default="1,8,32", help="closed-loop concurrencies, comma-separated")
    parser.add_argument("--request-rate", type=float, help="Poisson req/s (default: per model); 0 skips it")
    parser.add_argument("--prefix-requests", type=int, help="requests of the prefix workload (default: per model)")
    parser.add_argument("--skip-prefix", action="store_true", help="skip the prefix-sharing workload")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    return parse_server_args(parser, argv, _check_load_args)


def _check_load_args(args: argparse.Namespace) -> None:
    """ValueError for a load option out of range; ``--concurrency`` becomes a list of ints."""
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if any(c < 1 for c in args.concurrency):
        raise ValueError("--concurrency values must be at least 1")
    for name in ("num_requests", "output_len", "prefix_requests"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.request_rate is not None and args.request_rate < 0:
        raise ValueError("--request-rate must be positive (0 skips the Poisson scenario)")
    if args.base_url is not None:
        args.base_url = check_base_url(args.base_url)
        if len(args.models) != 1:
            raise ValueError("with --base-url, --models names the one model that server runs (its workload)")


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    args.bench_dir.mkdir(parents=True, exist_ok=True)
    specs = model_specs(args.bench_dir)
    facts = machine_facts()
    results = {}
    for key in args.models:
        results[key] = asyncio.run(bench_model(specs[key], args))
    facts["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    rows: list[tuple[str, ...]] = []
    for key, result in results.items():
        if rows:
            rows.append(("",) * len(HEADER))
        rows += table_rows(key, result)
    print(format_table(HEADER, rows))
    cpu = f"{facts['cpu']} x{facts['cpus']}, torch {facts['torch']}"
    print(f"machine: {cpu}; 1-min load avg {facts['load_avg_1m_start']} at start, {facts['load_avg_1m_end']} at end")
    out_path = args.bench_dir / "serve_bench.json"
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    out_path.write_text(json.dumps({"settings": settings, "machine": facts, "results": results}, indent=2))
    log(f"wrote {out_path}")
    return 0 if all(s["failed"] == 0 for r in results.values() for s in r["scenarios"]) else 1


if __name__ == "__main__":
    sys.exit(main())
