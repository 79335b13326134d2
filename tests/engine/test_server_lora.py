"""LoRA adapters through `pagoda serve` and the official openai client: selecting an adapter by model name, the
model list, runtime load and unload, the watched adapter list, errors, and the vLLM metric."""

import json
import time
from pathlib import Path

import openai
import pytest
from fake_hub import FakeHub
from lora_helpers import make_adapter
from server_helpers import Server, start_server

from pagoda import LLM, SamplingParams
from pagoda.config import builtin_model_path
from pagoda.lora import LoRARequest
from pagoda.lora.sources import adapters_offline

PROMPT = "Once upon a time"
BASE = "stories260K"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("server-lora")
    made = {name: make_adapter(builtin_model_path(), root / name, rank=8, seed=i, scale=0.3) for i, name in
            enumerate(("tales", "poems", "songs"))}  # fmt: skip
    broken = make_adapter(builtin_model_path(), root / "broken", rank=8, seed=9)
    config = json.loads((broken / "adapter_config.json").read_text())
    (broken / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    return {**made, "broken": broken}


@pytest.fixture(scope="module")
def expected(adapters) -> dict[str, str]:
    """Each adapter's greedy text in-process (the engine tests hold those tokens to PEFT's)."""
    llm = LLM(enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    texts = {BASE: llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text}
    for name in ("tales", "poems", "songs"):
        request = LoRARequest(name, 0, str(adapters[name]))
        texts[name] = llm.generate([PROMPT], params, use_tqdm=False, lora_request=request)[0].outputs[0].text
    assert len(set(texts.values())) == 4
    return texts


@pytest.fixture(scope="module")
def server(adapters, tmp_path_factory):
    listing = tmp_path_factory.mktemp("listing") / "adapters.json"
    listing.write_text("[]")
    server = start_server(
        "--enable-lora",
        "--lora-modules",
        f"tales={adapters['tales']}",
        "--lora-modules-file",
        str(listing),
        "--lora-modules-poll-seconds",
        "0.2",
        "--allow-runtime-lora-updates",
        "--lora-allowed-roots",
        str(adapters["tales"].parent),  # runtime loads read the other adapters beside it
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
    )
    server.listing = listing
    yield server
    server.stop()


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)


def complete(server: Server, model: str) -> openai.types.Completion:
    return client(server).completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0)


def test_a_requests_model_selects_its_adapter(server, expected) -> None:
    for model in (BASE, "tales"):
        response = complete(server, model)
        assert response.model == model and response.choices[0].text == expected[model]
    chat = client(server).chat.completions.create(
        model="tales", messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=8, temperature=0
    )
    assert chat.model == "tales" and chat.choices[0].message.content


def test_the_model_list_names_each_adapter_with_the_base_as_parent(server, adapters) -> None:
    models = {m.id: m for m in client(server).models.list().data}
    assert models["tales"].parent == BASE and models["tales"].root == str(adapters["tales"])
    assert models[BASE].parent is None


def test_adapters_load_and_unload_at_runtime(server, adapters, expected) -> None:
    status, _, body = server.request(
        "POST", "/v1/load_lora_adapter", {"lora_name": "songs", "lora_path": str(adapters["songs"])}
    )
    assert status == 200 and "added" in body
    assert complete(server, "songs").choices[0].text == expected["songs"]
    status, _, body = server.request("POST", "/v1/load_lora_adapter", {"lora_name": "songs", "lora_path": "/x"})
    assert status == 400 and "already loaded" in body["error"]["message"]
    status, _, _ = server.request("POST", "/v1/unload_lora_adapter", {"lora_name": "songs"})
    assert status == 200
    with pytest.raises(openai.NotFoundError) as caught:
        complete(server, "songs")
    assert caught.value.code == "model_not_found" and "'tales'" in caught.value.message
    status, _, body = server.request("POST", "/v1/unload_lora_adapter", {"lora_name": "songs"})
    assert status == 404 and body["error"]["param"] == "lora_name"


def test_a_failed_replacement_leaves_the_old_adapter_serving(server, adapters, expected) -> None:
    body = {"lora_name": "tales", "lora_path": str(adapters["broken"]), "load_inplace": True}
    status, _, error = server.request("POST", "/v1/load_lora_adapter", body)
    assert status == 400 and "use_dora" in error["error"]["message"]
    assert complete(server, "tales").choices[0].text == expected["tales"]
    body = {"lora_name": "tales", "lora_path": str(adapters["songs"]), "load_inplace": True}
    assert server.request("POST", "/v1/load_lora_adapter", body)[0] == 200
    assert complete(server, "tales").choices[0].text == expected["songs"]
    body = {"lora_name": "tales", "lora_path": str(adapters["tales"]), "load_inplace": True}
    assert server.request("POST", "/v1/load_lora_adapter", body)[0] == 200
    status, _, error = server.request("POST", "/v1/load_lora_adapter", {"lora_name": BASE, "lora_path": "/x"})
    assert status == 400 and "served model's name" in error["error"]["message"]


