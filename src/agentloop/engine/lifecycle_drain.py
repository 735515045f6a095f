"""What each sleep stage does on one server (`SLEEP_STAGES`: pause → settle → continue → flush_cache →
release), and putting one re-admitted server to sleep on its own. `Lifecycle.sleep` runs the stages
over the servers in rotation."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import anyio

from .lifecycle_fleet import FleetMixin
from .lifecycle_server import TrackedServer
from .lifecycle_types import SLEEP_STAGES, LifecycleError

__all__ = ["DrainMixin"]


class DrainMixin(FleetMixin):
    """The sleep stages' per-server work."""

    settle_timeout: float
    flush_retries: int
    flush_retry_delay: float

    def _sleep_stage(self, stage: str) -> Callable[[TrackedServer], Awaitable[Any]]:
        run: dict[str, Callable[[TrackedServer], Awaitable[Any]]] = {
            "pause": lambda s: s.client.pause_generation("abort"),
            "settle": self._settle,
            # the engine is not left paused while asleep, so a wake-up needs no continue
            "continue": lambda s: s.client.continue_generation(),
            "flush_cache": self._flush,
            "release": self._release,
        }
        fn = run[stage]
        if stage == "release":
            return fn

        async def draining(s: TrackedServer) -> Any:
            if s.may_be_running:  # a server holding no weights or KV cache has nothing to drain
                return await fn(s)

        return draining

    async def _sleep_one(self, s: TrackedServer) -> None:
        """Put one (re-admitted) server to sleep on its own: every sleep stage, in order."""
        for stage in SLEEP_STAGES:
            with anyio.fail_after(self.stage_timeout):
                await self._sleep_stage(stage)(s)

    async def _settle(self, s: TrackedServer) -> None:
        left = 0
        for g in self._gates:
            left += await g.wait_settled(s.url, self.settle_timeout)
        if left:
            raise LifecycleError("settle", f"{left} requests still in flight after {self.settle_timeout:.0f}s", url=s.url)

    async def _flush(self, s: TrackedServer) -> None:
        for _ in range(self.flush_retries):
            if await s.client.flush_cache():
                return
            await anyio.sleep(self.flush_retry_delay)
        raise LifecycleError("flush_cache", f"engine still busy after {self.flush_retries} tries", url=s.url)
