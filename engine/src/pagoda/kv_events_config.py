"""vLLM's ``--kv-events-config``: whether and where the engine publishes KV cache events (see docs/kv-events.md).

The JSON object takes exactly the fields of vLLM's ``KVEventsConfig``; an unknown field or a value of the wrong type
is refused at start with the field named, so a typo never silently turns the events off.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional, Union

FLAG = "--kv-events-config"
PUBLISHERS = ("zmq", "null")
_ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """The parsed flag; the defaults are vLLM's."""

    enable_kv_cache_events: bool = False
    # None: "zmq" when events are enabled, else "null" (vLLM resolves it the same way)
    publisher: Optional[str] = None
    endpoint: str = "tcp://*:5557"  # PUB socket; bound when it has a wildcard (or is ipc/inproc), else connected
    replay_endpoint: Optional[str] = None  # ROUTER socket (always bound) answering replay requests
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # ZeroMQ send high-water mark of the PUB socket
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; beyond it the oldest is dropped
    topic: str = ""

    @property
    def resolved_publisher(self) -> str:
        """``publisher`` with vLLM's default applied."""
        if self.publisher is not None:
            return self.publisher
        return "zmq" if self.enable_kv_cache_events else "null"

    @property
    def publishes(self) -> bool:
        """Whether the engine collects and publishes events at all (off: no cost on any step)."""
        return self.enable_kv_cache_events and self.resolved_publisher == "zmq"

    def to_json(self) -> str:
        """The flag's value that gives this config back."""
        return json.dumps(asdict(self))


_TYPES: dict[str, tuple[type, ...]] = {
    "enable_kv_cache_events": (bool,),
    "publisher": (str, type(None)),
    "endpoint": (str,),
    "replay_endpoint": (str, type(None)),
    "buffer_steps": (int,),
    "hwm": (int,),
    "max_queue_size": (int,),
    "topic": (str,),
}
_MINIMUM = {"buffer_steps": 1, "hwm": 0, "max_queue_size": 1}


def parse_kv_events_config(value: Union[None, str, Mapping[str, Any], KVEventsConfig]) -> Optional[KVEventsConfig]:
    """The flag's JSON text (or an already parsed mapping / config) as a :class:`KVEventsConfig`; None when unset.

    Raises ValueError naming the first field that is unknown or has a bad value.
    """
    if value is None or isinstance(value, KVEventsConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{FLAG}: cannot parse {value!r} as JSON: {exc}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"{FLAG} must be a JSON object, got {value!r}")
    known = [f.name for f in fields(KVEventsConfig)]
    for name, field_value in value.items():
        if name not in _TYPES:
            raise ValueError(f"{FLAG}: unknown field {name!r} (fields: {', '.join(known)})")
        _check_field(name, field_value)
    return KVEventsConfig(**value)


def _check_field(name: str, value: Any) -> None:
    kinds = _TYPES[name]
    # bool is an int in Python; a JSON true is no count of steps
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        wanted = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
        raise ValueError(f"{FLAG}: field {name!r} must be {wanted}, got {value!r}")
    if name in _MINIMUM and value < _MINIMUM[name]:
        raise ValueError(f"{FLAG}: field {name!r} must be at least {_MINIMUM[name]}, got {value}")
    if name == "publisher" and value is not None and value not in PUBLISHERS:
        raise ValueError(f"{FLAG}: field 'publisher' must be one of {', '.join(PUBLISHERS)}, got {value!r}")
    if name in ("endpoint", "replay_endpoint") and value is not None and not value.startswith(_ENDPOINT_SCHEMES):
        raise ValueError(
            f"{FLAG}: field {name!r} must be a ZeroMQ endpoint ({', '.join(_ENDPOINT_SCHEMES)}...), got {value!r}"
        )


def check_kv_events(config: Optional[KVEventsConfig], enable_prefix_caching: bool) -> None:
    """ValueError when events are asked for but cannot be produced: they come from the prefix cache's hash chain."""
    if config is not None and config.publishes and not enable_prefix_caching:
        raise ValueError(
            f"{FLAG}: enable_kv_cache_events needs prefix caching (KV events describe the prefix cache's blocks); "
            "drop --no-enable-prefix-caching"
        )
