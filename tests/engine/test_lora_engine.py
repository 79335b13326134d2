"""Multi-LoRA through the whole engine: every adapter's greedy tokens are PEFT's, in mixed batches with the base
model, with fewer slots than adapters, under preemption, chunked prefill and prefix caching."""

import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from core_helpers import fake_execute, make_request
from lora_helpers import make_adapter, peft_greedy, peft_model
from test_models import assert_tokens_are_hf_argmax, hf_greedy, hf_model, random_prompt

from pagoda import LLM, SamplingParams
from pagoda.config import SchedulerConfig, builtin_model_path
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.scheduler import Scheduler
from pagoda.engine.lora_requests import UnknownLoRAError
from pagoda.lora import LoRARequest
from pagoda.lora.reader import MAX_READS_IN_FLIGHT
from pagoda.lora.sources import LoRAModule

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
RANKS = (8, 16, 4)


class Case:
    """A base checkpoint, three adapters of it, prompts, and the reference tokens of each (adapter, prompt)."""

    def __init__(self, base: Path, root: Path, prompts: list[list[int]], tokenizer: Path) -> None:
        self.base, self.prompts, self.tokenizer = base, prompts, tokenizer
        self.adapters = [make_adapter(base, root / f"a{i}", rank=r, seed=i + 1) for i, r in enumerate(RANKS)]
        self.expected: dict[int | None, list[list[int]]] = {
            None: [hf_greedy(hf_model(base, torch.float32), p, MAX_TOKENS) for p in prompts]
        }
        for i, adapter in enumerate(self.adapters):
            model = peft_model(base, adapter)
            self.expected[i] = [peft_greedy(model, p, MAX_TOKENS) for p in prompts]

    def llm(self, **kwargs) -> LLM:
        args = {"block_size": 4, "max_model_len": 128, "enable_lora": True, "max_lora_rank": 16, **kwargs}
        return LLM(model=str(self.base), tokenizer=str(self.tokenizer), **args)

    def mixed_batch(self) -> tuple[list, list, list]:
        """Every prompt with the base model and each adapter, interleaved: (prompts, lora requests, expected)."""
        prompts, requests, expected = [], [], []
        for j, prompt in enumerate(self.prompts):
            for k in (None, 0, 1, 2):
                prompts.append(prompt)
                requests.append(None if k is None else LoRARequest(f"a{k}", 0, str(self.adapters[k])))
                expected.append(self.expected[k][j])
        return prompts, requests, expected


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def case(request, tiny, tmp_path_factory) -> Case:
    prompts = [random_prompt(n, seed) for seed, n in enumerate((5, 19, 33))]
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    return Case(tiny.get(request.param), root, prompts, builtin_model_path())


def test_three_adapters_and_the_base_in_one_batch_give_peft_tokens(case: Case) -> None:
    prompts, requests, expected = case.mixed_batch()
    outputs = case.llm().generate(prompts, GREEDY, use_tqdm=False, lora_request=requests)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(case.expected[i] != case.expected[None] for i in range(3))  # each adapter changes the output


def test_two_slots_for_three_adapters_swap_them_and_stay_exact(case: Case) -> None:
    llm = case.llm(max_loras=2)
    steps: list[set[int]] = []
    execute = llm.engine.executor.execute_model

    def observed(plan, adapters):
        steps.append({s.request.lora_id for s in plan.scheduled if s.request.lora_id is not None})
        return execute(plan, adapters)

    llm.engine.executor.execute_model = observed
    prompts, requests, expected = case.mixed_batch()
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert max(len(s) for s in steps) == 2 and len(set().union(*steps)) == 3


def test_preemption_chunked_prefill_and_prefix_caching_keep_every_adapter_exact(case: Case) -> None:
    # 24 blocks of 4 tokens cannot hold 12 sequences of up to 45 tokens: sequences are preempted and recomputed;
    # a 16-token budget chunks the 33-token prompt; the same prompts recur under each adapter (prefix caching).
    kv_bytes = 24 * 2048  # 2048 bytes per block of 4 tokens (2 layers, K and V, 2 heads of 16 floats)
    llm = case.llm(kv_cache_memory=kv_bytes, max_num_batched_tokens=16, max_num_seqs=6, max_model_len=64)
    assert llm.engine.scheduler.kv.pool.num_blocks == 24
    prompts, requests, expected = case.mixed_batch()
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.num_chunked_prefill_steps > 0


