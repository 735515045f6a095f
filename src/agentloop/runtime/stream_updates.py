"""One job: apply the streaming mode's in-flight weight updates through the lifecycle and keep what each
cost — its seconds; the drain (the gates closed → every request of ours aborted and back, or the
load's end, whichever is first) and the weight load (which waits for the server's own drain), two
spans that overlap; this process's CPU seconds over it (the interrupted trajectories are handled meanwhile:
the client is on the update's critical path), and the requests it interrupted, whose turns went on in
place under the new weights (`Episode.generate`)."""

from __future__ import annotations

import time
from typing import Any

from ..engine.lifecycle import Lifecycle, Weights
from ..scheduler.gc_scope import collector_paused

__all__ = ["UpdateLog"]


class UpdateLog:
    """Updates applied so far, one entry per update in each list."""

    def __init__(self, lifecycle: Lifecycle, *, flush_cache: bool, gc_paused: bool,
                 server_drain: bool = False) -> None:
        self.lifecycle = lifecycle
        self.flush_cache = flush_cache
        self.server_drain = server_drain
        self.gc_paused = gc_paused
        self.seconds: list[float] = []
        self.drain_seconds: list[float] = []
        self.load_seconds: list[float] = []
        self.cpu_seconds: list[float] = []
        self._drains: list[int] = []  # each update's drain number at the gate
        self._counted: list[int] = []  # requests seen interrupted while each update ran (a gate without per-drain counts)

    async def apply(self, weights: Weights) -> str | None:
        """Drain, load and reopen (`Lifecycle.update_weights_drained`), measured; returns the version served.
        A failed update raises and records nothing."""
        lc = self.lifecycle
        t0, cpu0, mark = time.monotonic(), time.process_time(), lc.record_mark()
        cut0 = int(getattr(lc.gate, "interrupted_for_update", 0))
        with collector_paused(self.gc_paused):
            served = await lc.update_weights_drained(weights, flush_cache=self.flush_cache,
                                                     server_drain=self.server_drain)
        self.seconds.append(time.monotonic() - t0)
        recs = lc.records_since(mark)
        self.drain_seconds.append(sum(r.seconds for r in recs if r.stage == "drain"))
        self.load_seconds.append(sum(r.seconds for r in recs if r.stage != "drain"))
        self.cpu_seconds.append(time.process_time() - cpu0)
        self._drains.append(int(getattr(lc.gate, "update_drains", 0)))
        self._counted.append(int(getattr(lc.gate, "interrupted_for_update", 0)) - cut0)
        return served

    @property
    def interrupted(self) -> list[int]:
        """Requests each update interrupted, counted by the drain that aborted them: with the server's drain
        an aborted answer may be taken back only after its update returned, so this is read when asked."""
        by_drain = getattr(self.lifecycle.gate, "interrupted_by_drain", None)
        if by_drain is None:
            return list(self._counted)
        return [by_drain.get(d, 0) for d in self._drains]

    def metrics(self) -> dict[str, Any]:
        return {"update_seconds": list(self.seconds), "update_drain_seconds": list(self.drain_seconds),
                "update_load_seconds": list(self.load_seconds), "update_cpu_seconds": list(self.cpu_seconds),
                "update_interrupted": self.interrupted}
