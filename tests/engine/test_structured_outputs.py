"""Structured outputs in the engine: the constraint, its compilation, and grammar-masked sampling.

A random-weight model writes invalid JSON on its own, so outputs that validate can only come from the
grammar mask. Every test reads outputs through ``jsonschema`` / ``re``, never through the engine's own code.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import Future

import jsonschema
import pytest
from core_helpers import fake_execute, make_request
from tiny_chat_model import IM_END_ID

from pagoda import LLM, SamplingParams, StructuredOutputsParams
from pagoda.config import SchedulerConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.scheduler import Scheduler
from pagoda.request import RequestStatus
from pagoda.structured_output.compiler import StructuredOutputCompiler, choice_grammar
from pagoda.structured_output.grammar import RequestGrammar

NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "status": {"enum": ["open", "closed", "pending"]},
        "active": {"type": "boolean"},
        "owner": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 8},
                "level": {"type": "integer", "minimum": -5, "maximum": 5},
            },
            "required": ["name", "level"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["id", "score", "status", "active", "owner", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_chat_qwen3) -> LLM:
    return LLM(str(tiny_chat_qwen3), device="cpu", max_model_len=1024, kv_cache_memory="16MiB", max_num_seqs=64)


# ---- the constraint ----------------------------------------------------------------------------------


def test_a_constraint_is_exactly_one_kind() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=["a", ""])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")


def test_a_schema_keeps_its_property_order_and_equal_schemas_share_a_key() -> None:
    a = StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {}}})
    b = StructuredOutputsParams(json='{"type": "object",  "properties": {"b": {}, "a": {}}}')
    assert a.key == b.key
    assert list(a.schema["properties"]) == ["b", "a"]


# ---- compiling ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiler(llm: LLM) -> StructuredOutputCompiler:
    return llm.engine.structured_output_compiler()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutputsParams(regex="[0-9"), r"^structured_outputs\.regex could not be compiled: .*Unclosed"),
        (StructuredOutputsParams(grammar="root ::= "), r"^structured_outputs\.grammar could not be compiled"),
        (StructuredOutputsParams(json={"type": "frobnicate"}), r"^structured_outputs\.json\.type is not a valid"),
        (
            StructuredOutputsParams(json={"type": "object", "properties": {"a": {"minimum": "x"}}}),
            r"^structured_outputs\.json\.properties\.a\.minimum is not a valid",
        ),
    ],
)
def test_what_cannot_compile_is_a_value_error_naming_the_field(compiler, spec, message) -> None:
    with pytest.raises(ValueError, match=message) as info:
        compiler.compile(spec).result(timeout=60)
    assert ".cc:" not in str(info.value)  # no native source locations for clients


def test_a_full_compile_queue_refuses_new_specs_but_not_cached_ones(compiler) -> None:
    from pagoda.structured_output.compiler import CompileQueueFull

    cached = StructuredOutputsParams(regex="cached")
    compiler.compile(cached).result(timeout=60)
    assert compiler.compile(cached, max_pending=0).done()
    with pytest.raises(CompileQueueFull):
        compiler.compile(StructuredOutputsParams(regex="never seen before"), max_pending=0)
    assert not compiler.forget(cached)  # finished: stays cached


def test_json_object_must_be_a_boolean() -> None:
    with pytest.raises(ValueError, match="true or false"):
        StructuredOutputsParams(json_object={})


def test_min_tokens_cannot_be_combined_with_a_constraint() -> None:
    with pytest.raises(ValueError, match="min_tokens cannot be combined"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(choice=["a"]))


def test_one_grammar_in_several_rows_is_filled_once_and_copied(compiler) -> None:
    import torch

    from pagoda.structured_output.grammar import apply_grammar_masks

    grammar = _ready_grammar(compiler, StructuredOutputsParams(json=NESTED_SCHEMA))
    logits = torch.randn(4, compiler.vocab_size, generator=torch.Generator().manual_seed(1))
    shared = apply_grammar_masks(logits, [grammar, grammar, None, grammar])
    alone = apply_grammar_masks(logits[:1], [grammar])
    for row in (0, 1, 3):
        assert torch.equal(torch.isneginf(shared[row]), torch.isneginf(alone[0]))
    assert torch.equal(shared[2], logits[2])
    assert not torch.isneginf(logits).any()  # the input is left unmodified


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, r"\.json: uniqueItems"),
        ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, r"\.json\.properties\.a: .*'not'"),
        ({"anyOf": [{"type": "integer", "if": {"minimum": 0}, "then": {"maximum": 5}}]}, r"anyOf\[0\]: .*'if'"),
        ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "allOf with more than one"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ],
)
def test_keywords_the_grammar_cannot_enforce_are_refused(compiler, schema, message) -> None:
    with pytest.raises(ValueError, match=message):
        compiler.compile(StructuredOutputsParams(json=schema)).result(timeout=60)


def test_a_property_named_like_a_keyword_is_just_a_property(compiler) -> None:
    schema = {"type": "object", "properties": {"not": {"type": "integer"}, "if": {"type": "string"}}}
    compiler.compile(StructuredOutputsParams(json=schema)).result(timeout=60)


def test_schemas_mean_what_json_schema_says(llm) -> None:
    # A list without "items" and an object without "additionalProperties" allow any items and more properties
    # (xgrammar's strict mode would allow only [] and the listed properties).
    from pagoda.structured_output.grammar import RequestGrammar as Grammar

    compiler = llm.engine.structured_output_compiler()
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"tags": {"type": "array"}}})
    future = compiler.compile(spec)
    future.result(timeout=60)
    grammar = Grammar(future)
    assert grammar.poll()
    tokenizer = llm.get_tokenizer()
    assert all(grammar.accept(t) for t in tokenizer.encode('{"tags": [1, "a"], "extra": null}'))
    assert grammar.accept(IM_END_ID) and grammar.is_terminated


def test_compiled_grammars_are_cached_by_spec(compiler) -> None:
    first = compiler.compile(StructuredOutputsParams(json={"type": "object", "properties": {"x": {}}}))
    again = compiler.compile(StructuredOutputsParams(json='{"type":"object","properties":{"x":{}}}'))
    assert again is first


def test_choices_are_matched_literally() -> None:
    assert choice_grammar(['say "hi"', "a\\b", "ü\n"]) == 'root ::= "say \\"hi\\"" | "a\\\\b" | "ü\\n"'


# ---- generating --------------------------------------------------------------------------------------


def test_100_sampled_completions_under_a_nested_schema_all_validate(llm) -> None:
    params = SamplingParams(
        n=10, temperature=1.0, max_tokens=300, seed=7, structured_outputs=StructuredOutputsParams(json=NESTED_SCHEMA)
    )
    outputs = llm.generate([f"Record {i}:" for i in range(10)], params, use_tqdm=False)
    texts = [c.text for o in outputs for c in o.outputs]
    assert len(texts) == 100
    for o in outputs:
        assert all(c.finish_reason == "stop" for c in o.outputs), [c.text for c in o.outputs]
    for text in texts:
        jsonschema.validate(json.loads(text), NESTED_SCHEMA)
    assert len(set(texts)) > 50  # sampled, not one forced string


def test_unconstrained_output_of_the_same_model_is_not_json(llm) -> None:
    # The control for the test above: without the grammar this model does not write valid JSON.
    outputs = llm.generate(["Record:"] * 10, SamplingParams(temperature=1.0, max_tokens=40, seed=7), use_tqdm=False)
    valid = 0
    for o in outputs:
        try:
            jsonschema.validate(json.loads(o.outputs[0].text), NESTED_SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    assert valid == 0


def test_100_sampled_completions_each_under_a_regex_and_a_choice(llm) -> None:
    regex = r"(yes|no) [0-9]{2}-[a-f]{3}"
    params = SamplingParams(n=50, temperature=1.0, max_tokens=40, seed=3)
    by_regex = llm.generate(["Answer:", "Reply:"], _with(params, regex=regex), use_tqdm=False)
    texts = [c.text for o in by_regex for c in o.outputs]
    assert len(texts) == 100 and all(re.fullmatch(regex, t) for t in texts)
    assert len(set(texts)) > 50
    choices = ["red", "green", "blue", "dark red"]
    by_choice = llm.generate(["Colour:"] * 2, _with(params, choice=choices), use_tqdm=False)
    picked = [c.text for o in by_choice for c in o.outputs]
    assert len(picked) == 100 and set(picked) <= set(choices) and len(set(picked)) > 1


def test_any_json_object(llm) -> None:
    outputs = llm.generate(
        ["Data:"] * 4, _with(SamplingParams(temperature=1.0, max_tokens=400, seed=1), json_object=True)
    )
    for o in outputs:
        if o.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(o.outputs[0].text), dict)
        else:  # cut by max_tokens: a prefix of an object
            assert o.outputs[0].text.startswith("{")


def test_a_constrained_request_does_not_change_its_unconstrained_neighbours(llm) -> None:
    plain = SamplingParams(temperature=1.0, max_tokens=24, seed=11)
    alone = llm.generate(["Once upon a time"], plain, use_tqdm=False)[0].outputs[0].token_ids
    constrained = _with(SamplingParams(temperature=1.0, max_tokens=60, seed=5), json=NESTED_SCHEMA)
    mixed = llm.generate(["Record:", "Once upon a time", "Record:"], [constrained, plain, constrained], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    for o in (mixed[0], mixed[2]):
        assert o.outputs[0].text.startswith('{"id": ')


def test_the_grammar_ends_the_output_even_with_ignore_eos(llm) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=50, seed=2, ignore_eos=True)
    out = llm.generate(["x"], _with(params, choice=["alpha", "beta"]), use_tqdm=False)[0].outputs[0]
    assert out.text in ("alpha", "beta") and out.finish_reason == "stop"
    assert out.token_ids[-1] == IM_END_ID  # the grammar's end is the model's EOS token


def test_preempted_sequences_keep_their_grammar_state(tiny_chat_qwen3) -> None:
    params = SamplingParams(n=4, temperature=1.0, max_tokens=120, seed=9, structured_outputs=_schema_spec())
    prompts = [f"Item {i} " * 20 for i in range(6)]
    roomy = LLM(str(tiny_chat_qwen3), device="cpu", max_model_len=512, kv_cache_memory="16MiB", block_size=16)
    expected = [[c.text for c in o.outputs] for o in roomy.generate(prompts, params, use_tqdm=False)]
    # Room for fewer sequences than the 24 that run: some are preempted and recomputed mid-output.
    tight = LLM(str(tiny_chat_qwen3), device="cpu", max_model_len=512, kv_cache_memory="640KiB", block_size=16)
    got = [[c.text for c in o.outputs] for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.engine.get_stats().num_preemptions > 0
    assert got == expected
    for texts in got:
        for text in texts:
            jsonschema.validate(json.loads(text), NESTED_SCHEMA)


def test_stop_strings_cut_a_constrained_output(llm) -> None:
    params = SamplingParams(n=6, temperature=1.0, max_tokens=20, seed=4, stop=[" "])
    (out,) = llm.generate(["Pick:"], _with(params, choice=["alpha beta", "gamma delta"]), use_tqdm=False)
    assert {c.text for c in out.outputs} <= {"alpha", "gamma"}
    assert all(c.finish_reason == "stop" and c.stop_reason == " " for c in out.outputs)


def test_chunked_prefill_and_prefix_caching_leave_the_grammar_alone(tiny_chat_qwen3) -> None:
    # A 600-token prompt computed in 64-token chunks; the second request finds it in the prefix cache.
    llm = LLM(
        str(tiny_chat_qwen3), device="cpu", max_model_len=1024, kv_cache_memory="16MiB", max_num_batched_tokens=64
    )
    prompt = [3 + i % 400 for i in range(600)]
    params = _with(SamplingParams(temperature=1.0, max_tokens=300, seed=6), json=NESTED_SCHEMA)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    second = llm.generate([prompt], params, use_tqdm=False)[0]
    assert llm.engine.get_stats().num_chunked_prefill_steps > 0
    assert second.num_cached_tokens > 0
    assert first.outputs[0].text == second.outputs[0].text
    jsonschema.validate(json.loads(first.outputs[0].text), NESTED_SCHEMA)


def test_an_invalid_constraint_fails_only_its_request(llm) -> None:
    engine = llm.engine
    engine.add_request("good", "Hello", SamplingParams(max_tokens=4, temperature=0.0))
    engine.add_request("bad", "Hello", _with(SamplingParams(max_tokens=4), regex="(unclosed"))
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    assert finals["bad"].error.startswith("structured_outputs.regex could not be compiled")
    assert finals["bad"].outputs[0].finish_reason == "error"
    assert finals["good"].error is None and len(finals["good"].outputs[0].token_ids) == 4


def test_offline_generate_refuses_an_invalid_constraint_before_running(llm) -> None:
    with pytest.raises(ValueError, match="structured_outputs.json"):
        llm.generate(["x"], _with(SamplingParams(), json={"type": 3}), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


# ---- scheduling while a grammar compiles -------------------------------------------------------------


def test_a_request_whose_grammar_compiles_waits_without_holding_up_the_queue(compiler) -> None:
    scheduler = Scheduler(SchedulerConfig(8, 256, 256, True), KVCacheManager(64, 16, True))
    pending: Future = Future()
    compiling = make_request([1, 2, 3], max_tokens=2)
    compiling.grammar = RequestGrammar(pending)
    behind = make_request([4, 5, 6], max_tokens=2)
    scheduler.add_request(compiling)
    scheduler.add_request(behind)
    plan = scheduler.schedule()
    assert [s.request for s in plan.scheduled] == [behind]
    assert list(scheduler.waiting) == [compiling] and scheduler.num_waiting_seqs == 1
    scheduler.update_from_output(plan, fake_execute(plan))
    # Compiled: it runs from the next step on.
    pending.set_result(compiler.compile(StructuredOutputsParams(choice=["x"])).result())
    assert compiling.grammar.poll() and compiling.grammar.ready
    plan = scheduler.schedule()
    assert compiling in [s.request for s in plan.scheduled]
    assert compiling.status == RequestStatus.RUNNING


def _ready_grammar(compiler: StructuredOutputCompiler, spec: StructuredOutputsParams) -> RequestGrammar:
    future = compiler.compile(spec)
    future.result(timeout=60)
    grammar = RequestGrammar(future)
    assert grammar.poll() and grammar.ready
    return grammar


def _schema_spec() -> StructuredOutputsParams:
    return StructuredOutputsParams(json=NESTED_SCHEMA)


def _with(params: SamplingParams, **constraint) -> SamplingParams:
    from dataclasses import replace

    return replace(params, structured_outputs=StructuredOutputsParams(**constraint))


# ---- the mask on a GPU (skipped without one) ----------------------------------------------------------


@pytest.mark.gpu
def test_the_mask_on_cuda_equals_the_mask_on_cpu(compiler) -> None:
    import torch

    from pagoda.structured_output.grammar import apply_grammar_masks

    grammar = _ready_grammar(compiler, StructuredOutputsParams(json=NESTED_SCHEMA))
    grammars = [grammar, None, grammar]
    logits = torch.randn(3, compiler.vocab_size, generator=torch.Generator().manual_seed(0))
    on_cpu = apply_grammar_masks(logits.clone(), grammars)
    on_gpu = apply_grammar_masks(logits.cuda(), grammars).cpu()
    assert torch.equal(on_cpu, on_gpu)
    assert torch.equal(on_cpu[1], logits[1])  # a row without a grammar is untouched
    assert bool(torch.isneginf(on_cpu[0]).any()) and bool(torch.isfinite(on_cpu[0]).any())


# ---- the mask kernel ---------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [457, 1024, 151936])
def test_the_native_mask_kernel_equals_the_torch_reference_and_xgrammars(vocab) -> None:
    import torch
    import xgrammar as xgr

    from pagoda.cpu import cpu_ops
    from pagoda.structured_output.grammar import masked_logits_reference

    assert cpu_ops(), "the native CPU kernels must build here"
    generator = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (6, words), dtype=torch.int32, generator=generator)
    bitmask[0] = 0  # nothing allowed
    bitmask[1] = -1  # everything allowed
    bitmask[2, : words // 2] = 0  # mostly nothing, as a grammar's rows are
    logits = torch.randn(6, vocab, generator=generator)
    rows = [0, 1, 2, 4]  # rows 3 and 5 have no grammar
    native = torch.ops.pagoda_cpu.grammar_masked_logits(logits, bitmask, torch.tensor(rows))
    by_xgrammar = logits.clone()
    xgr.apply_token_bitmask_inplace(by_xgrammar, bitmask, vocab_size=vocab, indices=rows)
    reference = masked_logits_reference(logits, bitmask, rows)
    assert torch.equal(native, reference) and torch.equal(by_xgrammar, reference)
    assert torch.equal(native[3], logits[3]) and torch.isneginf(native[0]).all()
