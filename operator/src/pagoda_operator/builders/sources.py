"""How the engine names a source: the path it reads inside the pod, or what it downloads."""

from __future__ import annotations

from pagoda_operator.spec import ModelSource

PVC_MOUNT_ROOT = "/mnt/pvc"


def source_argument(source: ModelSource) -> str:
    """The engine's view of a source: the mount path for pvc://, else the path, the Hugging Face id or the s3:// URL."""
    if source.kind == "pvc":
        return f"{PVC_MOUNT_ROOT}/{source.claim}/{source.value}"
    return source.value
