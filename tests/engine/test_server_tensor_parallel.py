"""`pagoda serve --tensor-parallel-size 2` with the official openai client: the same greedy text as one rank, and a
worker killed mid-generation fails the stream and makes the server exit non-zero (so Kubernetes restarts it)."""

from __future__ import annotations

import os
import re
import signal
import time

import openai
import pytest
from server_helpers import start_server

# stories260K (the built-in model): 8 heads, 4 KV heads, intermediate 172, all divisible by 2
SERVE_ARGS = ("--max-model-len", "256", "--kv-cache-memory", "64MiB", "--distributed-timeout-seconds", "10")
PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben went to the park"]


def _completions(client: openai.OpenAI) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        response = client.completions.create(model="stories260K", prompt=prompt, max_tokens=40, temperature=0.0)
        texts.append(response.choices[0].text)
    chat = client.chat.completions.create(
        model="stories260K", messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=30, temperature=0
    )
    return [*texts, chat.choices[0].message.content]


@pytest.fixture(scope="module")
def one_rank_texts() -> list[str]:
    server = start_server(*SERVE_ARGS)
    try:
        return _completions(openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0))
    finally:
        server.stop()


def test_two_ranks_answer_the_openai_client_with_one_ranks_greedy_text_and_die_loudly(one_rank_texts, tmp_path):
    log = tmp_path / "serve.log"
    server = start_server(*SERVE_ARGS, "--tensor-parallel-size", "2", "--log-level", "info", log_path=str(log))
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
        assert _completions(client) == one_rank_texts
        assert all(one_rank_texts)
        rank1_pid = int(re.search(r"tensor-parallel rank 1 runs in pid (\d+)", server.log()).group(1))
        stream = client.completions.create(
            model="stories260K",
            prompt="Once upon a time",
            max_tokens=240,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        # The headers are back, so the request is running; 240 tokens take far longer than this kill.
        killed = time.monotonic()
        os.kill(rank1_pid, signal.SIGKILL)
        with pytest.raises(openai.APIError):
            for _ in stream:
                pass
        assert server.process.wait(30) != 0  # Kubernetes restarts the pod
        assert time.monotonic() - killed < 30
        assert "tensor-parallel worker pagoda-tp-rank-1" in server.log()
    finally:
        server.stop()
