"""One engine server as the lifecycle tracks it (`TrackedServer`: its released memory, its mark, its
lease, whether it is in rotation), and the small helpers every lifecycle module shares."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Mapping

from .base import EngineClient, EngineError
from .lifecycle_types import MemoryMark

__all__ = ["GENERATION_TAGS", "PROBE_ERRORS", "TrackedServer", "log", "reported_released", "short_error"]

#: One logger for the whole lifecycle (its modules are one component to whoever filters the logs).
log = logging.getLogger("agentloop.engine.lifecycle")

#: What a server that cannot be reached raises (a probe or a stage failing on it, not a bug).
PROBE_ERRORS = (EngineError, TimeoutError, OSError)
#: Generation is impossible while either of these is released, so nothing can be running to drain.
GENERATION_TAGS = frozenset({"weights", "kv_cache"})


@dataclass
class TrackedServer:
    """One engine server: its client and what the lifecycle knows of its memory, mark and rotation."""

    client: EngineClient
    released: set[str] = field(default_factory=set)
    model_path: str | None = None
    #: why the server is out of rotation (None: in rotation)
    out: str | None = None
    #: whether the server keeps our `MemoryMark` (False once it refused `/update_weight_version`)
    marks: bool = True
    #: the weight version string the server reports now, as last written or read
    mark: str | None = None
    #: what the first attach found (restored by `restore`)
    found: MemoryMark | None = None
    #: left asleep on purpose (`park`): recorded in its mark when the lifecycle lets it go
    parked: bool = False
    #: the server's mark carries this lifecycle's lease (what the liveness probe checks it still does)
    leased: bool = False

    @property
    def url(self) -> str:
        return self.client.url

    @property
    def may_be_running(self) -> bool:
        return not (self.released & GENERATION_TAGS)


async def reported_released(client: EngineClient) -> set[str] | None:
    """The released tags a server reports itself (the CPU engine does; SGLang 0.5.17 does not)."""
    try:
        info = await client.server_info()
    except EngineError:
        return None
    for part in [info, *(info.get("internal_states") or [])]:
        tags = part.get("released_tags") if isinstance(part, Mapping) else None
        if isinstance(tags, list):
            return {str(t) for t in tags}
    return None


def short_error(e: BaseException) -> str:
    """An error in one line (its type and first line, at most 300 characters), for logs and reasons."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]
