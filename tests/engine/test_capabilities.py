"""The capability contract (`pagoda capabilities --json`) says exactly what the engine does, and start-up failures
are classified into the reasons the operator reports."""

import errno
import json
import subprocess
import sys

import pytest
import torch

from pagoda.capabilities import QUANTIZATION_DEVICES
from pagoda.cli import build_parser
from pagoda.layers.linear_kernels import validate_quantization
from pagoda.model_source import ModelSourceError
from pagoda.startup_failure import InsufficientMemoryError, classify, report_startup_failure


def contract() -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "pagoda.cli", "capabilities", "--json"], capture_output=True, text=True, check=True
    )
    return json.loads(result.stdout)


def test_the_contract_lists_every_flag_serve_takes() -> None:
    serve = next(a for a in build_parser()._subparsers._actions if a.choices and "serve" in a.choices).choices["serve"]
    flags = {option for action in serve._actions for option in action.option_strings if option.startswith("--")}
    assert set(contract()["serve_flags"]) == flags
    assert {"--revision", "--download-dir", "--chat-template", "--max-prompt-chars"} <= flags


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("method", ["int8", "awq", "gptq", "fp8", "bitsandbytes"])
def test_quantization_is_accepted_exactly_where_the_contract_says(device: str, method: str) -> None:
    promised = method in contract()["devices"][device]["quantization"]
    if promised:
        validate_quantization(method, torch.device(device))
    else:
        with pytest.raises(ValueError, match=method):
            validate_quantization(method, torch.device(device))
    assert promised == (device in QUANTIZATION_DEVICES.get(method, ()))


def serve_error(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pagoda.cli", "serve", *args, "--port", "0"]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_tensor_parallelism_and_lora_beyond_the_contract_are_refused_before_the_server_starts() -> None:
    data = contract()
    beyond = str(data["devices"]["cpu"]["tensor_parallel_max"] + 1)
    result = serve_error("--tensor-parallel-size", beyond)
    assert (
        result.returncode == 2 and f"UnsupportedSpec: --tensor-parallel-size {beyond} is not supported" in result.stderr
    )
    result = serve_error("--tensor-parallel-size", "2", "--enable-lora")
    assert result.returncode == 2 and "--enable-lora is not supported with --tensor-parallel-size" in result.stderr
    if not data["lora"]["supported"]:
        result = serve_error("--enable-lora")
        assert result.returncode == 2 and "UnsupportedSpec: LoRA" in result.stderr


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (ModelSourceError("ModelNotFound", "org/m", "no such model"), "ModelNotFound"),
        (ModelSourceError("Unauthorized", "org/m", "refused"), "Unauthorized"),
        (InsufficientMemoryError("the KV cache holds 3 blocks"), "OutOfMemory"),
        (torch.OutOfMemoryError("CUDA out of memory"), "OutOfMemory"),
        (MemoryError(), "OutOfMemory"),
        (ValueError("quantization 'awq' is not supported"), "UnsupportedSpec"),
        (OSError(errno.ENOSPC, "No space left on device"), "OutOfDiskSpace"),
        (RuntimeError("safetensors header\nis corrupt"), "ModelLoadFailed"),
    ],
)
def test_startup_failures_are_classified_into_one_line(error: BaseException, reason: str) -> None:
    got, message = classify(error)
    assert got == reason and message and "\n" not in message


def test_the_termination_message_is_written_where_kubernetes_reads_it(tmp_path, monkeypatch) -> None:
    path = tmp_path / "termination-log"
    monkeypatch.setenv("PAGODA_TERMINATION_LOG", str(path))
    line = report_startup_failure(ModelSourceError("ModelNotFound", "org/m", "no such model on the Hub"))
    assert path.read_text() == line == "ModelNotFound: model 'org/m': no such model on the Hub"
    report_startup_failure(ValueError("x" * 10_000))
    assert len(path.read_bytes()) == 4096  # the kubelet's limit


def test_the_contract_lists_the_architectures_the_engine_builds() -> None:
    from pagoda.models.registry import get_model_class

    listed = contract()["architectures"]
    assert {"LlamaForCausalLM", "Qwen3ForCausalLM"} <= set(listed) and listed == sorted(listed)
    for architecture in listed:
        get_model_class(architecture)  # each one has a model class


def test_an_unsupported_architecture_stops_start_up_with_one_line_naming_it_and_the_supported_ones(
    tmp_path, monkeypatch
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
    }
    (model / "config.json").write_text(json.dumps(config))
    termination = tmp_path / "termination-log"
    monkeypatch.setenv("PAGODA_TERMINATION_LOG", str(termination))
    result = serve_error("--model", str(model))
    assert result.returncode != 0
    line = termination.read_text()
    assert "\n" not in line and line.startswith("UnsupportedSpec: ")
    assert "'DeepseekV3ForCausalLM' is not supported" in line
    assert all(name in line for name in contract()["architectures"])
