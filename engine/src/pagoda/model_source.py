"""Where a model's files come from, and getting them onto local disk.

A model argument is one of:
- nothing: the built-in stories260K;
- a local directory (config.json, safetensors, tokenizer files);
- a Hugging Face id, ``org/name`` or ``hf://org/name``: downloaded with ``huggingface_hub`` into its cache
  (``--download-dir``, else ``HF_HUB_CACHE`` / ``HF_HOME``), with ``--revision`` (a commit pins it), ``HF_TOKEN``,
  resumed downloads, a progress bar, and no network at all when the files are cached and ``PAGODA_OFFLINE=1`` (or
  ``HF_HUB_OFFLINE=1``) is set; huggingface_hub also falls back to the cache when the Hub cannot be reached;
- ``s3://bucket/prefix``: downloaded with boto3 (endpoint and credentials from the standard ``AWS_*`` variables)
  into ``--download-dir`` (else ``$PAGODA_CACHE_DIR/models``, else ``~/.cache/pagoda/models``).

Only the files the engine reads are fetched (weights, configs, tokenizer, chat template). Replicas that share one
cache volume (ReadWriteMany) do not corrupt each other: huggingface_hub locks each file and renames complete
downloads into place; the S3 download takes a lock on its folder and renames every file into place, and marks
the folder complete only when every file is there. Every failure is a :class:`ModelSourceError` whose one-line
message names the model and the cause, and whose ``reason`` says what kind of failure it was.

An S3 download (:func:`download_s3`; boto3 is imported for S3 models only) goes to ``<root>/s3/<bucket>/<prefix>``.
One download at a time per folder (a file lock, so replicas
sharing a ReadWriteMany volume take turns); each object goes to a temporary name in the same folder and is renamed
into place once complete, and objects already there with the same size and ETag are not fetched again (an
interrupted download resumes file by file). ``.pagoda-complete.json`` is written last: a folder without it is
never used, and with it (and ``offline``) the download needs no network at all.

Endpoint, region and credentials come from boto3's usual sources (``AWS_ENDPOINT_URL_S3`` or
``AWS_ENDPOINT_URL``, ``AWS_REGION``, ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, a profile, or the pod's
role), so an S3-compatible store (MinIO, Ceph) needs only the endpoint variable.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from pagoda.confined_paths import confined_path, unsafe_parts

if TYPE_CHECKING:
    import botocore.exceptions

logger = logging.getLogger(__name__)

# What the engine reads from a model folder (root only: subfolders such as original/ hold other formats).
MODEL_FILE_PATTERNS = (
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "quantize_config.json",  # AutoGPTQ exports that keep their quantization here, not in config.json
    "quant_config.json",  # AutoAWQ exports, likewise
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.tiktoken",
    "chat_template.jinja",
    "chat_template.json",
    "adapter_config.json",
    # sentence-transformers embedders (pooling models): which modules, and the pooling module's own config below
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
)
# The only files below the top level a model needs (named exactly): sentence-transformers' pooling config.
NESTED_MODEL_FILES = ("1_Pooling/config.json",)
# The Hub filter matches whole paths, and a * in MODEL_FILE_PATTERNS crosses folders: those matches below the top
# level are ignored, as is anything two folders deep, which leaves the top level and NESTED_MODEL_FILES.
_HUB_IGNORED = ("*/*/*", *(f"*/{pattern}" for pattern in MODEL_FILE_PATTERNS if "*" in pattern))
_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
_S3_COMPLETE = ".pagoda-complete.json"

# Why a model could not be had; the names are the Degraded reasons the operator reports.
MODEL_NOT_FOUND = "ModelNotFound"
UNAUTHORIZED = "Unauthorized"
OUT_OF_DISK = "OutOfDiskSpace"
DOWNLOAD_FAILED = "ModelLoadFailed"


class ModelSourceError(ValueError):
    """The model's files could not be had; ``reason`` is one of the constants above."""

    def __init__(self, reason: str, model: str, cause: str) -> None:
        super().__init__(f"model {model!r}: {cause}")
        self.reason = reason
        self.model = model


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A parsed model argument: ``kind`` is builtin, local, hf or s3; ``value`` the path, repo id or bucket/prefix."""

    kind: str
    value: str

    @property
    def bucket(self) -> str:
        assert self.kind == "s3"
        return self.value.partition("/")[0]

    @property
    def prefix(self) -> str:
        assert self.kind == "s3"
        return self.value.partition("/")[2].strip("/")


def parse_model_source(text: Optional[str]) -> ModelSource:
    """Classify a model argument; ValueError when it is none of the forms in the module docstring."""
    if not text:
        return ModelSource("builtin", "")
    if text.startswith("s3://"):
        bucket_and_prefix = text[len("s3://") :].strip("/")
        if not bucket_and_prefix or bucket_and_prefix.startswith("/"):
            raise ValueError(f"model {text!r}: expected s3://bucket/prefix")
        if unsafe_parts(bucket_and_prefix.replace("\\", "/")):  # the download folder is named after the URL
            raise ValueError(f"model {text!r}: an s3:// URL may not hold '.' or '..' path segments")
        return ModelSource("s3", bucket_and_prefix)
    if text.startswith("hf://"):
        repo_id = text[len("hf://") :].strip("/")
        if not _HF_ID.match(repo_id):
            raise ValueError(f"model {text!r}: expected hf://org/name")
        return ModelSource("hf", repo_id)
    path = Path(text).expanduser()
    if path.is_dir():
        return ModelSource("local", str(path))
    if not text.startswith(("/", ".", "~")) and _HF_ID.match(text):
        return ModelSource("hf", text)
    raise ModelSourceError(
        MODEL_NOT_FOUND, text, "not a local directory, a Hugging Face id (org/name) or an s3://bucket/prefix"
    )


def offline_mode() -> bool:
    """Whether downloads are off: only files already cached may be used (``PAGODA_OFFLINE`` or ``HF_HUB_OFFLINE``)."""
    return any(
        os.environ.get(name, "").lower() in ("1", "true", "yes") for name in ("PAGODA_OFFLINE", "HF_HUB_OFFLINE")
    )


def resolve_model(
    text: Optional[str],
    revision: Optional[str] = None,
    download_dir: Optional[str] = None,
    offline: Optional[bool] = None,
    builtin: Optional[Path] = None,
    marker: str = "config.json",
) -> Path:
    """The local folder holding the model's files, downloading them first when needed.

    ``builtin`` is the folder of the built-in model (for a missing ``text``); ``offline`` defaults to
    :func:`offline_mode`; ``marker`` is the file a download must bring (``adapter_config.json`` for a LoRA adapter).
    """
    source = parse_model_source(text)
    if source.kind == "builtin":
        assert builtin is not None, "no built-in model folder given"
        return builtin
    if revision is not None and source.kind != "hf":
        raise ValueError(f"model {text!r}: --revision applies to Hugging Face models only")
    if revision is not None and unsafe_parts(revision):
        raise ValueError(f"model {text!r}: revision {revision!r} may not hold '.' or '..' segments or start with '/'")
    offline = offline_mode() if offline is None else offline
    if source.kind == "local":
        return Path(source.value)
    if source.kind == "hf":
        return _download_hf(source.value, revision, download_dir, offline, marker)
    return download_s3(source, _s3_root(download_dir), offline, marker)


def download_roots(download_dir: Optional[str]) -> tuple[Path, ...]:
    """The folders downloads of Hub and S3 models (and adapters) land in: ``download_dir``, or the Hub cache and the
    S3 cache."""
    if download_dir:
        return (Path(download_dir),)
    from huggingface_hub import constants

    return (Path(constants.HF_HUB_CACHE), _s3_root(None))


def _s3_root(download_dir: Optional[str]) -> Path:
    if download_dir:
        return Path(download_dir)
    cache = os.environ.get("PAGODA_CACHE_DIR")
    return Path(cache) / "models" if cache else Path.home() / ".cache" / "pagoda" / "models"


def _download_hf(
    repo_id: str, revision: Optional[str], download_dir: Optional[str], offline: bool, marker: str = "config.json"
) -> Path:
    import huggingface_hub
    from huggingface_hub import errors as hf_errors

    where = f" at revision {revision}" if revision else ""
    logger.info("model %s%s: fetching from the Hugging Face Hub (or its cache)", repo_id, where)
    try:
        folder = huggingface_hub.snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=download_dir,
            allow_patterns=[*MODEL_FILE_PATTERNS, *NESTED_MODEL_FILES],
            ignore_patterns=list(_HUB_IGNORED),
            local_files_only=offline,
        )
    except hf_errors.GatedRepoError:
        raise ModelSourceError(
            UNAUTHORIZED, repo_id, "the Hub refused access: the model is gated; set HF_TOKEN"
        ) from None
    except hf_errors.RepositoryNotFoundError as exc:
        raise _repository_error(repo_id, exc) from None
    except hf_errors.RevisionNotFoundError:
        raise ModelSourceError(MODEL_NOT_FOUND, repo_id, f"revision {revision!r} does not exist on the Hub") from None
    except hf_errors.LocalEntryNotFoundError as exc:
        raise _unreachable(repo_id, exc, offline) from None
    except hf_errors.HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):  # a token the Hub does not know, or one without access
            raise ModelSourceError(UNAUTHORIZED, repo_id, f"the Hub refused the token (HTTP {status})") from None
        raise ModelSourceError(DOWNLOAD_FAILED, repo_id, f"the Hub answered HTTP {status}") from None
    except OSError as exc:
        raise _os_error(repo_id, exc) from None
    except Exception as exc:  # the HTTP client's own errors (a connection lost mid-file, a timeout)
        raise ModelSourceError(DOWNLOAD_FAILED, repo_id, f"the download failed: {type(exc).__name__}: {exc}") from None
    path = Path(folder)
    if not (path / marker).is_file():
        raise ModelSourceError(MODEL_NOT_FOUND, repo_id, f"the repository has no {marker}: not {kind_of(marker)}")
    return path


def kind_of(marker: str) -> str:
    """What a download that must bring ``marker`` fetches, for messages."""
    return "a model" if marker == "config.json" else "an adapter"


def _repository_error(repo_id: str, exc: Exception) -> ModelSourceError:
    # The Hub answers 401 for a private repository without (or with a wrong) token, 404 for one that does not exist.
    response = getattr(exc, "response", None)
    if response is not None and response.status_code in (401, 403):
        cause = "the Hub refused access (HTTP 401): the model is private or gated; set HF_TOKEN to a token with access"
        return ModelSourceError(UNAUTHORIZED, repo_id, cause)
    return ModelSourceError(MODEL_NOT_FOUND, repo_id, "no such model on the Hugging Face Hub")


def _unreachable(repo_id: str, exc: Exception, offline: bool) -> ModelSourceError:
    if offline:
        return ModelSourceError(MODEL_NOT_FOUND, repo_id, "not in the local cache, and downloads are off (offline)")
    cause = exc.__cause__ or exc.__context__
    detail = f" ({type(cause).__name__})" if cause is not None else ""
    return ModelSourceError(
        DOWNLOAD_FAILED, repo_id, f"cannot reach the Hugging Face Hub{detail}, and it is not cached"
    )


def _os_error(model: str, exc: OSError) -> ModelSourceError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ModelSourceError(OUT_OF_DISK, model, f"no space left on the download volume ({exc.filename or ''})")
    return ModelSourceError(DOWNLOAD_FAILED, model, f"{exc.strerror or type(exc).__name__} ({exc.filename or ''})")


def read_completion_marker(folder: Path) -> Optional[dict]:
    """The manifest a finished S3 download leaves in its folder, or None (never finished, or a partial write)."""
    try:
        return json.loads((folder / _S3_COMPLETE).read_text())
    except (OSError, ValueError):
        return None


# ---- S3 ----------------------------------------------------------------------------------------------------

_S3_FILES = ".pagoda-files.json"  # files fetched so far, with the size and ETag they had
_DENIED = frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "ExpiredToken"})
_MISSING = frozenset({"NoSuchBucket", "NoSuchKey", "404"})


def download_s3(source: ModelSource, root: Path, offline: bool, marker: str = "config.json") -> Path:
    """The local folder of ``source``'s files, fetched first unless a complete copy is there; ``marker`` is the
    file the prefix must hold (``config.json`` for a model, ``adapter_config.json`` for a LoRA adapter)."""
    import botocore.exceptions
    from filelock import FileLock

    url = f"s3://{source.value}"
    try:  # parse_model_source refused '..' already; this also catches a symlink in the cache leading elsewhere
        folder = confined_path(root / "s3", f"{source.bucket}/{source.prefix}".rstrip("/"))
    except ValueError as exc:
        raise ModelSourceError(DOWNLOAD_FAILED, url, f"the download folder would be outside the cache: {exc}") from None
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
    import boto3  # boto3 and tqdm are imported only for S3 models: every `pagoda` command imports this module
    from tqdm.auto import tqdm

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
            target = _object_path(folder, name, url)
            target.parent.mkdir(parents=True, exist_ok=True)  # NESTED_MODEL_FILES have a folder of their own
            partial = target.with_name(f".{target.name}.incomplete.{os.getpid()}")
            key = f"{source.prefix}/{name}" if source.prefix else name
            client.download_file(source.bucket, key, str(partial), Callback=bar.update)
            os.replace(partial, target)
            fetched[name] = [size, etag]
            _write_json(folder / _S3_FILES, fetched)
    _write_json(folder / _S3_COMPLETE, {name: list(info) for name, info in objects.items()})


def _object_path(folder: Path, name: str, url: str) -> Path:
    """Where the object listed as ``name`` goes: inside ``folder``, or the listing is refused."""
    try:
        return confined_path(folder, name)
    except ValueError as exc:
        raise ModelSourceError(DOWNLOAD_FAILED, url, f"S3 listed an object outside the prefix: {exc}") from None


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
            if not item["Key"].startswith(prefix):  # a listing that strays from the prefix asked for
                continue
            name = item["Key"][len(prefix) :]
            if is_model_file(name):
                found[name] = (int(item["Size"]), str(item.get("ETag", "")))
    return found


def is_model_file(name: str) -> bool:
    """Whether a remote file (``/``-separated, relative to the model's root) is one a model is served from."""
    if name in NESTED_MODEL_FILES:
        return True
    return "/" not in name and any(fnmatch.fnmatch(name, pattern) for pattern in MODEL_FILE_PATTERNS)


def _client_error(url: str, exc: botocore.exceptions.ClientError) -> ModelSourceError:
    code = str(exc.response.get("Error", {}).get("Code", ""))
    if code in _DENIED:
        return ModelSourceError(UNAUTHORIZED, url, f"S3 refused access ({code}): check the credentials")
    if code in _MISSING:
        return ModelSourceError(MODEL_NOT_FOUND, url, f"no such bucket or object ({code})")
    return ModelSourceError(DOWNLOAD_FAILED, url, f"S3 error {code}")
