"""The lifecycle's one logger and the small helpers its parts share."""

from __future__ import annotations

import logging
from typing import Any

from ..base import EngineError

__all__ = ["GENERATION_TAGS", "PROBE_ERRORS", "forward", "log", "short_error"]

#: One logger for the whole lifecycle (its modules are one component to whoever filters the logs).
log = logging.getLogger("agentloop.engine.lifecycle")

#: What a server that cannot be reached raises (a probe or a stage failing on it, not a bug).
PROBE_ERRORS = (EngineError, TimeoutError, OSError)
#: Generation is impossible while either of these is released, so nothing can be running to drain.
GENERATION_TAGS = frozenset({"weights", "kv_cache"})


def short_error(e: BaseException) -> str:
    """An error in one line (its type and first line, at most 300 characters), for logs and reasons."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def forward(part: str, name: str, doc: str, *, settable: bool = False) -> property:
    """A read-through property to `self.<part>.<name>` (the lifecycle's public face keeps what its
    parts do without a method of its own for each)."""

    def get(self: Any) -> Any:
        return getattr(getattr(self, part), name)

    def put(self: Any, value: Any) -> None:
        setattr(getattr(self, part), name, value)

    return property(get, put if settable else None, doc=doc)
