"""The asyncio front of the engine: streaming, concurrency, admission errors, cancellation,
and failures that reach every waiting caller instead of hanging them."""

import asyncio
import gc
import time

import pytest

from pagoda import LLM, RequestOutputKind, SamplingParams
from pagoda.engine.async_engine import AsyncLLMEngine, EngineDeadError

README_FIRST_16 = [403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338]


def delta(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA, **kwargs)


@pytest.fixture
def engine():
    async_engine = AsyncLLMEngine(LLM(max_model_len=256).engine)
    yield async_engine
    async_engine.shutdown(timeout=10)


async def collect(engine, request_id, prompt, params) -> tuple[str, list[int], str]:
    text, tokens, reason = "", [], None
    async for output in engine.generate(request_id, prompt, params):
        text += output.outputs[0].text
        tokens += output.outputs[0].token_ids
        reason = output.outputs[0].finish_reason
    return text, tokens, reason


def test_streams_deltas_that_add_up_to_the_offline_result(engine):
    text, tokens, reason = asyncio.run(collect(engine, "a", [1], delta(16)))
    assert tokens == README_FIRST_16
    assert text.startswith("Once upon a time, there was a little girl")
    assert reason == "length"


def test_concurrent_requests_all_finish_with_their_own_results(engine):
    async def main():
        return await asyncio.gather(*(collect(engine, f"r{i}", [1], delta(4 + i)) for i in range(6)))

    results = asyncio.run(main())
    assert [r[1] for r in results] == [README_FIRST_16[: 4 + i] for i in range(6)]


def test_a_bad_request_raises_value_error_and_others_carry_on(engine):
    async def main():
        with pytest.raises(ValueError, match="maximum context length"):
            await collect(engine, "too-long", [1] * 250, delta(100))
        return await collect(engine, "ok", [1], delta(3))

    assert asyncio.run(main())[1] == README_FIRST_16[:3]


def test_a_consumer_that_goes_away_aborts_its_request_and_frees_its_blocks(engine):
    async def main():
        async for _ in engine.generate("leaver", [1], delta(200, ignore_eos=True)):
            break  # e.g. the HTTP client disconnected
        for _ in range(200):
            if not engine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert not engine.engine.has_unfinished_requests()
    assert engine.engine.get_stats().kv_cache_usage == 0.0


def test_the_event_loop_keeps_running_while_the_engine_computes(engine):
    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await collect(engine, "busy", [1], delta(64, ignore_eos=True))
        task.cancel()
        return ticks

    assert asyncio.run(main()) > 64  # the loop ran between (and during) every step


def test_an_engine_failure_reaches_every_waiting_caller(engine, monkeypatch):
    def broken(plan, adapters):
        raise RuntimeError("boom")

    monkeypatch.setattr(engine.engine.executor, "execute_model", broken)

    async def main():
        with pytest.raises(EngineDeadError, match="boom"):
            await collect(engine, "victim", [1], delta(4))
        with pytest.raises(EngineDeadError):
            await collect(engine, "late", [1], delta(4))

    asyncio.run(main())
    assert not engine.is_alive


def test_shutdown_fails_unfinished_requests_instead_of_hanging_them():
    async_engine = AsyncLLMEngine(LLM(max_model_len=256).engine)

    async def main():
        stream = async_engine.generate("long", [1], delta(250, ignore_eos=True))
        await stream.__anext__()
        async_engine.shutdown(timeout=10)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass

    asyncio.run(main())


def test_a_submitted_request_counts_as_waiting_at_once_and_dropping_its_stream_aborts_it():
    async_engine = AsyncLLMEngine(LLM(max_model_len=256, max_num_seqs=1).engine)

    async def wait_until(condition) -> None:
        for _ in range(500):
            if condition():
                return
            await asyncio.sleep(0.01)

    async def main():
        busy = aiter(async_engine.submit("busy", [1], delta(250, ignore_eos=True)))
        await anext(busy)  # running: the next ones must wait behind it
        queued = [async_engine.submit(f"q{i}", [1], delta(4)) for i in range(3)]
        # Counted before any await: an admission check in the same event-loop iteration sees them.
        # (It may briefly count one twice while the engine thread moves it into the scheduler.)
        assert async_engine.num_waiting >= 3
        await wait_until(lambda: async_engine.num_waiting == 3)  # all three in the scheduler's queue
        assert async_engine.num_waiting == 3
        del queued  # e.g. a response whose body never started
        gc.collect()
        await wait_until(lambda: async_engine.num_waiting == 0)
        assert async_engine.num_waiting == 0
        await busy.aclose()
        await wait_until(lambda: not async_engine.engine.has_unfinished_requests())

    try:
        asyncio.run(main())
        assert not async_engine.engine.has_unfinished_requests()
        assert async_engine.engine.get_stats().kv_cache_usage == 0.0
    finally:
        async_engine.shutdown(timeout=10)


def test_a_request_whose_event_loop_closed_is_aborted_and_the_engine_carries_on(engine):
    async def leave_running():
        stream = engine.submit("orphan", [1], delta(200, ignore_eos=True))
        await asyncio.sleep(0.05)  # added and running, its outputs queued on this loop
        return stream  # never read, kept alive past the loop: only the closed loop can stop it

    orphan = asyncio.run(leave_running())
    for _ in range(500):
        if not engine.engine.has_unfinished_requests():
            break
        time.sleep(0.01)
    assert not engine.engine.has_unfinished_requests() and engine.is_alive
    assert asyncio.run(collect(engine, "next", [1], delta(4)))[1] == README_FIRST_16[:4]
    del orphan
