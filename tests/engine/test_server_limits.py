"""The server's per-request limits, admission by sequences, and the tokenizer pool, without a server process."""

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from pagoda.config import builtin_model_path
from pagoda.entrypoints.openai.errors import OpenAIError
from pagoda.entrypoints.openai.limits import AdmissionControl, RequestChecker, ServerLimits
from pagoda.entrypoints.openai.tokenizer_pool import TokenizerPool, TokenizerPoolError, TokenizerSpec
from pagoda.tokenizer import get_tokenizer

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def checker(**limits) -> RequestChecker:
    resolved = ServerLimits(**limits)
    return RequestChecker(resolved, resolved.prompt_chars(512))


def error_of(call) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        call()
    return info.value


def test_the_prompt_character_limit_follows_max_model_len_unless_set() -> None:
    assert ServerLimits().prompt_chars(512) == 16 * 512
    assert ServerLimits(max_prompt_chars=100).prompt_chars(512) == 100


@pytest.mark.parametrize(
    ("call", "param", "flag"),
    [
        (lambda c: c.check_prompts(["a"] * 257), "prompt", "--max-prompts-per-request"),
        (lambda c: c.check_prompts(["a" * 8193]), "prompt", "--max-prompt-chars"),
        (lambda c: c.check_messages([{"role": "user", "content": "x"}] * 1025), "messages", "--max-messages"),
        (lambda c: c.check_messages([{"role": "user", "content": "x" * 5000}] * 2), "messages", "--max-prompt-chars"),
        (lambda c: c.check_sampling(129, None, None, None), "n", "--max-n"),
        (lambda c: c.check_sampling(1, ["s"] * 65, None, None), "stop", "--max-stop-sequences"),
        (lambda c: c.check_sampling(1, "s" * 9000, None, None), "stop", "--max-prompt-chars"),
        (lambda c: c.check_sampling(1, None, list(range(65)), None), "stop_token_ids", "--max-stop-sequences"),
        (
            lambda c: c.check_sampling(1, None, None, {str(i): 1.0 for i in range(1025)}),
            "logit_bias",
            "--max-logit-bias",
        ),
    ],
)
def test_each_limit_is_a_400_naming_the_field_and_the_flag(call, param: str, flag: str) -> None:
    error = error_of(lambda: call(checker()))
    assert (error.status_code, error.param) == (400, param)
    assert flag in error.message


def test_requests_within_the_limits_pass() -> None:
    c = checker()
    c.check_prompts(["a" * 8192] * 255 + [[1] * 100_000])  # token ids are checked by the engine, not here
    c.check_messages([{"role": "user", "content": [{"type": "text", "text": "x" * 4000}]}] * 2)
    c.check_sampling(128, ["s"] * 64, list(range(64)), {str(i): 1.0 for i in range(1024)})


def test_nested_message_text_counts_toward_the_limit_at_any_depth() -> None:
    deep: object = "x" * 9000
    for _ in range(5000):  # deeper than Python's recursion limit
        deep = [deep]
    assert error_of(lambda: checker().check_messages([{"role": "user", "content": deep}])).param == "messages"


def test_invalid_limits_are_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="--max-n must be positive"):
        ServerLimits(max_n=0).validate()
    with pytest.raises(ValueError, match="--http-body-timeout must be positive"):
        ServerLimits(http_body_timeout=-1.0).validate()


def test_admission_counts_sequences_and_reservations() -> None:
    engine_waiting = [0]
    admission = AdmissionControl(10, lambda: engine_waiting[0])
    first = admission.reserve(6)  # e.g. 3 prompts x n=2
    assert admission.num_waiting == 6
    assert error_of(lambda: admission.reserve(5)).status_code == 429  # 6 + 5 > 10
    second = admission.reserve(4)
    assert admission.num_waiting == 10
    first.release()
    first.release()  # idempotent
    engine_waiting[0] = 6  # the released sequences are in the engine's own count now
    assert admission.num_waiting == 10
    second.release()
    engine_waiting[0] = 0
    assert admission.num_waiting == 0


def test_a_request_larger_than_the_whole_queue_is_a_400_not_a_429() -> None:
    admission = AdmissionControl(1024, lambda: 0)
    error = error_of(lambda: admission.reserve(50_000))
    assert error.status_code == 400 and "--max-num-queued-requests" in error.message
    with admission.reserve(1024):
        assert admission.num_waiting == 1024
    assert admission.num_waiting == 0


# --- the tokenizer pool ---------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["process", "thread"])
def pool(request):
    pool = TokenizerPool(TokenizerSpec(str(builtin_model_path()), TEMPLATE), request.param, size=1)
    pool.start().wait()
    yield pool
    pool.shutdown()


def test_the_pool_tokenizes_as_the_tokenizer_does(pool) -> None:
    tokenizer = get_tokenizer(builtin_model_path())
    messages = [{"role": "user", "content": "Once upon a time"}]

    async def main():
        ids = await pool.encode("Once upon a time")
        chat = await pool.render_chat(messages, True)
        text = await pool.decode(ids)
        return ids, chat, text

    ids, chat, text = asyncio.run(main())
    assert ids == tokenizer.encode("Once upon a time")
    assert chat == tokenizer.encode("user: Once upon a time\n", add_special_tokens=False)
    assert text == tokenizer.decode(ids)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p: p.encode("abc\ud800"), "not valid Unicode"),
        (lambda p: p.render_chat([{"role": "user", "content": "\udfff"}], True), "not valid Unicode"),
        (lambda p: p.render_chat([{"role": "user", "content": [{"type": "image_url"}]}], True), "only text"),
    ],
)
def test_input_the_tokenizer_refuses_is_a_value_error(pool, call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        asyncio.run(call(pool))


def test_a_dead_worker_process_fails_one_call_and_the_pool_recovers() -> None:
    pool = TokenizerPool(TokenizerSpec(str(builtin_model_path())), "process", size=1)
    pool.start().wait()
    try:
        (pid,) = pool._get_executor()._processes  # the worker a tokenizer crash would take down
        os.kill(pid, signal.SIGKILL)

        async def main():
            with pytest.raises(TokenizerPoolError):
                await pool.encode("Once")
            return await pool.encode("Once")

        assert asyncio.run(main()) == get_tokenizer(builtin_model_path()).encode("Once")
    finally:
        pool.shutdown()


WORKER_OWNER = """
import time
from pagoda.config import builtin_model_path
from pagoda.entrypoints.openai.tokenizer_pool import TokenizerPool, TokenizerSpec

pool = TokenizerPool(TokenizerSpec(str(builtin_model_path())), "process", size=2)
pool.start().wait()
print(" ".join(str(pid) for pid in pool._get_executor()._processes), flush=True)
time.sleep(120)
"""


def test_worker_processes_never_outlive_the_server() -> None:
    owner = subprocess.Popen([sys.executable, "-c", WORKER_OWNER], stdout=subprocess.PIPE, text=True)
    workers = [int(pid) for pid in owner.stdout.readline().split()]
    assert len(workers) == 2
    owner.kill()  # SIGKILL: no shutdown code runs in the server
    owner.wait()
    deadline = time.monotonic() + 10
    while any(_running(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_running(pid) for pid in workers)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()  # a zombie has exited
    except FileNotFoundError:
        return False
