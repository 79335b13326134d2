"""LoRA adapters under attack, against a real `pagoda serve`: files that block on read (a hung NFS or FUSE mount; a
FIFO reproduces one), adapters whose weights are not finite, runtime loads outside the allowed roots, and what
``GET /lora_adapters`` tells a caller without the API key.

Every read of adapter files has a deadline (--lora-read-timeout, 1 s here) and runs off the engine thread and off
any lock other requests need: the request on the unreadable adapter fails alone with a 503, everyone else is
served, and /health stays fast."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from lora_helpers import make_adapter
from safetensors.torch import load_file, save_file
from security_helpers import HealthProbe, assert_openai_error
from server_helpers import Server, start_server

from pagoda.config import builtin_model_path

pytestmark = pytest.mark.slow  # real servers

PROMPT = "Once upon a time"
BASE = "stories260K"
KEY = "sk-lora-security"
AUTH = {"Authorization": f"Bearer {KEY}"}
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
READ_TIMEOUT = 1.0
# The one answer for every runtime load refused by confinement (it must not tell which paths exist).
REFUSED = "lora_path is not an adapter folder inside the allowed roots"


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """Two small adapters of the built-in model, made by PEFT, in a folder no server reads from directly."""
    root = tmp_path_factory.mktemp("made")
    for seed, name in enumerate(("one", "two")):
        make_adapter(builtin_model_path(), root / name, rank=8, seed=seed, scale=0.3)
    return root


def block_reads(folder: Path) -> Path:
    """Replace the adapter's config by a FIFO: opening it for reading blocks until someone opens its write end."""
    fifo = folder / CONFIG
    fifo.unlink()
    os.mkfifo(fifo)
    return fifo


def unblock(fifo: Path) -> None:
    """Let a reader blocked opening ``fifo`` go: opening the write end releases it, closing it gives it EOF (so its
    read fails). Nothing to do when nobody has it open (ENXIO)."""
    with contextlib.suppress(OSError):
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def complete(server: Server, model: str, headers: dict | None = None) -> tuple[int, dict, object, float]:
    start = time.monotonic()
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    status, head, payload = server.request("POST", "/v1/completions", body, headers)
    return status, head, payload, time.monotonic() - start


def adapter_report(server: Server, name: str, headers: dict | None = None) -> dict:
    status, _, body = server.request("GET", "/lora_adapters", headers=headers)
    assert status == 200, body
    return next((a for a in body["data"] if a["name"] == name), {"state": None})  # None: not listed (yet)


# ---- an adapter re-read from a file that blocks --------------------------------------------------------------


@pytest.fixture(scope="module")
def rereading(made, tmp_path_factory):
    """A server whose host memory keeps one adapter: serving ``a`` after ``b`` was loaded reads ``a`` again."""
    root = tmp_path_factory.mktemp("rereading")
    folders = {name: shutil.copytree(made / src, root / name) for name, src in (("a", "one"), ("b", "two"))}
    server = start_server(
        "--enable-lora", "--max-lora-rank", "8", "--max-loras", "1", "--max-cpu-loras", "1",
        "--lora-read-timeout", str(READ_TIMEOUT), "--lora-modules", f"a={folders['a']}", f"b={folders['b']}",
    )  # fmt: skip
    server.folders = folders
    yield server
    server.stop()


