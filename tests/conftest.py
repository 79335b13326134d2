"""Test-suite-wide hooks: skip tests whose hardware or cluster is not there.

Markers (registered in the root pyproject.toml):
- ``gpu``: skipped when ``torch.cuda.is_available()`` is False.
- ``k8s``: skipped unless ``KUBECONFIG`` or ``PAGODA_E2E_CLUSTER`` is set.
- ``slow``: runs by default; ``-m "not slow"`` deselects it.
"""

import os

import pytest

# Triton decides at decoration time whether a kernel is compiled or interpreted, so the switch must be
# set before any kernel module is imported. Without a GPU the kernels run on CPU tensors in the
# interpreter (slow: kernel tests use small shapes); with one they are compiled for real.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (torch is imported only when a gpu test is about to run)."""
    import torch

    return torch.cuda.is_available()


def k8s_cluster_configured() -> bool:
    """Whether the environment points the tests at a real Kubernetes cluster."""
    return bool(os.environ.get("KUBECONFIG") or os.environ.get("PAGODA_E2E_CLUSTER"))


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and not cuda_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    if item.get_closest_marker("k8s") is not None and not k8s_cluster_configured():
        pytest.skip("needs a Kubernetes cluster: set KUBECONFIG or PAGODA_E2E_CLUSTER")
