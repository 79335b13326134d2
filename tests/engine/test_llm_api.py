"""The offline API and the step-level engine API on the built-in model, as a user calls them."""

import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagoda import LLM, RequestOutputKind, SamplingParams
from pagoda.config import builtin_model_path

# stories260K's README: greedy 64 tokens after the prompt [1] (BOS).
README_IDS = [
    403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337, 410, 408,
    419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394, 261, 370, 432, 352, 266, 268, 388, 426,
    338, 391, 266, 267, 337, 335, 312, 432, 398, 312, 286, 267, 414, 270, 333, 415, 426, 13, 438, 310,
]  # fmt: skip


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=256)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def test_builtin_model_greedy_from_bos_equals_its_readme(llm):
    (output,) = llm.generate([[1]], greedy(64), use_tqdm=False)
    assert output.outputs[0].token_ids == README_IDS
    assert output.outputs[0].text.startswith("Once upon a time, there was a little girl named Lily.")
    assert output.outputs[0].finish_reason == "length"


def test_text_prompt_output_carries_text_ids_reason_and_timing(llm):
    (output,) = llm.generate("Once upon a time", greedy(8), use_tqdm=False)
    assert output.prompt == "Once upon a time"
    assert output.prompt_token_ids == [1, 403, 407, 261, 378]
    completion = output.outputs[0]
    assert completion.token_ids == README_IDS[4:12]
    assert completion.text == ", there was a little girl"
    assert output.finished
    m = output.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time


def test_outputs_come_back_in_prompt_order_with_per_prompt_params(llm):
    prompts = ["Once upon a time", "Tim and Sue", [1, 403]]
    params = [greedy(3), greedy(5), greedy(7)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 5, 7]
    assert outputs[1].prompt == "Tim and Sue"


def test_stop_strings_end_the_text_with_or_without_the_stop_string(llm):
    (out,) = llm.generate([[1]], greedy(64, stop=["Lily"]), use_tqdm=False)
    c = out.outputs[0]
    assert c.text == "Once upon a time, there was a little girl named "
    assert (c.finish_reason, c.stop_reason) == ("stop", "Lily")
    (out,) = llm.generate([[1]], greedy(64, stop=["Lily"], include_stop_str_in_output=True), use_tqdm=False)
    assert out.outputs[0].text == "Once upon a time, there was a little girl named Lily"


