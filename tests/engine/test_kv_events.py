"""KV cache events as vLLM publishes them: what the block pool logs for a prefix-cached sequence, an eviction and a
reset; and a real `pagoda serve --kv-events-config` read by a subscriber written from vLLM's documented schema (plain
msgpack and ZeroMQ, none of Pagoda's decoder): the prompt's blocks arrive as BlockStored with the prompt's tokens
and a consistent parent chain, a DEALER replays the buffered batches from seq 0, and bad configs are refused."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import msgpack
import pytest
import zmq
from core_helpers import make_request
from server_helpers import free_port, start_server

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventCollector,
    external_block_hash,
)
from pagoda.engine.kv_event_publisher import KVEventStream
from pagoda.kv_events_config import KVEventsConfig, check_kv_events, parse_kv_events_config

BS = 4


def _manager(num_blocks: int = 10, lora_names: dict | None = None) -> KVCacheManager:
    collector = KVEventCollector(BS, lora_name_of=lora_names.get if lora_names else None)
    return KVCacheManager(num_blocks=num_blocks, block_size=BS, events=collector)


def _admit(kv: KVCacheManager, request) -> None:
    hits, num_cached = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_cached, hits) is not None
    request.num_computed_tokens = request.num_tokens


def _wire(hashes: list[bytes]) -> list[int]:
    return [external_block_hash(h) for h in hashes]


# ---- (a) what the pool and the manager log --------------------------------------------------------------------------


def test_a_prompt_stores_its_full_blocks_chained_and_decode_extends_the_chain():
    kv = _manager()
    request = make_request(list(range(100, 109)))  # 9 tokens: 2 full blocks and one token
    _admit(kv, request)
    [stored] = kv.pool.events.drain()
    assert stored == BlockStored(_wire(request.block_hashes[:2]), None, list(range(100, 108)), BS, None, "GPU", None)
    for token in (7, 8, 9):  # the third block fills while decoding
        request.append_output_token(token)
        assert kv.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
    [third] = kv.pool.events.drain()
    assert third.block_hashes == _wire(request.block_hashes[2:3])
    assert third.parent_block_hash == stored.block_hashes[-1] and third.token_ids == [108, 7, 8, 9]


def test_a_cache_hit_stores_nothing_again_and_only_the_new_tail_is_stored():
    kv = _manager()
    _admit(kv, make_request(list(range(100, 109))))
    kv.pool.events.drain()
    longer = make_request(list(range(100, 113)))  # shares the 2 blocks, adds a third
    _admit(kv, longer)
    [stored] = kv.pool.events.drain()
    assert stored.block_hashes == _wire(longer.block_hashes[2:3])
    assert stored.parent_block_hash == external_block_hash(longer.block_hashes[1])
    assert stored.token_ids == list(range(108, 112))


def test_evicting_cached_blocks_removes_their_hashes():
    kv = _manager(num_blocks=3)
    first = make_request(list(range(100, 109)))  # takes all 3 blocks, 2 of them cached
    _admit(kv, first)
    kv.free(first)
    kv.pool.events.drain()
    other = make_request(list(range(500, 511)))  # needs all 3 blocks: both cached ones are evicted
    _admit(kv, other)
    events = kv.pool.events.drain()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert removed == [BlockRemoved(_wire(first.block_hashes[1::-1]), "GPU")]  # LRU: the tail was freed first
    assert isinstance(events[-1], BlockStored) and events[-1].token_ids == list(range(500, 508))


def test_a_request_freed_before_its_forward_withdraws_the_blocks_it_published():
    kv = _manager()
    request = make_request(list(range(100, 109)))
    hits, _ = kv.get_computed_blocks(request)
    kv.allocate_slots(request, request.num_tokens, hits)  # published on allocation, never computed
    kv.free(request)
    stored, removed = kv.pool.events.drain()
    assert isinstance(stored, BlockStored) and removed == BlockRemoved(stored.block_hashes, "GPU")


def test_reset_prefix_cache_clears_all_blocks():
    kv = _manager()
    request = make_request(list(range(100, 109)))
    _admit(kv, request)
    kv.free(request)
    kv.pool.events.drain()
    assert kv.pool.reset_prefix_cache()
    assert kv.pool.events.drain() == [AllBlocksCleared()]


def test_lora_requests_carry_the_adapter_id_and_name():
    kv = _manager(lora_names={3: "sql"})
    _admit(kv, make_request(list(range(100, 105)), lora_id=3))
    [stored] = kv.pool.events.drain()
    assert (stored.lora_id, stored.lora_name) == (3, "sql")


def test_without_events_the_pool_logs_nothing():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    _admit(kv, make_request(list(range(100, 109))))
    assert kv.pool.events is None


def test_the_batch_encodes_as_vllms_positional_structs():
    batch = KVEventBatch(
        1.5,
        [BlockStored([2**64 - 1], None, [1, 2], 2), BlockRemoved([7, 8]), AllBlocksCleared()],
        data_parallel_rank=0,
    )
    assert msgpack.unpackb(batch.encode()) == [
        1.5,
        [
            ["BlockStored", [2**64 - 1], None, [1, 2], 2, None, "GPU", None],
            ["BlockRemoved", [7, 8], "GPU"],
            ["AllBlocksCleared"],
        ],
        0,
    ]
    assert external_block_hash(bytes(range(16))) == int.from_bytes(bytes(range(8, 16)), "big")


def _join(sub: zmq.Socket) -> None:
    """Let the subscription reach the PUB socket (ZeroMQ's slow joiner: what is sent before is lost). A SUB socket
    sends its subscription only while its own thread calls into it, hence polls rather than a sleep."""
    for _ in range(10):
        sub.poll(50)


def test_the_publisher_sends_framed_batches_and_closes_promptly():
    context = zmq.Context()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="inproc://kv-events-test", topic="t")
    stream = KVEventStream(config, BS, context)
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"t")
    sub.connect("inproc://kv-events-test")
    _join(sub)
    stream.collector.cleared()
    stream.flush()
    stream.flush()  # a step without events publishes nothing
    stream.collector.removed(bytes(16))
    start = time.monotonic()
    stream.close()  # sends what is queued, then closes
    assert time.monotonic() - start < 1.0
    frames = [sub.recv_multipart() for _ in range(2)]
    assert [(topic, int.from_bytes(seq, "big")) for topic, seq, _ in frames] == [(b"t", 0), (b"t", 1)]
    assert msgpack.unpackb(frames[1][2])[1:] == [[["BlockRemoved", [0], "GPU"]], 0]
    stream.publisher.publish(KVEventBatch(0.0, [AllBlocksCleared()]))  # a step finishing during shutdown: dropped
    assert stream.publisher.dropped == 1
    sub.close(linger=0)
    context.term()


# ---- (d) the flag -----------------------------------------------------------------------------------------------


def test_the_flag_takes_vllms_fields_and_defaults():
    config = parse_kv_events_config('{"enable_kv_cache_events": true, "topic": "kv-events"}')
    assert config == KVEventsConfig(enable_kv_cache_events=True, topic="kv-events")
    assert (config.resolved_publisher, config.endpoint, config.buffer_steps) == ("zmq", "tcp://*:5557", 10_000)
    assert parse_kv_events_config("{}").resolved_publisher == "null" and not parse_kv_events_config("{}").publishes
    assert not parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}').publishes


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"enable_kv_cache_events": true, "buffer_step": 5}', "unknown field 'buffer_step'"),
        ('{"hwm": -1}', "field 'hwm' must be at least 0"),
        ('{"buffer_steps": true}', "field 'buffer_steps' must be int"),
        ('{"publisher": "kafka"}', "field 'publisher' must be one of zmq, null"),
        ('{"endpoint": "localhost:5557"}', "field 'endpoint' must be a ZeroMQ endpoint"),
        ('{"enable_kv_cache_events": "yes"}', "field 'enable_kv_cache_events' must be bool"),
        ("[1]", "must be a JSON object"),
    ],
)
def test_bad_configs_are_refused_naming_the_field(value: str, message: str):
    with pytest.raises(ValueError, match=message):
        parse_kv_events_config(value)


def test_events_need_prefix_caching():
    with pytest.raises(ValueError, match="needs prefix caching"):
        check_kv_events(KVEventsConfig(enable_kv_cache_events=True), enable_prefix_caching=False)


@pytest.mark.slow
def test_serve_refuses_an_unknown_field_at_start_in_one_line():
    config = '{"enable_kv_cache_events": true, "max_queue": 5}'
    command = [sys.executable, "-m", "pagoda.cli", "serve", "--port", "0", "--kv-events-config", config]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "--kv-events-config: unknown field 'max_queue'" in result.stderr


# ---- (b, c) a real server and a subscriber from vLLM's documented schema -------------------------------------------

TOPIC = b"kv-events"
PROMPT = "Once upon a time, there was a little girl named Lily who loved to play in the park with her dog"


@pytest.fixture(scope="module")
def served():
    pub_port, replay_port = free_port(), free_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": TOPIC.decode(),
    }
    server = start_server("--max-model-len", "256", "--block-size", "4", "--kv-events-config", json.dumps(config))
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    sub.connect(f"tcp://127.0.0.1:{pub_port}")
    _join(sub)
    yield server, sub, context, replay_port
    sub.close(linger=0)
    context.term()
    assert server.stop() == 0  # the publisher closes without hanging the shutdown


def _messages(sub: zmq.Socket, until: float) -> list[tuple[int, list]]:
    """(seq, decoded batch) of every message that arrives before ``until``; frames checked as vLLM sends them."""
    received = []
    while time.monotonic() < until:
        if not sub.poll(100):
            continue
        topic, seq, payload = sub.recv_multipart()
        assert topic == TOPIC and len(seq) == 8
        received.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload, raw=False)))
    return received


@pytest.mark.slow
def test_a_completion_publishes_its_prompt_blocks_with_their_tokens(served):
    server, sub, _, _ = served
    status, _, body = server.request("POST", "/tokenize", {"model": "stories260K", "prompt": PROMPT})
    assert status == 200
    tokens = body["tokens"]
    assert len(tokens) >= 12
    completion = {"model": "stories260K", "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    assert server.request("POST", "/v1/completions", completion)[0] == 200
    messages = _messages(sub, time.monotonic() + 1.5)
    seqs = [seq for seq, _ in messages]
    assert seqs and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    stored = []
    for _, batch in messages:
        ts, events, dp_rank = batch  # EventBatch: [ts, events, data_parallel_rank]
        assert isinstance(ts, float) and abs(ts - time.time()) < 60 and dp_rank == 0
        stored += [event for event in events if event[0] == "BlockStored"]
    # BlockStored: [tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]
    chain_tokens, parent = [], None
    for _, hashes, parent_hash, token_ids, block_size, lora_id, medium, lora_name in stored:
        assert parent_hash == parent and block_size == 4 and (lora_id, medium, lora_name) == (None, "GPU", None)
        assert len(token_ids) == 4 * len(hashes) and all(0 <= h < 2**64 for h in hashes)
        chain_tokens += token_ids
        parent = hashes[-1]
    assert chain_tokens == tokens[: len(tokens) // 4 * 4]
    served_metrics(server)


def served_metrics(server) -> None:
    """The series the Gateway API endpoint picker reads: one per family."""
    _, _, text = server.request("GET", "/metrics")
    for family in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc", "cache_config_info"):
        series = [line for line in str(text).splitlines() if line.startswith(f"vllm:{family}{{")]
        assert len(series) == 1, (family, series)


@pytest.mark.slow
def test_a_dealer_replays_the_buffered_batches_from_seq_zero(served):
    server, sub, context, replay_port = served
    completion = {"model": "stories260K", "prompt": PROMPT + " every day", "max_tokens": 1, "temperature": 0}
    assert server.request("POST", "/v1/completions", completion)[0] == 200
    live = dict(_messages(sub, time.monotonic() + 1.0))
    assert live
    dealer = context.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    replayed = {}
    while True:
        assert dealer.poll(5000), "no replay answer"
        empty, seq, payload = dealer.recv_multipart()
        assert empty == b""
        if int.from_bytes(seq, "big", signed=True) == -1:
            assert payload == b""
            break
        replayed[int.from_bytes(seq, "big")] = msgpack.unpackb(payload, raw=False)
    dealer.close(linger=0)
    assert sorted(replayed) == list(range(len(replayed)))  # every batch since the start, in order
    assert all(replayed[seq] == batch for seq, batch in live.items())
