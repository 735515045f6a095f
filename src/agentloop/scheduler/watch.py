"""Stopping trajectories of one scheduler run: per-trajectory deadlines (one watcher task for the whole
run), the hung-server watchdog, and stopping a trajectory's route session until nothing is in flight.

A mixin of `agentloop.scheduler._ScheduleRun` (the run's state lives there).
"""

from __future__ import annotations

import heapq
from typing import Any, Callable

import anyio
import anyio.abc

from ..engine.router import RouteSession

__all__ = ["WatchMixin"]


class WatchMixin:
    """Deadlines, the server watchdog and stopping sessions (a sleep, a timeout, an early stop)."""

    s: Any  # the Scheduler
    clock: Callable[[], float]
    tg: anyio.abc.TaskGroup | None
    sessions: dict[int, RouteSession]
    timed_out: set[int]
    deadlines: list[tuple[float, int]]
    _deadline_added: anyio.Event
    stopping: bool
    stop_reason: str
    external_stop: bool

    def _add_deadline(self, deadline: float, i: int) -> None:
        heapq.heappush(self.deadlines, (deadline, i))
        if self.deadlines[0][1] == i:
            self._deadline_added.set()  # an earlier deadline than the watcher sleeps for

    async def _watch_servers(self, hung_timeout: float) -> None:
        """The step watchdog (one task per run): takes out servers that stopped answering (see `Router.take_out_stalled`),
        checked a few times per `hung_timeout` so a hung server is found at most a quarter of it late. A round
        that overslept (this loop was blocked) takes nothing out: a client-side stall is not a hung server."""
        period = min(5.0, hung_timeout / 4)
        while True:
            t0 = anyio.current_time()
            await anyio.sleep(period)
            if anyio.current_time() - t0 - period > max(1.0, period):
                # This event loop was blocked (a client-side stall): the servers' answers waited unread,
                # so their silence is ours. Judge them next round, once the loop has read what came.
                continue
            await self.s.router.take_out_stalled(hung_timeout)

    async def _watch_deadlines(self) -> None:
        """One task for the whole run (not one per trajectory): stops trajectories past their timeout."""
        while True:
            while self.deadlines and self.deadlines[0][1] not in self.sessions:
                heapq.heappop(self.deadlines)  # finished before its deadline
            self._deadline_added = anyio.Event()
            if not self.deadlines:
                await self._deadline_added.wait()
                continue
            deadline, i = self.deadlines[0]
            now = self.clock()
            if now < deadline:
                with anyio.move_on_after(deadline - now):
                    await self._deadline_added.wait()
                continue
            heapq.heappop(self.deadlines)
            self.timed_out.add(i)
            assert self.tg is not None
            self.tg.start_soon(self._stop_session, self.sessions[i], "timeout")

    async def _stop_session(self, session: RouteSession, reason: str) -> None:
        session.stop(reason)
        # A request dispatched just before the stop may not be registered on its server yet: repeat the
        # abort until the session has nothing in flight.
        while session.in_flight_rid is not None:
            await self.s.router.abort([session.in_flight_rid])
            with anyio.move_on_after(0.2):
                await session.wait_idle()

    def stop(self, reason: str, *, early: bool = False) -> None:
        self.external_stop = self.external_stop or not early
        self.stopping = True
        self.stop_reason = reason
        if self.tg is None:
            return
        for session in list(self.sessions.values()):
            self.tg.start_soon(self._stop_session, session, reason)
