"""The real control plane for the cluster tests: one API server for the whole session, a namespace for each module.

Starting ``../shared/k8s/cluster`` takes about 10 s, so every cluster test module shares one control plane (and the
ModelDeployment CRD, applied once), and keeps to a namespace of its own: a module names it in ``NS``; the ``cluster``
fixture creates it before the module's first test and deletes it, with everything in it, after its last one. The
``operator`` fixture runs the operator (``kopf run``) watching that namespace; a module that wants more in its
environment sets ``OPERATOR_ENV``. A module may override either fixture, asking for this one by the same name to
build on it (e.g. to add Secrets to its namespace).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from control_plane import CLUSTER_SCRIPT, Cluster, cluster_with_crd, own_namespace, running_operator


@pytest.fixture(scope="session")
def control_plane_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """etcd, kube-apiserver and kube-controller-manager with the CRD established, for every cluster test."""
    if not CLUSTER_SCRIPT.exists():
        pytest.skip(f"needs {CLUSTER_SCRIPT}")
    with cluster_with_crd(tmp_path_factory.mktemp("k8s") / "cluster") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest, control_plane_session: Cluster) -> Iterator[Cluster]:
    """The session's control plane, acting in the test module's own namespace (its ``NS``)."""
    namespace = getattr(request.module, "NS", None)
    assert namespace, f"{request.module.__name__} needs NS, the namespace its cluster tests use"
    with own_namespace(control_plane_session, namespace) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def operator(
    request: pytest.FixtureRequest, cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    """The operator watching the module's namespace, with the module's ``OPERATOR_ENV`` if any; yields its log."""
    log = tmp_path_factory.mktemp("operator") / "kopf.log"
    with running_operator(cluster, cluster.namespace, log, getattr(request.module, "OPERATOR_ENV", None)):
        yield log
