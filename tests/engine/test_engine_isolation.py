"""One request's failure is that request's alone: the engine goes on, frees its blocks, and every other
request gets exactly what it would have got without it. Faults that no valid input can cause (NaN logits
from a device, a crashing detokenizer) are injected at the component that would raise them."""

import asyncio

import pytest

from pagoda import LLM, RequestOutputKind, SamplingParams
from pagoda.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestFailedError
from pagoda.engine.detokenizer import IncrementalDetokenizer
from pagoda.engine.output_processor import DETOKENIZE_FAILED
from pagoda.worker.sampler import NON_FINITE_LOGITS

VOCAB = 512  # stories260K
POISONED_SEED = 13  # the request whose logits the "device" corrupts


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=256)


def params(**kwargs) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 12, "temperature": 0.8, "seed": 1, **kwargs})


def prompts_and_params() -> tuple[list[str], list[SamplingParams]]:
    prompts = ["Once upon a time", "Tim and Sue", "Lily", "The cat"]
    return prompts, [params(seed=1), params(seed=POISONED_SEED), params(seed=3, n=2), params(temperature=0)]


def poison_logits(llm, monkeypatch) -> None:
    """Rows of the poisoned request get NaN logits, as a faulty device would produce."""
    sampler = llm.engine.executor.driver_worker.model_runner.sampler

    def faulty(logits, rows):
        logits = logits.clone()
        for i, row in enumerate(rows):
            if row.params.seed == POISONED_SEED:
                logits[i, ::7] = float("nan")
        return sampler(logits, rows)

    monkeypatch.setattr(llm.engine.executor.driver_worker.model_runner, "sampler", faulty)


def test_non_finite_logits_fail_only_their_request(llm, monkeypatch) -> None:
    prompts, plist = prompts_and_params()
    clean = llm.generate(prompts, plist, use_tqdm=False)
    poison_logits(llm, monkeypatch)
    outputs = llm.generate(prompts, plist, use_tqdm=False)
    failed = outputs[1]
    assert failed.error == NON_FINITE_LOGITS
    assert [c.finish_reason for c in failed.outputs] == ["error"]
    for i in (0, 2, 3):
        assert outputs[i].error is None
        assert [c.token_ids for c in outputs[i].outputs] == [c.token_ids for c in clean[i].outputs]
    assert llm.engine.scheduler.kv.usage == 0.0 and not llm.engine.has_unfinished_requests()


def test_a_failing_detokenizer_fails_only_its_request(llm, monkeypatch) -> None:
    update = IncrementalDetokenizer.update

    def crashing(self, new_token_ids, stop_terminated=False):
        if self.params.seed == POISONED_SEED:
            raise RuntimeError("decoder bug")
        return update(self, new_token_ids, stop_terminated)

    monkeypatch.setattr(IncrementalDetokenizer, "update", crashing)
    prompts, plist = prompts_and_params()
    outputs = llm.generate(prompts, plist, use_tqdm=False)
    assert outputs[1].error == DETOKENIZE_FAILED
    assert all(outputs[i].error is None and outputs[i].outputs[0].finish_reason == "length" for i in (0, 2, 3))
    assert llm.engine.scheduler.kv.usage == 0.0


def test_requests_that_could_never_produce_a_token_are_refused_up_front(llm) -> None:
    engine = llm.engine
    everything = list(range(VOCAB))
    with pytest.raises(ValueError, match="min_tokens=1 cannot be met"):
        engine.add_request("r", [1], params(min_tokens=1, stop_token_ids=everything))
    with pytest.raises(ValueError, match="prompt is not valid Unicode"):
        engine.add_request("r", "abc\ud800", params())
    assert not engine.has_unfinished_requests() and "r" not in engine.output_processor.states
    # without min_tokens the same stop ids are fine: the first token stops the request
    (out,) = llm.generate([[1]], params(stop_token_ids=everything), use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop" and len(out.outputs[0].token_ids) == 1


def delta(**kwargs) -> SamplingParams:
    return params(output_kind=RequestOutputKind.DELTA, **kwargs)


async def drain(engine: AsyncLLMEngine, request_id: str, prompt, p: SamplingParams) -> list:
    return [output async for output in engine.generate(request_id, prompt, p)]


def test_an_unexpected_error_adding_one_request_leaves_the_engine_running(monkeypatch) -> None:
    llm = LLM(max_model_len=256)
    add = llm.engine.add_request

    def add_or_crash(request_id, prompt, p, **kwargs):
        if request_id == "bad":
            raise TypeError("tokenizer exploded")
        return add(request_id, prompt, p, **kwargs)

    monkeypatch.setattr(llm.engine, "add_request", add_or_crash)
    engine = AsyncLLMEngine(llm.engine)

    async def main():
        with pytest.raises(RequestFailedError, match="could not be added"):
            await drain(engine, "bad", [1], delta())
        outputs = await drain(engine, "good", [1], delta())
        assert outputs[-1].finished and outputs[-1].error is None

    try:
        asyncio.run(main())
        assert engine.is_alive and engine.num_waiting_seqs == 0
    finally:
        engine.shutdown(timeout=10)


def test_a_failed_request_reaches_its_stream_as_an_error_output(monkeypatch) -> None:
    llm = LLM(max_model_len=256)
    poison_logits(llm, monkeypatch)
    engine = AsyncLLMEngine(llm.engine)

    async def main():
        bad, good = await asyncio.gather(
            drain(engine, "bad", [1], delta(seed=POISONED_SEED)), drain(engine, "good", [1], delta())
        )
        assert bad[-1].finished and bad[-1].error == NON_FINITE_LOGITS
        assert good[-1].finished and good[-1].error is None and sum(len(o.outputs[0].token_ids) for o in good) == 12

    try:
        asyncio.run(main())
        assert engine.is_alive
    finally:
        engine.shutdown(timeout=10)


def test_a_failed_engine_loop_calls_on_dead_once_after_failing_every_request(monkeypatch) -> None:
    llm = LLM(max_model_len=256)
    deaths: list[BaseException] = []

    def broken(plan, adapters):
        raise RuntimeError("device lost")

    monkeypatch.setattr(llm.engine.executor, "execute_model", broken)
    engine = AsyncLLMEngine(llm.engine, on_dead=deaths.append)

    async def main():
        with pytest.raises(EngineDeadError):
            await drain(engine, "victim", [1], delta())

    asyncio.run(main())
    engine._thread.join(10)
    assert [str(e) for e in deaths] == ["device lost"] and not engine.is_alive


def test_waiting_sequences_count_n_per_request() -> None:
    llm = LLM(max_model_len=256, max_num_seqs=4)
    engine = llm.engine
    engine.add_request("a", [1], params(n=3, max_tokens=4))
    engine.add_request("b", [1, 2], params(max_tokens=4))
    assert engine.scheduler.num_waiting_seqs == 4
    engine.step()  # both admitted
    assert engine.scheduler.num_waiting_seqs == 0
    engine.abort_request(["a", "b"])
    assert engine.scheduler.num_waiting_seqs == 0 and not engine.has_unfinished_requests()
