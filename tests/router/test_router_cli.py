"""The router's command line: `pagoda router ARGS` runs it (the engine execs the operator package's module), and
flags that contradict each other are refused before anything starts."""

from __future__ import annotations

import subprocess
import sys


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60)


def test_pagoda_router_runs_the_router_with_its_arguments() -> None:
    done = run("-m", "pagoda.cli", "router", "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: pagoda-router") and "--static-models" in done.stdout


def test_exactly_one_source_of_models_is_required() -> None:
    for args in ((), ("--namespace", "a", "--static-models", "m.yaml"), ("--all-namespaces", "--namespace", "a")):
        done = run("-m", "pagoda_operator.router", *args)
        assert done.returncode == 2 and "exactly one of" in done.stderr


def test_an_unreadable_static_file_is_an_error_not_a_crash(tmp_path) -> None:
    bad = tmp_path / "models.yaml"
    bad.write_text("models: [{endpoints: [x]}]\n")
    done = run("-m", "pagoda_operator.router", "--static-models", str(bad), "--port", "0")
    assert done.returncode == 2 and "needs a `name`" in done.stderr and "Traceback" not in done.stderr
