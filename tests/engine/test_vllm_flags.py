"""A ``vllm serve`` command line (or a Helm values file's flags) runs as ``pagoda serve``: every flag below parses,
the ones without meaning here warn once, ``--trust-remote-code`` is refused, ``--config FILE`` equals its flags on
the command line, and a real server started with such a command line (TLS, a root path) answers the openai client."""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import json
import logging
import ssl
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from tests.engine.server_helpers import free_port

from pagoda.capabilities import builtin_model_path
from pagoda.cli import build_parser, parse_args
from pagoda.cli_models import engine_args_from
from pagoda.vllm_flags import VLLM_FLAGS, apply_vllm_args, flag_table
from pagoda.vllm_flags.table import KINDS, NO_EFFECT, REFUSED

# The vllm serve flags that `pagoda serve` takes, each with a value vLLM users write (none: a switch).
VLLM_SERVE_FLAGS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("--model", ("org/model",)),
    ("--host", ("0.0.0.0",)),
    ("--port", ("8080",)),
    ("--api-key", ("sk-1", "sk-2")),
    ("--served-model-name", ("llama",)),
    ("--kv-events-config", ('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}',)),
    ("--max-model-len", ("32k",)),
    ("--dtype", ("bfloat16",)),
    ("--seed", ("0",)),
    ("--gpu-memory-utilization", ("0.9",)),
    ("--tensor-parallel-size", ("1",)),
    ("--pipeline-parallel-size", ("1",)),
    ("--data-parallel-size", ("1",)),
    ("--max-num-seqs", ("64",)),
    ("--max-num-batched-tokens", ("8192",)),
    ("--block-size", ("16",)),
    ("--enable-prefix-caching", ()),
    ("--no-enable-prefix-caching", ()),
    ("--enable-chunked-prefill", ()),
    ("--kv-cache-dtype", ("fp8",)),
    ("--quantization", ("awq",)),
    ("--enforce-eager", ()),
    ("--max-seq-len-to-capture", ("8192",)),
    ("--download-dir", ("/models",)),
    ("--revision", ("main",)),
    ("--code-revision", ("main",)),
    ("--tokenizer", ("org/tokenizer",)),
    ("--tokenizer-mode", ("auto",)),
    ("--load-format", ("safetensors",)),
    ("--config-format", ("hf",)),
    ("--hf-overrides", ('{"max_position_embeddings": 8192}',)),
    ("--override-generation-config", ('{"temperature": 0.6, "top_p": 0.95}',)),
    ("--generation-config", ("vllm",)),
    ("--disable-log-stats", ()),
    ("--disable-log-requests", ()),
    ("--enable-log-requests", ()),
    ("--uvicorn-log-level", ("warning",)),
    ("--ssl-keyfile", ("/tls/key.pem",)),
    ("--ssl-certfile", ("/tls/cert.pem",)),
    ("--ssl-ca-certs", ("/tls/ca.pem",)),
    ("--ssl-cert-reqs", ("0",)),
    ("--root-path", ("/llm",)),
    ("--allowed-origins", ('["*"]',)),
    ("--allowed-methods", ('["GET", "POST"]',)),
    ("--allowed-headers", ('["*"]',)),
    ("--allow-credentials", ()),
    ("--chat-template", ("{{ messages[0]['content'] }}",)),
    ("--chat-template-content-format", ("auto",)),
    ("--response-role", ("assistant",)),
    ("--enable-auto-tool-choice", ()),
    ("--tool-call-parser", ("hermes",)),
    ("--reasoning-parser", ("qwen3",)),
    ("--enable-reasoning", ()),
    ("--enable-lora", ()),
    ("--max-loras", ("2",)),
    ("--max-lora-rank", ("64",)),
    ("--max-cpu-loras", ("4",)),
    ("--lora-modules", ("sql=/adapters/sql",)),
    ("--swap-space", ("4",)),
    ("--cpu-offload-gb", ("0",)),
    ("--scheduling-policy", ("priority",)),
    ("--max-logprobs", ("20",)),
    ("--disable-frontend-multiprocessing", ()),
    ("--enable-prompt-tokens-details", ()),
    ("--enable-force-include-usage", ()),
    ("--return-tokens-as-token-ids", ()),
    ("--structured-outputs-config", ('{"backend": "xgrammar"}',)),
    ("--guided-decoding-backend", ("xgrammar",)),
    ("--disable-fastapi-docs", ()),
    ("--disable-uvicorn-access-log", ()),
    ("--enable-server-load-tracking", ()),
    ("--max-log-len", ("100",)),
    ("--distributed-executor-backend", ("mp",)),
    ("--worker-cls", ("auto",)),
    ("--compilation-config", ('{"level": 3}',)),
    ("-O3", ()),
    ("--kv-transfer-config", ('{"kv_connector": "NixlConnector"}',)),
    ("--limit-mm-per-prompt", ('{"image": 0}',)),
    ("--mm-processor-kwargs", ("{}",)),
    ("--disable-custom-all-reduce", ()),
    ("--num-scheduler-steps", ("1",)),
    ("--async-scheduling", ()),
    ("--enable-expert-parallel", ()),
    ("--hf-token", ()),
    ("--trust-remote-code", ()),
    ("--no-trust-remote-code", ()),
    ("--no-enforce-eager", ()),
    ("--no-enable-log-requests", ()),
)


