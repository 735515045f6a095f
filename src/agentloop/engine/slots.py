"""The per-server request slots of the router: a semaphore whose waiters are served by priority.

`Router` gives each server `per_server_limit` slots; with `scheduler.slot_order` the key decides who
gets a freed slot (fifo: arrival order; depth_first: the trajectory with most turns behind it;
oldest_first: the session that started first; target_first: the rank the scheduler gives, see
`GroupBook.slot_rank`).

With preemption (`target_first` and `scheduler.slot_preemption`) the slots also know who holds them:
a waiter of a better class (a key's first number) than the worst holder may take that holder's slot
(`preempt_for`); the waiter then aborts the holder's request, whose session continues the turn in
place once it has a slot again (`GenerateOutput.preempted`).
"""

from __future__ import annotations

import heapq
import itertools

import anyio

__all__ = ["PrioritySlots"]


#: What a holder record stores: its request's server and rid (what a preempting waiter aborts).
Victim = tuple[str, str]


class PrioritySlots:
    """A semaphore of `limit` slots whose waiters are admitted lowest key first (FIFO among equal keys).

    A freed slot passes straight to the chosen waiter, so a newcomer cannot overtake the queue: `free`
    is above zero only while nobody waits. A wait can also be withdrawn from outside (`withdraw`, what
    a route session's stop does): the waiter then wakes without the slot."""

    _WAITING, _GRANTED, _WITHDRAWN = 0, 1, 2
    _HELD, _PREEMPTED, _RELEASED = 0, 1, 2

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.free = limit
        self._heap: list[list] = []  # [key, seq, event, state]
        self._seq = itertools.count()
        #: Registered holders, worst key on top: [negated key, seq, victim, state] (lazily dropped).
        self._holders: list[list] = []
        self._live_holders = 0
        self.preemptions = 0  #: holders whose slot a better waiter took

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

    # ------------------------------------------------------------------ preemption
    def hold(self, key: tuple[int, ...], victim: Victim) -> list:
        """Register the holder of a slot just taken (its `key`; `victim`: its request's server and rid),
        so a better waiter may preempt it. Pass the record to `release`."""
        record = [tuple(-k for k in key), next(self._seq), victim, self._HELD]
        heapq.heappush(self._holders, record)
        self._live_holders += 1
        if len(self._holders) > 2 * self._live_holders + 64:  # released records deep in the heap
            self._holders = [r for r in self._holders if r[3] != self._RELEASED]
            heapq.heapify(self._holders)
        return record

    @classmethod
    def was_preempted(cls, record: list | None) -> bool:
        return record is not None and record[3] == cls._PREEMPTED

    def preempt_for(self, key: tuple[int, ...]) -> Victim | None:
        """The request a waiter with `key` may abort to take its slot: the worst-keyed held one, if its
        class (first number) is worse than the waiter's; it is marked preempted (chosen once). None: none."""
        heap = self._holders
        while heap and heap[0][3] != self._HELD:
            heapq.heappop(heap)
        if not heap or -heap[0][0][0] <= key[0]:
            return None
        record = heapq.heappop(heap)
        record[3] = self._PREEMPTED
        self.preemptions += 1
        return record[2]

    def forfeit(self, entry: list) -> None:
        """Give up a queued `entry` without waiting on it (its waiter was cancelled before `wait`): a
        slot already granted to it is passed on."""
        if entry[3] == self._GRANTED:
            self.release()
        else:
            entry[3] = self._WITHDRAWN

    def release(self, record: list | None = None) -> None:
        """Free a slot (`record`: its holder's, from `hold`)."""
        if record is not None and record[3] != self._RELEASED:
            record[3] = self._RELEASED
            self._live_holders -= 1
        while self._heap:
            entry = heapq.heappop(self._heap)
            if entry[3] == self._WAITING:
                entry[3] = self._GRANTED
                entry[2].set()
                return
        self.free += 1
