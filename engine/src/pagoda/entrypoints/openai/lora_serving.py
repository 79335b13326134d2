"""LoRA adapters at the server: start-up adapters, the watched adapter list file, and the runtime endpoints.

Adapters come from three places, each owning its own: ``--lora-modules`` (loaded before the server is ready; a
bad one fails the start), ``--lora-modules-file`` (re-read every few seconds; adapters added are loaded, removed
ones unloaded, and one that fails is reported, not fatal: the operator mounts its ConfigMap there), and
``POST /v1/load_lora_adapter`` (with ``--allow-runtime-lora-updates``; a local path must lie inside
``--lora-allowed-roots``). ``GET /lora_adapters`` reports every adapter's state, failures included, for the
operator's status; callers without the API key (the operator, which never reads Secrets) get each adapter's name,
state and a digest of its path, never the path or the error text.

Changes to one adapter name are serialized; changes to different names never wait for each other, and no lock
other requests need is held while an adapter is downloaded or read (reads have a deadline, --lora-read-timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.lora_requests import UnknownLoRAError
from pagoda.entrypoints.openai.errors import OpenAIError, bad_request, service_unavailable
from pagoda.lora.reader import AdapterReadTimeout
from pagoda.lora.sources import LoRAModule, confine_runtime_adapter, read_lora_modules_file

logger = logging.getLogger(__name__)

LOADED, FAILED = "loaded", "failed"
# What callers without the API key are told of a failure instead of its text (which names paths).
REDACTED_ERROR = (
    "the adapter could not be loaded or read; the server log (or GET /lora_adapters with the API key) says why"
)
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

    def as_dict(self, full: bool = True) -> dict:
        """The report's entry; without ``full`` (a caller without the API key) the path is a sha256 digest (enough to
        tell which source is served) and an error says only that there is one."""
        entry = {"name": self.name, "origin": self.origin, "state": self.state}
        entry["path_sha256"] = hashlib.sha256(self.path.encode()).hexdigest()
        if full:
            return {**entry, "path": self.path, "error": self.error}
        return {**entry, "error": REDACTED_ERROR if self.error is not None else None}


class LoRAAdapters:
    """The server's adapters over the engine's registry; thread-safe (routes, the file watcher).

    Each name belongs to the origin that loaded it: the file's adapters change only through the file (an API call
    that would replace or unload one is refused), and the file never touches a name the flags or the API own."""

    def __init__(
        self,
        engine: LLMEngine,
        reserved_names: frozenset[str] = frozenset(),
        allowed_roots: tuple[Path, ...] = (),
    ) -> None:
        self.engine = engine
        self.reserved_names = reserved_names  # the served model's name: an adapter of that name could not be chosen
        self.allowed_roots = (
            allowed_roots  # where runtime loads of local folders may read (see confine_runtime_adapter)
        )
        self._lock = threading.Lock()  # guards _states and _busy, held only briefly
        self._busy: set[str] = set()  # names a load or unload is changing now
        self._states: dict[str, AdapterState] = {}

    @contextlib.contextmanager
    def _changing(self, name: str) -> Iterator[None]:
        """One change per name at a time; a second one is refused rather than queued behind a slow download."""
        with self._lock:
            if name in self._busy:
                raise ValueError(
                    f"LoRA adapter {name!r} is being loaded or unloaded already; try again when it is done"
                )
            self._busy.add(name)
        try:
            yield
        finally:
            with self._lock:
                self._busy.discard(name)

    def load(self, module: LoRAModule, origin: str, replace: bool = False) -> None:
        """Load and serve ``module`` (``replace``: swap out a loaded adapter of that name once the new one is read,
        so a bad replacement leaves the old one serving). ValueError says why not (AdapterReadTimeout: its files
        did not read in time); for the file's adapters it is also recorded as their state."""
        if module.name in self.reserved_names:
            raise ValueError(f"LoRA adapter name {module.name!r} is the served model's name; choose another")
        with self._changing(module.name):
            owner = self._state(module.name)
            if owner is not None and owner.origin == "file" and origin != "file":
                raise ValueError(f"LoRA adapter {module.name!r} comes from the adapter list file; change it there")
            if not replace and self.engine.lora_id_or_none(module.name) is not None:
                raise ValueError(f"LoRA adapter {module.name!r} is already loaded; unload it first")
            try:
                if origin == "api":
                    confine_runtime_adapter(module, self.allowed_roots)
                self.engine.add_lora(module, replace=replace)
            except Exception as exc:  # a download's or a file's own error types too: never a 500, never fatal
                message = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
                if not isinstance(exc, ValueError) or not message.startswith("LoRA adapter"):
                    message = f"LoRA adapter {module.name!r} could not be loaded from {module.path}: {message}"
                if origin == "file":
                    self._set(module.name, AdapterState(module.name, module.path, origin, FAILED, message))
                raise (AdapterReadTimeout if isinstance(exc, AdapterReadTimeout) else ValueError)(message) from None
            self._set(module.name, AdapterState(module.name, module.path, origin, LOADED))

    def unload(self, name: str, origin: str = "api") -> None:
        """Stop serving ``name``: UnknownLoRAError if it is not loaded, ValueError if the file owns it and
        ``origin`` is not the file."""
        with self._changing(name):
            state = self._state(name)
            if state is not None and state.origin == "file" and origin != "file":
                raise ValueError(f"LoRA adapter {name!r} comes from the adapter list file; remove it there")
            if state is None or state.state != FAILED:
                self.engine.remove_lora(name)
            self._set(name, None)

    def report(self) -> list[AdapterState]:
        """What ``GET /lora_adapters`` says: each adapter's state, and as failed (saying why) a loaded one whose
        files could not be read again since (host memory had dropped it; its requests get 503 until a read
        succeeds)."""
        registry = self.engine.lora
        states = self.states()
        if registry is None:
            return states
        return [
            AdapterState(s.name, s.path, s.origin, FAILED, error) if s.state == LOADED and error is not None else s
            for s, error in ((s, registry.read_error(s.name)) for s in states)
        ]

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
    authorized: Callable[[dict], bool],
) -> None:
    """``GET /lora_adapters`` always (503 while an ``enabled`` server loads; an empty list without LoRA; paths and
    errors only for callers ``authorized`` finds the API key on); the load and unload endpoints with
    ``runtime_updates``. ``adapters()``: the server's adapters once the model is loaded."""

    def ready_adapters() -> LoRAAdapters:
        current = adapters()
        if current is None:
            raise service_unavailable("the model is still loading, or this server runs without --enable-lora")
        return current

    @route("get", "/lora_adapters")
    async def lora_adapters(raw: Request) -> Response:
        current = adapters()
        if current is None and enabled:  # not "no adapters": the list has not been read yet
            raise service_unavailable("the model is still loading; the adapter list is read before it is ready")
        states = current.report() if current is not None else []
        full = authorized(raw.scope)
        return JSONResponse({"object": "list", "data": [s.as_dict(full) for s in states]})

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
        except AdapterReadTimeout as exc:
            raise service_unavailable(str(exc)) from None
        except ValueError as exc:
            naming = ("already loaded", "adapter list file", "served model's name", "is not valid", "being loaded")
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
