"""One job: notice, during a stream, that no engine server is left — the streaming mode never sleeps, so
the liveness probe of each wake-up and sleep does not run for it.

`EngineWatch.check()` runs the lifecycle's liveness probe (at most once per `interval`); `watch()`
asks for one whenever a server with requests in flight has answered none for `hung_timeout` (a hung
server fails no trajectory until the request timeout, and the router keeps the last one in rotation).
When the probe finds no server left, `on_gone(error)` is told once; a server that answers `/model_info`
is only slow and stays."""

from __future__ import annotations

import logging
import time
from typing import Callable

import anyio

from ..engine.lifecycle import Lifecycle, LifecycleError

log = logging.getLogger(__name__)

__all__ = ["EngineWatch"]


class EngineWatch:
    """The liveness checks of one stream (see the module docstring)."""

    def __init__(self, lifecycle: Lifecycle, on_gone: Callable[[LifecycleError], None], *,
                 hung_timeout: float | None, interval: float = 1.0) -> None:
        self.lifecycle = lifecycle
        self.on_gone = on_gone
        self.hung_timeout = hung_timeout
        self.interval = interval
        self.gone: LifecycleError | None = None
        self._lock = anyio.Lock()
        self._checked = float("-inf")

    async def check(self) -> None:
        """The liveness probe now, unless one ran within `interval` or the fleet is already gone."""
        async with self._lock:
            if self.gone is not None or time.monotonic() - self._checked < self.interval:
                return
            try:
                await self.lifecycle.check_liveness()
            except LifecycleError as e:
                log.error("rollout stream: %s", e)
                self.gone = e
                self.on_gone(e)
            self._checked = time.monotonic()

    async def watch(self) -> None:
        """Until the fleet is gone (or cancelled): a check whenever a server looks hung."""
        if self.hung_timeout is None:
            return
        gate = self.lifecycle.gate
        while self.gone is None:
            await anyio.sleep(min(5.0, self.hung_timeout / 4))
            if gate.stalled(self.hung_timeout):
                await self.check()
