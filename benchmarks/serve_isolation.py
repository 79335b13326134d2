"""How much one client's big prompts stall everyone else's streams.

For each model it starts a real `pagoda serve` (as ``serve_bench.py`` does), runs ``--streams`` greedy
streaming completions, and measures each stream's gaps between tokens twice: alone, then while
``--big-clients`` other clients keep sending ``--big-prompt-bytes`` text prompts (each refused: too many
characters, or too many tokens once tokenized). Prints the largest gap, the gap percentiles and the
streams' throughput for both phases. ``--serve-arg`` passes flags (``--max-prompt-chars=2000000`` makes
the big prompts go through the tokenizer instead of being refused unread); ``--engine-src`` serves another
checkout's engine for a before/after in one session.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    QWEN3_SHAPE_NAME,
    REPO_ROOT,
    ensure_qwen3_shape_checkpoint,
    format_table,
    log,
    machine_facts,
    percentile,
)
from serve_bench import model_specs, parse_server_args, server_parser, start_server  # noqa: E402
from serve_common import HTTP_TIMEOUT  # noqa: E402


@dataclass(slots=True)
class Phase:
    """One phase: every stream's token arrival times, and what the big-prompt clients got."""

    name: str
    arrivals: list[list[float]] = field(default_factory=list)
    big_status: Counter = field(default_factory=Counter)
    big_latency: list[float] = field(default_factory=list)
    seconds: float = 0.0

    def row(self) -> tuple[str, ...]:
        gaps = [b - a for times in self.arrivals for a, b in zip(times, times[1:])]
        tokens = sum(len(times) for times in self.arrivals)
        big = ", ".join(f"{count} x {status}" for status, count in sorted(self.big_status.items(), key=str)) or "-"
        big_p50 = f"{percentile(self.big_latency, 50) * 1000:.0f} ms" if self.big_latency else "-"
        return (
            self.name,
            f"{tokens / self.seconds:.1f}",
            f"{percentile(gaps, 50) * 1000:.0f} ms",
            f"{percentile(gaps, 99) * 1000:.0f} ms",
            f"{max(gaps) * 1000:.0f} ms",
            big,
            big_p50,
        )