def test_an_adapter_whose_files_block_fails_alone_while_everyone_else_is_served(rereading, made) -> None:
    fifo = block_reads(rereading.folders["a"])
    try:
        with HealthProbe(rereading.port) as probe, ThreadPoolExecutor(8) as pool:
            stuck = pool.submit(complete, rereading, "a")
            time.sleep(0.3)  # the engine is reading (old servers: blocked on the FIFO) when the others arrive
            others = [pool.submit(complete, rereading, model) for model in (BASE, "b") * 3]
            served = [f.result(timeout=30) for f in others]
            status, _, payload, took = stuck.result(timeout=30)
        assert [s[0] for s in served] == [200] * 6, served
        assert max(s[3] for s in served) < 5, "the other requests waited on the unreadable adapter"
        assert status == 503 and "LoRA adapter 'a' is unavailable" in payload["error"]["message"], payload
        assert took < READ_TIMEOUT + 2 and str(rereading.folders["a"]) not in payload["error"]["message"]
        probe.assert_healthy()
        # While that read is stuck, later requests on the adapter fail at once instead of queueing behind it.
        status, _, _, took = complete(rereading, "a")
        assert status == 503 and took < 1.0
        report = adapter_report(rereading, "a")
        assert report["state"] == "failed" and "has not finished after" in report["error"], report
        assert adapter_report(rereading, "b")["state"] == "loaded"
    finally:
        unblock(fifo)
    fifo.unlink()
    shutil.copy(made / "one" / CONFIG, fifo)  # the mount is back: the next request reads it and is served
    deadline = time.monotonic() + 10
    while (status := complete(rereading, "a")[0]) != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert status == 200 and adapter_report(rereading, "a")["state"] == "loaded"


# ---- runtime loads, the watched list, and the report ---------------------------------------------------------


@pytest.fixture(scope="module")
def guarded(made, tmp_path_factory):
    """A server with an API key, runtime loads confined to ``root``, and a watched adapter list."""
    root = tmp_path_factory.mktemp("allowed")
    shutil.copytree(made / "one", root / "tales")
    listing = tmp_path_factory.mktemp("listing") / "adapters.json"
    listing.write_text("[]")
    server = start_server(
        "--enable-lora", "--max-lora-rank", "8", "--api-key", KEY, "--allow-runtime-lora-updates",
        "--lora-read-timeout", str(READ_TIMEOUT), "--lora-allowed-roots", str(root),
        "--lora-modules", f"tales={root / 'tales'}", "--lora-modules-file", str(listing),
        "--lora-modules-poll-seconds", "0.2",
    )  # fmt: skip
    server.root, server.listing = root, listing
    yield server
    server.stop()


def load(server: Server, name: str, path: Path | str) -> tuple[int, object, float]:
    start = time.monotonic()
    status, _, body = server.request("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, AUTH)
    return status, body, time.monotonic() - start


def test_runtime_loads_outside_the_allowed_roots_get_one_answer_whatever_the_reason(guarded, made, tmp_path):
    root = guarded.root
    shutil.copytree(made / "one", root / "fine")
    (root / "escape").symlink_to(made / "two", target_is_directory=True)  # a folder link leading out
    shutil.copytree(made / "one", root / "linked")
    (root / "linked" / WEIGHTS).unlink()
    (root / "linked" / WEIGHTS).symlink_to(made / "two" / WEIGHTS)  # one file link leading out
    shutil.copytree(made / "one", root / "piped")
    block_reads(root / "piped")  # a FIFO inside the roots: not a regular file
    refused = [made / "two", root / "escape", root / "linked", root / "piped", root / "absent", "/etc", "/no/such"]
    for path in refused:
        status, body, took = load(guarded, "probe", path)
        assert_openai_error(status, body, 400)
        assert REFUSED in body["error"]["message"] and str(path) not in body["error"]["message"], (path, body)
        assert took < 2
    assert len({load(guarded, "probe", p)[1]["error"]["message"] for p in refused}) == 1  # nothing to tell apart
    assert load(guarded, "fine", root / "fine")[0] == 200
    assert complete(guarded, "fine", AUTH)[0] == 200


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"poison": float("nan")}, "has NaN or Inf in lora_A"),
        ({"poison": float("inf")}, "has NaN or Inf in lora_A"),
        ({"lora_alpha": 1e308}, "has NaN or Inf in lora_B scaled by"),
    ],
)
def test_adapters_whose_weights_are_not_finite_are_refused_with_400(guarded, made, edit, message) -> None:
    folder = shutil.copytree(made / "one", guarded.root / f"bad-{len(list(guarded.root.iterdir()))}")
    if "poison" in edit:
        weights = load_file(str(folder / WEIGHTS))
        key = next(k for k in sorted(weights) if "lora_A" in k)
        weights[key][0, 0] = edit["poison"]
        save_file(weights, str(folder / WEIGHTS))
    else:
        config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**config, **edit}))
    status, body, _ = load(guarded, "poisoned", folder)
    assert_openai_error(status, body, 400)
    assert message in body["error"]["message"], body
    assert complete(guarded, "tales", AUTH)[0] == 200


