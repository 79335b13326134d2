"""Publishing the KV cache events of each engine step over ZeroMQ, framed as vLLM's ``ZmqEventPublisher`` frames them.

* PUB socket on ``endpoint``: one multipart message per step that had events,
  ``[topic (UTF-8), seq (8-byte big-endian unsigned, from 0), MessagePack KVEventBatch]``.
* ROUTER socket on ``replay_endpoint`` (optional): a client sends ``[b"", start_seq (8 bytes big-endian)]`` (a REQ
  or a DEALER with the empty delimiter frame) and gets ``[b"", seq, payload]`` for every batch still in the ring
  buffer (the last ``buffer_steps``) with ``seq >= start_seq``, then ``[b"", (-1 as 8 signed bytes), b""]``.

The engine thread only appends to a bounded queue (the oldest batch is dropped, counted and logged when it is full);
one background thread encodes, sends and serves replays, so a slow or absent subscriber never holds up a step.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from typing import Any, Optional

import zmq

from pagoda.core.kv_events import KVEventBatch, KVEventCollector
from pagoda.kv_events_config import FLAG, KVEventsConfig, parse_kv_events_config

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker
_POLL_S = 0.02  # how long the thread waits for a batch before looking at the replay socket again
_CLOSE_TIMEOUT_S = 2.0
_STOP = object()


def _binds(endpoint: str) -> bool:
    # vLLM's convention: a wildcard address (or a local transport) is bound, a concrete one is connected to
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqKVEventPublisher:
    """PUB + optional replay ROUTER, fed from any thread through :meth:`publish`, closed by :meth:`close`."""

    def __init__(self, config: KVEventsConfig, context: Optional[zmq.Context] = None) -> None:
        self.config = config
        self.dropped = 0  # batches dropped because the queue was full
        self.published = 0
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode("utf-8")
        self._seq = 0
        self._closed = False
        self._context = context or zmq.Context()
        self._own_context = context is None
        # Sockets are made (and bound) here, so that a taken port fails the engine's start; from then on only the
        # publisher thread touches them (starting the thread hands them over).
        self._pub = self._context.socket(zmq.PUB)
        self._replay: Optional[zmq.Socket] = None
        try:
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.set_hwm(config.hwm)
            self._attach(self._pub, "endpoint", config.endpoint, _binds(config.endpoint))
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._attach(self._replay, "replay_endpoint", config.replay_endpoint, True)
        except BaseException:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    @staticmethod
    def _attach(socket: zmq.Socket, field: str, endpoint: str, bind: bool) -> None:
        try:
            socket.bind(endpoint) if bind else socket.connect(endpoint)
        except zmq.ZMQError as exc:
            raise ValueError(
                f"{FLAG}: field {field!r}: cannot {'bind' if bind else 'connect'} {endpoint}: {exc}"
            ) from None

    @property
    def closed(self) -> bool:
        return self._closed

    def publish(self, batch: KVEventBatch) -> None:
        """Queue one batch for sending; never blocks (a full queue loses its oldest batch; once closed, a step
        still finishing while the engine shuts down loses its batch)."""
        if self._closed:
            self.dropped += 1
            return
        self._put(batch)

    def _put(self, item: Any) -> None:
        while True:
            try:
                self._queue.put_nowait(item)
                return
            except queue.Full:
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    continue
                self.dropped += 1
                if self.dropped == 1 or self.dropped % 1000 == 0:
                    logger.warning(
                        "KV event queue full (max_queue_size %d): %d batches dropped so far",
                        self.config.max_queue_size,
                        self.dropped,
                    )

    def close(self) -> None:
        """Send what is queued (for up to two seconds), stop the thread and close the sockets (linger 0)."""
        if self._closed:
            return
        self._closed = True
        self._put(_STOP)
        self._thread.join(_CLOSE_TIMEOUT_S)
        if self._thread.is_alive():  # never seen: sends do not block; leave the sockets to the daemon thread
            logger.warning("the KV event publisher thread did not stop within %.0f s", _CLOSE_TIMEOUT_S)
            return
        self._close_sockets()

    def _close_sockets(self) -> None:
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)
        if self._own_context:
            self._context.term()

    # ---- the publisher thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                item = None
            if self._replay is not None:
                self._serve_replays()
            if item is _STOP:
                return
            if item is not None:
                try:
                    self._send(item)
                except Exception:  # one bad batch must not stop the stream
                    logger.exception("could not publish a KV event batch")

    def _send(self, batch: KVEventBatch) -> None:
        payload = batch.encode()
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.published += 1

    def _serve_replays(self) -> None:
        assert self._replay is not None
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            # [identity, b"", start_seq] from REQ / DEALER-with-delimiter; [identity, start_seq] from a bare DEALER
            if len(frames) == 3 and frames[1] == b"":
                envelope, start = [frames[0], b""], frames[2]
            elif len(frames) == 2:
                envelope, start = [frames[0]], frames[1]
            else:
                logger.warning("ignoring a KV event replay request of %d frames", len(frames))
                continue
            if len(start) != 8:
                logger.warning("ignoring a KV event replay request whose start seq is %d bytes, not 8", len(start))
                continue
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    self._replay.send_multipart([*envelope, seq.to_bytes(8, "big"), payload])
            self._replay.send_multipart([*envelope, END_SEQ, b""])


class KVEventStream:
    """What the engine holds while KV events are on: the collector the KV cache appends to, and the publisher."""

    def __init__(self, config: KVEventsConfig, block_size: int, context: Optional[zmq.Context] = None) -> None:
        self.collector = KVEventCollector(block_size)
        self.publisher = ZmqKVEventPublisher(config, context)
        replay = f", replay on {config.replay_endpoint}" if config.replay_endpoint else ""
        logger.info("publishing KV cache events on %s (topic %r%s)", config.endpoint, config.topic, replay)

    def flush(self) -> None:
        """Publish the events of the step that just ran (nothing when it had none)."""
        batch = self.collector.drain_batch(data_parallel_rank=0)
        if batch is not None:
            self.publisher.publish(batch)

    def close(self) -> None:
        """Publish what is left, then close the publisher (idempotent)."""
        if not self.publisher.closed:
            self.flush()
            self.publisher.close()


def start_kv_events(config: Any, block_size: int) -> Optional[KVEventStream]:
    """The engine's event stream for ``--kv-events-config`` (a :class:`KVEventsConfig`, its JSON or mapping), or
    None when events are off (``enable_kv_cache_events`` false, or publisher "null")."""
    parsed = parse_kv_events_config(config)
    if parsed is None or not parsed.publishes:
        return None
    return KVEventStream(parsed, block_size)
