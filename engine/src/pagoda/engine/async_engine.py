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
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Optional, Union

from pagoda.engine.llm_engine import LLMEngine
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped because of an internal error; no request can make progress."""


class RequestFailedError(RuntimeError):
    """This request alone failed inside the engine (the engine carries on). The message is safe to show a
    client; the details are in the server log."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: Union[str, list[int]]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    admitted: asyncio.Future
    lora_name: Optional[str] = None
    priority: int = 0


@dataclass(slots=True)
class _Abort:
    request_id: str


# How long after a worker's death an engine thread that has not stopped is declared dead by the watchdog.
_DEATH_GRACE_S = 5.0


@dataclass
class _Fatal:
    """The engine can make no progress (a tensor-parallel worker died): stop the loop with ``error``."""

    error: BaseException


class RequestStream:
    """The outputs of one submitted request, iterated once (see :meth:`AsyncLLMEngine.submit`).

    Until its last output has been taken, closing the stream or garbage-collecting it aborts the
    request, so a response that is never sent (the client went away before the body started) does
    not leave the request running.
    """

    __slots__ = ("request_id", "_outputs", "_admitted", "_abort", "__weakref__")

    def __init__(
        self, engine: AsyncLLMEngine, request_id: str, outputs: asyncio.Queue, admitted: asyncio.Future
    ) -> None:
        self.request_id = request_id
        self._outputs = outputs
        self._admitted = admitted
        self._abort = weakref.finalize(self, engine.abort, request_id)
        self._abort.atexit = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def admitted(self) -> None:
        """Return once the engine has taken the request; raise ValueError if it refused it as invalid,
        :class:`RequestFailedError` or :class:`EngineDeadError` if it could not take it."""
        await asyncio.shield(self._admitted)

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            await self._admitted  # raises the engine's ValueError for a bad request
            while True:
                item = await self._outputs.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    self._abort.detach()
                yield item
                if item.finished:
                    return
        finally:
            self.close()

    def close(self) -> None:
        """Abort the request unless it has finished (idempotent, thread-safe)."""
        self._abort()