def test_a_listed_adapter_whose_files_block_holds_no_lock_other_loads_need(guarded, made) -> None:
    stuck = shutil.copytree(made / "one", guarded.root.parent / "stuck-listed")
    fifo = block_reads(stuck)
    try:
        guarded.listing.write_text(json.dumps([{"name": "stuck", "path": str(stuck)}]))
        time.sleep(0.5)  # the watcher is reading it now (old servers: blocked, holding the one LoRA lock)
        with ThreadPoolExecutor(2) as pool:
            loaded = pool.submit(load, guarded, "songs", guarded.root / "tales")
            status, body, took = loaded.result(timeout=10)
        assert status == 200 and took < 2, (status, body, took)
        unloaded = guarded.request("POST", "/v1/unload_lora_adapter", {"lora_name": "songs"}, AUTH)
        assert unloaded[0] == 200
        deadline = time.monotonic() + 10
        while adapter_report(guarded, "stuck", AUTH)["state"] != "failed" and time.monotonic() < deadline:
            time.sleep(0.1)
        report = adapter_report(guarded, "stuck", AUTH)
        assert report["state"] == "failed" and "has not finished after" in report["error"], report
    finally:
        unblock(fifo)
        guarded.listing.write_text("[]")


def test_the_adapter_report_names_no_paths_or_errors_without_the_key(guarded, made) -> None:
    guarded.listing.write_text(json.dumps([{"name": "missing", "path": str(guarded.root / "not-here")}]))
    deadline = time.monotonic() + 10
    while "missing" not in [a["name"] for a in guarded.request("GET", "/lora_adapters")[2]["data"]]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    status, _, anonymous = guarded.request("GET", "/lora_adapters")
    assert status == 200  # the operator asks without a key
    text = json.dumps(anonymous)
    assert str(guarded.root) not in text and "not-here" not in text, anonymous
    entries = {a["name"]: a for a in anonymous["data"]}
    assert entries["tales"]["state"] == "loaded" and "path" not in entries["tales"]
    assert entries["missing"]["state"] == "failed" and "API key" in entries["missing"]["error"]
    full = {a["name"]: a for a in guarded.request("GET", "/lora_adapters", headers=AUTH)[2]["data"]}
    assert full["tales"]["path"] == str(guarded.root / "tales")
    assert full["tales"]["path_sha256"] == entries["tales"]["path_sha256"]  # what the operator matches on
    assert "not-here" in full["missing"]["error"]
    guarded.listing.write_text("[]")


def test_concurrent_changes_to_one_name_are_refused_not_queued(guarded) -> None:
    """Loads of different names never wait for each other; a second change to a name in progress is a 400."""
    barrier = threading.Barrier(4)

    def racing(i: int) -> int:
        barrier.wait()
        return load(guarded, f"race-{i % 2}", guarded.root / "tales")[0]

    with ThreadPoolExecutor(4) as pool:
        statuses = sorted(pool.map(racing, range(4)))
    assert statuses.count(200) == 2 and set(statuses) <= {200, 400}, statuses
    for name in ("race-0", "race-1"):
        assert guarded.request("POST", "/v1/unload_lora_adapter", {"lora_name": name}, AUTH)[0] == 200
