"""The per-server request slots of the router: a semaphore whose waiters are served by priority.

`Router` gives each server `per_server_limit` slots; with `scheduler.slot_order` the key decides who
gets a freed slot (fifo: arrival order; depth_first: the trajectory with most turns behind it;
oldest_first: the session that started first).
"""

from __future__ import annotations

import heapq
import itertools

import anyio

__all__ = ["PrioritySlots"]


class PrioritySlots:
    """A semaphore of `limit` slots whose waiters are admitted lowest key first (FIFO among equal keys).

    A freed slot passes straight to the chosen waiter, so a newcomer cannot overtake the queue: `free`
    is above zero only while nobody waits. A wait can also be withdrawn from outside (`withdraw`, what
    a route session's stop does): the waiter then wakes without the slot."""

    _WAITING, _GRANTED, _WITHDRAWN = 0, 1, 2

    def __init__(self, limit: int) -> None:
        self.free = limit
        self._heap: list[list] = []  # [key, seq, event, state]
        self._seq = itertools.count()

    def enqueue(self, key: tuple = ()) -> list | None:
        """Take a free slot (None), or join the queue: the entry to pass to `wait` (and `withdraw`)."""
        if self.free > 0:
            self.free -= 1
            return None
        entry = [key, next(self._seq), anyio.Event(), self._WAITING]
        heapq.heappush(self._heap, entry)
        return entry

    async def wait(self, entry: list) -> bool:
        """Wait for the queued `entry`: True once its slot is held, False if it was withdrawn first."""
        try:
            await entry[2].wait()
        except BaseException:
            if entry[3] == self._GRANTED:  # granted, then cancelled before it could use the slot: pass it on
                self.release()
            else:
                entry[3] = self._WITHDRAWN  # lazily dropped by `release`
            raise
        return entry[3] == self._GRANTED

    def withdraw(self, entry: list) -> None:
        """End a queued wait without the slot (its waiter's `wait` returns False); no-op once granted."""
        if entry[3] == self._WAITING:
            entry[3] = self._WITHDRAWN
            entry[2].set()

    async def acquire(self, key: tuple = ()) -> None:
        entry = self.enqueue(key)
        if entry is not None:
            await self.wait(entry)

    def release(self) -> None:
        while self._heap:
            entry = heapq.heappop(self._heap)
            if entry[3] == self._WAITING:
                entry[3] = self._GRANTED
                entry[2].set()
                return
        self.free += 1