def parse(*args: str):
    return parse_args(build_parser(), ["serve", *args])


@pytest.mark.parametrize(("flag", "values"), VLLM_SERVE_FLAGS, ids=[flag for flag, _ in VLLM_SERVE_FLAGS])
def test_every_vllm_flag_parses(flag: str, values: tuple[str, ...]) -> None:
    ns = parse(flag, *values)
    name = flag.split("=")[0] if flag.startswith("--") else "--compilation-config"
    entry = next(e for e in VLLM_FLAGS if e.flag == name.replace("--no-", "--"))
    if entry.kind == REFUSED and flag == entry.flag:  # --no-trust-remote-code asks for nothing
        with pytest.raises(ValueError, match=f"{entry.flag} is refused"):
            apply_vllm_args(ns)
    else:
        apply_vllm_args(ns)


def test_the_table_names_only_real_pagoda_flags() -> None:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    options = set(serve._option_string_actions)
    assert {entry.flag for entry in VLLM_FLAGS} <= options
    assert len(VLLM_FLAGS) >= 70 and len({entry.flag for entry in VLLM_FLAGS}) == len(VLLM_FLAGS)
    listed = {flag for flag, _ in VLLM_SERVE_FLAGS if flag.startswith("--")}
    assert listed <= options


def test_flags_without_effect_warn_once_each_and_the_others_do_not(caplog: pytest.LogCaptureFixture) -> None:
    refused = {entry.flag for entry in VLLM_FLAGS if entry.kind == REFUSED}
    flags = [(flag, values) for flag, values in VLLM_SERVE_FLAGS if flag not in refused and "--no-" not in flag]
    command = [part for flag, values in flags for part in (flag, *values)]
    ns = parse(*command, "--swap-space", "8")  # given twice, warned about once
    with caplog.at_level(logging.WARNING, logger="pagoda.vllm_flags"):
        apply_vllm_args(ns)
    warned = sorted(record.getMessage().split()[0] for record in caplog.records)
    given = {"--compilation-config" if flag == "-O3" else flag for flag, _ in flags}
    assert warned == sorted(e.flag for e in VLLM_FLAGS if e.kind == NO_EFFECT and e.flag in given)
    assert all("has no effect in Pagoda: " in record.getMessage() for record in caplog.records)


