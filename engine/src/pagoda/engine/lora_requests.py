"""The engine's LoRA side: serving adapters by name, and the per-step work the adapters need."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Optional

from pagoda.core.scheduler_output import SchedulerOutput
from pagoda.lora.manager import LoRAManager, LoRARecord
from pagoda.lora.sources import LoRAModule
from pagoda.outputs import RequestOutput
from pagoda.request import Request

if TYPE_CHECKING:
    from pagoda.core.scheduler import Scheduler
    from pagoda.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class UnknownLoRAError(ValueError):
    """A request or an unload names an adapter that is not loaded."""

    def __init__(self, name: str) -> None:
        super().__init__(f"LoRA adapter {name!r} is not loaded")
        self.name = name


class LoRAEngineMixin:
    """Adapter methods of :class:`~pagoda.engine.llm_engine.LLMEngine` (which owns ``runner`` and ``scheduler``)."""

    runner: ModelRunner
    scheduler: Scheduler
    fail_request: Callable[[str, str], Optional[RequestOutput]]

    @property
    def lora(self) -> Optional[LoRAManager]:
        """The adapters this engine serves; None without ``enable_lora``."""
        return self.runner.lora

    def add_lora(self, module: LoRAModule, replace: bool = False) -> LoRARecord:
        """Load an adapter and serve it under ``module.name`` (any thread; seconds for a download). ValueError
        when it cannot be served. ``replace``: an adapter of that name is swapped out once the new one is read
        (its running requests finish on the old weights)."""
        return self._lora_manager().load(module, replace=replace)

    def remove_lora(self, name: str) -> LoRARecord:
        """Stop serving adapter ``name`` (UnknownLoRAError if it is not loaded); running requests finish on it."""
        try:
            return self._lora_manager().unload(name)
        except KeyError:
            raise UnknownLoRAError(name) from None

    def lora_id(self, name: Optional[str]) -> Optional[int]:
        """The id a request for adapter ``name`` runs with (None for the base model)."""
        if name is None:
            return None
        record = self._lora_manager().lookup(name)
        if record is None:
            raise UnknownLoRAError(name)
        return record.lora_id

    def lora_id_or_none(self, name: str) -> Optional[int]:
        record = self._lora_manager().lookup(name)
        return None if record is None else record.lora_id

    def _lora_manager(self) -> LoRAManager:
        if self.runner.lora is None:
            raise ValueError("LoRA adapters are not enabled on this engine (enable_lora / --enable-lora)")
        return self.runner.lora

    def _fetch_adapters(self, plan: SchedulerOutput) -> list[RequestOutput]:
        """Have the step's adapters in host memory. The requests of an adapter that cannot be read again fail,
        and leave the plan."""
        failed = self.runner.lora.fetch({s.request.lora_id for s in plan.scheduled if s.request.lora_id is not None})
        if not failed:
            return []
        outputs = []
        for lora_id, message in failed.items():
            for request in [r for r in self.scheduler.requests.values() if r.lora_id == lora_id]:
                logger.warning("request_id=%s failed: %s", request.external_id, message)
                output = self.fail_request(request.external_id, message)
                if output is not None:
                    outputs.append(output)
        plan.scheduled = [s for s in plan.scheduled if s.request.lora_id not in failed]
        return outputs

    def _adapter_names(self, requests: Iterable[Request]) -> tuple[str, ...]:
        if self.runner.lora is None:
            return ()
        ids = {r.lora_id for r in requests if r.lora_id is not None}
        return tuple(sorted(self.runner.lora.name_of(i) for i in ids))
