"""Compile threads that a stuck compile cannot block, and a grammar cache bounded in entries and bytes.

xgrammar compiles in native code that cannot be interrupted. A compile that runs past its caller's time limit is
*abandoned*: its future fails at once, its thread is no longer one of the pool's workers (a fresh one takes its
place, so the queue keeps moving) and exits when the native call returns, its result unused. Abandoned threads
still burn CPU until then, so there may be only ``max_abandoned`` of them: beyond that the pool is
``saturated`` and callers refuse new work (the server answers 429) instead of piling up threads.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any, Optional

# The nice value of an abandoned compile's thread (the lowest priority): it serves nobody any more, so it yields
# the CPU to the event loop, the engine's step and the compiles still wanted. Lowering priority needs no privilege.
ABANDONED_NICENESS = 19


class CompilePool:
    """``workers`` daemon threads running submitted calls; see the module docstring for abandoning."""

    def __init__(self, workers: int, max_abandoned: int, name: str = "grammar-compile") -> None:
        if workers < 1 or max_abandoned < 1:
            raise ValueError("workers and max_abandoned must be >= 1")
        self.max_abandoned = max_abandoned
        self._name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._workers: set[threading.Thread] = set()
        self._abandoned: set[threading.Thread] = set()
        self._running: dict[Future, threading.Thread] = {}
        self._closed = False
        self._serial = 0
        with self._lock:
            for _ in range(workers):
                self._start_worker()
        _live_pools.add(self)

    @property
    def num_abandoned(self) -> int:
        """Abandoned compiles whose native call has not returned yet."""
        return len(self._abandoned)

    @property
    def saturated(self) -> bool:
        """As many abandoned compiles as allowed are still running: new work should be refused."""
        return len(self._abandoned) >= self.max_abandoned

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """A future of ``fn(*args)``, run by the next free worker."""
        if self._closed:
            raise RuntimeError("the compile pool is shut down")
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def abandon(self, future: Future, error: BaseException) -> bool:
        """Cancel a queued ``future``, or fail a running one with ``error`` now and replace its worker.

        False if it had already finished (nothing to do)."""
        if future.cancel():
            return True
        with self._lock:
            thread = self._running.pop(future, None)
            if thread is None:  # finished (or finishing: its worker already took it off the running list)
                return False
            self._workers.discard(thread)
            self._abandoned.add(thread)
            with contextlib.suppress(AttributeError, OSError, TypeError):  # Linux: each thread has its own nice
                os.setpriority(os.PRIO_PROCESS, thread.native_id, ABANDONED_NICENESS)
            if not self._closed:
                self._start_worker()
        future.set_exception(error)
        return True

    def shutdown(self, wait: float = 0.0) -> None:
        """Cancel queued work and let idle workers exit, waiting up to ``wait`` seconds for each (running native
        calls cannot be stopped)."""
        with self._lock:
            self._closed = True
            workers = list(self._workers)
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        for _ in workers:
            self._jobs.put(None)
        for thread in workers if wait > 0 else ():
            thread.join(wait)

    def _start_worker(self) -> None:
        self._serial += 1
        thread = threading.Thread(target=self._work, name=f"{self._name}-{self._serial}", daemon=True)
        self._workers.add(thread)
        thread.start()

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            job = self._jobs.get()
            if job is None:
                with self._lock:
                    self._workers.discard(me)
                return
            future, fn, args = job
            with self._lock:
                if not future.set_running_or_notify_cancel():
                    continue
                self._running[future] = me
            error: Optional[BaseException] = None
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to the future, as an executor does
                result, error = None, exc
            with self._lock:
                if self._running.pop(future, None) is not me:  # abandoned meanwhile: a new worker took our place
                    self._abandoned.discard(me)
                    return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)
            del future, result, error  # a finished grammar belongs to the cache, not to an idle thread


_live_pools: weakref.WeakSet[CompilePool] = weakref.WeakSet()


@atexit.register
def _stop_idle_workers() -> None:
    # Worker threads still blocked on the queue while the interpreter finalizes make xgrammar's native side abort
    # the process ("terminate called without an active exception"): let them exit first.
    for pool in list(_live_pools):
        pool.shutdown(wait=1.0)


class GrammarCache:
    """Futures of grammars by key. Finished ones (least recently used first) are bounded: at most ``max_entries``
    of them and ``max_bytes`` of compiled grammar (``memory_size_bytes``; a failure counts 0). Those still
    compiling are kept apart, never evicted (the caller bounds them: ``num_pending``)."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("max_entries and max_bytes must be >= 1")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.lock = threading.RLock()  # RLock: a future that is already done runs its callback inline
        self._pending: dict[Hashable, Future] = {}
        self._done: OrderedDict[Hashable, Future] = OrderedDict()
        self._sizes: dict[Hashable, int] = {}
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._pending) + len(self._done)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def set_bounds(self, max_entries: int, max_bytes: int) -> None:
        """New bounds, applied at once (least recently used entries go first)."""
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("max_entries and max_bytes must be >= 1")
        with self.lock:
            self.max_entries, self.max_bytes = max_entries, max_bytes
            self._evict()

    def get(self, key: Hashable) -> Optional[Future]:
        with self.lock:
            future = self._pending.get(key)
            if future is None:
                future = self._done.get(key)
                if future is not None:
                    self._done.move_to_end(key)
            return future

    def put(self, key: Hashable, future: Future) -> None:
        with self.lock:
            self._pending[key] = future
            future.add_done_callback(lambda f: self._finished(key, f))

    def pop(self, key: Hashable) -> None:
        with self.lock:
            self._pending.pop(key, None)
            self._done.pop(key, None)
            self.num_bytes -= self._sizes.pop(key, 0)

    def _finished(self, key: Hashable, future: Future) -> None:
        with self.lock:
            if self._pending.get(key) is not future:
                return  # dropped while compiling
            del self._pending[key]
            size = 0
            if not future.cancelled() and future.exception() is None:
                size = int(getattr(future.result(), "memory_size_bytes", 0))
            self._done[key] = future
            self._sizes[key] = size
            self.num_bytes += size
            self._evict()

    def _evict(self) -> None:
        while self._done and (len(self._done) > self.max_entries or self.num_bytes > self.max_bytes):
            self.pop(next(iter(self._done)))
