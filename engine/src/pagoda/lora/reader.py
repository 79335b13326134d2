"""Adapter files are read off the engine thread, with a deadline.

A read can block for as long as the file system wants: a hung NFS or FUSE mount, a FIFO where a safetensors file
should be. Python cannot interrupt a thread stuck in ``read()``, so each read runs in its own daemon thread and
callers wait for it with a timeout; a read that outlives its deadline is abandoned (it finishes, or not, on its
own) and its adapter is reported as unreadable. The reads of one folder never overlap, so a mount that hangs holds
at most one thread per adapter folder, and at most :data:`MAX_READS_IN_FLIGHT` threads in all.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Generic, Optional, TypeVar

from pagoda.lora.adapter import LoRAAdapterError

T = TypeVar("T")

# Reads stuck at once before new ones are refused: each holds a thread that cannot be stopped.
MAX_READS_IN_FLIGHT = 16


class AdapterReadTimeout(LoRAAdapterError):
    """An adapter's files could not be read in time (or an earlier read of them is still stuck): the adapter is
    unavailable for now, not invalid; servers answer 503."""


@dataclass(slots=True)
class Read(Generic[T]):
    """One read in flight: its result arrives in ``future``."""

    key: str
    started: float  # time.monotonic()
    future: Future = field(default_factory=Future)
    reported: bool = False  # its overdue state was logged (once per read, not once per engine step)

    def overdue(self, timeout: float, now: Optional[float] = None) -> bool:
        return not self.future.done() and (time.monotonic() if now is None else now) - self.started > timeout


class AdapterReader:
    """Runs adapter reads in daemon threads; ``timeout`` (seconds) is how long a caller waits for one."""

    def __init__(self, timeout: float) -> None:
        assert timeout > 0
        self.timeout = timeout
        self._lock = threading.Lock()
        self._in_flight: dict[str, Read] = {}  # key (the adapter folder) -> its read

    def read(self, key: str, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` in a reader thread, waited for up to ``timeout``: AdapterReadTimeout when it takes longer (the
        thread is left to finish alone), or when an earlier read of ``key`` is still running."""
        pending = self.start(key, what, fn)
        try:
            return pending.future.result(timeout=max(0.0, pending.started + self.timeout - time.monotonic()))
        except TimeoutError:
            raise AdapterReadTimeout(self.timeout_message(what, pending)) from None

    def start(self, key: str, what: str, fn: Callable[[], T]) -> Read[T]:
        """Start ``fn()`` in a reader thread and return its Read at once; the Read already running for ``key``, if
        any (the same files are never read twice at once). AdapterReadTimeout when too many reads are stuck."""
        with self._lock:
            running = self._in_flight.get(key)
            if running is not None:
                return running
            if len(self._in_flight) >= MAX_READS_IN_FLIGHT:
                raise AdapterReadTimeout(
                    f"{what}: {len(self._in_flight)} adapter reads are still running (a file system not answering?); "
                    "try again later"
                )
            pending: Read[T] = Read(key, time.monotonic())
            self._in_flight[key] = pending
        thread = threading.Thread(target=self._run, args=(pending, fn), name="lora-reader", daemon=True)
        thread.start()
        return pending

    def timeout_message(self, what: str, pending: Read) -> str:
        seconds = time.monotonic() - pending.started
        return (
            f"{what}: reading its files has not finished after {seconds:.1f} s (--lora-read-timeout "
            f"{self.timeout:g}); is its file system answering?"
        )

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def _run(self, pending: Read, fn: Callable[[], object]) -> None:
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits: the reader thread must not die loudly
            pending.future.set_exception(exc)
        else:
            pending.future.set_result(result)
        finally:
            with self._lock:
                if self._in_flight.get(pending.key) is pending:
                    del self._in_flight[pending.key]
