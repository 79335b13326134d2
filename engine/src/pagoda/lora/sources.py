"""Which adapters to serve: ``--lora-modules`` arguments and the ``--lora-modules-file`` list.

An adapter's path has the forms a model argument has (see :mod:`pagoda.model_source`): a local folder, an
``org/name`` Hub id or ``hf://org/name``, or ``s3://bucket/prefix``; remote adapters are downloaded into the same
cache as models.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from pagoda.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, LoRAAdapterError

# A name a request's ``model`` field can carry: no whitespace, no quotes, not too long.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One adapter to serve: the name clients select it by, and where its files are."""

    name: str
    path: str
    base_model_name: Optional[str] = None  # informational (vLLM's JSON form); the shapes decide compatibility

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(
                f"LoRA adapter name {self.name!r} is not valid: 1-128 characters, letters, digits and ._:/@+- "
                "(starting with a letter or digit)"
            )
        if not isinstance(self.path, str) or not self.path.strip():
            raise ValueError(f"LoRA adapter {self.name!r} needs a path")


def parse_lora_module(text: str) -> LoRAModule:
    """``name=path`` or vLLM's JSON form ``{"name": ..., "path": ..., "base_model_name": ...}``."""
    text = text.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-modules: {text!r} is not valid JSON ({exc.msg})") from None
        return module_from_mapping(data, "--lora-modules")
    name, sep, path = text.partition("=")
    if not sep:
        raise ValueError(f"--lora-modules: expected name=path or a JSON object, got {text!r}")
    return LoRAModule(name.strip(), path.strip())


def module_from_mapping(data: Any, where: str) -> LoRAModule:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: each adapter is an object with name and path, got {type(data).__name__}")
    unknown = set(data) - {"name", "path", "base_model_name"}
    if unknown:
        raise ValueError(f"{where}: unknown adapter field(s) {', '.join(sorted(unknown))}")
    if not isinstance(data.get("name"), str) or not isinstance(data.get("path"), str):
        raise ValueError(f"{where}: an adapter needs string fields name and path, got {data!r}")
    base = data.get("base_model_name")
    return LoRAModule(data["name"], data["path"], base if isinstance(base, str) else None)


def parse_lora_modules(items: list[str]) -> list[LoRAModule]:
    """Every ``--lora-modules`` argument; a name given twice is an error."""
    return _unique([parse_lora_module(item) for item in items], "--lora-modules")


def read_lora_modules_file(path: Path) -> list[LoRAModule]:
    """The adapters listed in a JSON file: ``[{"name": ..., "path": ...}, ...]`` (or ``{"adapters": [...]}``).

    ValueError when the file cannot be read or parsed, naming the file and the problem."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read the LoRA modules file {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"the LoRA modules file {path} is not valid JSON: {exc}") from None
    if isinstance(data, dict) and set(data) == {"adapters"}:
        data = data["adapters"]
    if not isinstance(data, list):
        raise ValueError(f"the LoRA modules file {path} must hold a JSON list of adapters")
    where = f"LoRA modules file {path}"
    return _unique([module_from_mapping(item, where) for item in data], where)


def _unique(modules: list[LoRAModule], where: str) -> list[LoRAModule]:
    seen: set[str] = set()
    for module in modules:
        if module.name in seen:
            raise ValueError(f"{where}: adapter name {module.name!r} is given more than once")
        seen.add(module.name)
    return modules


def adapters_offline() -> bool:
    """Whether adapters may only come from the cache: ``PAGODA_LORA_OFFLINE`` when set, else the model's offline
    mode. The operator sets ``PAGODA_OFFLINE=1`` (its init container fetched the model) and
    ``PAGODA_LORA_OFFLINE=0`` (a later adapter list may name a Hub or S3 adapter the engine must download)."""
    value = os.environ.get("PAGODA_LORA_OFFLINE")
    if value is None:
        from pagoda.model_source import offline_mode

        return offline_mode()
    return value.strip().lower() in ("1", "true", "yes")


def resolve_adapter_path(path: str, download_dir: Optional[str] = None) -> Path:
    """The adapter's local folder, downloading a remote one first (a ModelSourceError, a ValueError, says why)."""
    from pagoda.model_source import resolve_model

    return resolve_model(path, None, download_dir, offline=adapters_offline(), marker="adapter_config.json")


def default_allowed_roots(download_dir: Optional[str], startup: Iterable[LoRAModule]) -> tuple[Path, ...]:
    """Where runtime loads may read local adapters when ``--lora-allowed-roots`` is not given: the download cache
    (where Hub and S3 adapters land) and the local folders of the start-up adapters."""
    from pagoda.model_source import download_roots, parse_model_source

    local = [Path(m.path) for m in startup if parse_model_source(m.path).kind == "local"]
    return (*download_roots(download_dir), *local)


def confine_runtime_adapter(module: LoRAModule, roots: Iterable[Path]) -> None:
    """Refuse a runtime load of a local folder unless it and its two adapter files, symlinks resolved, lie inside
    one of ``roots`` and the files are regular files (not a FIFO or a device that blocks the reader). Every reason
    gives the same LoRAAdapterError, so the answer never tells which paths exist. Hub and S3 adapters pass: they
    are downloaded into the cache, where every file name is confined (see pagoda.model_source)."""
    from pagoda.model_source import parse_model_source

    try:
        remote = parse_model_source(module.path).kind in ("hf", "s3")
    except ValueError:  # neither a folder nor a source: answered like any other path outside the roots
        remote = False
    if remote:
        return
    inside = [Path(root).resolve() for root in roots]
    try:
        folder = Path(module.path).resolve(strict=True)
        files = [(folder / name).resolve(strict=True) for name in (CONFIG_FILE, WEIGHTS_FILE)]
        allowed = all(any(p.is_relative_to(root) for root in inside) for p in (folder, *files))
        allowed = allowed and all(stat.S_ISREG(os.stat(f).st_mode) for f in files)
    except (OSError, RuntimeError, ValueError):  # missing, a symlink loop, unreadable: the same answer
        allowed = False
    if not allowed:
        raise LoRAAdapterError(
            f"LoRA adapter {module.name!r}: lora_path is not an adapter folder inside the allowed roots "
            "(--lora-allowed-roots: by default the download cache and the start-up adapters' folders)"
        )
