"""Measuring a real `pagoda serve` under attack: /health latency while an attack runs, the server process's
threads, file descriptors and memory (read from /proc), and repeating a hostile request many times.

Typical use::

    before = read_resources(server.process.pid)
    with HealthProbe(server.port) as probe:
        repeat(1000, lambda: hostile(server), concurrency=8)
    assert probe.p99() < 0.1, probe.summary()
    assert_no_growth(before, settle(server.process.pid, before))
"""

from __future__ import annotations

import contextlib
import http.client
import json
import multiprocessing
import os
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

# Slack for assert_no_growth, and why each is what it is. A leak of one thread, fd or a few kB per request
# over 1,000 requests shows as 1,000 threads, 1,000 fds or several MB per kB, far above every slack here; the
# slack only absorbs what a healthy server legitimately grows by once, whatever the host:
# - threads: asyncio's default executor (to_thread, getaddrinfo) grows lazily to min(32, cpus + 4) workers,
#   and the tokenizer pool's thread mode adds its own; 8 covers a pool that first warms during the attack.
#   Threads that are part of a warmed-up pool are not a leak; 1,000 never joined threads are.
DEFAULT_THREAD_SLACK = 8
# - fds: each concurrent client connection is one socket fd while open; after the attack they are closed,
#   but uvicorn may still be closing a few keep-alive sockets when we look. 16 covers the concurrency the
#   helpers here use (<= 16); a per-request leak of 1,000 fds does not fit.
DEFAULT_FD_SLACK = 16
# - RSS: Python's allocator keeps freed arenas, and the first requests of a kind warm caches (compiled
#   regexes, tokenizer caches, the chat template). 64 MB is far below a 1,000 x 100 kB retained payload
#   (100 MB) or a retained KV or tensor per request, and far above allocator noise.
DEFAULT_RSS_SLACK_MB = 64.0


@dataclass(frozen=True)
class Resources:
    """What one process holds at one moment."""

    threads: int
    fds: int
    rss_mb: float

    def __str__(self) -> str:
        return f"threads={self.threads} fds={self.fds} rss={self.rss_mb:.1f}MB"


def read_resources(pid: int) -> Resources:
    """Threads (``Threads:`` in /proc/PID/status), open fds (entries of /proc/PID/fd) and RSS of ``pid``."""
    fields: dict[str, str] = {}
    with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    rss_kb = int(fields["VmRSS"].split()[0])
    return Resources(threads=int(fields["Threads"]), fds=len(os.listdir(f"/proc/{pid}/fd")), rss_mb=rss_kb / 1024)


def settle(
    pid: int,
    baseline: Resources,
    timeout: float = 5.0,
    threads: int = DEFAULT_THREAD_SLACK,
    fds: int = DEFAULT_FD_SLACK,
    rss_mb: float = DEFAULT_RSS_SLACK_MB,
) -> Resources:
    """``pid``'s resources once they are back within the slack of ``baseline``, or after ``timeout`` s.

    Closing sockets and finishing aborted requests takes the server a few event-loop turns after the client
    is done; reading once, at once, would blame the server for what it is still cleaning up."""
    deadline = time.monotonic() + timeout
    while True:
        now = read_resources(pid)
        if _within(baseline, now, threads, fds, rss_mb) or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def _within(before: Resources, after: Resources, threads: int, fds: int, rss_mb: float) -> bool:
    return (
        after.threads - before.threads <= threads
        and after.fds - before.fds <= fds
        and after.rss_mb - before.rss_mb <= rss_mb
    )


def assert_no_growth(
    before: Resources,
    after: Resources,
    threads: int = DEFAULT_THREAD_SLACK,
    fds: int = DEFAULT_FD_SLACK,
    rss_mb: float = DEFAULT_RSS_SLACK_MB,
) -> None:
    """``after`` holds at most the slack more threads, fds and MB of RSS than ``before`` (see the defaults)."""
    assert _within(before, after, threads, fds, rss_mb), (
        f"resources grew: before {before}, after {after} (slack threads={threads} fds={fds} rss={rss_mb}MB)"
    )


