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
        self.interrupted: list[int] = []

    async def apply(self, weights: Weights) -> str | None:
        """Drain, load and reopen (`Lifecycle.update_weights_drained`), measured; returns the version served.
        A failed update raises and records nothing."""
        lc = self.lifecycle
        t0, cpu0, mark, cut0 = time.monotonic(), time.process_time(), lc.record_mark(), self._interrupted_requests()
        with collector_paused(self.gc_paused):
            served = await lc.update_weights_drained(weights, flush_cache=self.flush_cache,
                                                     server_drain=self.server_drain)
        self.seconds.append(time.monotonic() - t0)
        recs = lc.records_since(mark)
        self.drain_seconds.append(sum(r.seconds for r in recs if r.stage == "drain"))
        self.load_seconds.append(sum(r.seconds for r in recs if r.stage != "drain"))
        self.cpu_seconds.append(time.process_time() - cpu0)
        self.interrupted.append(self._interrupted_requests() - cut0)
        return served

    def _interrupted_requests(self) -> int:
        return int(getattr(self.lifecycle.gate, "interrupted_for_update", 0))

    def metrics(self) -> dict[str, Any]:
        return {"update_seconds": list(self.seconds), "update_drain_seconds": list(self.drain_seconds),
                "update_load_seconds": list(self.load_seconds), "update_cpu_seconds": list(self.cpu_seconds),
                "update_interrupted": list(self.interrupted)}
