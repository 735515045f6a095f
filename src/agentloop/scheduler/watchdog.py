"""The watchdog of one scheduler run: per-trajectory deadlines and hung servers, in one task.

- **Deadlines**: `add_deadline(key, at)` when a trajectory starts; once `at` passes while
  `is_running(key)`, the key is recorded in `timed_out` and `on_expired(key)` is called (the run stops
  that trajectory's route session). One heap and one task for the whole run, not one timer per
  trajectory.
- **Hung servers**: with `hung_timeout`, `router.take_out_stalled(hung_timeout)` is called a few times
  per `hung_timeout` (at most 5 s apart), so a server that stopped answering is found at most a quarter
  of it late and its requests are retried elsewhere.

`run()` watches until it is cancelled (the run cancels it when its last trajectory is done).
"""

from __future__ import annotations

import heapq
from typing import Any, Callable, Hashable

import anyio

__all__ = ["Watchdog"]


def _never(key: Any) -> bool:
    return False


def _ignore(key: Any) -> None:
    return None


class Watchdog:
    """Deadlines and the hung-server check of one run (see the module docstring)."""

    def __init__(
        self,
        *,
        clock: Callable[[], float],
        is_running: Callable[[Any], bool],
        on_expired: Callable[[Any], None],
        router: Any = None,
        hung_timeout: float | None = None,
    ) -> None:
        if hung_timeout is not None and router is None:
            raise ValueError("Watchdog: hung_timeout needs the router whose servers it checks")
        self.clock = clock
        self.is_running = is_running
        self.on_expired = on_expired
        self.router = router
        self.hung_timeout = hung_timeout
        #: Keys whose deadline passed while they were running.
        self.timed_out: set[Any] = set()
        self._heap: list[tuple[float, int, Any]] = []  # (deadline, insertion order, key)
        self._order = 0
        self._earlier = anyio.Event()  # set when a deadline earlier than the one waited for arrives
        self._stopped = anyio.Event()

    @classmethod
    def servers_only(cls, router: Any, hung_timeout: float | None, *, clock: Callable[[], float]) -> "Watchdog | None":
        """A watchdog of `router`'s servers alone (no deadlines; None without a `hung_timeout`): one
        for many small runs at once (the streaming mode's), instead of one per run."""
        if hung_timeout is None:
            return None
        return cls(clock=clock, is_running=_never, on_expired=_ignore, router=router, hung_timeout=hung_timeout)

    def add_deadline(self, key: Hashable, at: float) -> None:
        heapq.heappush(self._heap, (at, self._order, key))
        self._order += 1
        if self._heap[0][2] == key:
            self._earlier.set()  # the watcher sleeps toward a later deadline: wake it

    @property
    def pending(self) -> int:
        """Deadlines not yet expired nor dropped (their trajectory may have finished meanwhile)."""
        return len(self._heap)

    def stop(self) -> None:
        """End `run()` and let go of the callbacks (bound methods of the run that owns this watchdog:
        kept, they and a cancelled watcher's traceback held each run in a reference cycle, garbage that
        only a full collection frees; the streaming mode makes one run per trajectory). `run()`
        returns, it is not cancelled."""
        self._stopped.set()
        self._earlier.set()
        self.is_running = _never
        self.on_expired = _ignore

    async def run(self) -> None:
        """Watch deadlines (and servers, with `hung_timeout`) until `stop()` (or cancelled)."""
        async with anyio.create_task_group() as tg:
            if self.hung_timeout is not None:
                tg.start_soon(self._watch_servers, self.hung_timeout)
            await self._watch_deadlines()
            tg.cancel_scope.cancel()  # the server watch sleeps toward its next round

    async def _watch_servers(self, hung_timeout: float) -> None:
        period = min(5.0, hung_timeout / 4)
        while True:
            t0 = anyio.current_time()
            await anyio.sleep(period)
            if anyio.current_time() - t0 - period > max(1.0, period):
                # This event loop was blocked (a client-side stall): the servers' answers waited unread,
                # so their silence is ours. Judge them next round, once the loop has read what came.
                continue
            await self.router.take_out_stalled(hung_timeout)

    async def _watch_deadlines(self) -> None:
        while not self._stopped.is_set():
            while self._heap and not self.is_running(self._heap[0][2]):
                heapq.heappop(self._heap)  # finished before its deadline
            self._earlier = anyio.Event()
            if not self._heap:
                await self._earlier.wait()
                continue
            at, _, key = self._heap[0]
            now = self.clock()
            if now < at:
                with anyio.move_on_after(at - now):
                    await self._earlier.wait()
                continue
            heapq.heappop(self._heap)
            self.timed_out.add(key)
            self.on_expired(key)
