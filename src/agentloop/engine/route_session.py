"""One trajectory's road to the engines: `RouteSession`, the `GenerateFn` bound into `AgentContext.generate`.

`Router.session(key)` makes one (`engine/router.py` says how servers are chosen). The session keeps its
trajectory sticky to one server, retries a failed turn elsewhere, waits for the gate and for a per-server
slot (recorded as "wait" spans; requests as "generate" spans), gives every request a unique rid
(`in_flight_rid`, aborted on its server by a stop), and after `stop(reason)` answers every call with an
aborted `GenerateOutput` without dispatching. It uses only the router's public methods.

With `server_priority="oldest_first"` every request carries SGLang's `priority`: minus the session's age,
so under a server's default direction (--enable-priority-scheduling: higher values first) the
trajectory that started first is admitted first, and may preempt younger running requests.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Awaitable, Callable, Iterator, Literal, Protocol, get_args

import anyio

from ..types import TimelineEvent
from .base import EngineError, EngineUnavailable, GenerateOutput, NoServerError, SamplingParams
from .gate import Gate
from .slots import PrioritySlots

log = logging.getLogger("agentloop.engine.router")

__all__ = ["RouteSession", "ServerPriority", "SessionRouter", "SlotOrder"]

SlotOrder = Literal["depth_first", "fifo", "oldest_first"]
SLOT_ORDERS: tuple[str, ...] = get_args(SlotOrder)


#: What each generate request tells the server of its place (SGLang's request `priority`).
ServerPriority = Literal["none", "oldest_first"]


def check_slot_order(order: object) -> None:
    if order not in SLOT_ORDERS:
        raise ValueError(f"slot_order must be one of {', '.join(SLOT_ORDERS)}, got {order!r}")


def check_server_priority(priority: object) -> None:
    if priority not in get_args(ServerPriority):
        raise ValueError(f"server_priority must be one of {', '.join(get_args(ServerPriority))}, got {priority!r}")


class SessionRouter(Protocol):
    """What a session needs of its router (`engine.router.Router` is one; so is the Ray worker's
    `PinnedRouter`): its public surface, nothing private."""

    gate: Gate
    max_retries: int
    request_timeout: float | None
    clock: Callable[[], float]
    stats: Any  #: `RouterStats`: the session counts its retries there

    @property
    def urls(self) -> list[str]: ...
    def least_loaded(self) -> str: ...
    def bind(self, url: str) -> None: ...
    def unbind(self, url: str) -> None: ...
    def request_started(self, url: str) -> None: ...
    def request_ended(self, url: str) -> None: ...
    def slots(self, url: str) -> PrioritySlots | None: ...
    async def report_failure(self, url: str, error: EngineError) -> None: ...
    def report_success(self, url: str) -> None: ...


class RouteSession:
    """The `GenerateFn` of one trajectory: sticky to one server, retried elsewhere if it dies."""

    def __init__(self, router: SessionRouter, key: str, *, age: int = 0, slot_order: SlotOrder = "fifo",
                 server_priority: ServerPriority = "none") -> None:
        self.router = router
        self.key = key
        self.age = age  #: the tie-break of the slot order (older sessions first)
        self.slot_order = slot_order
        #: SGLang's `priority` of every request (None: not sent): older sessions get higher values.
        self.priority: int | None = -age if server_priority == "oldest_first" else None
        self.url: str | None = None
        self.in_flight_rid: str | None = None
        self.in_flight_url: str | None = None  #: the server `in_flight_rid` was sent to
        self.rids: list[str] = []
        self.stop_reason: str | None = None
        self.events: list[TimelineEvent] = []
        self.servers: list[str] = []  #: every server this trajectory was bound to, in order
        self.retries = 0
        self._closed = False
        self._stop_event: anyio.Event | None = None  #: made by `wait_stopped` (the Ray pool's), not per trajectory
        self._waits: set[anyio.CancelScope] = set()  #: gate waits a stop must end
        self._slot_waits: dict[int, tuple[PrioritySlots, list]] = {}  #: queued slot waits a stop withdraws
        self._idle: anyio.Event | None = None  #: made by `wait_idle` (rarely needed), not per request

    # ------------------------------------------------------------------ control
    def stop(self, reason: str) -> None:
        """Later calls return an aborted output without dispatching (the in-flight one is aborted by rid)."""
        if self.stop_reason is None:
            self.stop_reason = reason
            if self._stop_event is not None:
                self._stop_event.set()
            for scope in self._waits:
                scope.cancel()
            for slots, entry in self._slot_waits.values():
                slots.withdraw(entry)

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[anyio.CancelScope]:
        """A cancel scope that `stop()` cancels (cancelled at once if stopped already): the agent loop's
        waits between model turns (tools) run in it, so a stop ends them at once (`AgentContext.interruptible`)."""
        with anyio.CancelScope() as scope:
            if self.stopped:
                scope.cancel()
            self._waits.add(scope)
            try:
                yield scope
            finally:
                self._waits.discard(scope)

    async def wait_stopped(self) -> None:
        """Return once `stop()` was called (at once if it was)."""
        if self.stop_reason is not None:
            return
        if self._stop_event is None:
            self._stop_event = anyio.Event()
        await self._stop_event.wait()

    async def wait_idle(self) -> None:
        """Return once no request of this session is in flight."""
        if self.in_flight_rid is None:
            return
        if self._idle is None:
            self._idle = anyio.Event()
        await self._idle.wait()

    def close(self) -> None:
        """Release the sticky binding (the trajectory has ended)."""
        if self.url is not None and not self._closed:
            self.router.unbind(self.url)
        self._closed = True
        self.url = None

    # ------------------------------------------------------------------ GenerateFn
    async def __call__(self, input_ids: list[int], sampling_params: SamplingParams) -> GenerateOutput:
        if self._closed:
            raise RuntimeError(f"trajectory {self.key}: generate called after its route session was closed")
        router = self.router
        attempt = 0
        while True:
            if self.stopped:
                return self._not_dispatched()
            url = self.current_server()
            rid = f"{self.key}-{os.urandom(6).hex()}"  # 48 random bits, as uuid4().hex[:12] had
            router.request_started(url)
            try:
                out = await self._dispatch(url, rid, input_ids, sampling_params)
            except EngineError as e:
                if not self._retryable(url, e) or attempt >= router.max_retries:
                    raise
                attempt += 1
                self.retries += 1
                log.debug("trajectory %s: turn failed on %s (%s); retrying (%d/%d)", self.key, url, e, attempt, router.max_retries)
                await router.report_failure(url, e)
                if url not in router.urls:
                    self._unbind()  # move on to another server
                continue
            finally:
                router.request_ended(url)
            router.report_success(url)
            if out is None:  # stopped while waiting for the gate or a slot
                return self._not_dispatched()
            return out

    async def _dispatch(self, url: str, rid: str, input_ids: list[int], params: SamplingParams) -> GenerateOutput | None:
        router = self.router
        clock = router.clock
        t0 = clock()
        # Wait for the gate here (not only inside Lifecycle.generate) so the wait is visible on the
        # timeline, and so a stop ends the wait (a sleeping engine would otherwise hold it forever).
        if not router.gate.is_open and not await self._unless_stopped(router.gate.wait_awake):
            return None
        slot = router.slots(url)
        if slot is not None:
            if self.stopped:
                return None
            entry = slot.enqueue(self._slot_key())
            if entry is not None:
                # Most turns wait here (more trajectories than slots): the wait is withdrawn by `stop()`
                # rather than run in a cancel scope, whose cost per turn was a visible share of the client's CPU.
                self._slot_waits[id(entry)] = (slot, entry)
                try:
                    if not await slot.wait(entry):
                        return None
                finally:
                    del self._slot_waits[id(entry)]
        try:
            t1 = clock()
            if t1 - t0 > 1e-4:
                self.events.append(TimelineEvent("wait", t0, t1))
            if self.stopped:
                return None
            self.in_flight_rid, self.in_flight_url = rid, url
            self.rids.append(rid)
            router.stats.requests += 1
            try:
                return await router.gate.generate(url, input_ids, params, rid=rid, timeout=router.request_timeout,
                                                  priority=self.priority)
            finally:
                self.in_flight_rid = self.in_flight_url = None
                if self._idle is not None:
                    self._idle.set()
                    self._idle = None
                self.events.append(TimelineEvent("generate", t1, clock()))
        finally:
            if slot is not None:
                slot.release()

    async def _unless_stopped(self, wait: Callable[[], Awaitable[None]]) -> bool:
        """Run `wait()` unless the session is stopped first; True if `wait` completed."""
        if self.stopped:
            return False
        # A cancel scope that `stop()` cancels, not a task group racing `wait` against a stop event.
        done = False
        with self.interruptible():
            await wait()
            done = True
        return done

    def current_server(self) -> str:
        """The server this trajectory is bound to (sticky); picks the least-loaded one if none."""
        if self.url is not None and self.url not in self.router.urls:
            self._unbind()  # its server was taken out (by another trajectory's failure)
        if self.url is None:
            self.bind_to(self.router.least_loaded())
        assert self.url is not None
        return self.url

    def bind_to(self, url: str) -> None:
        """Bind this trajectory to `url` (sticky from now on); e.g. the server a Ray driver chose for it."""
        self._unbind()
        self.url = url
        self.router.bind(url)
        self.servers.append(url)

    def _unbind(self) -> None:
        if self.url is not None:
            self.router.unbind(self.url)
            self.url = None

    def _retryable(self, url: str, e: EngineError) -> bool:
        if isinstance(e, NoServerError):
            return False
        if isinstance(e, EngineUnavailable):
            return True
        if url not in self.router.urls:  # taken out of rotation meanwhile
            return True
        return e.status is not None and e.status >= 500

    def _slot_key(self) -> tuple[int, ...]:
        """This turn's place in a per-server slot queue (lowest first; FIFO among equal keys)."""
        if self.slot_order == "depth_first":  # most model turns behind it, then the oldest session
            return (-len(self.rids), self.age)
        if self.slot_order == "oldest_first":  # the session started first: a step's carried groups, then
            return (self.age, 0)               # its groups in the order they were given
        return (0, 0)

    def _not_dispatched(self) -> GenerateOutput:
        return GenerateOutput(
            output_ids=[],
            output_logprobs=[],
            finish_reason={"type": "abort", "message": f"not dispatched: {self.stop_reason}"},
            weight_version=self.router.gate.weight_version or "",
            rid="",
            server_url=self.url or "",
        )