def test_bf16_adapters_on_the_native_kernels_pick_pefts_argmax_at_every_step(tiny, tmp_path: Path) -> None:
    base = tiny.get("llama", torch.bfloat16)
    adapters = [make_adapter(base, tmp_path / f"b{i}", rank=16, seed=i) for i in range(2)]
    llm = LLM(model=str(base), tokenizer=str(builtin_model_path()), block_size=4, max_model_len=128, enable_lora=True)
    assert llm.engine.dtype == torch.bfloat16
    prompts = [random_prompt(n, seed) for seed, n in enumerate((5, 19, 33))] * 2
    requests = [LoRARequest(f"b{i // 3}", 0, str(adapters[i // 3])) for i in range(6)]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests)
    for i, adapter in enumerate(adapters):
        reference = peft_model(base, adapter, torch.bfloat16)
        for prompt, output in zip(prompts[3 * i : 3 * i + 3], outputs[3 * i : 3 * i + 3]):
            assert_tokens_are_hf_argmax(reference, prompt, output.outputs[0].token_ids)


def test_stories260k_adapter_gives_peft_tokens(tmp_path: Path) -> None:
    base = builtin_model_path()
    adapter = make_adapter(base, tmp_path / "tales", rank=8, seed=3, scale=0.3)
    prompts = [[1, 403, 407, 261, 378], [1, 9, 40, 77, 230, 261, 44]]
    model = peft_model(base, adapter)
    expected = [peft_greedy(model, p, 24) for p in prompts]
    llm = LLM(model=str(base), enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=LoRARequest("tales", 1, str(adapter)))
    assert [o.outputs[0].token_ids for o in outputs] == expected
    base_outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in base_outputs] != expected


def test_prefix_cache_blocks_are_never_shared_between_adapters(case: Case) -> None:
    llm = case.llm()
    engine = llm.engine
    for k in (0, 1):
        engine.add_lora(LoRAModule(f"a{k}", str(case.adapters[k])))
    prompt = case.prompts[2]  # 33 tokens: 8 full blocks

    def cached_tokens(lora_name):
        request = engine.add_request(f"r{cached_tokens.calls}", prompt, GREEDY, lora_name=lora_name)
        cached_tokens.calls += 1
        while engine.has_unfinished_requests():
            engine.step()
        return request.num_cached_tokens

    cached_tokens.calls = 0
    assert cached_tokens("a0") == 0
    assert cached_tokens("a1") == 0  # same tokens, other adapter: no hit
    assert cached_tokens(None) == 0  # nor for the base model
    assert cached_tokens("a1") == 32


def test_unloading_an_adapter_in_use_lets_its_requests_finish_on_it(case: Case) -> None:
    engine = case.llm().engine
    engine.add_lora(LoRAModule("a0", str(case.adapters[0])))
    engine.add_request("running", case.prompts[1], GREEDY, lora_name="a0")
    engine.step()
    lora_id = engine.lora_id("a0")
    engine.remove_lora("a0")
    with pytest.raises(UnknownLoRAError, match="'a0' is not loaded"):
        engine.add_request("late", case.prompts[0], GREEDY, lora_name="a0")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].outputs[0].token_ids == case.expected[0][1]
    engine.step()  # the next step releases the weights nobody uses
    assert engine.lora.name_of(lora_id) == str(lora_id) and engine.lora.loaded() == []
    engine.add_lora(LoRAModule("a0", str(case.adapters[1])))  # the name again, other weights: a new id
    assert engine.lora_id("a0") != lora_id


def test_adapters_dropped_from_host_memory_are_read_again_and_a_vanished_one_fails_alone(case, tmp_path) -> None:
    engine = case.llm(max_loras=1, max_cpu_loras=1).engine
    copies = [shutil.copytree(case.adapters[k], tmp_path / f"a{k}") for k in range(3)]
    for k, folder in enumerate(copies):
        engine.add_lora(LoRAModule(f"a{k}", str(folder)))  # host memory keeps only the last one loaded
    assert len(engine.lora._host) == 1
    shutil.rmtree(copies[1])
    for k in range(3):
        engine.add_request(f"r{k}", case.prompts[0], GREEDY, lora_name=f"a{k}")
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["r0"].outputs[0].token_ids == case.expected[0][0]  # read again from its folder
    assert finals["r2"].outputs[0].token_ids == case.expected[2][0]
    # The request is told the adapter is unavailable (a 503 at the server), the registry keeps why for the status.
    assert "'a1' is unavailable" in finals["r1"].error and finals["r1"].error_unavailable
    assert "could not be read again" in engine.lora.read_error("a1")


def test_when_every_reader_thread_is_stuck_the_adapters_requests_fail_alone_and_the_engine_goes_on(case) -> None:
    """Reads stuck on a hung mount hold their threads; past MAX_READS_IN_FLIGHT a re-read is refused, and the
    requests on that adapter fail (unavailable) instead of waiting, while the base model's are served."""
    engine = case.llm(max_loras=1, max_cpu_loras=1).engine
    for k in range(2):
        engine.add_lora(LoRAModule(f"a{k}", str(case.adapters[k])))  # host memory keeps a1 only
    mount = threading.Event()
    for k in range(MAX_READS_IN_FLIGHT):  # other folders whose reads hang
        engine.lora.reader.start(f"/hung/{k}", "stuck", mount.wait)
    engine.add_request("on-a0", case.prompts[0], GREEDY, lora_name="a0")
    engine.add_request("base", case.prompts[0], GREEDY)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["on-a0"].error_unavailable and "'a0' is unavailable" in finals["on-a0"].error
    assert finals["base"].error is None
    assert "adapter reads are still running" in engine.lora.read_error("a0")
    mount.set()  # the mount answers again: a0 is read once more and served
    deadline = time.monotonic() + 10
    while engine.lora.reader.num_in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.add_request("again", case.prompts[0], GREEDY, lora_name="a0")
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["again"].outputs[0].token_ids == case.expected[0][0]
    assert engine.lora.read_error("a0") is None


def test_an_adapter_in_a_slot_runs_from_the_slot_even_after_host_memory_dropped_it(case, tmp_path) -> None:
    engine = case.llm(max_loras=2, max_cpu_loras=2).engine
    folder = shutil.copytree(case.adapters[0], tmp_path / "a0")
    engine.add_lora(LoRAModule("a0", str(folder)))
    engine.add_request("first", case.prompts[0], GREEDY, lora_name="a0")
    while engine.has_unfinished_requests():
        engine.step()
    for k in (1, 2):  # two more adapters push a0 out of host memory; it keeps its device slot
        engine.add_lora(LoRAModule(f"a{k}", str(case.adapters[k])))
    shutil.rmtree(folder)
    engine.add_request("second", case.prompts[1], GREEDY, lora_name="a0")
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    assert finals[0].error is None and finals[0].outputs[0].token_ids == case.expected[0][1]


def test_replacing_an_adapter_swaps_the_name_once_the_new_one_is_read(case) -> None:
    engine = case.llm().engine
    engine.add_lora(LoRAModule("x", str(case.adapters[0])))
    with pytest.raises(ValueError, match="already loaded"):
        engine.add_lora(LoRAModule("x", str(case.adapters[1])))
    old = engine.lora_id("x")
    engine.add_lora(LoRAModule("x", str(case.adapters[1])), replace=True)
    assert engine.lora_id("x") != old and [r.name for r in engine.lora.loaded()] == ["x"]


def test_requests_for_an_unknown_adapter_or_without_lora_are_refused(case: Case) -> None:
    with pytest.raises(UnknownLoRAError):
        case.llm().engine.add_request("x", [5, 6], GREEDY, lora_name="nope")
    plain = LLM(model=str(case.base), tokenizer=str(case.tokenizer), max_model_len=64)
    with pytest.raises(ValueError, match="not enabled"):
        plain.engine.add_request("x", [5, 6], GREEDY, lora_name="a0")


def _scheduler(max_loras: int) -> Scheduler:
    return Scheduler(SchedulerConfig(16, 512, 256, True, max_loras), KVCacheManager(256, 4))


def test_the_scheduler_never_runs_more_adapters_than_slots_and_a_waiting_adapter_is_not_starved() -> None:
    scheduler = _scheduler(max_loras=2)
    for lora_id in (1, 2, 1, 2, 3):  # adapter 3 arrives last, behind busy adapters 1 and 2
        scheduler.add_request(make_request([5, 6, 7], max_tokens=3, lora_id=lora_id))
    for _ in range(6):  # new requests for 1 and 2 keep arriving
        plan = scheduler.schedule()
        assert len({s.request.lora_id for s in plan.scheduled}) <= 2
        scheduler.update_from_output(plan, fake_execute(plan))
        scheduler.add_request(make_request([5, 6, 7], max_tokens=3, lora_id=1))
        scheduler.add_request(make_request([5, 6, 7], max_tokens=3, lora_id=2))
        if any(r.lora_id == 3 for r in scheduler.running):
            break
    assert any(r.lora_id == 3 for r in scheduler.running), "adapter 3 starved behind adapters 1 and 2"


def test_base_model_requests_are_never_held_back_by_adapter_slots() -> None:
    scheduler = _scheduler(max_loras=1)
    for lora_id in (1, 2, None, None):
        scheduler.add_request(make_request([5, 6, 7], max_tokens=3, lora_id=lora_id))
    plan = scheduler.schedule()
    assert [s.request.lora_id for s in plan.scheduled] == [1, None, None]
