"""The container recipes (no Docker here): COPY sources exist, users are non-root, and the operator has no torch."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from operator_helpers import REPO


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


@pytest.mark.parametrize("name", ["Dockerfile.engine", "Dockerfile.operator"])
def test_every_copy_source_exists_and_the_user_is_not_root(name: str) -> None:
    steps = instructions(REPO / name)
    copies = [args.split()[:-1] for op, args in steps if op == "COPY"]
    assert copies
    for sources in copies:
        for source in sources:
            assert (REPO / source).exists(), f"{name}: COPY source {source} does not exist"
    users = [args for op, args in steps if op == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert [op for op, _ in steps].index("USER") > max(i for i, (op, _) in enumerate(steps) if op == "RUN")


def test_engine_image_is_cuda_with_torch_and_serves() -> None:
    steps = instructions(REPO / "Dockerfile.engine")
    args = dict(steps)
    assert any("nvidia/cuda" in a for op, a in steps if op == "ARG")
    assert any("requirements/torch.txt" in a for op, a in steps if op == "RUN")
    assert args["ENTRYPOINT"] == '["pagoda", "serve"]'
    # the native CPU kernels are compiled on the node, for its CPU: the image needs a C++ compiler
    assert any("g++" in a for op, a in steps if op == "RUN")


def test_operator_image_has_no_torch_and_runs_kopf() -> None:
    text = (REPO / "Dockerfile.operator").read_text()
    steps = instructions(REPO / "Dockerfile.operator")
    assert "torch.txt" not in text and "engine/" not in text
    assert dict(steps)["ENTRYPOINT"] == '["kopf", "run", "--module=pagoda_operator.main"]'


def test_operator_imports_without_torch_and_does_not_depend_on_it() -> None:
    # torch is installed in the development venv, so block it: any import of it by the operator now fails.
    code = "import sys; sys.modules['torch'] = None; import pagoda_operator.main, pagoda_operator.reconcile"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    pyproject = (REPO / "operator" / "pyproject.toml").read_text()
    dependencies = pyproject.split("dependencies = [", 1)[1].split("]", 1)[0]
    assert "torch" not in dependencies and "pagoda-engine" not in dependencies


@pytest.mark.slow
def test_operator_installs_and_imports_in_a_fresh_venv(tmp_path: Path) -> None:
    """A real install from the package index into an empty venv (skipped when no index is reachable)."""
    source = tmp_path / "operator"
    shutil.copytree(REPO / "operator", source, ignore=shutil.ignore_patterns("*.egg-info", "build", "__pycache__"))
    venv.create(tmp_path / "venv", with_pip=True)
    python = tmp_path / "venv" / "bin" / "python"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(source)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    if install.returncode != 0 and "No matching distribution" in install.stderr + install.stdout:
        pytest.skip(f"no package index reachable: {install.stderr[-300:]}")
    assert install.returncode == 0, install.stderr
    check = (
        "import importlib.util, pagoda_operator.main; assert importlib.util.find_spec('torch') is None; "
        "from pagoda_operator.capabilities import engine_capabilities; assert engine_capabilities()['serve_flags']"
    )
    subprocess.run([str(python), "-c", check], check=True, timeout=60)
