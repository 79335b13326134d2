"""The shared-memory collectives of CPU tensor parallelism, against plain torch sums: ranks on threads of this
process (one mapping each, as separate processes have), so each case runs in milliseconds."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

from pagoda.distributed.shm_comm import ShmCommunicator, segment_path

SLOT_BYTES = 64 * 1024


def ranks(world_size: int, timeout_s: float = 10.0) -> list[ShmCommunicator]:
    path = segment_path()
    comms = [ShmCommunicator(path, 0, world_size, timeout_s, SLOT_BYTES)]
    comms += [ShmCommunicator(path, r, world_size, timeout_s, SLOT_BYTES) for r in range(1, world_size)]
    comms[0].unlink()
    return comms


def on_every_rank(comms: list[ShmCommunicator], work: Callable[[ShmCommunicator], object]) -> list:
    results: list = [None] * len(comms)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = work(comms[i])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(comms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_reduce_gives_every_rank_the_same_sum_over_many_calls(world_size, dtype):
    comms = ranks(world_size)
    gen = torch.Generator().manual_seed(world_size)
    calls = [[torch.randn(n, 48, generator=gen).to(dtype) for _ in range(world_size)] for n in (1, 7, 32, 1, 100)]

    def work(comm: ShmCommunicator) -> list[torch.Tensor]:
        outs = []
        for parts in calls:  # back to back: the two slot sets alternate under ranks that run ahead
            tensor = parts[comm.rank].clone()
            assert comm.all_reduce(tensor)
            outs.append(tensor)
        return outs

    results = on_every_rank(comms, work)
    for i, parts in enumerate(calls):
        expected = parts[0].clone()
        for part in parts[1:]:
            expected += part
        for rank_result in results:
            assert torch.equal(rank_result[i], expected)  # bit-identical on every rank


def test_gather_puts_the_ranks_side_by_side_on_rank_0_only():
    comms = ranks(2)
    parts = [torch.randn(5, 11), torch.randn(5, 11)]
    results = on_every_rank(comms, lambda c: c.gather_to_first(parts[c.rank]))
    assert results[0][0] and torch.equal(results[0][1], torch.cat(parts, dim=-1))
    assert results[1] == (True, None)


def test_a_tensor_larger_than_a_slot_is_left_to_gloo():
    comms = ranks(2)
    big = torch.zeros(SLOT_BYTES // 4 + 1)
    assert comms[0].all_reduce(big) is False  # no wait, no flag raised: the caller uses gloo
    assert comms[0].gather_to_first(big.view(1, -1)) == (False, None)


def test_a_missing_rank_times_out_and_an_abort_stops_the_wait_at_once():
    comms = ranks(2, timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="did not reach the exchange within"):
        comms[0].all_reduce(torch.ones(4))  # rank 1 never comes
    assert 0.5 <= time.monotonic() - started < 5
    comms = ranks(2, timeout_s=60)
    threading.Timer(0.2, comms[0].abort).start()  # what the watchdog does when a worker dies
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="aborted: a rank died"):
        comms[0].all_reduce(torch.ones(4))
    assert time.monotonic() - started < 5
