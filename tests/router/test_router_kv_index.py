"""The engines' KV cache events in the router: the index they build, and the subscriber that keeps it, against real
ZMQ PUB and ROUTER sockets publishing msgpack batches encoded here by hand in vLLM's schema (EventBatch
``[ts, events, dp_rank]``; events ``["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium,
lora_name]``, ``["BlockRemoved", hashes, medium]``, ``["AllBlocksCleared"]``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Optional

import msgpack
import pytest
import pytest_asyncio
import zmq
import zmq.asyncio

from pagoda_operator.router.endpoints import Endpoint, EndpointLoad
from pagoda_operator.router.kv_index import KVIndex
from pagoda_operator.router.kv_subscriber import KVEventSubscriber
from pagoda_operator.router.picker import Picker

pytestmark = [pytest.mark.timeout(60)]

BS = 4  # tokens per block
TOKENS = list(range(100, 100 + 5 * BS))  # five full blocks


def stored(hashes: list[Any], parent: Any, tokens: list[int], lora: Optional[str] = None, medium: str = "GPU") -> list:
    return ["BlockStored", hashes, parent, tokens, BS, None, medium, lora]


def removed(hashes: list[Any], medium: str = "GPU") -> list:
    return ["BlockRemoved", hashes, medium]


def batch(*events: list) -> list:
    return [time.time(), list(events), 0]


def chain_of(index: KVIndex, key: str = "pod") -> KVIndex:
    """Blocks 1..3 of TOKENS, stored by two events (the second's parent is the first's last block)."""
    index.apply(key, batch(stored([11, 12], None, TOKENS[: 2 * BS])))
    index.apply(key, batch(stored([13], 12, TOKENS[2 * BS : 3 * BS])))
    return index


# ---- the index --------------------------------------------------------------------------------------------------


def test_an_endpoint_holds_the_leading_blocks_its_events_stored() -> None:
    index = chain_of(KVIndex())
    assert index.num_blocks("pod") == 3 and index.block_size("pod") == BS
    assert index.match_tokens("pod", TOKENS, BS) == 3
    assert index.match_tokens("pod", TOKENS[: 2 * BS + 1], BS) == 2  # a partial block never matches
    other = TOKENS[:BS] + [7] + TOKENS[BS + 1 :]  # differs in block 2: block 3 no longer follows either
    assert index.match_tokens("pod", other, BS) == 1
    assert index.match_tokens("elsewhere", TOKENS, BS) == 0


def test_blocks_whose_parent_was_never_seen_count_but_never_match() -> None:
    index = KVIndex()
    index.apply("pod", batch(stored([21, 22], 999, TOKENS[: 2 * BS])))
    assert index.num_blocks("pod") == 2
    assert index.match_tokens("pod", TOKENS, BS) == 0


def test_removed_blocks_cut_the_chain_and_other_media_keep_theirs() -> None:
    index = chain_of(KVIndex())
    index.apply("pod", batch(stored([12], 11, TOKENS[BS : 2 * BS], medium="CPU")))  # block 2 offloaded as well
    index.apply("pod", batch(removed([12], "GPU")))
    assert index.match_tokens("pod", TOKENS, BS) == 3  # still on CPU
    index.apply("pod", batch(removed([12], "CPU")))
    assert index.match_tokens("pod", TOKENS, BS) == 1
    assert index.num_blocks("pod") == 2


def test_all_blocks_cleared_empties_the_endpoint_and_counts_a_generation() -> None:
    index = chain_of(KVIndex())
    index.apply("pod", batch(["AllBlocksCleared"]))
    assert (index.num_blocks("pod"), index.match_tokens("pod", TOKENS, BS), index.generation("pod")) == (0, 0, 1)
    chain_of(index)
    assert index.match_tokens("pod", TOKENS, BS) == 3


def test_both_layouts_byte_hashes_and_older_shorter_events_are_read() -> None:
    index = KVIndex()
    map_event = {"type": "BlockStored", "block_hashes": [b"\x01" * 32], "parent_block_hash": None}
    map_event |= {"token_ids": TOKENS[:BS], "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None}
    index.apply("pod", {"ts": 1.0, "events": [map_event]})
    index.apply("pod", [1.0, [["BlockStored", [b"\x02" * 32], b"\x01" * 32, TOKENS[BS : 2 * BS], BS, None]]])
    assert index.match_tokens("pod", TOKENS, BS) == 2
    index.apply("pod", [1.0, [{"type": "BlockRemoved", "block_hashes": [b"\x02" * 32], "medium": "GPU"}]])
    assert index.match_tokens("pod", TOKENS, BS) == 1


def test_malformed_events_and_batches_are_skipped() -> None:
    index = chain_of(KVIndex())
    for junk in (None, 3, [1.0], [1.0, [["BlockStored", [1]], ["Unknown", 1], [5], "x", {"type": 3}]], {"ts": 1}):
        index.apply("pod", junk)
    assert index.match_tokens("pod", TOKENS, BS) == 3


def test_adapter_blocks_and_multimodal_blocks_match_only_their_own_requests() -> None:
    index = KVIndex()
    index.apply("pod", batch(stored([31], None, TOKENS[:BS], lora="sql")))
    assert index.match_tokens("pod", TOKENS, BS) == 0
    assert index.match_tokens("pod", TOKENS, BS, lora="sql") == 1
    event = stored([41], None, TOKENS[:BS]) + [[["image-hash"]]]  # extra_keys: the block holds an image
    index.apply("mm", batch(event))
    assert index.num_blocks("mm") == 1 and index.match_tokens("mm", TOKENS, BS) == 0


# ---- the picker with the index ----------------------------------------------------------------------------------

PODS = [Endpoint(key=f"ns/pod-{i}", url=f"http://10.0.0.{i}:8000", kv_events="tcp://x:1") for i in range(3)]


def test_a_token_prompt_goes_where_the_engine_holds_its_blocks() -> None:
    index = KVIndex()
    picker = Picker(kv_index=index)
    text = " ".join(map(str, TOKENS))
    for pod in PODS:
        index.apply(pod.key, batch())  # every pod publishes; only pod-2 holds the prompt's blocks
    chain_of(index, PODS[2].key)
    assert {picker.pick(PODS, text, token_ids=TOKENS) for _ in range(3)} == {PODS[2]}
    picker.update_load(PODS[2].key, EndpointLoad(running=9.0))  # but not beyond the load threshold
    assert picker.pick(PODS, text, token_ids=TOKENS) != PODS[2]


def test_an_engine_that_cleared_its_cache_clears_the_text_index_too() -> None:
    index = KVIndex()
    picker = Picker(kv_index=index, kv_grace=0.0)
    text = "a long shared prompt. " * 60
    home = picker.pick(PODS, text)
    assert home is not None
    picker.started(home, text)
    index.apply(home.key, batch(stored(list(range(1, 200)), None, list(range(199 * BS)))))  # holds plenty
    assert picker.match(home, picker._hashes(text)) == len(picker._hashes(text))
    index.apply(home.key, batch(["AllBlocksCleared"]))
    assert picker.match(home, picker._hashes(text)) == 0


def test_the_text_index_is_trimmed_to_what_the_engine_says_it_holds() -> None:
    index = KVIndex()
    pod = PODS[0]
    recent, settled = Picker(kv_index=index), Picker(kv_index=index, kv_grace=0.0)
    text = "x" * 128 * 10  # ten chunks of 128 chars: 320 tokens at 4 chars a token
    index.apply(pod.key, batch(stored([1, 2], None, list(range(2 * BS)))))  # 8 tokens: 32 chars, no whole chunk
    for picker in (recent, settled):
        picker.started(pod, text)
    assert recent.explain()[pod.key]["indexed_chunks"] == 10  # just routed: the engine may not have stored it yet
    assert settled.explain()[pod.key]["indexed_chunks"] == 0


# ---- the subscriber, over real sockets --------------------------------------------------------------------------


class Publisher:
    """An engine's side of the protocol: PUB ``[topic, seq, payload]`` and a ROUTER answering replay requests."""

    def __init__(self, ctx: zmq.asyncio.Context, topic: bytes = b"kv-events") -> None:
        self.topic = topic
        self.pub = ctx.socket(zmq.PUB)
        self.pub_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = ctx.socket(zmq.ROUTER)
        self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: list[tuple[int, bytes]] = []
        self.replay_requests: list[int] = []
        self.seq = 0
        self.task = asyncio.create_task(self.serve_replays())

    def endpoint(self, replay: bool = True) -> Endpoint:
        return Endpoint(
            key="ns/pod",
            url="http://127.0.0.1:1",
            kv_events=f"tcp://127.0.0.1:{self.pub_port}",
            kv_replay=f"tcp://127.0.0.1:{self.replay_port}" if replay else None,
        )

    async def publish(self, *events: list, lose: bool = False) -> None:
        """Publish one batch (``lose``: buffer it for replay but never send it, as a dropped message)."""
        payload = msgpack.packb(batch(*events))
        self.buffer.append((self.seq, payload))
        if not lose:
            await self.pub.send_multipart([self.topic, self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def restart(self) -> None:
        self.buffer, self.seq = [], 0

    async def serve_replays(self) -> None:
        while True:
            identity, _, start = await self.router.recv_multipart()
            self.replay_requests.append(int.from_bytes(start, "big"))
            for seq, payload in list(self.buffer):
                if seq >= self.replay_requests[-1]:
                    await self.router.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([identity, b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self.task.cancel()
        self.pub.close(linger=0)
        self.router.close(linger=0)


@pytest_asyncio.fixture
async def publisher() -> AsyncIterator[Publisher]:
    ctx = zmq.asyncio.Context()
    engine = Publisher(ctx)
    yield engine
    engine.close()
    ctx.term()


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def subscribed(publisher: Publisher, index: KVIndex, *, replay: bool = True) -> KVEventSubscriber:
    """A running subscriber that has received at least one batch (ZMQ's SUB joins a moment after connecting)."""
    subscriber = KVEventSubscriber(publisher.endpoint(replay), index, "kv-events", replay_timeout=1.0)
    subscriber.task = asyncio.create_task(subscriber.run())  # type: ignore[attr-defined]
    while subscriber.last_seq < 0:
        await publisher.publish()
        await asyncio.sleep(0.02)
    return subscriber


async def stop(subscriber: KVEventSubscriber) -> None:
    subscriber.close()
    await asyncio.wait_for(subscriber.task, 2.0)  # type: ignore[attr-defined]


@pytest.mark.asyncio
async def test_batches_published_before_the_subscriber_joined_are_replayed(publisher: Publisher) -> None:
    await publisher.publish(stored([11, 12], None, TOKENS[: 2 * BS]))
    await publisher.publish(stored([13], 12, TOKENS[2 * BS : 3 * BS]))
    index = KVIndex()
    subscriber = await subscribed(publisher, index)
    await until(lambda: index.match_tokens("ns/pod", TOKENS, BS) == 3)
    assert publisher.replay_requests[0] == 0
    await stop(subscriber)


@pytest.mark.asyncio
async def test_a_gap_in_the_sequence_is_replayed_from_the_last_seen_batch(publisher: Publisher) -> None:
    index = KVIndex()
    subscriber = await subscribed(publisher, index)
    seen = subscriber.last_seq
    replays = len(publisher.replay_requests)
    await publisher.publish(stored([11, 12], None, TOKENS[: 2 * BS]), lose=True)
    await publisher.publish(stored([13], 12, TOKENS[2 * BS : 3 * BS]))
    await until(lambda: subscriber.last_seq == publisher.seq - 1)
    assert publisher.replay_requests[replays:] == [seen + 1]
    assert index.match_tokens("ns/pod", TOKENS, BS) == 3  # the lost batch came back through the replay
    await publisher.publish(removed([13]))  # and the stream goes on in order
    await until(lambda: index.match_tokens("ns/pod", TOKENS, BS) == 2)
    assert len(publisher.replay_requests) == replays + 1
    await stop(subscriber)


@pytest.mark.asyncio
async def test_a_cleared_cache_and_a_restarted_engine_empty_the_index(publisher: Publisher) -> None:
    index = KVIndex()
    subscriber = await subscribed(publisher, index)
    await publisher.publish(stored([11, 12], None, TOKENS[: 2 * BS]))
    await until(lambda: index.num_blocks("ns/pod") == 2)
    await publisher.publish(["AllBlocksCleared"])
    await until(lambda: index.num_blocks("ns/pod") == 0)
    await publisher.publish(stored([11], None, TOKENS[:BS]))
    await until(lambda: index.num_blocks("ns/pod") == 1)
    publisher.restart()  # a new engine process: its sequence starts over at 0, its cache is empty
    await publisher.publish(stored([51], None, TOKENS[BS : 2 * BS]))
    await until(lambda: subscriber.last_seq == 0)
    await until(lambda: index.num_blocks("ns/pod") == 1)
    assert index.match_tokens("ns/pod", TOKENS, BS) == 0  # block 11 went with the old engine
    assert index.generation("ns/pod") == 2
    await stop(subscriber)


@pytest.mark.asyncio
async def test_without_a_replay_endpoint_a_gap_is_skipped_and_the_stream_goes_on(publisher: Publisher) -> None:
    index = KVIndex()
    subscriber = await subscribed(publisher, index, replay=False)
    await publisher.publish(stored([11], None, TOKENS[:BS]), lose=True)
    await publisher.publish(stored([21], None, TOKENS[BS : 2 * BS]))
    await until(lambda: subscriber.last_seq == publisher.seq - 1)
    assert index.num_blocks("ns/pod") == 1 and publisher.replay_requests == []
    await stop(subscriber)


@pytest.mark.asyncio
async def test_an_unanswered_replay_times_out_and_undecodable_batches_are_skipped(publisher: Publisher) -> None:
    index = KVIndex()
    subscriber = await subscribed(publisher, index)
    replays = subscriber.replays  # joining may have replayed already
    publisher.task.cancel()  # the replay socket stops answering
    await publisher.pub.send_multipart([b"kv-events", (publisher.seq + 5).to_bytes(8, "big"), b"\xc1not msgpack"])
    publisher.seq += 6
    await publisher.publish(stored([11], None, TOKENS[:BS]))
    start = time.monotonic()
    await until(lambda: index.num_blocks("ns/pod") == 1)
    assert time.monotonic() - start < 3.0
    assert subscriber.replays == replays + 1
    await stop(subscriber)


def test_an_endpoint_without_kv_events_gets_no_subscriber() -> None:
    with pytest.raises(ValueError):
        KVEventSubscriber(Endpoint(key="k", url="http://x"), KVIndex())
