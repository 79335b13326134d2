"""One endpoint's KV cache events, from its ZMQ publisher into the router's KVIndex (vLLM's protocol).

The engine's PUB socket sends multipart ``[topic, seq, payload]``: ``seq`` an 8-byte big-endian counter from 0,
``payload`` a msgpack EventBatch. Its ROUTER replay socket answers a request holding a start seq (8-byte big-endian)
with one ``[seq, payload]`` message per buffered batch from that seq on, then the end marker ``[-1 (8 bytes, signed),
b""]``; this side talks to it from a DEALER, so each message carries the empty delimiter frame a REQ would add.

Sequence handling: the subscriber applies batches in seq order. A seq past the next expected one is a gap (the
subscriber joined late, or ZMQ dropped messages at its high-water mark): it replays from the last applied seq + 1,
then goes on; batches the replay already applied are skipped when they arrive on the SUB socket. A seq at or below
the previous one *on the SUB socket* means the publisher started over (engine restart): the endpoint's index is
cleared and the new stream replayed from 0. Without a replay endpoint, or when the replay does not answer within
``replay_timeout``, the missed batches are lost and the stream goes on.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

import msgpack
import zmq
import zmq.asyncio

from pagoda_operator.router.endpoints import Endpoint
from pagoda_operator.router.kv_index import KVIndex

log = logging.getLogger(__name__)

END_SEQ = -1  # the replay's end marker (signed)


class KVEventSubscriber:
    """Subscribes to one endpoint's KV events (SUB), replays gaps (DEALER to its replay ROUTER), feeds a KVIndex."""

    def __init__(
        self,
        endpoint: Endpoint,
        index: KVIndex,
        topic: str = "kv-events",
        *,
        context: Optional[zmq.asyncio.Context] = None,
        replay_timeout: float = 2.0,
    ) -> None:
        if not endpoint.kv_events:
            raise ValueError(f"endpoint {endpoint.key} publishes no KV events")
        self.endpoint = endpoint
        self.index = index
        self.topic = topic
        self.replay_timeout = replay_timeout
        self._context = context
        self._sub: Optional[zmq.asyncio.Socket] = None
        self._closed = False
        self.last_seq = -1  # the last batch applied to the index
        self._sub_last: Optional[int] = None  # the last seq the SUB socket delivered
        self.batches = 0  # batches applied (from the SUB socket or a replay)
        self.replays = 0  # replays asked for

    def _ctx(self) -> zmq.asyncio.Context:
        return self._context if self._context is not None else zmq.asyncio.Context.instance()

    async def run(self) -> None:
        """Receive and apply batches until ``close`` (or cancellation). Bad messages are logged and skipped."""
        sub = self._ctx().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode("utf-8"))
        sub.connect(self.endpoint.kv_events or "")
        self._sub = sub
        try:
            while not self._closed:
                frames = await sub.recv_multipart()
                await self._receive(frames)
        except (zmq.ZMQError, asyncio.CancelledError):
            if not self._closed:
                raise
        finally:
            sub.close(linger=0)

    def close(self) -> None:
        """Stop: ``run`` returns (its pending receive is cancelled with the socket)."""
        self._closed = True
        if self._sub is not None:
            self._sub.close(linger=0)

    async def _receive(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            log.warning("KV events of %s: unexpected message of %d frames", self.endpoint.key, len(frames))
            return
        seq = int.from_bytes(frames[1], "big")
        if self._sub_last is not None and seq <= self._sub_last:
            log.info("KV events of %s started over at seq %d: clearing its index", self.endpoint.key, seq)
            self.index.clear(self.endpoint.key)
            self.last_seq = -1
        self._sub_last = seq
        if seq <= self.last_seq:
            return  # a replay applied it already
        if seq > self.last_seq + 1 and self.endpoint.kv_replay:
            await self._replay(self.last_seq + 1)
        if seq > self.last_seq:
            self._apply(seq, frames[2])

    async def _replay(self, start: int) -> None:
        """Ask the replay socket for the batches from ``start`` on and apply the ones not applied yet."""
        self.replays += 1
        dealer = self._ctx().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.endpoint.kv_replay or "")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.replay_timeout
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), max(deadline - loop.time(), 0.0))
                if frames and frames[0] == b"":
                    frames = frames[1:]  # the delimiter the ROUTER sends back to a DEALER
                if len(frames) != 2 or len(frames[0]) != 8:
                    continue
                seq = int.from_bytes(frames[0], "big", signed=True)
                if seq == END_SEQ:
                    return
                if seq > self.last_seq:
                    self._apply(seq, frames[1])
        except TimeoutError:
            log.warning("KV event replay of %s from seq %d timed out", self.endpoint.key, start)
        finally:
            dealer.close(linger=0)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        except (ValueError, msgpack.UnpackException) as error:
            log.warning("KV events of %s: seq %d does not decode: %r", self.endpoint.key, seq, error)
        else:
            self.index.apply(self.endpoint.key, batch)
            self.batches += 1
        self.last_seq = seq  # applied or not, it is past: never replayed again