async def stream(session: aiohttp.ClientSession, url: str, model: str, output_len: int, seed: int) -> list[float]:
    """One greedy streamed completion; the arrival time of every token event."""
    body = {
        "model": model,
        "prompt": [1 + (seed * 7919 + i * 104729) % 400 for i in range(32)],
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    arrivals: list[float] = []
    async with session.post(f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for raw in response.content:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                return arrivals
            if line.startswith("data:") and json.loads(line[5:]).get("choices"):
                arrivals.append(time.perf_counter())
    raise RuntimeError("the stream ended without [DONE]")


async def big_client(session: aiohttp.ClientSession, url: str, payload: bytes, stop, interval: float, out: dict):
    """Send the big prompt again and again (every ``interval`` s, or back to back) until ``stop`` is set."""
    headers = {"Content-Type": "application/json"}
    path = json.loads(payload).get("path", "/v1/completions")
    while not stop.is_set():
        start = time.perf_counter()
        try:
            async with session.post(f"{url}{path}", data=payload, headers=headers) as response:
                await response.read()
                out["status"][str(response.status)] += 1
        except aiohttp.ClientError as exc:
            out["status"][type(exc).__name__] += 1
        out["latency"].append(time.perf_counter() - start)
        if interval > 0:
            await asyncio.sleep(max(interval - (time.perf_counter() - start), 0.0))


def _big_body(model: str, args: argparse.Namespace) -> dict:
    """A completion with one big text prompt, or a chat of ``--big-chat-messages`` messages of the same size
    in all (rendered by the chat template: Jinja, in Python, before any tokenizing)."""
    text = "Once upon a time " * (args.big_prompt_bytes // 17)
    if not args.big_chat_messages:
        return {"model": model, "prompt": text}
    size = len(text) // args.big_chat_messages
    messages = [{"role": "user", "content": text[i * size : (i + 1) * size]} for i in range(args.big_chat_messages)]
    return {"model": model, "messages": messages, "path": "/v1/chat/completions"}


def attackers(url: str, payload: bytes, clients: int, interval: float, stop, results) -> None:
    """The big-prompt clients, in a process of their own: sharing the measuring client's event loop (or its
    GIL), they would delay the timestamps of the streams they are meant to disturb."""

    async def main() -> dict:
        out = {"status": Counter(), "latency": []}
        async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as session:
            await asyncio.gather(*(big_client(session, url, payload, stop, interval, out) for _ in range(clients)))
        return out

    results.put(asyncio.run(main()))


async def run_phase(name: str, url: str, model: str, args: argparse.Namespace, attacked: bool) -> Phase:
    phase = Phase(name)
    context = multiprocessing.get_context("spawn")
    stop, results = context.Event(), context.Queue()
    attacker = None
    if attacked:
        payload = json.dumps(_big_body(model, args)).encode()
        attacker = context.Process(
            target=attackers, args=(url, payload, args.big_clients, args.big_interval, stop, results)
        )
        attacker.start()
        await asyncio.sleep(1.0)  # the attack is under way before the streams start
    async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT, connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        phase.arrivals = list(
            await asyncio.gather(*(stream(session, url, model, args.output_len, i) for i in range(args.streams)))
        )
        phase.seconds = time.perf_counter() - start
    if attacker is not None:
        stop.set()
        out = await asyncio.to_thread(results.get)
        attacker.join()
        phase.big_status, phase.big_latency = out["status"], out["latency"]
    log(f"{name}: {phase.row()}")
    return phase


async def bench_model(key: str, args: argparse.Namespace) -> list[Phase]:
    spec = model_specs(args.bench_dir)[key]
    if key == "qwen3":
        ensure_qwen3_shape_checkpoint(args.bench_dir / QWEN3_SHAPE_NAME)
    server = await start_server(
        spec, args.bench_dir, extra_args=tuple(args.serve_arg), engine_src=args.engine_src, name="serve_isolation"
    )
    try:
        async with aiohttp.ClientSession() as session, session.get(f"{server.base_url}/v1/models") as response:
            model = (await response.json())["data"][0]["id"]
        await run_phase("warm-up", server.base_url, model, argparse.Namespace(**{**vars(args), "streams": 2}), False)
        quiet = await run_phase(f"{key}: streams alone", server.base_url, model, args, attacked=False)
        size = f"{args.big_prompt_bytes / 1e6:g} MB"
        if args.big_chat_messages:
            size += f" {args.big_chat_messages}-message chat"
        every = f"every {args.big_interval:g} s" if args.big_interval > 0 else "back to back"
        attacked = await run_phase(
            f"{key}: + {args.big_clients} clients, {size} prompts {every}", server.base_url, model, args, attacked=True
        )
    finally:
        server.stop()
    return [quiet, attacked]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = server_parser(__doc__, "stories", "checkpoint and logs")
    streams = parser.add_argument_group("the measured streams")
    streams.add_argument("--streams", type=int, default=8, help="concurrent streamed completions")
    streams.add_argument("--output-len", type=int, default=200, help="tokens per stream")
    big = parser.add_argument_group("the clients sending big prompts meanwhile")
    big.add_argument("--big-clients", type=int, default=2, help="how many")
    big.add_argument("--big-prompt-bytes", type=int, default=1_000_000, help="size of each big prompt")
    big.add_argument(
        "--big-chat-messages", type=int, default=0, help="send chats of this many messages instead (0: prompts)"
    )
    big.add_argument(
        "--big-interval", type=float, default=0.0, help="seconds between one client's big prompts (0: back to back)"
    )
    return parse_server_args(parser, argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    args.bench_dir.mkdir(parents=True, exist_ok=True)
    facts = machine_facts()
    rows = []
    for key in args.models:
        rows += [phase.row() for phase in asyncio.run(bench_model(key, args))]
    header = ("phase", "stream tok/s", "gap p50", "gap p99", "max gap", "big prompts answered", "big p50")
    print(format_table(header, rows))
    engine = args.engine_src or REPO_ROOT / "engine" / "src"
    print(f"engine: {engine}; serve args: {' '.join(args.serve_arg) or '-'}")
    print(f"machine: {facts['cpu']} x{facts['cpus']}, torch {facts['torch']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
