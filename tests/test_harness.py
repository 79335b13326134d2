"""The test harness and packaging: markers, skips, and what the installed distributions contain."""

import importlib.metadata
import importlib.resources
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch  # imported here, not inside pytester runs: those unload new modules afterwards, and torch cannot reload

REPO_ROOT = Path(__file__).resolve().parents[1]
ENGINE_DIR = REPO_ROOT / "engine"
MODEL_SUBDIR = "assets/models/stories260K"  # inside the pagoda package
BUILTIN_MODEL_FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"]

MARKED_TESTS = """
import pytest

@pytest.mark.gpu
def test_needs_gpu():
    pass

@pytest.mark.k8s
def test_needs_cluster():
    pass

@pytest.mark.slow
def test_slow():
    pass

def test_plain():
    pass
"""


def test_pytest_lists_the_project_markers() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--markers"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    for marker in ("gpu", "k8s", "slow"):
        assert f"@pytest.mark.{marker}:" in result.stdout


@pytest.fixture
def marked_suite(pytester: pytest.Pytester) -> pytest.Pytester:
    """A throwaway test directory with the repository's pytest config and tests/conftest.py."""
    pytester.makepyprojecttoml((REPO_ROOT / "pyproject.toml").read_text())
    pytester.makeconftest((REPO_ROOT / "tests" / "conftest.py").read_text())
    pytester.makepyfile(test_marked=MARKED_TESTS)
    return pytester


@pytest.mark.parametrize(
    ("cuda", "cluster", "passed", "skipped"),
    [
        (False, None, {"test_slow", "test_plain"}, {"test_needs_gpu", "test_needs_cluster"}),
        (True, None, {"test_needs_gpu", "test_slow", "test_plain"}, {"test_needs_cluster"}),
        (False, "pagoda-e2e", {"test_needs_cluster", "test_slow", "test_plain"}, {"test_needs_gpu"}),
    ],
    ids=["bare-machine", "cuda", "cluster"],
)
def test_gpu_and_k8s_tests_are_skipped_without_their_hardware_and_slow_tests_run_by_default(
    marked_suite: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    cuda: bool,
    cluster: str | None,
    passed: set[str],
    skipped: set[str],
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("PAGODA_E2E_CLUSTER", raising=False)
    if cluster is not None:
        monkeypatch.setenv("PAGODA_E2E_CLUSTER", cluster)

    reports = marked_suite.inline_run().getreports("pytest_runtest_logreport")

    assert {r.head_line for r in reports if r.when == "call" and r.passed} == passed
    assert {r.head_line for r in reports if r.skipped} == skipped


def test_e2e_tests_are_marked_k8s_and_need_a_cluster(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyprojecttoml((REPO_ROOT / "pyproject.toml").read_text())
    e2e = pytester.mkdir("e2e")
    (e2e / "conftest.py").write_text((REPO_ROOT / "e2e" / "conftest.py").read_text())
    (e2e / "test_cluster.py").write_text("def test_deploys_a_model():\n    pass\n")
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("PAGODA_E2E_CLUSTER", raising=False)

    pytester.runpytest_inprocess("e2e").assert_outcomes(skipped=1)
    pytester.runpytest_inprocess("e2e", "-m", "not k8s").assert_outcomes(deselected=1)
    monkeypatch.setenv("KUBECONFIG", str(pytester.path / "kubeconfig"))
    pytester.runpytest_inprocess("e2e").assert_outcomes(passed=1)


def test_builtin_model_ships_inside_the_pagoda_package() -> None:
    model_dir = importlib.resources.files("pagoda").joinpath(MODEL_SUBDIR)
    for name in BUILTIN_MODEL_FILES:
        assert (model_dir / name).is_file(), f"{name} missing from the installed pagoda package"
    readme = (model_dir / "README.md").read_text()
    assert "MIT, Copyright (c) 2023 Andrej Karpathy" in readme


def test_operator_distribution_does_not_depend_on_torch() -> None:
    requirements = importlib.metadata.requires("pagoda-operator") or []
    assert not [r for r in requirements if r.lower().startswith("torch")]


@pytest.mark.slow
def test_engine_wheel_contains_every_module_the_model_files_and_the_cli(tmp_path: Path) -> None:
    # An editable install reads the source tree, so only a real wheel shows what a user or the Docker image gets.
    source = tmp_path / "engine"
    shutil.copytree(ENGINE_DIR, source, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path, source],
        check=True,
    )
    (wheel,) = tmp_path.glob("pagoda_engine-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())

    src = ENGINE_DIR / "src"
    modules = {p.relative_to(src).as_posix() for p in (src / "pagoda").rglob("*.py")}
    assert modules - shipped == set(), "modules missing from the wheel (does each package have an __init__.py?)"
    model_files = {p.relative_to(src).as_posix() for p in (src / "pagoda" / MODEL_SUBDIR).iterdir()}
    assert model_files - shipped == set()
    (entry_points,) = [name for name in shipped if name.endswith(".dist-info/entry_points.txt")]
    assert "pagoda = pagoda.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
