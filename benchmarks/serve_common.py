"""The serving benchmark's client side: streaming completion requests over HTTP, the closed- and
open-loop drivers, the server's Prometheus counters, and per-scenario statistics."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import aiohttp

from common import percentile

# Generation can take minutes on a slow CPU under load; only a silent connection is an error.
HTTP_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600)


@dataclass(slots=True)
class RequestResult:
    """One streamed request, timed on the client (seconds since it was sent)."""

    prompt_tokens: int
    ok: bool = False
    error: Optional[str] = None
    ttft: Optional[float] = None
    e2e: Optional[float] = None
    output_tokens: int = 0  # from the usage chunk
    cached_tokens: Optional[int] = None

    @property
    def tpot(self) -> Optional[float]:
        """Mean time per output token after the first."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass(slots=True)
class Client:
    """Sends streaming ``/v1/completions`` requests with token-id prompts to one server."""

    session: aiohttp.ClientSession
    base_url: str  # http://127.0.0.1:PORT (no /v1)
    model: str
    output_len: int

    async def complete(self, prompt: list[int], output_len: Optional[int] = None) -> RequestResult:
        """Greedy, EOS ignored, exactly ``output_len`` tokens; never raises for a failed request."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": output_len or self.output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        result = RequestResult(prompt_tokens=len(prompt))
        start = time.perf_counter()
        try:
            async with self.session.post(f"{self.base_url}/v1/completions", json=body) as response:
                if response.status != 200:
                    result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                    return result
                await _read_stream(response, result, start)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:  # ValueError: a malformed event
            result.error = f"{type(exc).__name__}: {exc}"
        return result


async def _read_stream(response: aiohttp.ClientResponse, result: RequestResult, start: float) -> None:
    """Parse ``data: {...}`` events until ``data: [DONE]``; fills ``result`` in place."""
    async for raw in response.content:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue  # blank separators, comments
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            result.e2e = time.perf_counter() - start
            result.ok = result.error is None and result.ttft is not None
            if result.ok and result.output_tokens == 0:
                result.ok, result.error = False, "the stream had no usage chunk"
            return
        chunk = json.loads(data)
        if "error" in chunk:
            result.error = str(chunk["error"].get("message", chunk["error"]))[:200]
        elif chunk.get("choices"):
            # Each chunk carries the token(s) of one engine step; its text may be empty while the
            # detokenizer waits for a complete character, so the chunk itself marks the first token.
            if result.ttft is None:
                result.ttft = time.perf_counter() - start
        elif chunk.get("usage"):
            usage = chunk["usage"]
            result.output_tokens = int(usage["completion_tokens"])
            details = usage.get("prompt_tokens_details") or {}
            result.cached_tokens = details.get("cached_tokens")
    result.error = result.error or "the stream ended without [DONE]"


# ---- drivers -----------------------------------------------------------------------------


async def closed_loop(client: Client, prompts: list[list[int]], concurrency: int) -> tuple[list[RequestResult], float]:
    """``concurrency`` workers, each sending the next prompt as soon as its previous one finished."""
    queue = list(reversed(prompts))
    results: list[RequestResult] = []

    async def worker() -> None:
        while queue:
            results.append(await client.complete(queue.pop()))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - start


async def poisson(
    client: Client, prompts: list[list[int]], rate: float, seed: int
) -> tuple[list[RequestResult], float]:
    """Open loop: requests sent at exponential intervals of mean ``1 / rate`` s, whatever is in flight."""
    rng = random.Random(seed)
    tasks = []
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        if i:
            await asyncio.sleep(rng.expovariate(rate))
        tasks.append(asyncio.create_task(client.complete(prompt)))
    results = list(await asyncio.gather(*tasks))
    return results, time.perf_counter() - start


async def sequential(client: Client, prompts: list[list[int]], output_len: int) -> tuple[list[RequestResult], float]:
    """One request at a time, in order (each later one can reuse what the earlier ones cached)."""
    results = []
    start = time.perf_counter()
    for prompt in prompts:
        results.append(await client.complete(prompt, output_len))
    return results, time.perf_counter() - start


# ---- server-side counters ------------------------------------------------------------------


async def fetch_metric_sums(session: aiohttp.ClientSession, base_url: str, names: list[str]) -> dict[str, float]:
    """Sum of every sample of each named metric (all label sets) in ``/metrics``."""
    async with session.get(f"{base_url}/metrics") as response:
        response.raise_for_status()
        text = await response.text()
    sums = {name: 0.0 for name in names}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        for name in names:
            if line.startswith(name + "{") or line.startswith(name + " "):
                sums[name] += float(line.rsplit(" ", 1)[1])
    return sums


# ---- statistics ----------------------------------------------------------------------------


@dataclass(slots=True)
class ScenarioStats:
    """What one scenario reports; times in seconds."""

    scenario: str
    requests: int
    failed: int
    seconds: float
    output_tokens: int
    request_throughput: float
    output_throughput: float
    ttft_p50: Optional[float]
    ttft_p99: Optional[float]
    tpot_p50: Optional[float]
    tpot_p99: Optional[float]
    ttft_mean: Optional[float]
    e2e_p50: Optional[float]
    extra: dict = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def summarize(
    scenario: str, results: list[RequestResult], seconds: float, extra: Optional[dict] = None
) -> ScenarioStats:
    """Throughput over the scenario's wall time (successful requests only) and latency percentiles."""
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    e2es = [r.e2e for r in ok if r.e2e is not None]
    output_tokens = sum(r.output_tokens for r in ok)

    def pct(values: list[float], q: float) -> Optional[float]:
        return percentile(values, q) if values else None

    return ScenarioStats(
        scenario=scenario,
        requests=len(results),
        failed=len(results) - len(ok),
        seconds=seconds,
        output_tokens=output_tokens,
        request_throughput=len(ok) / seconds,
        output_throughput=output_tokens / seconds,
        ttft_p50=pct(ttfts, 50),
        ttft_p99=pct(ttfts, 99),
        tpot_p50=pct(tpots, 50),
        tpot_p99=pct(tpots, 99),
        ttft_mean=sum(ttfts) / len(ttfts) if ttfts else None,
        e2e_p50=pct(e2es, 50),
        extra=extra or {},
        errors=sorted({r.error for r in results if r.error})[:5],
    )


def fmt_ms(value: Optional[float]) -> str:
    """Milliseconds below 10 s, seconds above; '-' when there is no value."""
    if value is None:
        return "-"
    return f"{value * 1e3:.1f} ms" if value < 10 else f"{value:.1f} s"