def serve_fails(*args: str) -> str:
    """stderr of a `pagoda serve` that must fail at start with exit status 2 and one line."""
    command = [sys.executable, "-m", "pagoda.cli", "serve", *args, "--port", "0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    return result.stderr


def test_trust_remote_code_is_refused_in_one_line() -> None:
    assert "never runs a checkpoint's own Python code" in serve_fails("--trust-remote-code")


def test_a_config_file_with_unknown_keys_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "values.yaml").write_text("max-model-len: 64\nmax-batch: 4\n")
    assert "unknown keys 'max-batch'" in serve_fails("--config", str(tmp_path / "values.yaml"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--load-format", "pt"), "--load-format pt is not supported"),
        (("--load-format", "dummy"), "accepted: auto, safetensors"),
        (("--tokenizer-mode", "mistral"), "--tokenizer-mode mistral is not supported"),
        (("--pipeline-parallel-size", "2"), "--pipeline-parallel-size 2 is not supported"),
        (("--structured-outputs-config", '{"backend": "guidance"}'), "'guidance' is not supported"),
        (("--structured-outputs-config", '{"backend": "xgrammar", "x": 1}'), "'x' not supported"),
        (("--guided-decoding-backend", "outlines"), "'outlines' is not supported"),
        (("--tokenizer-revision", "v2"), "--tokenizer-revision v2 is not supported"),
        (("--middleware", "my.Middleware"), "--middleware is refused"),
        (("--model", "a", "b"), "--model a and the positional MODEL b differ"),
        (("--hf-overrides", '{"hidden_size": 8, "rope_theta": 5.0}'), "--hf-overrides: cannot honour 'hidden_size'"),
        (("--hf-overrides", "[1]"), "--hf-overrides must be a JSON object"),
        (("--override-generation-config", '{"max_new_tokens": 8}'), "cannot honour 'max_new_tokens'"),
        (("--served-model-name", "a", "b"), "one name is served, got 2"),
        (("--ssl-keyfile", "/key.pem"), "HTTPS needs both --ssl-keyfile and --ssl-certfile"),
        (("--root-path", "llm"), "--root-path must start with '/'"),
        (("--max-logprobs", "-2"), "max_logprobs must be -1"),
    ],
)
def test_values_pagoda_cannot_honour_are_refused_naming_them(args: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        ns = parse(*args)
        apply_vllm_args(ns)
        server_config(ns).validate()


def test_max_logprobs_bounds_the_engine_and_minus_one_is_the_vocabulary() -> None:
    from pagoda import LLM, SamplingParams

    llm = LLM(max_logprobs=-1)
    vocab = llm.engine.model_config.vocab_size
    assert llm.engine.max_logprobs == vocab
    output = llm.generate(["Once"], SamplingParams(max_tokens=1, logprobs=vocab, temperature=0.0))[0].outputs[0]
    assert len(output.logprobs[0]) == vocab
    with pytest.raises(ValueError, match="exceeds the maximum of 3"):
        LLM(max_logprobs=3).generate(["Once"], SamplingParams(max_tokens=1, logprobs=4))


def test_model_flag_and_positional() -> None:
    ns = parse("--model", "org/m")
    apply_vllm_args(ns)
    assert ns.model == "org/m"
    ns = parse("org/m", "--model", "org/m")
    apply_vllm_args(ns)
    assert ns.model == "org/m"
    assert parse("org/m").model == "org/m"
    assert server_config(parse("--served-model-name", "a")).served_model_name == "a"


def test_config_file_equals_its_flags_and_the_command_line_wins(tmp_path: Path) -> None:
    config = tmp_path / "vllm.yaml"
    config.write_text(
        "model: org/m\nmax-model-len: 1024\nmax_num_seqs: 8\nenable-prefix-caching: false\nenforce_eager: true\n"
        "disable-log-requests: true\nallowed-origins: [http://a, http://b]\nhf_overrides: {rope_theta: 5.0}\n"
        "lora-modules: [a=/x, b=/y]\nenable-lora: true\nseed: 3\n"
    )
    flags = [
        *("--model=org/m", "--max-model-len=1024", "--max-num-seqs=8", "--no-enable-prefix-caching"),
        *("--enforce-eager", "--disable-log-requests", "--allowed-origins=http://a", "--allowed-origins=http://b"),
        *('--hf-overrides={"rope_theta":5.0}', "--lora-modules", "a=/x", "b=/y", "--enable-lora", "--seed=3"),
    ]
    from_file, from_flags = parse("--config", str(config)), parse(*flags)
    assert server_config(from_file) == server_config(from_flags)
    assert server_config(from_file).engine_args.hf_overrides == {"rope_theta": 5.0}
    unparsed = {"hf_overrides"}  # the same JSON object, spelt with other spaces
    assert {k: v for k, v in vars(from_file).items() if k not in unparsed} == {
        k: v for k, v in vars(from_flags).items() if k not in unparsed
    }
    ns = parse("--config", str(config), "--max-num-seqs", "2", "--enable-prefix-caching", "other/m")
    assert (ns.max_num_seqs, ns.enable_prefix_caching, ns.model, ns.model_flag) == (2, True, "other/m", None)
    assert ns.max_model_len == 1024
    config.write_text("max-model-len: 1024\nswap_spaces: 4\nbogus: 1\n")
    with pytest.raises(ValueError, match="unknown keys 'swap_spaces', 'bogus'"):
        parse("--config", str(config))


def server_config(ns):
    from pagoda.entrypoints.openai.defaults import ServerConfig
    from pagoda.options import from_namespace

    return from_namespace(ServerConfig, ns, engine_args=engine_args_from(ns), api_keys=())


# ---- a real server started with a vLLM command line, over HTTPS, behind a root path --------------------------------


def _self_signed(folder: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_path, cert_path = folder / "key.pem", folder / "cert.pem"
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


def _get(port: int, context: ssl.SSLContext, path: str, key: str = "") -> tuple[int, bytes]:
    conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=30, context=context)
    conn.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
    response = conn.getresponse()
    body = response.read()
    conn.close()
    return response.status, body


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("vllm_flags")
    key_path, cert_path = _self_signed(folder)
    (folder / "values.yaml").write_text("max_num_seqs: 8\nenable-prefix-caching: true\ndisable_log_stats: true\n")
    port = free_port()
    command = [
        *(sys.executable, "-m", "pagoda.cli", "serve", "--model", str(builtin_model_path())),
        *("--config", str(folder / "values.yaml"), "--host", "127.0.0.1", "--port", str(port)),
        *("--served-model-name", "stories", "--api-key", "sk-vllm", "--dtype", "float32", "--seed", "0"),
        *("--tensor-parallel-size", "1", "--pipeline-parallel-size", "1", "--max-num-batched-tokens", "512"),
        *("--gpu-memory-utilization", "0.9", "--block-size", "16", "--kv-cache-dtype", "auto"),
        *("--disable-log-requests", "--uvicorn-log-level", "warning", "--log-level", "warning"),
        *("--ssl-keyfile", str(key_path), "--ssl-certfile", str(cert_path), "--root-path", "/llm"),
        *("--load-format", "safetensors", "--tokenizer-mode", "auto"),
        *("--hf-overrides", '{"max_position_embeddings": 256}'),
        *("--override-generation-config", '{"temperature": 0.0}', "--max-logprobs", "5"),
        *("--structured-outputs-config", '{"backend": "xgrammar"}', "--enable-force-include-usage"),
        *("--swap-space", "4", "--disable-custom-all-reduce", "--num-scheduler-steps", "1", "--enforce-eager"),
    ]
    log_path = folder / "server.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
    context = ssl.create_default_context(cafile=str(cert_path))
    deadline = time.monotonic() + 90
    try:
        while True:
            assert process.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "not ready in 90 s: " + log_path.read_text()
            try:
                if _get(port, context, "/ready")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        yield port, context, log_path
    finally:
        process.terminate()
        try:
            process.wait(45)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def test_a_vllm_command_line_serves_completions_over_https(tls_server) -> None:
    port, context, log_path = tls_server
    # closed at the end: an open TLS connection holds the server's shutdown until its close_notify times out
    with openai.OpenAI(
        base_url=f"https://127.0.0.1:{port}/v1",
        api_key="sk-vllm",
        max_retries=0,
        http_client=openai.DefaultHttpxClient(verify=context),
    ) as client:
        # --override-generation-config's temperature 0: greedy, so the built-in model tells its story
        completion = client.completions.create(model="stories", prompt="Once upon a time", max_tokens=12)
        models = client.models.list()
    assert completion.choices[0].text.startswith(", there was a little girl named Lily")
    assert [(m.id, m.max_model_len) for m in models.data] == [("stories", 256)]  # --hf-overrides
    log = log_path.read_text()
    for flag in ("--swap-space", "--disable-custom-all-reduce", "--num-scheduler-steps"):
        assert log.count(f"{flag} has no effect in Pagoda") == 1, log
    with pytest.raises(ssl.SSLError):  # plain HTTP clients cannot talk to it, and TLS checks the certificate
        _get(port, ssl.create_default_context(), "/health")


def test_the_root_path_is_honoured(tls_server) -> None:
    port, context, _ = tls_server
    status, body = _get(port, context, "/docs", key="sk-vllm")
    assert status == 200 and b"/llm/openapi.json" in body  # the docs page asks for the document under the prefix
    status, body = _get(port, context, "/llm/v1/models", key="sk-vllm")  # a request that still has the prefix
    assert status == 200 and json.loads(body)["data"][0]["id"] == "stories"
    assert _get(port, context, "/v1/models")[0] == 401  # --api-key holds


def test_the_docs_list_every_flag_of_the_table() -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "vllm-compatibility.md").read_text(encoding="utf-8")
    cells = [line.replace("\\|", "/").split("|") for line in docs.splitlines() if line.startswith("| `")]
    rows = {cell[1].strip(): cell[-2].strip() for cell in cells}  # flag -> what it does here
    flags = {f"`{e.flag}`" + (f" / `{e.short}`" if e.short else ""): e.meaning.replace("|", "/") for e in VLLM_FLAGS}
    assert rows == flags


def test_the_capability_contract_carries_the_table() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pagoda.cli", "capabilities", "--json"], capture_output=True, text=True, check=True
    )
    rows = json.loads(result.stdout)["vllm_flags"]
    assert rows == flag_table() and {row["kind"] for row in rows} == set(KINDS)
    by_flag = {row["flag"]: row for row in rows}
    assert by_flag["--trust-remote-code"]["kind"] == "refused"
    assert by_flag["--load-format"]["accepted"] == ["auto", "safetensors"]


def test_generation_config_folder_and_both_overrides_reach_the_engine(tmp_path: Path) -> None:
    from pagoda import LLM

    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.5, "top_k": 7, "top_p": 0.8}))
    with LLM(
        generation_config=str(tmp_path),
        override_generation_config={"top_k": 3},
        hf_overrides={"rope_theta": 500.0, "max_position_embeddings": 128},
        max_num_seqs=2,
    ) as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_k, defaults.top_p) == (0.5, 3, 0.8)
        assert (llm.engine.model_config.rope_theta, llm.engine.max_model_len) == (500.0, 128)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="the folder has no generation_config.json"):
        LLM(generation_config=str(empty), max_num_seqs=2)
