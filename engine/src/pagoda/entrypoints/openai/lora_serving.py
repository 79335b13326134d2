"""LoRA adapters at the server: start-up adapters, the watched adapter list file, and the runtime endpoints.

Adapters come from three places, each owning its own: ``--lora-modules`` (loaded before the server is ready; a
bad one fails the start), ``--lora-modules-file`` (re-read every few seconds; adapters added are loaded, removed
ones unloaded, and one that fails is reported, not fatal: the operator mounts its ConfigMap there), and
``POST /v1/load_lora_adapter`` (with ``--allow-runtime-lora-updates``). ``GET /lora_adapters`` reports every
adapter's state, failures included, for the operator's status.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.lora_requests import UnknownLoRAError
from pagoda.entrypoints.openai.errors import OpenAIError, bad_request, service_unavailable
from pagoda.lora.sources import LoRAModule, read_lora_modules_file

logger = logging.getLogger(__name__)

LOADED, FAILED = "loaded", "failed"
# An adapter of the list that failed (a download during a network blip) is tried again this often.
RETRY_FAILED_SECONDS = 30.0


@dataclass(frozen=True, slots=True)
class AdapterState:
    """What ``GET /lora_adapters`` says of one adapter."""

    name: str
    path: str
    origin: str  # flag | file | api
    state: str  # loaded | failed
    error: Optional[str] = None

    def as_dict(self) -> dict:
        return {"name": self.name, "path": self.path, "origin": self.origin, "state": self.state, "error": self.error}


class LoRAAdapters:
    """The server's adapters over the engine's registry; thread-safe (routes, the file watcher).

    Each name belongs to the origin that loaded it: the file's adapters change only through the file (an API call
    that would replace or unload one is refused), and the file never touches a name the flags or the API own."""

    def __init__(self, engine: LLMEngine, reserved_names: frozenset[str] = frozenset()) -> None:
        self.engine = engine
        self.reserved_names = reserved_names  # the served model's name: an adapter of that name could not be chosen
        self._changes = threading.Lock()  # one load or unload at a time (a load may download for a while)
        self._lock = threading.Lock()  # guards _states, held only briefly
        self._states: dict[str, AdapterState] = {}

    def load(self, module: LoRAModule, origin: str, replace: bool = False) -> None:
        """Load and serve ``module`` (``replace``: swap out a loaded adapter of that name once the new one is read,
        so a bad replacement leaves the old one serving). ValueError says why not; for the file's adapters it is
        also recorded as their state."""
        if module.name in self.reserved_names:
            raise ValueError(f"LoRA adapter name {module.name!r} is the served model's name; choose another")
        with self._changes:
            owner = self._state(module.name)
            if owner is not None and owner.origin == "file" and origin != "file":
                raise ValueError(f"LoRA adapter {module.name!r} comes from the adapter list file; change it there")
            if not replace and self.engine.lora_id_or_none(module.name) is not None:
                raise ValueError(f"LoRA adapter {module.name!r} is already loaded; unload it first")
            try:
                self.engine.add_lora(module, replace=replace)
            except Exception as exc:  # a download's or a file's own error types too: never a 500, never fatal
                message = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
                if not isinstance(exc, ValueError) or not message.startswith("LoRA adapter"):
                    message = f"LoRA adapter {module.name!r} could not be loaded from {module.path}: {message}"
                if origin == "file":
                    self._set(module.name, AdapterState(module.name, module.path, origin, FAILED, message))
                raise ValueError(message) from None
            self._set(module.name, AdapterState(module.name, module.path, origin, LOADED))

    def unload(self, name: str, origin: str = "api") -> None:
        """Stop serving ``name``: UnknownLoRAError if it is not loaded, ValueError if the file owns it and
        ``origin`` is not the file."""
        with self._changes:
            state = self._state(name)
            if state is not None and state.origin == "file" and origin != "file":
                raise ValueError(f"LoRA adapter {name!r} comes from the adapter list file; remove it there")
            if state is None or state.state != FAILED:
                self.engine.remove_lora(name)
            self._set(name, None)

    def states(self) -> list[AdapterState]:
        with self._lock:
            return list(self._states.values())

    def _state(self, name: str) -> Optional[AdapterState]:
        with self._lock:
            return self._states.get(name)

    def _set(self, name: str, state: Optional[AdapterState]) -> None:
        with self._lock:
            if state is None:
                self._states.pop(name, None)
            else:
                self._states[name] = state

    def sync_file(self, modules: list[LoRAModule]) -> None:
        """Make the file's adapters what it lists: unload the ones gone or changed, load the new ones (and retry
        the failed ones). Adapters from the flags or the API are left alone."""
        wanted = {m.name: m for m in modules}
        for state in self.states():
            if state.origin != "file":
                continue
            module = wanted.get(state.name)
            if module is None or module.path != state.path or state.state == FAILED:
                self._unload_quietly(state.name)
        current = {s.name for s in self.states()}
        for module in modules:
            if module.name in current:
                continue
            try:
                self.load(module, "file")
            except ValueError as exc:
                logger.warning("LoRA adapter %s from the adapter list could not be loaded: %s", module.name, exc)

    def _unload_quietly(self, name: str) -> None:
        with contextlib.suppress(UnknownLoRAError):
            self.unload(name, origin="file")


class LoRAFileWatcher:
    """Re-reads the adapter list file every ``interval`` seconds and syncs the adapters when its content changes.

    A file that cannot be read or parsed is logged (once per content) and changes nothing: a half-written or
    broken list never unloads adapters that serve traffic."""

    def __init__(self, adapters: LoRAAdapters, path: Path, interval: float) -> None:
        self.adapters = adapters
        self.path = Path(path)
        self.interval = interval
        self._digest: Optional[str] = None
        self._retry_at = 0.0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def sync_once(self) -> None:
        """Read the file and apply it if it changed (the first call loads it)."""
        try:
            content = self.path.read_bytes()
        except OSError as exc:
            content = f"unreadable: {exc}".encode()
        digest = hashlib.sha256(content).hexdigest()
        failed = any(s.origin == "file" and s.state == FAILED for s in self.adapters.states())
        if digest == self._digest and not (failed and time.monotonic() >= self._retry_at):
            return
        self._digest = digest
        self._retry_at = time.monotonic() + RETRY_FAILED_SECONDS
        try:
            modules = read_lora_modules_file(self.path)
        except ValueError as exc:
            logger.error("the LoRA adapter list is not applied: %s", exc)
            return
        logger.info("applying the LoRA adapter list %s (%d adapters)", self.path, len(modules))
        self.adapters.sync_file(modules)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="lora-file-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sync_once()
            except Exception:  # never let the watcher die: the next change must still apply
                logger.exception("syncing the LoRA adapter list failed")


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's body)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = False  # replace a loaded adapter of that name


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's body; ``lora_int_id`` is accepted and ignored)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    lora_name: str = Field(min_length=1, max_length=128)
    lora_int_id: Optional[int] = None


def add_lora_routes(
    app: FastAPI,
    adapters: Callable[[], Optional[LoRAAdapters]],
    enabled: bool,
    runtime_updates: bool,
    route: Callable,
) -> None:
    """``GET /lora_adapters`` always (503 while an ``enabled`` server loads; an empty list without LoRA); the load and
    unload endpoints with ``runtime_updates``. ``adapters()``: the server's adapters once the model is loaded."""

    def ready_adapters() -> LoRAAdapters:
        current = adapters()
        if current is None:
            raise service_unavailable("the model is still loading, or this server runs without --enable-lora")
        return current

    @route("get", "/lora_adapters")
    async def lora_adapters() -> Response:
        current = adapters()
        if current is None and enabled:  # not "no adapters": the list has not been read yet
            raise service_unavailable("the model is still loading; the adapter list is read before it is ready")
        states = current.states() if current is not None else []
        return JSONResponse({"object": "list", "data": [s.as_dict() for s in states]})

    if not runtime_updates:
        return

    @route("post", "/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        current = ready_adapters()
        try:
            module = LoRAModule(body.lora_name, body.lora_path)
        except ValueError as exc:
            raise bad_request(str(exc), "lora_name") from None
        try:
            await asyncio.to_thread(current.load, module, "api", body.load_inplace)
        except ValueError as exc:
            naming = ("already loaded", "adapter list file", "served model's name", "is not valid")
            param = "lora_name" if any(text in str(exc) for text in naming) else "lora_path"
            raise bad_request(str(exc), param) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @route("post", "/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        current = ready_adapters()
        try:
            await asyncio.to_thread(current.unload, body.lora_name)
        except UnknownLoRAError as exc:
            raise OpenAIError(404, str(exc), param="lora_name", code="model_not_found") from None
        except ValueError as exc:
            raise bad_request(str(exc), "lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
