"""Labels, selectors and owner references shared by every child object."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagoda_operator.constants import API_VERSION, KIND

MANAGED_BY = "pagoda-operator"


@dataclass(slots=True, frozen=True)
class Owner:
    """The identity of the ModelDeployment that owns the children."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Owner:
        """Take name, namespace and uid from a ModelDeployment body."""
        meta = body["metadata"]
        return cls(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])


def selector_labels(owner: Owner) -> dict[str, str]:
    """The labels that select this model's pods; never changes for an existing resource (selectors are immutable)."""
    return {"app.kubernetes.io/name": "pagoda-engine", "app.kubernetes.io/instance": owner.name}


def child_labels(owner: Owner) -> dict[str, str]:
    """Labels on every child and pod."""
    return {
        **selector_labels(owner),
        "app.kubernetes.io/managed-by": MANAGED_BY,
        "pagoda.dev/model-deployment": owner.name,
    }


def selector_string(owner: Owner) -> str:
    """The selector in the string form that the scale subresource publishes (``.status.selector``)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(owner).items()))


def owner_reference(owner: Owner) -> dict[str, Any]:
    """A controller owner reference, so Kubernetes' garbage collector deletes children with their owner."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_metadata(owner: Owner) -> dict[str, Any]:
    """Metadata of a child: same name and namespace as the owner, labels and the owner reference."""
    return {
        "name": owner.name,
        "namespace": owner.namespace,
        "labels": child_labels(owner),
        "ownerReferences": [owner_reference(owner)],
    }
