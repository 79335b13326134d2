"""The engine's LoRA side: serving adapters by name, and handing each step the adapters its slots lack."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Optional

from pagoda.core.scheduler_output import SchedulerOutput
from pagoda.lora.adapter import LoRAAdapter
from pagoda.lora.registry import LoRARecord, LoRARegistry, unavailable_message
from pagoda.lora.sources import LoRAModule
from pagoda.outputs import RequestOutput
from pagoda.request import Request

if TYPE_CHECKING:
    from pagoda.core.scheduler import Scheduler
    from pagoda.engine.engine_config import EngineConfig
    from pagoda.executor import Executor

logger = logging.getLogger(__name__)


class UnknownLoRAError(ValueError):
    """A request or an unload names an adapter that is not loaded."""

    def __init__(self, name: str) -> None:
        super().__init__(f"LoRA adapter {name!r} is not loaded")
        self.name = name


class LoRAEngineMixin:
    """Adapter methods of :class:`~pagoda.engine.llm_engine.LLMEngine` (which owns ``executor``, ``scheduler`` and
    ``lora_registry``)."""

    executor: Executor
    scheduler: Scheduler
    lora_registry: Optional[LoRARegistry]
    fail_request: Callable[..., Optional[RequestOutput]]

    def _lora_registry(self, config: EngineConfig) -> Optional[LoRARegistry]:
        """The registry of an engine with LoRA slots (None without ``enable_lora``): it checks every adapter
        against the layers the executor's model has slots in."""
        args = config.args
        if args.lora_slots == 0:
            return None
        return LoRARegistry(
            self.executor.lora_targets(),
            args.max_lora_rank,
            args.max_cpu_loras or args.lora_slots,
            config.dtype,
            args.download_dir,
            read_timeout=args.lora_read_timeout,
        )

    @property
    def lora(self) -> Optional[LoRARegistry]:
        """The adapters this engine serves; None without ``enable_lora``."""
        return self.lora_registry

    def add_lora(self, module: LoRAModule, replace: bool = False) -> LoRARecord:
        """Load an adapter and serve it under ``module.name`` (any thread; seconds for a download). ValueError
        when it cannot be served. ``replace``: an adapter of that name is swapped out once the new one is read
        (its running requests finish on the old weights)."""
        return self._registry().load(module, replace=replace)

    def remove_lora(self, name: str) -> LoRARecord:
        """Stop serving adapter ``name`` (UnknownLoRAError if it is not loaded); running requests finish on it."""
        try:
            return self._registry().unload(name)
        except KeyError:
            raise UnknownLoRAError(name) from None

    def lora_id(self, name: Optional[str]) -> Optional[int]:
        """The id a request for adapter ``name`` runs with (None for the base model)."""
        if name is None:
            return None
        record = self._registry().lookup(name)
        if record is None:
            raise UnknownLoRAError(name)
        return record.lora_id

    def lora_id_or_none(self, name: str) -> Optional[int]:
        record = self._registry().lookup(name)
        return None if record is None else record.lora_id

    def _registry(self) -> LoRARegistry:
        if self.lora_registry is None:
            raise ValueError("LoRA adapters are not enabled on this engine (enable_lora / --enable-lora)")
        return self.lora_registry

    def _release_unused_adapters(self) -> None:
        """Unloaded adapters' weights (host and device) go once no request uses them."""
        registry = self.lora_registry
        if registry is not None and registry.has_unloaded_in_use:
            gone = registry.release_unused({r.lora_id for r in self.scheduler.requests.values()} - {None})
            if gone:
                self.executor.remove_loras(gone)

    def _adapter_ready(self, lora_id: int) -> bool:
        """The scheduler's question before it admits a request on ``lora_id``: can a step have its weights without
        reading a file? (If not, a background read starts and the request waits.)"""
        assert self.lora_registry is not None
        return lora_id in self.executor.resident_loras() or self.lora_registry.ready(lora_id)

    def _poll_adapter_reads(self) -> list[RequestOutput]:
        """Fail the requests of adapters whose files could not be read again (or not in time)."""
        if self.lora_registry is None:
            return []
        return self._fail_adapter_requests(self.lora_registry.poll_reads())

    def _fetch_adapters(self, plan: SchedulerOutput) -> tuple[dict[int, LoRAAdapter], list[RequestOutput]]:
        """The weights of the step's adapters that no device slot holds, from host memory (never from disk: see
        ``_adapter_ready``). The requests of an adapter that is not there fail, and leave the plan."""
        if self.lora_registry is None:
            return {}, []
        step_ids = {s.request.lora_id for s in plan.scheduled if s.request.lora_id is not None}
        if not step_ids:
            return {}, []
        found = self.lora_registry.fetch(step_ids - self.executor.resident_loras(), step_ids)
        outputs = self._fail_adapter_requests(found.failed)
        if found.failed:
            plan.scheduled = [s for s in plan.scheduled if s.request.lora_id not in found.failed]
        return found.adapters, outputs

    def _fail_adapter_requests(self, failed: dict[int, str]) -> list[RequestOutput]:
        """Every request on an adapter of ``failed`` (id -> why, for the log) ends with a 503-class error that names
        the adapter only; the other requests carry on."""
        outputs = []
        for lora_id, message in failed.items():
            client_message = unavailable_message(self._registry().name_of(lora_id))
            for request in [r for r in self.scheduler.requests.values() if r.lora_id == lora_id]:
                logger.info("request_id=%s failed: %s", request.external_id, message)
                output = self.fail_request(request.external_id, client_message, unavailable=True)
                if output is not None:
                    outputs.append(output)
        return outputs

    def _adapter_names(self, requests: Iterable[Request]) -> tuple[str, ...]:
        if self.lora_registry is None:
            return ()
        ids = {r.lora_id for r in requests if r.lora_id is not None}
        return tuple(sorted(self.lora_registry.name_of(i) for i in ids))
