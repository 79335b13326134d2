"""Downloading a model from ``s3://bucket/prefix`` with boto3 (see :mod:`pagoda.model_source`).

The folder is ``<root>/s3/<bucket>/<prefix>``. One download at a time per folder (a file lock, so replicas
sharing a ReadWriteMany volume take turns); each object goes to a temporary name in the same folder and is renamed
into place once complete, and objects already there with the same size and ETag are not fetched again (an
interrupted download resumes file by file). ``.pagoda-complete.json`` is written last: a folder without it is
never used, and with it (and ``offline``) the download needs no network at all.

Endpoint, region and credentials come from boto3's usual sources (``AWS_ENDPOINT_URL_S3`` or
``AWS_ENDPOINT_URL``, ``AWS_REGION``, ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, a profile, or the pod's
role), so an S3-compatible store (MinIO, Ceph) needs only the endpoint variable.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
from pathlib import Path

import boto3
import botocore.exceptions
from filelock import FileLock
from tqdm.auto import tqdm

from pagoda.model_source import (
    _S3_COMPLETE,
    DOWNLOAD_FAILED,
    MODEL_FILE_PATTERNS,
    MODEL_NOT_FOUND,
    UNAUTHORIZED,
    ModelSource,
    ModelSourceError,
    _os_error,
    kind_of,
    read_completion_marker,
)

logger = logging.getLogger(__name__)

_S3_FILES = ".pagoda-files.json"  # files fetched so far, with the size and ETag they had
_DENIED = frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "ExpiredToken"})
_MISSING = frozenset({"NoSuchBucket", "NoSuchKey", "404"})


def download_s3(source: ModelSource, root: Path, offline: bool, marker: str = "config.json") -> Path:
    """The local folder of ``source``'s files, fetched first unless a complete copy is there; ``marker`` is the
    file the prefix must hold (``config.json`` for a model, ``adapter_config.json`` for a LoRA adapter)."""
    url = f"s3://{source.value}"
    folder = root / "s3" / source.bucket / source.prefix
    if read_completion_marker(folder) is not None and offline:
        return folder
    if offline:
        raise ModelSourceError(MODEL_NOT_FOUND, url, "not in the local cache, and downloads are off (offline)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with FileLock(str(folder / ".pagoda-download.lock")):
            _download(source, folder, url, marker)
    except botocore.exceptions.NoCredentialsError:
        cause = "no S3 credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)"
        raise ModelSourceError(UNAUTHORIZED, url, cause) from None
    except botocore.exceptions.ClientError as exc:
        raise _client_error(url, exc) from None
    except (botocore.exceptions.EndpointConnectionError, botocore.exceptions.ConnectTimeoutError) as exc:
        raise ModelSourceError(DOWNLOAD_FAILED, url, f"cannot reach the S3 endpoint ({exc})") from None
    except OSError as exc:
        raise _os_error(url, exc) from None
    return folder


def _download(source: ModelSource, folder: Path, url: str, marker: str) -> None:
    client = boto3.client("s3")
    objects = _list(client, source)
    if marker not in objects:
        raise ModelSourceError(MODEL_NOT_FOUND, url, f"no {marker} under this prefix: not {kind_of(marker)}")
    (folder / _S3_COMPLETE).unlink(missing_ok=True)  # from here until the end the folder is not complete
    fetched = _read_json(folder / _S3_FILES)  # what earlier (maybe interrupted) downloads finished
    todo = {name: info for name, info in objects.items() if not _have(folder, name, info, fetched)}
    total = sum(size for size, _ in todo.values())
    logger.info("model %s: %d of %d files to download (%.1f MB)", url, len(todo), len(objects), total / 1e6)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"Downloading {url}", disable=not todo) as bar:
        for name, (size, etag) in sorted(todo.items()):
            partial = folder / f".{name}.incomplete.{os.getpid()}"
            key = f"{source.prefix}/{name}" if source.prefix else name
            client.download_file(source.bucket, key, str(partial), Callback=bar.update)
            os.replace(partial, folder / name)
            fetched[name] = [size, etag]
            _write_json(folder / _S3_FILES, fetched)
    _write_json(folder / _S3_COMPLETE, {name: list(info) for name, info in objects.items()})


def _have(folder: Path, name: str, info: tuple[int, str], fetched: dict) -> bool:
    path = folder / name
    return tuple(fetched.get(name, ())) == info and path.is_file() and path.stat().st_size == info[0]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_json(path: Path, data: dict) -> None:
    """Atomically: a reader sees the old file or the new one, never half of one."""
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(data))
    os.replace(temporary, path)


def _list(client, source: ModelSource) -> dict[str, tuple[int, str]]:
    """The model files directly under the prefix: name -> (size, ETag)."""
    prefix = f"{source.prefix}/" if source.prefix else ""
    found: dict[str, tuple[int, str]] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=source.bucket, Prefix=prefix):
        for item in page.get("Contents", ()):
            name = item["Key"][len(prefix) :]
            if "/" not in name and any(fnmatch.fnmatch(name, p) for p in MODEL_FILE_PATTERNS):
                found[name] = (int(item["Size"]), str(item.get("ETag", "")))
    return found


def _client_error(url: str, exc: botocore.exceptions.ClientError) -> ModelSourceError:
    code = str(exc.response.get("Error", {}).get("Code", ""))
    if code in _DENIED:
        return ModelSourceError(UNAUTHORIZED, url, f"S3 refused access ({code}): check the credentials")
    if code in _MISSING:
        return ModelSourceError(MODEL_NOT_FOUND, url, f"no such bucket or object ({code})")
    return ModelSourceError(DOWNLOAD_FAILED, url, f"S3 error {code}")
