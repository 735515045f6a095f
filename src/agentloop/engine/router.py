"""Routing one step's generate requests across engine servers: sticky, least-loaded, failure-tolerant.

This module owns *which server* serves a model turn. `Router.session(key)` returns a `RouteSession`
(`engine/route_session.py`), the per-trajectory `GenerateFn` bound into `AgentContext.generate`:

- **Stickiness**: a trajectory's first turn picks the server with the fewest outstanding requests
  (ties: fewest bound trajectories); every later turn goes to the same server while it is healthy, so
  its prefix stays cached. `RouteSession.close()` releases the binding.
- **Failure**: a turn whose server cannot be reached (`EngineUnavailable`) or fails with a server
  error (5xx) repeatedly is retried on another server (up to `max_retries`); a server that fails a
  health probe, or `failure_threshold` requests in a row, is taken out (`Gate.take_out`, which tells
  the lifecycle that owns the gate). The last server in rotation is never taken out by the router:
  its failures fail the turns (one log line per server state change, not per request). Nothing was
  appended for the failed attempt, so the retry loses no token. Request errors (4xx) are the
  request's fault and raise at once.
- **Hung servers**: `take_out_stalled(after)` (the scheduler's step watchdog calls it) takes out
  every server that has requests in flight, answered none of them for `after` seconds and does not
  answer a `/model_info` probe either; their requests are cancelled and retried on the other servers.
- **Slot order**: with a per-server limit, requests beyond it wait for a slot; the session's
  `slot_order` (given to `Router.session` by the scheduler's run, else the router's) says who
  gets a freed slot first. `"fifo"` (default): arrival order. `"depth_first"`: the trajectory with the
  most model turns behind it, then the oldest, so a trajectory back from its tool call goes before a
  fresh first turn. On the H200 (1024 trajectories, c = 256, 0.5 s tools) depth_first measured 0.94x
  fifo's throughput (benchmarks/results/rollout_throughput_sweep_sglang.json): finishing started
  trajectories first did not shorten the tail there, so it is an option, not the default.
  `"oldest_first"`: the trajectory whose session started first (in a step, the order of its samples:
  the carried groups first, then the fresh ones), so over-sampling's surplus takes only the slots the
  older groups leave free and does not slow the groups that will end the step.
  `"target_first"`: the rank the scheduler gives (`GroupBook.slot_rank`: the groups that will meet the
  step's target, fewest members left first), and with `preempt` a target group's turn that finds every
  slot taken aborts a surplus request (continued in place later), so the surplus never delays the target.
- **Server priority**: `server_priority="oldest_first"` sends every request SGLang's `priority` (minus
  its session's age: older first under the server's default direction), so a server launched with
  `--enable-priority-scheduling` (and a `--max-running-requests` below the trajectories in flight) admits
  the oldest trajectories' turns first and preempts younger running requests for them: `oldest_first`
  done inside the server, where a freed batch slot is known at once and a long young turn can be
  interrupted, which a client-side slot cannot do.
- **The gate**: generation goes only through `Gate.generate(url, ...)`; each request carries a
  unique rid, so `RouteSession.in_flight_rid` can be aborted on the servers directly.
- **Stop**: `RouteSession.stop(reason)` makes every later call return an aborted `GenerateOutput`
  without dispatching (the agent loop then ends with its partial trajectory), which is how the
  scheduler's early stop and timeouts end trajectories cleanly.
  `Router.stop_sessions(sessions, reason)` stops many at once and aborts their requests in flight.
- **Public surface for sessions**: a `RouteSession` uses only the router's public methods
  (`least_loaded`, `bind`/`unbind`, `request_started`/`request_ended`, `slots`, `report_failure`/
  `report_success`), so a router subclass (the Ray worker's `PinnedRouter`) keeps working.

Waits for the gate and for a per-server slot are recorded as "wait" spans, requests as "generate"
spans, on the session (the scheduler copies them into the trajectory's timeline).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import anyio

from .base import EngineError, EngineUnavailable, MisalignedLogprobs, NoServerError
from .gate import Gate
from .slots import PrioritySlots
from .lifecycle import Lifecycle
from .route_session import RouteSession, ServerPriority, SlotOrder, check_server_priority, check_slot_order

log = logging.getLogger(__name__)

__all__ = ["NoServerError", "PrioritySlots", "RouteSession", "Router", "RouterStats", "SlotOrder"]

#: Most abort requests in flight at once when requests are aborted one by one.
ABORT_CONCURRENCY = 64


@dataclass
class RouterStats:
    requests: int = 0
    retries: int = 0
    abort_requests: int = 0  #: /abort_request calls sent to stop sessions (and to preempt slots)
    slot_preemptions: int = 0  #: requests aborted for a better-ranked turn's slot (`target_first`)
    misaligned_answers: int = 0  #: answers dropped (and their turn asked again) for logprobs not matching their ids
    removed: dict[str, str] = field(default_factory=dict)  #: url → why it was taken out


class Router:
    """Routes requests of many trajectories over the servers of one `Gate` (a `Lifecycle` stands for its gate)."""

    def __init__(
        self,
        gate: Gate | Lifecycle,
        *,
        per_server_limit: int | None = None,
        max_retries: int = 3,
        failure_threshold: int = 2,
        request_timeout: float | None = 600.0,
        health_timeout: float = 5.0,
        slot_order: SlotOrder = "fifo",
        server_priority: ServerPriority = "none",
        clock: Callable[[], float] = time.monotonic,
        sole_client: bool = False,
    ) -> None:
        if per_server_limit is not None and per_server_limit < 1:
            raise ValueError(f"per_server_limit must be >= 1 or None, got {per_server_limit}")
        check_slot_order(slot_order)
        check_server_priority(server_priority)
        self.server_priority: ServerPriority = server_priority
        self.gate: Gate = gate.gate if isinstance(gate, Lifecycle) else gate
        self.per_server_limit = per_server_limit
        self.max_retries = max_retries
        self.failure_threshold = failure_threshold
        self.request_timeout = request_timeout
        self.health_timeout = health_timeout
        self.slot_order = slot_order
        self.clock = clock
        #: This process's gate is the only client generating on these servers (the runtime that owns
        #: them; not a Ray worker, whose servers other workers share): a stop may then abort everything a
        #: server runs with one `abort_all` when every request in flight there is one it stops.
        self.sole_client = sole_client
        self.stats = RouterStats()
        self._outstanding: dict[str, int] = {}
        self._bound: dict[str, int] = {}
        self._failures: dict[str, int] = {}
        self._slots: dict[str, PrioritySlots] = {}
        self._sessions = itertools.count()  # session age, the tie-break of the slot order
        self._probe_locks: dict[str, anyio.Lock] = {}
        self._kept_last: set[str] = set()  # servers whose "last one: kept" was logged

    # ------------------------------------------------------------------ public
    def session(self, key: str, *, slot_order: SlotOrder | None = None,
                server_priority: ServerPriority | None = None,
                slot_rank: Callable[[], tuple[int, int, int]] | None = None, preempt: bool = False) -> "RouteSession":
        """A sticky `GenerateFn` for one trajectory (`key` prefixes its request ids). `slot_order`: who
        of its turns gets a freed per-server slot first; `server_priority`: the request priority its turns
        carry (None: the router's settings); given with the session, so runs with different settings never
        change one shared by the router. With `target_first`: `slot_rank` gives its turns' slot key, and
        `preempt` lets a turn take the slot of a worse-class request (see `RouteSession`)."""
        order = self.slot_order if slot_order is None else slot_order
        check_slot_order(order)
        priority = self.server_priority if server_priority is None else server_priority
        check_server_priority(priority)
        return RouteSession(self, key, age=next(self._sessions), slot_order=order, server_priority=priority,
                            slot_rank=slot_rank, preempt=preempt)

    @property
    def urls(self) -> list[str]:
        return self.gate.urls

    def outstanding(self) -> dict[str, int]:
        """Requests routed to each live server and not yet answered (incl. those waiting for a slot)."""
        return {u: self._outstanding.get(u, 0) for u in self.urls}

    def bound(self) -> dict[str, int]:
        """Trajectories currently bound (sticky) to each live server."""
        return {u: self._bound.get(u, 0) for u in self.urls}

    async def abort_on_servers(self, rids_by_server: Mapping[str, Sequence[str]], *, timeout: float = 10.0,
                               by_rid: bool = False) -> int:
        """Abort requests on the servers they were sent to, all servers at once: one `abort_all` to a
        server whose requests in flight are all among its `rids` (known only with `sole_client`: no other
        process generates there) — one round trip instead of one per request — else one abort per rid there, at most
        `ABORT_CONCURRENCY` at a time (always with `by_rid`: a preemption, which must not end a request
        dispatched meanwhile). Returns the number of abort requests sent."""
        sent = 0
        limit = anyio.CapacityLimiter(ABORT_CONCURRENCY)

        async def send(url: str, rid: str | None) -> None:
            nonlocal sent
            sent += 1
            async with limit:
                with anyio.move_on_after(timeout):
                    try:
                        await self.gate.client(url).abort_request(rid, abort_all=rid is None)
                    except (EngineError, OSError) as e:  # a dead server cannot abort; its request ends on its own
                        log.debug("abort of %s on %s: %s", rid or "everything", url, e)

        async with anyio.create_task_group() as tg:
            for url, rids in rids_by_server.items():
                if not rids:
                    continue
                probing = url in self._probe_locks and self._probe_locks[url].locked()  # a /health generate runs
                if self.sole_client and not by_rid and not probing and self.gate.in_flight(url) <= len(rids):
                    # Nothing else runs there: abort it all at once.
                    tg.start_soon(send, url, None)
                else:
                    for rid in rids:
                        tg.start_soon(send, url, rid)
        return sent

    async def take_out_stalled(self, after: float) -> list[str]:
        """Take out every server with requests in flight that answered none for `after` seconds and
        does not answer `/model_info` either (a server that does is slow, not hung: its requests keep
        `request_timeout`). The longest-silent goes first, so the last server kept is the livelier."""
        hung = []
        for url in self.gate.stalled(after):
            try:
                with anyio.fail_after(self.health_timeout):
                    await self.gate.client(url).model_info()
                continue
            except (EngineError, TimeoutError, OSError) as e:
                why = f"{type(e).__name__}: {e}".strip()
            await self._remove(url, f"hung: requests in flight and no answer for {after:.0f}s, nor to /model_info ({why})")
            hung.append(url)
        return hung

    async def stop_sessions(self, sessions: Sequence["RouteSession"], reason: str) -> None:
        """Stop `sessions` at once: nothing more is dispatched for them, their waits (gate, slot,
        tool calls in `interruptible` scopes) end now, and their requests in flight are aborted on
        their servers in one round (`abort_on_servers`). A request dispatched just before the stop may
        not be registered on its server yet, so what is still in flight 0.2 s later is aborted again."""
        for s in sessions:
            s.stop(reason)
        while True:
            by_server: dict[str, list[str]] = {}
            for s in sessions:
                rid, url = s.in_flight_rid, s.in_flight_url
                if rid is not None and url is not None:
                    by_server.setdefault(url, []).append(rid)
            if not by_server:
                return
            self.stats.abort_requests += await self.abort_on_servers(by_server)
            with anyio.move_on_after(0.2):
                for s in sessions:
                    await s.wait_idle()

    # ------------------------------------------------------------------ what route sessions use
    def least_loaded(self) -> str:
        """The live server with the fewest outstanding requests (ties: fewest bound trajectories)."""
        urls = self.urls
        if not urls:
            why = "; ".join(f"{u}: {r}" for u, r in self.gate.out.items())
            raise NoServerError("/generate", None, f"no engine server left ({why})" if why else "no engine server left")
        order = {u: i for i, u in enumerate(urls)}
        return min(urls, key=lambda u: (self._outstanding.get(u, 0), self._bound.get(u, 0), order[u]))

    def bind(self, url: str) -> None:
        """One more trajectory is bound (sticky) to `url`."""
        self._bound[url] = self._bound.get(url, 0) + 1

    def unbind(self, url: str) -> None:
        self._bound[url] = max(0, self._bound.get(url, 0) - 1)

    def request_started(self, url: str) -> None:
        """A request was routed to `url` (it counts as outstanding until `request_ended`)."""
        self._outstanding[url] = self._outstanding.get(url, 0) + 1

    def request_ended(self, url: str) -> None:
        self._outstanding[url] -= 1

    def slots(self, url: str) -> PrioritySlots | None:
        """`url`'s per-server request slots (None: no per-server limit)."""
        if self.per_server_limit is None:
            return None
        if url not in self._slots:
            self._slots[url] = PrioritySlots(self.per_server_limit)
        return self._slots[url]

    async def report_failure(self, url: str, error: EngineError) -> None:
        """A request to `url` failed and is retried: count it; take the server out when it is dead or
        failing repeatedly (see the module docstring)."""
        self.stats.retries += 1
        if url in self.gate.urls:
            await self._on_failure(url, error)

    def misaligned_answer(self, error: MisalignedLogprobs) -> None:
        """An answer was dropped because its logprobs do not match its ids, and its turn is asked again:
        count it; warn once per router (the error names sglang's known cause when it has its shape)."""
        self.stats.misaligned_answers += 1
        if self.stats.misaligned_answers == 1:
            log.warning("dropped an answer whose logprobs do not match its output ids and asked for the turn again "
                        "(counted in RouterStats.misaligned_answers; warned once): %s", error)

    def report_success(self, url: str) -> None:
        """A request to `url` was answered: its run of failures ends."""
        self._failures[url] = 0
        self._kept_last.discard(url)

    # ------------------------------------------------------------------ internals
    async def _on_failure(self, url: str, error: EngineError) -> None:
        """Count a failure of `url`; take the server out when it is dead or failing repeatedly."""
        if url not in self.gate.urls:
            return
        self._failures[url] = self._failures.get(url, 0) + 1
        lock = self._probe_locks.setdefault(url, anyio.Lock())
        async with lock:  # one probe per server at a time, not one per failed trajectory
            if url not in self.gate.urls:
                return
            reason = None
            if self._failures[url] >= self.failure_threshold:
                reason = f"{self._failures[url]} failed requests in a row (last: {error})"
            elif isinstance(error, EngineUnavailable):
                healthy = False
                with anyio.move_on_after(self.health_timeout):
                    healthy = await self.gate.health(url)
                if not healthy:
                    reason = f"unreachable and failed its health probe ({error})"
            if reason is not None:
                await self._remove(url, reason)

    async def _remove(self, url: str, reason: str) -> None:
        if url not in self.gate.urls:
            return
        if len(self.gate.urls) == 1:  # the last server: keep it, the caller's retry budget decides
            if url not in self._kept_last:
                self._kept_last.add(url)
                log.error("engine server %s is the last one in rotation and is kept although %s", url, reason)
            return
        self.stats.removed[url] = reason
        await self.gate.take_out(url, reason)  # logged once by the lifecycle that owns the gate
