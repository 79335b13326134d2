"""`pagoda generate` as a user runs it: a real process on the built-in model."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # starts real processes


def run_pagoda(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagoda.cli", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_generate_with_the_builtin_model_prints_the_story():
    result = run_pagoda("generate", "--max-tokens", "16", "--log-level", "warning")
    assert result.returncode == 0, result.stderr
    assert "Once upon a time, there was a little girl named Lily." in result.stdout


def test_generate_json_output_and_several_prompts():
    result = run_pagoda(
        "generate", "--prompt", "Tim and Sue", "--prompt", "Once upon a time", "--max-tokens", "4", "--json"
    )
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["prompt"] for line in lines] == ["Tim and Sue", "Once upon a time"]
    assert all(len(line["token_ids"]) == 4 and line["finish_reason"] == "length" for line in lines)
    assert "KV cache:" in result.stderr  # the log states how many blocks/tokens fit


def test_bad_settings_exit_with_a_clear_message_not_a_traceback():
    result = run_pagoda("generate", "--kv-cache-memory", "64KiB")
    assert result.returncode == 2
    assert "fewer than one sequence of max_model_len" in result.stderr
    assert "Traceback" not in result.stderr
    result = run_pagoda("generate", "--kv-cache-memory", "lots")
    assert result.returncode == 2 and "cannot parse 'lots' as a size" in result.stderr


def test_help_shows_the_defaults():
    result = run_pagoda("generate", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "--max-num-seqs MAX_NUM_SEQS sequences per step (default: 256)" in text
    assert "--block-size BLOCK_SIZE tokens per KV block (default: 16)" in text


def test_help_states_each_default_once_and_never_as_none():
    result = run_pagoda("serve", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "(default: None)" not in text
    assert "--tokenizer TOKENIZER tokenizer: the same forms as MODEL (default: the model's) --dtype" in text
    assert "--max-num-queued-requests MAX_NUM_QUEUED_REQUESTS" in text and "(default: 1024)" in text
