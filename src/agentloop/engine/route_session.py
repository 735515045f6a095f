"""One trajectory's road to the engines: `RouteSession`, the `GenerateFn` bound into `AgentContext.generate`.

`Router.session(key)` makes one (`engine/router.py` says how servers are chosen). The session keeps its
trajectory sticky to one server, retries a failed turn elsewhere, waits for the gate and for a per-server
slot (recorded as "wait" spans; requests as "generate" spans), gives every request a unique rid
(`in_flight_rid`, aborted on its server by a stop), and after `stop(reason)` answers every call with an
aborted `GenerateOutput` without dispatching. It uses only the router's public methods.

With `server_priority="oldest_first"` every request carries SGLang's `priority`: minus the session's age,
so under a server's default direction (--enable-priority-scheduling: higher values first) the
trajectory that started first is admitted first, and may preempt younger running requests.

With `slot_order="target_first"` a turn's slot key is the rank its scheduler gives (`slot_rank`: the
groups that will meet the step's target first, see `GroupBook.slot_rank`), and with `preempt` a turn of
a better class that finds every slot taken aborts the worst-ranked request holding one. The preempted
session continues that turn itself: it queues for a slot again and asks for the rest of the turn (its
context plus the tokens sampled so far, the remaining `max_new_tokens`), and its caller gets one output
whose ids and logprobs are the pieces' in order, so no agent loop sees the preemption. If the weights
changed between the pieces, the pieces so far come back as a turn interrupted by an update
(`interrupted_for_update`), which the episode continues with the new version's tokens recorded apart.
The surplus of over-sampling thus fills the slots the target groups leave idle without delaying them
when they return from their tools.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from typing import Any, Awaitable, Callable, Iterator, Literal, Protocol, get_args

import anyio

from ..types import TimelineEvent
from .base import EngineError, EngineUnavailable, GenerateOutput, MisalignedLogprobs, NoServerError, SamplingParams
from .gate import Gate
from .slots import PrioritySlots

log = logging.getLogger("agentloop.engine.router")

__all__ = ["RouteSession", "ServerPriority", "SessionRouter", "SlotOrder"]

SlotOrder = Literal["depth_first", "fifo", "oldest_first", "target_first"]
SLOT_ORDERS: tuple[str, ...] = get_args(SlotOrder)

#: Longest a preempting turn waits for its victim's abort to be sent (it then waits for a slot as usual).
PREEMPT_ABORT_TIMEOUT = 5.0
#: Most pieces a preempted turn is continued in before it is returned as it stands (aborted).
MAX_PREEMPTED_PIECES = 100


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
    async def abort_on_servers(self, rids_by_server: Any, *, timeout: float = 10.0, by_rid: bool = False) -> int: ...
    async def report_failure(self, url: str, error: EngineError) -> None: ...
    def report_success(self, url: str) -> None: ...
    def misaligned_answer(self, error: MisalignedLogprobs) -> None: ...


class RouteSession:
    """The `GenerateFn` of one trajectory: sticky to one server, retried elsewhere if it dies."""

    def __init__(self, router: SessionRouter, key: str, *, age: int = 0, slot_order: SlotOrder = "fifo",
                 server_priority: ServerPriority = "none",
                 slot_rank: Callable[[], tuple[int, int, int]] | None = None, preempt: bool = False) -> None:
        self.router = router
        self.key = key
        self.age = age  #: the tie-break of the slot order (older sessions first)
        self.slot_order = slot_order
        self.slot_rank = slot_rank  #: target_first's key, from the scheduler (None: by age)
        self.preempt = preempt and slot_order == "target_first"  #: may take a worse-ranked holder's slot
        self.preempted = 0  #: requests of this session aborted for a better-ranked one
        self.misaligned = 0  #: answers dropped for logprobs not matching their ids (the turn asked again)
        self._was_preempted = False  # the last request dispatched was aborted by a preemption
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
        out = await self._request(input_ids, sampling_params)
        if not self._was_preempted:
            return out
        return await self._continue_preempted(list(input_ids), sampling_params, out)

    async def _continue_preempted(self, input_ids: list[int], params: SamplingParams,
                                  first: GenerateOutput) -> GenerateOutput:
        """Finish a turn whose request was preempted (see the module docstring): the pieces as one output."""
        pieces = [first]
        budget = params.max_new_tokens
        while self._was_preempted and len(pieces) < MAX_PREEMPTED_PIECES:
            sampled = [t for p in pieces for t in p.output_ids]
            if budget is not None and len(sampled) >= budget:  # every token asked for came before the abort
                return _joined(pieces, {"type": "length", "length": len(sampled)})
            changes: dict[str, object] = {}
            if budget is not None:
                changes["max_new_tokens"] = budget - len(sampled)
            if isinstance(params.extra.get("min_new_tokens"), int):
                changes["extra"] = {**params.extra, "min_new_tokens": max(0, params.extra["min_new_tokens"] - len(sampled))}
            out = await self._request(input_ids + sampled, params.replace(**changes))
            if out.output_ids and out.weight_version != first.weight_version:
                # Sampled by newer weights than the pieces before it: those come back as a turn cut by an
                # update (this piece is dropped; the episode asks for the rest under the new version).
                return _joined(pieces, None, updated=True)
            pieces.append(out)
        return _joined(pieces, None)

    async def _request(self, input_ids: list[int], sampling_params: SamplingParams) -> GenerateOutput:
        self._was_preempted = False
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
                if isinstance(e, MisalignedLogprobs):
                    # Dropped whole and the same turn asked again: nothing of it reached the trajectory, so
                    # the next answer is an honest fresh sample. The server is not blamed for it.
                    self.misaligned += 1
                    router.misaligned_answer(e)
                    continue
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
        holder: list | None = None
        if slot is not None:
            if self.stopped:
                return None
            key = self._slot_key()
            entry = slot.enqueue(key)
            if entry is not None:
                # Most turns wait here (more trajectories than slots): the wait is withdrawn by `stop()`
                # rather than run in a cancel scope, whose cost per turn was a visible share of the client's CPU.
                self._slot_waits[id(entry)] = (slot, entry)
                try:
                    victim = slot.preempt_for(key) if self.preempt else None
                    if victim is not None:
                        try:
                            await self._abort(victim)
                        except BaseException:
                            slot.forfeit(entry)
                            raise
                    if not await slot.wait(entry):
                        return None
                finally:
                    del self._slot_waits[id(entry)]
            if self.preempt:
                holder = slot.hold(key, (url, rid))
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
                out = await router.gate.generate(url, input_ids, params, rid=rid, timeout=router.request_timeout,
                                                 priority=self.priority)
                if out.aborted and PrioritySlots.was_preempted(holder) and not self.stopped:
                    self._was_preempted = True
                    self.preempted += 1
                return out
            finally:
                self.in_flight_rid = self.in_flight_url = None
                if self._idle is not None:
                    self._idle.set()
                    self._idle = None
                self.events.append(TimelineEvent("generate", t1, clock()))
        finally:
            if slot is not None:
                slot.release(holder)

    async def _abort(self, victim: tuple[str, str]) -> None:
        """Abort a preempted holder's request (its slot then passes to the best waiter: this turn, or a
        better one). A request not on its server yet is not found there and runs to its end: no retry."""
        url, rid = victim
        self.router.stats.slot_preemptions += 1
        self.router.stats.abort_requests += await self.router.abort_on_servers({url: [rid]}, timeout=PREEMPT_ABORT_TIMEOUT,
                                                                   by_rid=True)

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
        if isinstance(e, (EngineUnavailable, MisalignedLogprobs)):
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
        if self.slot_order == "target_first":  # (class, members left in its group, group order)
            return self.slot_rank() if self.slot_rank is not None else (0, 0, self.age)
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


def _joined(pieces: list[GenerateOutput], finish: dict | None, *, updated: bool = False) -> GenerateOutput:
    """One turn's output from the pieces it was sampled in (in order); `finish`: its finish reason (None:
    the last piece's); `updated`: the weights changed after these pieces, so the turn is returned aborted
    and `interrupted_for_update`, for the episode to continue under the new version."""
    last = pieces[-1]
    if updated:
        finish = {"type": "abort", "message": "preempted, then the weights were updated"}
    return dataclasses.replace(
        last, output_ids=[t for p in pieces for t in p.output_ids],
        output_logprobs=[lp for p in pieces for lp in p.output_logprobs],
        finish_reason=finish if finish is not None else last.finish_reason,
        prompt_tokens=pieces[0].prompt_tokens, completion_tokens=sum(p.completion_tokens for p in pieces),
        cached_tokens=sum(p.cached_tokens for p in pieces), e2e_latency=sum(p.e2e_latency for p in pieces),
        weight_version=pieces[0].weight_version, interrupted_for_update=updated or last.interrupted_for_update)