class HealthProbe:
    """A child process that sends GET /health every ``interval`` s on a fresh connection and records each latency.

    A process, not a thread: the attacking threads of the test hold its GIL, and a probe thread waiting for the
    GIL would measure the client, not the server. A fresh connection per probe is what a load balancer or kubelet
    does, and it also measures how quickly the server accepts, which an attack on the event loop delays first.
    The latencies are there once the probe is stopped (leaving the ``with`` block)."""

    def __init__(self, port: int, interval: float = 0.01, timeout: float = 5.0) -> None:
        self.port = port
        self.interval = interval
        self.timeout = timeout
        self.latencies: list[float] = []
        self.failures: list[str] = []
        context = multiprocessing.get_context("fork")  # (fork: nothing to import again, it starts in ms)
        self._stop = context.Event()
        self._results, sender = context.Pipe(duplex=False)
        self._process = context.Process(target=self._run, args=(sender,), name="health-probe", daemon=True)

    def __enter__(self) -> HealthProbe:
        self._process.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop probing and collect the latencies and failures."""
        self._stop.set()
        if self._results.poll(self.timeout + 5):
            self.latencies, self.failures = self._results.recv()
        self._process.join(self.timeout + 1)

    def _run(self, sender) -> None:  # in the child process
        latencies: list[float] = []
        failures: list[str] = []
        while not self._stop.is_set():
            start = time.perf_counter()
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
                conn.request("GET", "/health")
                response = conn.getresponse()
                response.read()
                conn.close()
                if response.status != 200:
                    failures.append(f"status {response.status}")
            except OSError as exc:
                failures.append(repr(exc))
            latencies.append(time.perf_counter() - start)
            self._stop.wait(self.interval)
        sender.send((latencies, failures))

    def percentile(self, q: float) -> float:
        """The ``q`` quantile (0..1) of the latencies so far, nearest-rank; inf when there are none."""
        if not self.latencies:
            return float("inf")
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered))) - 1))]

    def p99(self) -> float:
        return self.percentile(0.99)

    def summary(self) -> str:
        return (
            f"{len(self.latencies)} probes, p50={self.percentile(0.5) * 1000:.1f}ms "
            f"p99={self.p99() * 1000:.1f}ms max={max(self.latencies, default=0) * 1000:.1f}ms "
            f"failures={self.failures[:3]}"
        )

    def assert_healthy(self, p99_s: float = 0.1, min_probes: int = 5) -> None:
        """Every probe got a 200, there were enough of them to mean something, and p99 is under ``p99_s``."""
        assert not self.failures, self.summary()
        assert len(self.latencies) >= min_probes, self.summary()
        assert self.p99() < p99_s, self.summary()


def repeat(n: int, fn: Callable[[int], Any], concurrency: int = 1) -> list[Any]:
    """``fn(i)`` for i in range(n), ``concurrency`` at a time; the results in order. An exception in any call
    is raised here (after the others finish), so a failing attack is never silently counted as done."""
    if concurrency <= 1:
        return [fn(i) for i in range(n)]
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="attack") as pool:
        return list(pool.map(fn, range(n)))


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """(``fn()``, seconds it took)."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def assert_openai_error(code: int, payload: Any, status: Optional[int] = None, low: int = 400) -> None:
    """A 4xx (``status`` exactly, when given) whose body is an OpenAI error object."""
    if status is not None:
        assert code == status, (code, payload)
    assert low <= code < 500, (code, payload)
    assert isinstance(payload, dict) and isinstance(payload.get("error"), dict), payload
    assert {"message", "type", "param", "code"} <= set(payload["error"]), payload
    assert "Traceback" not in payload["error"]["message"]


def send_head(server: Any, head: bytes) -> tuple[int, dict, float]:
    """Send a raw request head to ``server`` (a server_helpers.Server); (status, JSON body, seconds) of the answer,
    read by its Content-Length (a refused head is answered before the server closes the connection)."""
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(head)  # (refused early, the answer is waiting all the same)
        reader = sock.makefile("rb")
        status = int(reader.readline().split()[1])
        length = 0
        while (line := reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.lower() == "content-length":
                length = int(value)
        payload = json.loads(reader.read(length))
    return status, payload, time.perf_counter() - start
