"""The router's model table (what each model name routes to) and the static YAML file that can fill it.

Both sources of models, Kubernetes discovery and a static file, write the same ``ModelTable``; the server only reads
it. A static file, for use without Kubernetes (and in tests), looks like::

    models:
      - name: alpha                      # the served model name clients send
        adapters: [sql]                  # LoRA adapter names served by the same endpoints (optional)
        endpoints: ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]   # or {url, kvEvents, kvReplay} each
        namespace: default               # optional: a ModelDeployment to label metrics with
        deployment: alpha                # optional

The file is re-read when it changes (``watch_static_file``), so endpoints can come and go without a restart.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from pagoda_operator.router.endpoints import Endpoint

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Model:
    """One routable model: its served name, the LoRA adapters its endpoints serve, and the ready endpoints.

    ``namespace``/``deployment`` name the ModelDeployment behind it (None for a static model without one)."""

    name: str
    endpoints: tuple[Endpoint, ...] = ()
    adapters: tuple[str, ...] = ()
    namespace: Optional[str] = None
    deployment: Optional[str] = None
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def labels(self) -> tuple[str, str]:
        """``(model_namespace, model_deployment)`` for the router's metrics."""
        return self.namespace or "", self.deployment or self.name


class ModelTable:
    """Models by source key ("namespace/deployment", or the name for static models); listeners hear of changes."""

    def __init__(self) -> None:
        self._models: dict[str, Model] = {}
        self._listeners: list[Callable[[], None]] = []

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` after every change (it must not block)."""
        self._listeners.append(callback)

    def _changed(self) -> None:
        for callback in self._listeners:
            callback()

    def set(self, key: str, model: Model) -> None:
        """Add or replace the model under ``key``."""
        if self._models.get(key) != model:
            self._models[key] = model
            self._changed()

    def remove(self, key: str) -> None:
        """Forget the model under ``key`` (a no-op when unknown)."""
        if self._models.pop(key, None) is not None:
            self._changed()

    def replace_all(self, models: Mapping[str, Model]) -> None:
        """Make the table exactly ``models``."""
        if dict(models) != self._models:
            self._models = dict(models)
            self._changed()

    def items(self) -> list[tuple[str, Model]]:
        """``(source key, model)`` of every model."""
        return list(self._models.items())

    def models(self) -> list[Model]:
        """Every model, in the order they were added."""
        return list(self._models.values())

    def get(self, key: str) -> Optional[Model]:
        """The model under ``key``."""
        return self._models.get(key)

    def resolve(self, name: str) -> Optional[tuple[str, Model, Optional[str]]]:
        """``(key, model, adapter)`` for a requested model name: a served name (adapter None) wins over an adapter
        of another model; None when no model has that name."""
        for key, model in self._models.items():
            if model.name == name:
                return key, model, None
        for key, model in self._models.items():
            if name in model.adapters:
                return key, model, name
        return None

    def endpoints(self) -> list[Endpoint]:
        """Every distinct endpoint of every model."""
        seen: dict[str, Endpoint] = {}
        for model in self._models.values():
            for endpoint in model.endpoints:
                seen.setdefault(endpoint.key, endpoint)
        return list(seen.values())


def _strings(value: Any, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{what} must be a list of non-empty strings")
    return tuple(value)


def _endpoint(value: Any, what: str) -> Endpoint:
    """An endpoint entry: its URL, or ``{url, kvEvents, kvReplay}`` for an engine that publishes KV events."""
    fields = {"url": value} if isinstance(value, str) else value
    if not isinstance(fields, dict) or not set(fields) <= {"url", "kvEvents", "kvReplay"}:
        raise ValueError(f"{what}: expected a URL or a mapping of url, kvEvents and kvReplay")
    url = fields.get("url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"{what}: {url!r} is not an http(s) URL")
    for key in ("kvEvents", "kvReplay"):
        address = fields.get(key)
        if address is not None and (not isinstance(address, str) or not address.startswith("tcp://")):
            raise ValueError(f"{what}.{key}: {address!r} is not a tcp:// address")
    url = url.rstrip("/")
    return Endpoint(key=url, url=url, kv_events=fields.get("kvEvents"), kv_replay=fields.get("kvReplay"))


def _endpoints(value: Any, what: str) -> tuple[Endpoint, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ValueError(f"{what} must be a list")
    return tuple(_endpoint(item, f"{what}[{i}]") for i, item in enumerate(value))


def parse_static_models(document: Any) -> dict[str, Model]:
    """The models of a parsed static file, by name; ValueError for a malformed one."""
    if not isinstance(document, dict) or not isinstance(document.get("models"), list):
        raise ValueError("a static models file needs a top-level list `models`")
    models: dict[str, Model] = {}
    for index, entry in enumerate(document["models"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
            raise ValueError(f"models[{index}] needs a `name`")
        name = entry["name"]
        if name in models:
            raise ValueError(f"model {name!r} is listed twice")
        endpoints = _endpoints(entry.get("endpoints"), f"models[{index}].endpoints")
        models[name] = Model(
            name=name,
            endpoints=endpoints,
            adapters=_strings(entry.get("adapters"), f"models[{index}].adapters"),
            namespace=entry.get("namespace"),
            deployment=entry.get("deployment"),
        )
    return models


def load_static_models(path: str) -> dict[str, Model]:
    """Read and parse a static models file; ValueError (or OSError) when it cannot be used."""
    with open(path, encoding="utf-8") as f:
        try:
            document = yaml.safe_load(f)
        except yaml.YAMLError as error:
            raise ValueError(f"{path}: not YAML: {error}") from None
    return parse_static_models(document)


def _stamp(path: str) -> Optional[tuple[int, int]]:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_mtime_ns, info.st_size


def _keep_created(table: ModelTable, models: Mapping[str, Model]) -> dict[str, Model]:
    """The new models, with the creation time of those the table already had (so a reload is not a change)."""
    out = {}
    for key, model in models.items():
        old = table.get(key)
        out[key] = model if old is None else Model(**{**_fields(model), "created": old.created})
    return out


def _fields(model: Model) -> dict[str, Any]:
    return {name: getattr(model, name) for name in Model.__slots__}  # type: ignore[attr-defined]


async def watch_static_file(path: str, table: ModelTable, interval: float = 1.0) -> None:
    """Fill ``table`` from ``path`` and re-read it whenever it changes, until cancelled. A file that turns bad is
    logged and its last good contents kept."""
    last = _stamp(path)
    while True:
        await asyncio.sleep(interval)
        stamp = _stamp(path)
        if stamp == last:
            continue
        last = stamp
        try:
            models = load_static_models(path)
        except (OSError, ValueError) as error:
            logger.warning("static models file %s not reloaded: %s", path, error)
            continue
        table.replace_all(_keep_created(table, models))
        logger.info("static models file %s reloaded: %d models", path, len(models))


def static_table(models: Iterable[Model] | Sequence[Model]) -> ModelTable:
    """A table holding ``models`` (keyed by name)."""
    table = ModelTable()
    table.replace_all({m.name: m for m in models})
    return table
