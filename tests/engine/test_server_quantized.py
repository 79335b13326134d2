"""`pagoda serve` of a quantized checkpoint with an FP8 KV cache, through the official openai client: the method is
read from the checkpoint, the answers are the offline engine's, and a flag the checkpoint contradicts stops the
server at start-up with the reason the operator reports."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest
import torch
from server_helpers import start_server

from pagoda import LLM, SamplingParams
from pagoda.config import builtin_model_path
from pagoda.testing.quant_writers import write_quantized_checkpoint

PROMPTS = [[1, 20, 31, 42, 53], [1, 100, 7]]  # token ids: the tiny model's vocabulary is 256
FLAGS = ("--max-model-len", "128", "--kv-cache-memory", "16MiB", "--kv-cache-dtype", "fp8_e4m3", "--dtype", "bfloat16")


@pytest.fixture(scope="module")
def awq_model(tiny, tmp_path_factory):
    return write_quantized_checkpoint(
        tiny.get("qwen3", torch.float32), tmp_path_factory.mktemp("served") / "awq", "awq", bits=4, group_size=32
    )


def test_an_awq_checkpoint_with_an_fp8_kv_cache_answers_the_openai_client_like_the_offline_engine(awq_model):
    tokenizer = str(builtin_model_path())
    offline = LLM(
        model=str(awq_model),
        tokenizer=tokenizer,
        max_model_len=128,
        kv_cache_memory="16MiB",
        kv_cache_dtype="fp8_e4m3",
        dtype="bfloat16",
    )
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = [o.outputs[0].text for o in offline.generate(PROMPTS, params, use_tqdm=False)]
    assert offline.engine.executor.driver_worker.model_runner.kv_caches[0].dtype == torch.float8_e4m3fn
    assert (
        "int4-native-gated" in offline.engine.executor.driver_worker.model_runner.linear_kernels
        or "int4-torch" in offline.engine.executor.driver_worker.model_runner.linear_kernels
    )
    del offline
    server = start_server(str(awq_model), "--tokenizer", tokenizer, "--served-model-name", "awq", *FLAGS)
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        texts = [
            client.completions.create(
                model="awq", prompt=p, max_tokens=16, temperature=0.0, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .text
            for p in PROMPTS
        ]
        assert texts == expected
    finally:
        assert server.stop() == 0


def test_a_quantization_flag_the_checkpoint_contradicts_stops_the_server_with_unsupported_spec(awq_model):
    result = subprocess.run(
        [sys.executable, "-m", "pagoda.cli", "serve", str(awq_model), "--quantization", "int8", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "UnsupportedSpec" in result.stderr + result.stdout and "awq" in result.stderr + result.stdout
