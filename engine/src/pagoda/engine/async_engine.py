"""Drive an LLMEngine from asyncio: the model runs in its own thread, never on the event loop.

Callers on the event loop submit commands (add, abort) into a thread-safe inbox; the engine
thread applies them between steps, runs ``step()``, and hands each output to the request's
``asyncio.Queue`` with ``call_soon_threadsafe``. So adding a request never waits for a forward
pass, and a request whose consumer goes away (a client disconnect cancels the generator) is
aborted at the next step boundary, freeing its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Optional, Union

from pagoda.engine.llm_engine import LLMEngine
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped because of an internal error; no request can make progress."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: Union[str, list[int]]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    admitted: asyncio.Future


@dataclass(slots=True)
class _Abort:
    request_id: str


class AsyncLLMEngine:
    """Thread-backed asyncio front of :class:`LLMEngine` (one engine thread per instance)."""

    def __init__(self, engine: LLMEngine, on_step: Optional[Callable[[LLMEngine, int], None]] = None) -> None:
        """``on_step(engine, num_batched_tokens)`` runs on the engine thread after every step, and with 0
        tokens after adds/aborts change the queues without a step (metrics); it must be quick."""
        self.engine = engine
        self._on_step = on_step
        self._inbox: queue.SimpleQueue[Union[_Add, _Abort, None]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = threading.Event()
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="pagoda-engine", daemon=True)
        self._thread.start()

    @property
    def num_waiting(self) -> int:
        """Requests queued for the engine: not yet scheduled, or not yet taken from the inbox."""
        return self.engine.scheduler.num_waiting + self._inbox.qsize()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    async def generate(
        self, request_id: str, prompt: Union[str, list[int]], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes; ValueError if it is not admitted.

        Leaving the loop early (or being cancelled) aborts the request.
        """
        self._check_alive()
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        admitted = loop.create_future()
        self._inbox.put(_Add(request_id, prompt, params, loop, outputs, admitted))
        finished = False
        try:
            await admitted  # raises the engine's ValueError for a bad request
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe; takes effect before the engine's next step)."""
        self._inbox.put(_Abort(request_id))

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """Stop the engine thread after its current step; unfinished requests get EngineDeadError."""
        self._stopping.set()
        self._inbox.put(None)
        self._thread.join(timeout)

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped after an internal error: {self.error!r}")
        if self._stopping.is_set():
            raise EngineDeadError("the engine is shut down")

    # ---- engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                # Block for work only when idle; otherwise just drain what arrived.
                if self._apply_commands(block=not self.engine.has_unfinished_requests()) and self._on_step:
                    self._on_step(self.engine, 0)
                if self._stopping.is_set() or not self.engine.has_unfinished_requests():
                    continue
                self._deliver_step(self.engine.step())
                if self._on_step is not None:
                    self._on_step(self.engine, self.engine.last_step_num_tokens)
        except BaseException as exc:  # an engine bug: fail every request loudly, never hang them
            logger.exception("engine thread failed")
            self.error = exc
        self._fail_all(EngineDeadError("the engine stopped" + (f": {self.error!r}" if self.error else "")))

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued adds and aborts; returns whether there were any."""
        command = self._inbox.get() if block else _get_nowait(self._inbox)
        applied = command is not None
        while command is not None:
            if isinstance(command, _Add):
                self._add(command)
            else:
                self._streams.pop(command.request_id, None)
                self.engine.abort_request(command.request_id)
            command = _get_nowait(self._inbox)
        return applied

    def _add(self, command: _Add) -> None:
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params)
        except ValueError as exc:
            command.loop.call_soon_threadsafe(_set_exception, command.admitted, exc)
            return
        self._streams[command.request_id] = (command.loop, command.outputs)
        command.loop.call_soon_threadsafe(_set_result, command.admitted)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs over with one wake-up per event loop, not one per request: at 32
        running requests the loop was woken 32 times per step, taking CPU from the next step."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for output in outputs:
            stream = self._take_stream(output.request_id, last=output.finished)
            if stream is not None:
                loop, request_queue = stream
                batches.setdefault(loop, []).append((request_queue, output))
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _take_stream(self, request_id: str, last: bool) -> Optional[tuple[asyncio.AbstractEventLoop, asyncio.Queue]]:
        """The request's (loop, queue); forgotten when this is its last item."""
        return self._streams.pop(request_id, None) if last else self._streams.get(request_id)

    def _deliver(self, request_id: str, item, last: bool) -> None:
        stream = self._take_stream(request_id, last)
        if stream is not None:
            loop, outputs = stream
            loop.call_soon_threadsafe(outputs.put_nowait, item)

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self._streams):
            self._deliver(request_id, error, last=True)
        while (command := _get_nowait(self._inbox)) is not None:
            if isinstance(command, _Add):
                command.loop.call_soon_threadsafe(_set_exception, command.admitted, error)


def _get_nowait(inbox: queue.SimpleQueue):
    try:
        return inbox.get_nowait()
    except queue.Empty:
        return None


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for outputs, item in items:
        outputs.put_nowait(item)


def _set_result(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
