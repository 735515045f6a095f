"""One job: the streaming mode's in-flight weight updates — one at a time, each under a version never
served before (`VersionLog.check_new`; weights without one are named by the lifecycle), applied through
the lifecycle (`Lifecycle.update_weights_drained`), and what each cost: its seconds; the drain (the
gates closed → every request of ours aborted and back, or the load's end, whichever is first) and the
weight load (which waits for the server's own drain), two spans that overlap; this process's CPU seconds
over it (the interrupted trajectories are handled meanwhile: the client is on the update's critical
path), and the requests it interrupted, whose turns went on in place under the new weights
(`Episode.generate`)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import anyio

from ..engine.lifecycle import Lifecycle, Weights
from ..scheduler.gc_scope import collector_paused
from ..scheduler.staleness import VersionLog

__all__ = ["UpdateLog"]


class UpdateLog:
    """The updates applied so far, one entry per update in each list (a failed one records nothing).
    `updating` is true while one runs; `on_change` is called when it ends, however it ends."""

    def __init__(self, lifecycle: Lifecycle, versions: VersionLog, *, flush_cache: bool, gc_paused: bool,
                 server_drain: bool = False, on_change: Callable[[], None] = lambda: None) -> None:
        self.lifecycle = lifecycle
        self.versions = versions
        self.flush_cache = flush_cache
        self.server_drain = server_drain
        self.gc_paused = gc_paused
        self.on_change = on_change
        self.updating = False
        self._lock = anyio.Lock()
        self.seconds: list[float] = []
        self.drain_seconds: list[float] = []
        self.load_seconds: list[float] = []
        self.cpu_seconds: list[float] = []
        self._drains: list[int] = []  # each update's drain number at the gate (`Gate.interrupted_by_drain`)

    @property
    def count(self) -> int:
        """Updates applied."""
        return len(self.seconds)

    async def apply(self, weights: Any, version: str | None = None) -> str | None:
        """Load `weights` (a state dict, a path or `Weights`; `version` overrides theirs) in flight, after
        the one running; returns the version served. ValueError for no weights or a version served before."""
        w = Weights.coerce(weights)
        if w is None:
            raise ValueError("update_weights needs weights (a state dict, a path or Weights), got None")
        lc = self.lifecycle
        if version is not None or w.version is None:
            w = dataclasses.replace(w, version=version if version is not None else lc.fresh_version())
        async with self._lock:
            self.versions.check_new(w.version, served=lc.weight_version, what="update_weights")
            self.updating = True
            try:
                served = await self._measured(w)
            finally:
                self.updating = False
                self.on_change()
            self.versions.observe(served)
            return served

    async def _measured(self, w: Weights) -> str | None:
        lc = self.lifecycle
        t0, cpu0, mark = time.monotonic(), time.process_time(), lc.record_mark()
        with collector_paused(self.gc_paused):
            served = await lc.update_weights_drained(w, flush_cache=self.flush_cache, server_drain=self.server_drain)
        self.seconds.append(time.monotonic() - t0)
        recs = lc.records_since(mark)
        self.drain_seconds.append(sum(r.seconds for r in recs if r.stage == "drain"))
        self.load_seconds.append(sum(r.seconds for r in recs if r.stage != "drain"))
        self.cpu_seconds.append(time.process_time() - cpu0)
        self._drains.append(lc.gate.update_drains)
        return served

    @property
    def interrupted(self) -> list[int]:
        """Requests each update interrupted, counted by the drain that aborted them: with the server's drain
        an aborted answer may be taken back only after its update returned, so this is read when asked."""
        return [self.lifecycle.gate.interrupted_by_drain.get(d, 0) for d in self._drains]

    def metrics(self) -> dict[str, Any]:
        return {"update_seconds": list(self.seconds), "update_drain_seconds": list(self.drain_seconds),
                "update_load_seconds": list(self.load_seconds), "update_cpu_seconds": list(self.cpu_seconds),
                "update_interrupted": self.interrupted}
