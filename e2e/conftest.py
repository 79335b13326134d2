"""End-to-end tests against a real Kubernetes (kind) cluster.

Every test under e2e/ is marked ``k8s`` and skipped unless ``KUBECONFIG`` or ``PAGODA_E2E_CLUSTER`` is set, so
``make test`` on a machine without a cluster reports them as skipped instead of failing. See e2e/README.md.
"""

import os
from pathlib import Path

import pytest

E2E_DIR = Path(__file__).parent


def k8s_cluster_configured() -> bool:
    """Whether the environment points the tests at a real Kubernetes cluster."""
    return bool(os.environ.get("KUBECONFIG") or os.environ.get("PAGODA_E2E_CLUSTER"))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # tryfirst: the marker must be on the items before `-m "not k8s"` deselects by it.
    for item in items:
        if item.path.is_relative_to(E2E_DIR):
            item.add_marker(pytest.mark.k8s)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if not k8s_cluster_configured():
        pytest.skip("needs a Kubernetes cluster: set KUBECONFIG or PAGODA_E2E_CLUSTER")
