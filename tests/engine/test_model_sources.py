"""Model sources as a deployment uses them: `pagoda download` and `pagoda serve` of Hugging Face ids against a local
test double of the Hub (the real huggingface_hub client, over HTTP), and of s3:// prefixes against moto's S3 server.
Every failure is one line naming the model and the cause, on stderr and in the termination message."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import boto3
import openai
import pytest
from fake_hub import FakeHub
from moto.server import ThreadedMotoServer
from server_helpers import start_server

from pagoda.config import builtin_model_path
from pagoda.confined_paths import confined_path
from pagoda.loader import safetensors_files
from pagoda.model_source import resolve_model

pytestmark = pytest.mark.slow  # real processes: downloads, servers

REPO = "pagoda-test/stories260K"
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def model_files() -> dict[str, bytes]:
    """The built-in model's folder (README.md included: a file the engine does not read, so never downloaded)."""
    return {p.name: p.read_bytes() for p in builtin_model_path().iterdir() if p.is_file()}


ENGINE_FILES = sorted(name for name in model_files() if name != "README.md")


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    with FakeHub() as hub:
        hub.add_commit(REPO, model_files())
        yield hub


def pagoda(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``pagoda ARGS`` in a child process (huggingface_hub reads HF_ENDPOINT at import)."""
    full_env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1", **env}
    for name in ("HF_TOKEN", "PAGODA_OFFLINE", "HF_HUB_OFFLINE"):
        if name not in env:
            full_env.pop(name, None)
    command = [sys.executable, "-m", "pagoda.cli", *args]
    return subprocess.run(command, env=full_env, capture_output=True, text=True, timeout=timeout)


def hub_env(hub_url: str, tmp_path: Path, **extra: str) -> dict[str, str]:
    return {
        "HF_ENDPOINT": hub_url,
        "HF_HOME": str(tmp_path / "hf"),
        "PAGODA_TERMINATION_LOG": str(tmp_path / "term"),
        **extra,
    }


def assert_fails_with(result: subprocess.CompletedProcess[str], tmp_path: Path, line: str) -> None:
    """Exit status 2, and the same one line on stderr and in the termination message."""
    assert result.returncode == 2, result.stderr
    message = (tmp_path / "term").read_text()
    assert message.startswith(line), message
    assert f"pagoda: error: {message}" in result.stderr and "\n" not in message


def digest(folder: Path) -> dict[str, str]:
    """sha256 of every model file in ``folder`` (the downloader's own .pagoda-* bookkeeping aside)."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def expected_digest() -> dict[str, str]:
    return {name: hashlib.sha256(content).hexdigest() for name, content in model_files().items() if name != "README.md"}


# ---- the Hugging Face Hub ---------------------------------------------------------------------------------------


def test_a_hub_model_downloads_only_the_files_the_engine_reads(hub, tmp_path) -> None:
    result = pagoda("download", REPO, env=hub_env(hub.url, tmp_path))
    assert result.returncode == 0, result.stderr
    folder = Path(result.stdout.strip())
    assert folder.is_relative_to(tmp_path / "hf") and sorted(digest(folder)) == ENGINE_FILES
    assert digest(folder) == expected_digest()
    # hf:// is the same model, and a second download needs no file again
    files_fetched = sum(1 for method, path, _, _ in hub.requests if method == "GET" and "/resolve/" in path)
    assert pagoda("download", f"hf://{REPO}", env=hub_env(hub.url, tmp_path)).stdout.strip() == str(folder)
    assert sum(1 for method, path, _, _ in hub.requests if method == "GET" and "/resolve/" in path) == files_fetched


def test_a_revision_pins_a_commit(tmp_path) -> None:
    with FakeHub() as hub:
        first = hub.add_commit(REPO, model_files())
        changed = {**model_files(), "generation_config.json": b'{"bos_token_id": 1, "eos_token_id": 2}'}
        hub.add_commit(REPO, changed)
        pinned, latest = (
            Path(pagoda("download", REPO, *args, env=hub_env(hub.url, tmp_path)).stdout.strip())
            for args in (("--revision", first), ())
        )
    assert pinned.name == first and latest.name != first
    assert (pinned / "generation_config.json").read_bytes() == model_files()["generation_config.json"]
    assert (latest / "generation_config.json").read_bytes() == changed["generation_config.json"]


def test_a_private_model_needs_its_token(tmp_path) -> None:
    with FakeHub(token="hf_secret") as hub:
        hub.add_commit(REPO, model_files())
        refused = pagoda("download", REPO, env=hub_env(hub.url, tmp_path))
        assert_fails_with(refused, tmp_path, f"Unauthorized: model '{REPO}': the Hub refused access (HTTP 401)")
        wrong = pagoda("download", REPO, env=hub_env(hub.url, tmp_path, HF_TOKEN="hf_wrong"))
        assert_fails_with(wrong, tmp_path, f"Unauthorized: model '{REPO}': the Hub refused the token (HTTP 401)")
        allowed = pagoda("download", REPO, env=hub_env(hub.url, tmp_path, HF_TOKEN="hf_secret"))
        assert allowed.returncode == 0 and digest(Path(allowed.stdout.strip())) == expected_digest()


def test_unknown_models_and_revisions_are_model_not_found(hub, tmp_path) -> None:
    missing = pagoda("download", "pagoda-test/nothing", env=hub_env(hub.url, tmp_path))
    assert_fails_with(
        missing, tmp_path, "ModelNotFound: model 'pagoda-test/nothing': no such model on the Hugging Face Hub"
    )
    bad_revision = pagoda("download", REPO, "--revision", "v9", env=hub_env(hub.url, tmp_path))
    assert_fails_with(bad_revision, tmp_path, f"ModelNotFound: model '{REPO}': revision 'v9' does not exist on the Hub")


def test_an_unreachable_hub_is_a_clear_error(tmp_path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    result = pagoda("download", REPO, env=hub_env(closed, tmp_path))
    assert_fails_with(result, tmp_path, f"ModelLoadFailed: model '{REPO}': cannot reach the Hugging Face Hub")


def test_a_full_volume_is_a_clear_error(hub, tmp_path) -> None:
    volume = tmp_path / "small"
    volume.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(volume)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        result = pagoda("download", REPO, "--download-dir", str(volume), env=hub_env(hub.url, tmp_path))
        assert_fails_with(result, tmp_path, f"OutOfDiskSpace: model '{REPO}': no space left on the download volume")
    finally:
        subprocess.run(["umount", str(volume)], check=True)


def test_a_connection_cut_mid_file_resumes_where_it_stopped(tmp_path) -> None:
    big = bytes(range(256)) * (12 * 4096)  # 12 MiB: the client keeps whole 10 MiB chunks across a retry
    with FakeHub() as hub:
        hub.add_commit(REPO, {**model_files(), "model-00002.safetensors": big})
        hub.fail_after_bytes, hub.fail_path = 11 * 2**20, "model-00002.safetensors"
        result = pagoda("download", REPO, env=hub_env(hub.url, tmp_path))
        assert result.returncode == 0, result.stderr
        ranges = [h.get("range") for m, path, _, h in hub.requests if m == "GET" and path.endswith("00002.safetensors")]
    assert ranges == [None, "bytes=10485760-"]
    assert (Path(result.stdout.strip()) / "model-00002.safetensors").read_bytes() == big


def test_a_download_that_failed_part_way_fetches_only_the_rest_next_time(hub, tmp_path) -> None:
    hub.broken_files = {"tokenizer.json"}
    failed = pagoda("download", REPO, env=hub_env(hub.url, tmp_path))
    assert failed.returncode == 2 and "ModelLoadFailed" in failed.stderr
    hub.broken_files = set()
    before = len(hub.requests)
    resumed = pagoda("download", REPO, env=hub_env(hub.url, tmp_path))
    assert resumed.returncode == 0, resumed.stderr
    fetched = [path.rsplit("/", 1)[-1] for m, path, status, _ in hub.requests[before:] if m == "GET" and status == 200]
    assert [name for name in fetched if "." in name] == ["tokenizer.json"]  # (tree listings aside)
    assert digest(Path(resumed.stdout.strip())) == expected_digest()


def test_replicas_sharing_one_cache_do_not_corrupt_it(hub, tmp_path) -> None:
    env = hub_env(hub.url, tmp_path)
    results: list[subprocess.CompletedProcess[str]] = []
    threads = [threading.Thread(target=lambda: results.append(pagoda("download", REPO, env=env))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.returncode for r in results] == [0, 0, 0], [r.stderr for r in results]
    assert len({r.stdout for r in results}) == 1
    assert digest(Path(results[0].stdout.strip())) == expected_digest()


def test_serve_downloads_a_hub_model_answers_chat_then_starts_offline_from_the_cache(hub, tmp_path) -> None:
    env = hub_env(hub.url, tmp_path)
    os.environ.update(env)  # start_server passes this process's environment to the child
    try:
        server = start_server(REPO)
        try:
            client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
            chat = client.chat.completions.create(
                model=REPO, messages=[{"role": "user", "content": "Once upon a time"}], max_tokens=8, temperature=0
            )
            assert chat.choices[0].message.content.startswith(", there was a little girl")
        finally:
            server.stop()
        hub.stop()
        os.environ["PAGODA_OFFLINE"] = "1"
        offline = start_server(REPO)
        try:
            assert offline.request("POST", "/v1/completions", {"prompt": "Once", "max_tokens": 2})[0] == 200
        finally:
            offline.stop()
    finally:
        for name in (*env, "PAGODA_OFFLINE"):
            os.environ.pop(name, None)


def test_serve_exits_with_the_reason_when_the_model_cannot_be_had(hub, tmp_path) -> None:
    env = {**os.environ, **hub_env(hub.url, tmp_path), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    command = [
        sys.executable,
        "-m",
        "pagoda.cli",
        "serve",
        "pagoda-test/nothing",
        "--port",
        "0",
        "--log-level",
        "warning",
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert (tmp_path / "term").read_text().startswith("ModelNotFound: model 'pagoda-test/nothing'")


# ---- S3 ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{server._server.server_address[1]}"
    client = boto3.client("s3", endpoint_url=url, **{k.lower(): v for k, v in S3_ENV.items() if "KEY" in k})
    client.create_bucket(Bucket="models")
    for name, content in model_files().items():
        client.put_object(Bucket="models", Key=f"stories/{name}", Body=content)
    client.put_object(Bucket="models", Key="stories/original/consolidated.pth", Body=b"not read")
    yield url
    server.stop()


def s3_env(url: str, tmp_path: Path) -> dict[str, str]:
    return {
        **S3_ENV,
        "AWS_ENDPOINT_URL": url,
        "PAGODA_CACHE_DIR": str(tmp_path / "cache"),
        "PAGODA_TERMINATION_LOG": str(tmp_path / "term"),
    }


def test_an_s3_model_downloads_into_the_cache_and_serves_offline_from_it(s3, tmp_path) -> None:
    env = s3_env(s3, tmp_path)
    result = pagoda("download", "s3://models/stories", env=env)
    assert result.returncode == 0, result.stderr
    folder = Path(result.stdout.strip())
    assert folder == tmp_path / "cache" / "models" / "s3" / "models" / "stories"
    assert digest(folder) == expected_digest() and (folder / ".pagoda-complete.json").is_file()
    offline = pagoda(
        "download", "s3://models/stories", env={**env, "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "PAGODA_OFFLINE": "1"}
    )
    assert offline.returncode == 0 and offline.stdout.strip() == str(folder)  # no network was needed


@pytest.mark.parametrize(
    ("source", "line"),
    [
        ("s3://no-such-bucket/stories", "ModelNotFound: model 's3://no-such-bucket/stories': no such bucket"),
        (
            "s3://models/nothing-here",
            "ModelNotFound: model 's3://models/nothing-here': no config.json under this prefix",
        ),
    ],
)
def test_missing_s3_models_are_model_not_found(s3, tmp_path, source: str, line: str) -> None:
    assert_fails_with(pagoda("download", source, env=s3_env(s3, tmp_path)), tmp_path, line)


def test_an_unreachable_s3_endpoint_is_a_clear_error(tmp_path) -> None:
    result = pagoda("download", "s3://models/stories", env=s3_env("http://127.0.0.1:9", tmp_path))
    assert_fails_with(result, tmp_path, "ModelLoadFailed: model 's3://models/stories': cannot reach the S3 endpoint")


def test_s3_downloads_resume_file_by_file_and_share_a_cache_safely(s3, tmp_path) -> None:
    env = s3_env(s3, tmp_path)
    results: list[subprocess.CompletedProcess[str]] = []
    threads = [
        threading.Thread(target=lambda: results.append(pagoda("download", "s3://models/stories", env=env)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.returncode for r in results] == [0, 0], [r.stderr for r in results]
    folder = Path(results[0].stdout.strip())
    assert digest(folder) == expected_digest()
    # As if a download had stopped after all files but one: only that one is fetched again.
    (folder / ".pagoda-complete.json").unlink()
    (folder / "tokenizer.json").unlink()
    kept = {name: (folder / name).stat().st_mtime_ns for name in ENGINE_FILES if name != "tokenizer.json"}
    assert pagoda("download", "s3://models/stories", env=env).returncode == 0
    assert {name: (folder / name).stat().st_mtime_ns for name in kept} == kept
    assert digest(folder) == expected_digest()
    shutil.rmtree(tmp_path / "cache")


# ---- remote names never leave their folder ----------------------------------------------------------------------


def test_confined_path_keeps_a_remote_name_inside_its_folder(tmp_path) -> None:
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "elsewhere").symlink_to(tmp_path)  # a symlink on the way counts where it leads
    assert confined_path(root, "sub/config.json") == root / "sub" / "config.json"
    for name in ("../x", "sub/../../x", "/etc/passwd", "elsewhere/x"):
        with pytest.raises(ValueError, match="leads outside"):
            confined_path(root, name)
    # A Hugging Face snapshot's files are symlinks into its blobs by design: there only the name itself is checked.
    assert confined_path(root, "elsewhere", resolve=False) == root / "elsewhere"
    for name in ("../x.safetensors", "/abs.safetensors", "./x", "a\\..\\..\\x", ""):
        with pytest.raises(ValueError, match="not a plain relative name"):
            confined_path(root, name, resolve=False)


@pytest.mark.parametrize(
    "url", ["s3://models/../../../../pwned", "s3://models/stories/../../../../../pwned", "s3://../pwned", "s3://m/./x"]
)
def test_an_s3_url_with_dot_segments_is_refused_before_anything_is_written(s3, tmp_path, url: str) -> None:
    result = pagoda("download", url, env=s3_env(s3, tmp_path))
    assert result.returncode == 2 and "may not hold '.' or '..' path segments" in result.stderr, result.stderr
    # The cache folder would have been <cache>/models/s3/models/<prefix>: '..' four times up is tmp_path itself.
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "cache").exists()


def test_a_revision_with_dot_dot_segments_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="may not hold"):
        resolve_model(REPO, revision="../../../../pwned", download_dir=str(tmp_path), offline=True)


def test_a_hostile_s3_listing_cannot_place_files_outside_the_model_folder(s3, tmp_path) -> None:
    client = boto3.client("s3", endpoint_url=s3, **{k.lower(): v for k, v in S3_ENV.items() if "KEY" in k})
    client.create_bucket(Bucket="hostile")
    for name, content in model_files().items():
        client.put_object(Bucket="hostile", Key=f"stories/{name}", Body=content)
    for key in ("stories/../../../../../escaped.safetensors", "stories//escaped.safetensors", "stories/..", "/x.json"):
        client.put_object(Bucket="hostile", Key=key, Body=b"not a model file")
    result = pagoda("download", "s3://hostile/stories", env=s3_env(s3, tmp_path))
    assert result.returncode == 0, result.stderr
    assert digest(Path(result.stdout.strip())) == expected_digest()
    assert not list(tmp_path.rglob("*escaped*"))


def test_a_symlink_in_the_cache_leading_elsewhere_is_refused(s3, tmp_path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "cache" / "models" / "s3").mkdir(parents=True)
    (tmp_path / "cache" / "models" / "s3" / "models").symlink_to(elsewhere)
    result = pagoda("download", "s3://models/stories", env=s3_env(s3, tmp_path))
    assert_fails_with(result, tmp_path, "ModelLoadFailed: model 's3://models/stories': the download folder would be")
    assert not any(elsewhere.iterdir())


def test_a_shard_index_naming_files_outside_the_checkpoint_is_refused(tmp_path) -> None:
    outside = tmp_path / "outside.safetensors"
    shutil.copy(builtin_model_path() / "model.safetensors", outside)
    folder = tmp_path / "model"
    shutil.copytree(builtin_model_path(), folder)
    index = {"metadata": {}, "weight_map": {"tok_embeddings.weight": "../outside.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="names a shard outside the checkpoint"):
        safetensors_files(folder)
