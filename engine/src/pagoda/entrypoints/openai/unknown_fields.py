"""Request fields the server does not know: logged once per field name at WARNING (as vLLM logs them), or refused
with a 400 naming them under ``--strict-request-fields``.

OpenAI clients send fields a server may not implement, so by default they are accepted and ignored; the log says
which, once per name, so an operator sees what clients expect without a line per request. The names remembered
are bounded: a client inventing a new name per request cannot grow the server's memory.
"""

from __future__ import annotations

import logging
import threading

from pagoda.entrypoints.openai.errors import bad_request

logger = logging.getLogger(__name__)

# Distinct field names logged before the server stops logging new ones.
MAX_LOGGED_NAMES = 256
# Longer names are cut to this in messages and the log.
MAX_NAME_CHARS = 64


class UnknownFields:
    """What the server does with fields its request models do not take."""

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def check(self, fields: tuple[str, ...], endpoint: str) -> None:
        """Refuse ``fields`` (strict), else log the names not logged before."""
        if not fields:
            return
        fields = tuple(name[:MAX_NAME_CHARS] for name in fields)
        if self.strict:
            raise bad_request(
                f"unknown request fields: {', '.join(fields)} (this server runs with --strict-request-fields)",
                param=fields[0],
            )
        with self._lock:
            new = [name for name in fields if name not in self._logged]
            room = MAX_LOGGED_NAMES - len(self._logged)
            if not new or room <= 0:
                return
            new = new[:room]
            self._logged.update(new)
            full = len(self._logged) >= MAX_LOGGED_NAMES
        logger.warning(
            "The following fields were present in the request but ignored: %s (%s; each name is logged once)%s",
            sorted(new),
            endpoint,
            "; further unknown field names are not logged" if full else "",
        )
