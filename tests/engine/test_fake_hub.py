"""The fake Hub serves the real huggingface_hub client as huggingface.co does: download, pin, auth, resume, offline."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub.constants
import pytest
from fake_hub import FakeHub
from huggingface_hub import hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

REPO = "acme/tiny-model"
FILES = {
    "config.json": b'{"model_type": "llama"}',
    "tokenizer.json": b'{"version": "1.0"}',
    "weights/model.safetensors": bytes(range(256)) * 64,
}


@pytest.fixture(autouse=True)
def online(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests only reach 127.0.0.1, so an HF_HUB_OFFLINE=1 in the environment must not turn them off."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    with FakeHub() as hub:
        yield hub


def files_in(folder: str | Path) -> dict[str, bytes]:
    """Every file under ``folder`` (following the cache's symlinks), by its path relative to it."""
    root = Path(folder)
    return {path.relative_to(root).as_posix(): path.read_bytes() for path in root.rglob("*") if path.is_file()}


def test_snapshot_download_gets_the_committed_files(hub: FakeHub, tmp_path: Path) -> None:
    hub.tree_page_size = 2  # 4 entries (3 files and the "weights" folder): the listing takes two pages
    sha = hub.add_commit(REPO, FILES)

    folder = snapshot_download(REPO, endpoint=hub.url, cache_dir=tmp_path / "all")

    assert Path(folder).name == sha
    assert files_in(folder) == FILES
    tree_pages = [path for method, path, _, _ in hub.requests if "/tree/" in path]
    assert len(tree_pages) == 2 and "cursor=" in tree_pages[1]
    only_json = snapshot_download(REPO, endpoint=hub.url, cache_dir=tmp_path / "json", allow_patterns="*.json")
    assert files_in(only_json) == {name: FILES[name] for name in ("config.json", "tokenizer.json")}


def test_revision_pins_a_commit(hub: FakeHub, tmp_path: Path) -> None:
    first = hub.add_commit(REPO, {"config.json": b"first", "old.txt": b"gone later"})
    second = hub.add_commit(REPO, {"config.json": b"second"})

    pinned = snapshot_download(REPO, revision=first, endpoint=hub.url, cache_dir=tmp_path)
    latest = snapshot_download(REPO, endpoint=hub.url, cache_dir=tmp_path)

    assert files_in(pinned) == {"config.json": b"first", "old.txt": b"gone later"}
    assert files_in(latest) == {"config.json": b"second"}
    assert Path(latest).name == second
    one_file = hf_hub_download(REPO, "config.json", revision=first, endpoint=hub.url, cache_dir=tmp_path / "one")
    assert Path(one_file).read_bytes() == b"first"


def test_private_repo_needs_the_token(tmp_path: Path) -> None:
    with FakeHub(token="secret") as hub:
        hub.add_commit(REPO, FILES)

        # Anonymous: the Hub's anti-enumeration 401, which the client reports as a missing repository.
        with pytest.raises(RepositoryNotFoundError) as anonymous:
            snapshot_download(REPO, endpoint=hub.url, cache_dir=tmp_path, token=False)
        assert anonymous.value.response.status_code == 401
        with pytest.raises(RepositoryNotFoundError):
            hf_hub_download(REPO, "config.json", endpoint=hub.url, cache_dir=tmp_path, token=False)
        # A token the Hub does not know: 401 "Invalid credentials", a plain HTTP error, not a missing repository.
        with pytest.raises(HfHubHTTPError) as wrong:
            snapshot_download(REPO, endpoint=hub.url, cache_dir=tmp_path, token="not-the-secret")
        assert not isinstance(wrong.value, RepositoryNotFoundError)
        assert wrong.value.response.status_code == 401

        folder = snapshot_download(REPO, endpoint=hub.url, cache_dir=tmp_path, token="secret")

    assert files_in(folder) == FILES
    assert hub.requests[-1][3]["authorization"] == "Bearer secret"


def download_cut_at(hub: FakeHub, size: int, cut_at: int, cache_dir: Path) -> list[tuple[int, str | None]]:
    """Download a ``size``-byte file whose first transfer drops after ``cut_at`` bytes: (status, Range) of each GET."""
    weights = os.urandom(size)
    hub.add_commit(REPO, {"model.safetensors": weights})
    hub.fail_after_bytes = cut_at
    try:
        path = hf_hub_download(REPO, "model.safetensors", endpoint=hub.url, cache_dir=cache_dir)
    except Exception:  # this client version retries by itself; another may give up and need a second call
        path = hf_hub_download(REPO, "model.safetensors", endpoint=hub.url, cache_dir=cache_dir)
    assert Path(path).read_bytes() == weights
    assert hub.fail_after_bytes is None
    return [(status, headers.get("range")) for method, _, status, headers in hub.requests if method == "GET"]


def test_interrupted_download_resumes_with_a_range_request(hub: FakeHub, tmp_path: Path) -> None:
    # The client writes what it receives in DOWNLOAD_CHUNK_SIZE (10 MiB) chunks: only bytes past a whole chunk survive
    # a dropped transfer, so the cut must come after the first chunk for a resume to show.
    chunk = huggingface_hub.constants.DOWNLOAD_CHUNK_SIZE
    gets = download_cut_at(hub, size=chunk + (2 << 20), cut_at=chunk + (1 << 20), cache_dir=tmp_path)

    assert gets == [(200, None), (206, f"bytes={chunk}-")]


def test_interruption_inside_the_first_chunk_restarts_from_zero(hub: FakeHub, tmp_path: Path) -> None:
    # A ~1 MB file cut at 300 kB: what arrived was still in the client's chunk buffer, so it asks for it all again.
    gets = download_cut_at(hub, size=1 << 20, cut_at=300_000, cache_dir=tmp_path)

    assert gets == [(200, None), (200, None)]


def test_offline_start_uses_the_cache(hub: FakeHub, tmp_path: Path) -> None:
    hub.add_commit(REPO, FILES)
    folder = snapshot_download(REPO, endpoint=hub.url, cache_dir=tmp_path)
    hub.stop()
    answered = len(hub.requests)

    assert snapshot_download(REPO, endpoint=hub.url, cache_dir=tmp_path, local_files_only=True) == folder
    # Hub unreachable (connection refused): the client falls back to the cached snapshot of "main".
    assert snapshot_download(REPO, endpoint=hub.url, cache_dir=tmp_path) == folder
    assert files_in(folder) == FILES
    assert len(hub.requests) == answered  # the client's pooled keep-alive connection went down with the hub


def test_missing_repo_revision_and_file_raise_the_hubs_errors(hub: FakeHub, tmp_path: Path) -> None:
    hub.add_commit(REPO, FILES)

    with pytest.raises(RepositoryNotFoundError):
        snapshot_download("acme/no-such-model", endpoint=hub.url, cache_dir=tmp_path)
    with pytest.raises(RevisionNotFoundError):
        snapshot_download(REPO, revision="no-such-branch", endpoint=hub.url, cache_dir=tmp_path)
    with pytest.raises(RevisionNotFoundError):
        snapshot_download(REPO, revision="0" * 40, endpoint=hub.url, cache_dir=tmp_path)
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(REPO, "no-such-file.json", endpoint=hub.url, cache_dir=tmp_path)
    assert {status for _, _, status, _ in hub.requests} == {404}


def test_hf_endpoint_in_a_child_process(hub: FakeHub, tmp_path: Path) -> None:
    hub.add_commit(REPO, FILES)
    script = f"import huggingface_hub as h; print(h.snapshot_download({REPO!r}, cache_dir={str(tmp_path)!r}))"
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}

    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)

    assert done.returncode == 0, done.stderr
    assert files_in(done.stdout.strip()) == FILES