def test_a_malformed_or_missing_adapter_is_a_400_naming_the_problem(server, adapters) -> None:
    status, _, body = server.request(
        "POST", "/v1/load_lora_adapter", {"lora_name": "broken", "lora_path": str(adapters["broken"])}
    )
    assert status == 400 and "use_dora=True is not supported" in body["error"]["message"]
    status, _, body = server.request("POST", "/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": "/no/such"})
    assert status == 400 and body["error"]["param"] == "lora_path"
    assert complete(server, BASE).choices  # the server serves on


def wait_for_state(server: Server, name: str, state) -> dict:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        _, _, body = server.request("GET", "/lora_adapters")
        found = next((a for a in body["data"] if a["name"] == name), None)
        if (found is None and state is None) or (found is not None and found["state"] == state):
            return found
        time.sleep(0.1)
    raise AssertionError(f"adapter {name} never reached {state}: {body}")


def test_the_watched_list_loads_reports_and_unloads_adapters(server, adapters, expected) -> None:
    server.listing.write_text(
        json.dumps(
            [{"name": "poems", "path": str(adapters["poems"])}, {"name": "bad", "path": str(adapters["broken"])}]
        )
    )
    assert wait_for_state(server, "poems", "loaded")["origin"] == "file"
    assert "use_dora" in wait_for_state(server, "bad", "failed")["error"]
    assert complete(server, "poems").choices[0].text == expected["poems"]
    status, _, error = server.request("POST", "/v1/unload_lora_adapter", {"lora_name": "poems"})
    assert status == 400 and "adapter list file" in error["error"]["message"]  # the file owns it
    server.listing.write_text("[{not json")  # a broken list changes nothing
    time.sleep(0.6)
    assert complete(server, "poems").choices[0].text == expected["poems"]
    server.listing.write_text("[]")
    wait_for_state(server, "poems", None)
    with pytest.raises(openai.NotFoundError):
        complete(server, "poems")
    assert complete(server, "tales").choices[0].text == expected["tales"]  # the flag's adapter stays


def test_the_lora_metric_reports_slots_and_running_adapters(server) -> None:
    complete(server, "tales")
    _, _, text = server.request("GET", "/metrics")
    lines = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(lines) == 1 and 'max_lora="2"' in lines[0]
    assert 'running_lora_adapters=""' in lines[0]  # idle now; the series shows the current state only


def test_lora_flags_without_enable_lora_are_refused_before_start() -> None:
    with pytest.raises(RuntimeError, match="need --enable-lora"):
        start_server("--lora-modules", "a=/x")


def test_a_hub_adapter_downloads_while_the_model_stays_offline(adapters, expected, tmp_path, monkeypatch) -> None:
    # As the operator runs the engine: the model from the cache only (PAGODA_OFFLINE=1), adapters from the Hub.
    folder = adapters["songs"]
    files = {name: (folder / name).read_bytes() for name in ("adapter_config.json", "adapter_model.safetensors")}
    with FakeHub() as hub:
        hub.add_commit("pagoda-test/songs-lora", files)
        for name, value in {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "PAGODA_OFFLINE": "1"}.items():
            monkeypatch.setenv(name, value)  # start_server hands this process's environment to the server
        monkeypatch.setenv("PAGODA_LORA_OFFLINE", "0")
        server = start_server("--enable-lora", "--max-lora-rank", "8", "--lora-modules", "songs=pagoda-test/songs-lora")
        try:
            assert complete(server, "songs").choices[0].text == expected["songs"]
        finally:
            server.stop()


def test_adapters_follow_the_models_offline_mode_unless_told_otherwise(monkeypatch) -> None:
    monkeypatch.delenv("PAGODA_LORA_OFFLINE", raising=False)
    monkeypatch.setenv("PAGODA_OFFLINE", "1")
    assert adapters_offline()
    monkeypatch.setenv("PAGODA_LORA_OFFLINE", "0")
    assert not adapters_offline()
    monkeypatch.delenv("PAGODA_OFFLINE")
    monkeypatch.setenv("PAGODA_LORA_OFFLINE", "1")
    assert adapters_offline()