def test_stop_token_ids_eos_min_tokens_and_ignore_eos(llm):
    (out,) = llm.generate([[1]], greedy(64, stop_token_ids=[README_IDS[5]]), use_tqdm=False)
    assert out.outputs[0].token_ids == README_IDS[:6]
    assert out.outputs[0].stop_reason == README_IDS[5]
    # The model ends a story by emitting BOS (id 1), which the built-in generation config counts as EOS:
    # force it with a logit bias and see min_tokens hold it back, and ignore_eos ignore it.
    force_bos = {1: 100.0}
    (out,) = llm.generate([[1]], greedy(20, logit_bias=force_bos, min_tokens=3), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].token_ids[-1] == 1
    assert 1 not in out.outputs[0].token_ids[:3]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", None)
    (out,) = llm.generate([[1]], greedy(10, logit_bias=force_bos, ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].token_ids == [1] * 10 and out.outputs[0].finish_reason == "length"


def test_logprobs_and_prompt_logprobs_match_transformers(llm):
    prompt = [1, 403, 407, 261, 378]
    (out,) = llm.generate([prompt], greedy(4, logprobs=3, prompt_logprobs=2), use_tqdm=False)
    reference = AutoModelForCausalLM.from_pretrained(builtin_model_path(), dtype=torch.float32)
    full = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(reference(torch.tensor([full])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert prompt[pos] in entry and len(entry) >= 2
        assert entry[prompt[pos]].logprob == pytest.approx(ref[pos - 1, prompt[pos]].item(), abs=1e-4)
    total = 0.0
    for i, token in enumerate(out.outputs[0].token_ids):
        entry = out.outputs[0].logprobs[i]
        assert entry[token].rank == 1  # greedy picks the most likely token
        top = torch.topk(ref[len(prompt) - 1 + i], 3)
        assert list(entry)[:3] == top.indices.tolist()
        assert entry[token].logprob == pytest.approx(top.values[0].item(), abs=1e-4)
        assert entry[token].decoded_token is not None
        total += entry[token].logprob
    assert out.outputs[0].cumulative_logprob == pytest.approx(total)


def test_seeded_sampling_does_not_depend_on_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=1234)
    (alone,) = llm.generate(["Tim and Sue"], params, use_tqdm=False)
    crowd = ["Once upon a time", "The dog", "Tim and Sue", "A bird", "Lily"]
    crowd_params = [SamplingParams(temperature=0.8, max_tokens=30), greedy(10), params, greedy(5), params]
    together = llm.generate(crowd, crowd_params, use_tqdm=False)
    assert together[2].outputs[0].token_ids == alone.outputs[0].token_ids
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=99)
    (different,) = llm.generate(["Tim and Sue"], other_seed, use_tqdm=False)
    assert different.outputs[0].token_ids != alone.outputs[0].token_ids


def test_n_sequences_share_one_prompt_and_sequence_zero_matches_a_single_request(llm):
    params = SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=7)
    (out,) = llm.generate(["Once upon a time"], params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    (single,) = llm.generate(
        ["Once upon a time"], SamplingParams(temperature=1.0, max_tokens=16, seed=7), use_tqdm=False
    )
    assert out.outputs[0].token_ids == single.outputs[0].token_ids


def test_streaming_deltas_add_up_to_the_final_text():
    llm = LLM(max_model_len=256)
    engine = llm.engine
    engine.add_request("s", "Once upon a time", greedy(40, stop=["park"], output_kind=RequestOutputKind.DELTA))
    pieces, tokens = [], []
    while engine.has_unfinished_requests():
        for output in engine.step():
            pieces.append(output.outputs[0].text)
            tokens += output.outputs[0].token_ids
            final = output
    assert final.finished and final.outputs[0].finish_reason == "stop"
    (reference,) = llm.generate("Once upon a time", greedy(40, stop=["park"]), use_tqdm=False)
    assert "".join(pieces) == reference.outputs[0].text
    assert tokens == reference.outputs[0].token_ids


def test_abort_frees_every_block_and_other_requests_carry_on():
    llm = LLM(max_model_len=256)
    engine = llm.engine
    engine.add_request("victim", "Once upon a time", greedy(100))
    engine.add_request("survivor", [1], greedy(12))
    engine.step()
    engine.abort_request("victim")
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["survivor"]
    assert finished[0].outputs[0].token_ids == README_IDS[:12]
    assert engine.get_stats().kv_cache_usage == 0.0


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], greedy(4), "prompt is empty"),
        ([1, 512], greedy(4), r"prompt token ids must be in \[0, 512\)"),
        ([1] * 200, greedy(100), "maximum context length is 256"),
        ([1] * 256, SamplingParams(max_tokens=None), "maximum context length is 256"),
        ([1], greedy(4, logprobs=21), "logprobs=21 exceeds the maximum of 20"),
        ([1], greedy(4, stop_token_ids=[600]), "600"),
    ],
)
def test_bad_requests_are_rejected_at_admission_with_a_clear_message(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_max_tokens_none_means_up_to_the_context_length(llm):
    (out,) = llm.generate([[1] + [403] * 240], SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 256 - 241


def test_chat_uses_the_models_template_or_the_one_given(llm):
    # the built-in model's own template opens a story with the messages' text
    (own,) = llm.chat([{"role": "user", "content": "Once upon a time"}], greedy(4))
    assert own.prompt_token_ids == [1, 403, 407, 261, 378]
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (out,) = llm.chat([{"role": "user", "content": "Once upon a time"}], greedy(4), chat_template=template)
    assert out.prompt_token_ids[-4:] == [403, 407, 261, 378]
    assert out.outputs[0].token_ids == README_IDS[4:8]


def test_startup_fails_clearly_when_one_max_length_sequence_does_not_fit():
    with pytest.raises(ValueError, match=re.escape("fewer than one sequence of max_model_len=512")):
        LLM(kv_cache_memory="64KiB")


def test_unknown_model_path_is_a_clear_error():
    with pytest.raises(ValueError, match="not a local directory"):
        LLM(model="/nonexistent/model")


def test_prompt_logprobs_are_the_same_when_the_prompt_is_chunked(llm):
    prompt = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421]
    params = greedy(2, prompt_logprobs=1)
    (whole,) = llm.generate([prompt], params, use_tqdm=False)
    chunked_llm = LLM(max_model_len=256, max_num_batched_tokens=4)
    (chunked,) = chunked_llm.generate([prompt], params, use_tqdm=False)
    assert chunked_llm.engine.get_stats().num_chunked_prefill_steps > 0
    assert len(chunked.prompt_logprobs) == len(prompt)
    for a, b in zip(whole.prompt_logprobs[1:], chunked.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5) for t in a)


@pytest.mark.parametrize("prompt", [[1.5, 2.0], ["a", "b"], None, [True, 1], [[1, 2]]])
def test_prompts_that_are_not_token_ids_are_rejected_and_leave_the_engine_usable(llm, prompt):
    with pytest.raises(ValueError, match="a prompt must be a string"):
        llm.generate([prompt] if prompt is not None else [None], greedy(2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    (out,) = llm.generate([[1]], greedy(3), use_tqdm=False)
    assert out.outputs[0].token_ids == README_IDS[:3]


def test_request_ids_are_unique_per_caller_and_never_clash_with_forked_sequences():
    engine = LLM(max_model_len=256).engine
    engine.add_request("a", [1], SamplingParams(n=2, temperature=1.0, max_tokens=4, seed=3))
    engine.add_request("a#1", [1], greedy(4))  # looks like a's second sequence, but is its own request
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [1], greedy(4))
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {o.request_id: o for o in engine.step() if o.finished}
    assert sorted(finished) == ["a", "a#1"]
    assert len(finished["a"].outputs) == 2 and finished["a#1"].outputs[0].token_ids == README_IDS[:4]


def test_a_stop_string_in_the_last_allowed_token_is_reported_as_stop(llm):
    (full,) = llm.generate([[1]], greedy(12), use_tqdm=False)
    assert full.outputs[0].text.endswith("little girl")
    (out,) = llm.generate([[1]], greedy(12, stop=["girl"]), use_tqdm=False)
    assert out.outputs[0].text == "Once upon a time, there was a little "
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", "girl")
