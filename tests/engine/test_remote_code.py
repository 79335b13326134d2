"""A checkpoint's own Python code is never run: ``auto_map`` entries in config.json or tokenizer_config.json point
at .py files in the checkpoint (a Hub repo or S3 prefix anyone may publish), and the engine never imports them,
whether or not the architecture is one it knows. The "evil" files below write a marker file and raise when
imported, so an import anywhere (transformers' dynamic-module loader included) shows up as the marker."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from server_helpers import start_server

from pagoda.config import builtin_model_path
from pagoda.entrypoints.llm import LLM
from pagoda.model_config import ModelConfig
from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer import get_tokenizer

AUTO_TOKENIZER = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", "tokenization_evil.EvilTokenizer"]}
AUTO_CONFIG = {"AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilModel"}


def evil_checkpoint(tmp_path: Path, config: dict[str, Any], tokenizer: dict[str, Any], drop: tuple[str, ...] = ()):
    """The built-in model with ``config`` / ``tokenizer`` merged into its JSON files (keys in ``drop`` removed from
    tokenizer_config.json) and three .py files that leave ``tmp_path/imported`` behind when imported."""
    folder = tmp_path / "evil-model"
    shutil.copytree(builtin_model_path(), folder)
    marker = tmp_path / "imported"
    code = f"import pathlib\npathlib.Path({str(marker)!r}).write_text(__name__)\nraise RuntimeError('imported')\n"
    for name in ("configuration_evil.py", "tokenization_evil.py", "modeling_evil.py"):
        (folder / name).write_text(code)
    for name, extra in (("config.json", config), ("tokenizer_config.json", tokenizer)):
        data = {**json.loads((folder / name).read_text()), **extra}
        for key in drop if name == "tokenizer_config.json" else ():
            data.pop(key, None)
        (folder / name).write_text(json.dumps(data))
    return folder, marker


def test_a_tokenizer_only_its_own_code_can_build_is_refused_clearly(tmp_path) -> None:
    folder, marker = evil_checkpoint(tmp_path, {}, {"tokenizer_class": "EvilTokenizer", "auto_map": AUTO_TOKENIZER})
    with pytest.raises(ValueError, match=r"needs the checkpoint's own Python code \(auto_map\), which pagoda never"):
        get_tokenizer(folder)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("config", "tokenizer", "drop"),
    [
        pytest.param({}, {"auto_map": AUTO_TOKENIZER}, (), id="auto_map-beside-a-known-tokenizer-class"),
        pytest.param({"auto_map": {**AUTO_CONFIG, **AUTO_TOKENIZER}}, {}, ("tokenizer_class",), id="config-auto_map"),
        pytest.param(
            {"model_type": "evil", "auto_map": AUTO_CONFIG}, {}, ("tokenizer_class",), id="unknown-model-type"
        ),
    ],
)
def test_auto_map_entries_are_ignored_when_the_tokenizer_is_a_standard_one(tmp_path, config, tokenizer, drop) -> None:
    folder, marker = evil_checkpoint(tmp_path, config, tokenizer, drop)
    assert get_tokenizer(folder).encode("Once upon a time")
    assert not marker.exists()


def test_the_engine_loads_and_runs_a_checkpoint_with_auto_map_without_importing_it(tmp_path) -> None:
    config = {"auto_map": {**AUTO_CONFIG, **AUTO_TOKENIZER}}
    folder, marker = evil_checkpoint(tmp_path, config, {"auto_map": AUTO_TOKENIZER})
    assert ModelConfig.from_model_dir(folder).architecture == "LlamaForCausalLM"
    with LLM(model=str(folder), max_model_len=128) as llm:
        (output,) = llm.generate(["Once upon a time"], SamplingParams(max_tokens=4, temperature=0))
    assert output.outputs[0].text
    assert not marker.exists()


def test_an_unknown_architecture_with_its_own_code_is_refused_without_importing_it(tmp_path) -> None:
    config = {"architectures": ["EvilForCausalLM"], "model_type": "evil", "auto_map": AUTO_CONFIG}
    folder, marker = evil_checkpoint(tmp_path, config, {}, ("tokenizer_class",))
    with pytest.raises(ValueError, match="EvilForCausalLM"):
        LLM(model=str(folder), max_model_len=128)
    assert not marker.exists()


def test_pagoda_serve_starts_and_chats_on_a_checkpoint_with_auto_map_without_importing_it(tmp_path) -> None:
    """The server's tokenizers (its tokenizer pool among them) load the same checkpoint, in other processes."""
    config = {"auto_map": {**AUTO_CONFIG, **AUTO_TOKENIZER}}
    folder, marker = evil_checkpoint(tmp_path, config, {"auto_map": AUTO_TOKENIZER})
    server = start_server(str(folder), "--max-model-len", "128")
    try:
        messages = [{"role": "user", "content": "Once upon a time"}]
        status, _, body = server.request("POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 4})
        assert status == 200, body
    finally:
        server.stop()
    assert not marker.exists()