class AsyncLLMEngine:
    """Thread-backed asyncio front of :class:`LLMEngine` (one engine thread per instance)."""

    def __init__(
        self,
        engine: LLMEngine,
        on_step: Optional[Callable[[LLMEngine, int], None]] = None,
        on_dead: Optional[Callable[[BaseException], None]] = None,
    ) -> None:
        """``on_step(engine, num_batched_tokens)`` runs on the engine thread after every step, and with 0
        tokens after adds/aborts change the queues without a step (metrics); it must be quick.
        ``on_dead(error)`` runs on the engine thread once, if the loop stops on an internal error (not on
        :meth:`shutdown`), after every unfinished request has been failed."""
        self.engine = engine
        self._on_step = on_step
        self._on_dead = on_dead
        self._inbox: queue.SimpleQueue[Union[_Add, _Abort, _Fatal, None]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # Adds submitted and not yet in the scheduler (or rejected by it), and the sequences they stand
        # for. The engine thread lowers them only after add_request returns, so num_waiting may briefly
        # count a request twice but never misses one: the admission limit errs on the safe side.
        self._num_pending_adds = 0
        self._num_pending_seqs = 0
        self._pending_lock = threading.Lock()
        self._stopping = threading.Event()
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="pagoda-engine", daemon=True)
        self._thread.start()
        engine.add_death_listener(self._worker_died)

    @property
    def num_waiting(self) -> int:
        """Requests queued for the engine: not yet scheduled, or not yet taken from the inbox."""
        return self.engine.scheduler.num_waiting + self._num_pending_adds

    @property
    def num_waiting_seqs(self) -> int:
        """Sequences queued for the engine (an ``n > 1`` request counts ``n``), as :attr:`num_waiting`."""
        return self.engine.scheduler.num_waiting_seqs + self._num_pending_seqs

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(
        self,
        request_id: str,
        prompt: Union[str, list[int]],
        params: SamplingParams,
        lora_name: Optional[str] = None,
        priority: int = 0,
    ) -> RequestStream:
        """Queue a request now and return the stream of its outputs (call on the event loop).

        ``priority``: see :meth:`LLMEngine.add_request` (non-zero needs ``--scheduling-policy priority``).

        The request counts in :attr:`num_waiting` from this call on, so an admission check followed
        by ``submit`` with no ``await`` in between cannot be overtaken by another handler. A bad
        request (ValueError) surfaces when the stream is iterated. Closing the stream, or dropping
        it, before its last output aborts the request.
        """
        self._check_alive()
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        admitted = loop.create_future()
        with self._pending_lock:
            self._num_pending_adds += 1
            self._num_pending_seqs += params.n
        self._inbox.put(_Add(request_id, prompt, params, loop, outputs, admitted, lora_name, priority))
        return RequestStream(self, request_id, outputs, admitted)

    async def generate(
        self, request_id: str, prompt: Union[str, list[int]], params: SamplingParams, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes; ValueError if it is not admitted.

        The request is queued when iteration starts (use :meth:`submit` to queue it at once).
        Leaving the loop early (or being cancelled) aborts the request.
        """
        stream = self.submit(request_id, prompt, params, priority=priority)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe; takes effect before the engine's next step)."""
        self._inbox.put(_Abort(request_id))

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """Stop the engine thread after its current step (and the tensor-parallel workers); unfinished requests
        get EngineDeadError."""
        self._stopping.set()
        self._inbox.put(None)
        self._thread.join(timeout)
        self.engine.shutdown()

    def _worker_died(self, error: BaseException) -> None:
        """Watchdog thread: a tensor-parallel worker died. An idle loop wakes up and stops; a busy one stops when its
        collective fails. One blocked where no error can reach it (waiting on a GPU for an NCCL collective that
        will never complete) is declared dead from here after a grace period, so requests still get their error
        and the server still exits."""
        self._inbox.put(_Fatal(error))
        timer = threading.Timer(_DEATH_GRACE_S, self._declare_dead, (error,))
        timer.daemon = True
        timer.start()

    def _declare_dead(self, error: BaseException) -> None:
        if not self._thread.is_alive() or self.error is not None or self._stopping.is_set():
            return
        logger.critical("the engine thread is stuck %.0f s after a worker died; the engine is dead", _DEATH_GRACE_S)
        self.error = error
        self._fail_all(EngineDeadError(f"the engine stopped: {error!r}"))  # the engine thread is blocked: no race
        if self._on_dead is not None:
            self._on_dead(error)

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
        except BaseException as exc:  # an engine bug or a device fault: fail every request loudly, never hang them
            logger.critical("the engine loop failed; no request can make progress", exc_info=exc)
            self.error = exc
        self._fail_all(EngineDeadError("the engine stopped" + (f": {self.error!r}" if self.error else "")))
        if self.error is not None and self._on_dead is not None:
            self._on_dead(self.error)

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued adds and aborts; returns whether there were any."""
        command = self._inbox.get() if block else _get_nowait(self._inbox)
        applied = command is not None
        while command is not None:
            if isinstance(command, _Fatal):
                raise command.error
            if isinstance(command, _Add):
                self._add(command)
            else:
                self._streams.pop(command.request_id, None)
                self.engine.abort_request(command.request_id)
            command = _get_nowait(self._inbox)
        return applied

    def _add(self, command: _Add) -> None:
        try:
            self.engine.add_request(
                command.request_id,
                command.prompt,
                command.params,
                lora_name=command.lora_name,
                priority=command.priority,
            )
        except ValueError as exc:  # the request is invalid: the caller answers 400
            _call_soon(command.loop, _set_exception, command.admitted, exc)
            return
        except Exception:  # this request alone could not be added; add_request registers nothing on failure
            logger.exception("request_id=%s: adding it to the engine failed", command.request_id)
            error = RequestFailedError("the request could not be added to the engine")
            _call_soon(command.loop, _set_exception, command.admitted, error)
            return
        finally:
            with self._pending_lock:
                self._num_pending_adds -= 1
                self._num_pending_seqs -= command.params.n
        if _call_soon(command.loop, _set_result, command.admitted):
            self._streams[command.request_id] = (command.loop, command.outputs)
        else:  # its event loop closed meanwhile: nobody will read it
            self.engine.abort_request(command.request_id)

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
            if not _call_soon(loop, _put_all, items):  # that event loop closed: nobody will read them
                for _, output in items:
                    self._streams.pop(output.request_id, None)
                    self.engine.abort_request(output.request_id)

    def _take_stream(self, request_id: str, last: bool) -> Optional[tuple[asyncio.AbstractEventLoop, asyncio.Queue]]:
        """The request's (loop, queue); forgotten when this is its last item."""
        return self._streams.pop(request_id, None) if last else self._streams.get(request_id)

    def _deliver(self, request_id: str, item, last: bool) -> None:
        stream = self._take_stream(request_id, last)
        if stream is not None:
            loop, outputs = stream
            _call_soon(loop, outputs.put_nowait, item)

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self._streams):
            self._deliver(request_id, error, last=True)
        while (command := _get_nowait(self._inbox)) is not None:
            if isinstance(command, _Add):
                with self._pending_lock:
                    self._num_pending_adds -= 1
                    self._num_pending_seqs -= command.params.n
                _call_soon(command.loop, _set_exception, command.admitted, error)


def _call_soon(loop: asyncio.AbstractEventLoop, callback, *args) -> bool:
    """``loop.call_soon_threadsafe``; False instead of an error if the loop has closed."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # "Event loop is closed"
        return False
    return True


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
