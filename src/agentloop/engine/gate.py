"""The gate: the one road to an engine's generate and `/health`, open only while the engines are AWAKE.

This module owns what a process that *generates* needs to know about the engines, and nothing that
drives them: whether they are AWAKE (the gate is open), the weight version they serve, which servers
are in rotation, and the requests in flight on each. `Gate.generate` waits for the gate to open, so
dispatching to an engine that is not AWAKE is impossible by construction (a released SGLang server
crashes on a generate or a `/health`). Only a lifecycle moves a gate (`open` / `close` /
`mark_sleeping`): the driver's `Lifecycle` owns one `Gate` in its own process and, in Ray mode, the
workers' gates through the same `GateControl` interface (`agentloop.distributed.pool.WorkerPool`).

Taking a server out (`take_out`: the router after repeated failures, the step watchdog when a server
stops making progress, the lifecycle when its liveness probe fails) cancels the requests in flight on
it, which then fail with `EngineUnavailable` and are retried elsewhere by the router; the gate's
`on_take_out` hook tells the owner (the lifecycle), so the server also leaves the lifecycle's stages
until it is re-admitted (`admit`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, Protocol, Sequence, runtime_checkable

import anyio

from .base import EngineClient, EngineError, EngineUnavailable, GenerateOutput, SamplingParams
from .memory_mark import served_version
from .state import EngineState

__all__ = ["Gate", "GateControl", "GateWatched"]

log = logging.getLogger(__name__)


class GateControl(Protocol):
    """What a lifecycle does to the gates it owns (a local `Gate`, or every Ray worker's gate at once)."""

    async def open(self, weight_version: str | None) -> None:
        """The engines are AWAKE serving `weight_version`: let generations through."""

    async def close(self, *, for_update: bool = False) -> int:
        """The engines are about to sleep (or, `for_update`, to be drained for a weight update): new
        generations wait. Returns the requests still in flight."""

    async def mark_sleeping(self) -> None:
        """The engines' memory is released."""

    async def wait_settled(self, url: str, timeout: float) -> int:
        """Wait until no request is in flight on `url`; returns how many still are after `timeout`."""

    async def take_out(self, url: str, reason: str) -> None:
        """`url` leaves the rotation: its in-flight requests are cancelled (retried elsewhere)."""

    async def admit(self, url: str) -> None:
        """`url` (back) in rotation."""


@runtime_checkable
class GateWatched(Protocol):
    """A client that checks, at the moment a generate or `/health` leaves it, that its gate is open, and
    counts the ones that leave while it is not (`SGLangClient` does; a gate tells each such client of
    its own state with `watch_gate`). Clients without it are simply not counted."""

    #: generates and /health calls sent while the watching gate said closed (stays 0)
    sent_outside_awake: int

    def watch_gate(self, is_open: Callable[[], bool]) -> None:
        """From now on, `is_open()` says whether generation is allowed (AWAKE)."""


@dataclass
class _Member:
    client: EngineClient
    in_flight: int = 0
    settled: anyio.Event = field(default_factory=anyio.Event)
    #: monotonic time of the last answer from this server (or of its first request after being idle)
    progress: float = 0.0
    scopes: set[anyio.CancelScope] = field(default_factory=set)


class Gate:
    """The gate of one process over `clients` (see the module docstring).

    `on_generate(url, state)` is an instrumentation hook called right before each dispatch;
    `on_take_out(url, reason)` is awaited when a server leaves the rotation. `check_answer(url,
    weight_version)` is called with the whole weight version each answer reports and returns why that
    server is no longer the owner's (restarted with its own weights, or taken over by another
    runtime), or None: such an answer is dropped, the server taken out and the request retried
    elsewhere, so no token of unknown weights reaches a trajectory.
    """

    def __init__(
        self,
        clients: Sequence[EngineClient],
        *,
        awake: bool = False,
        out: Mapping[str, str] | None = None,
        on_generate: Callable[[str, EngineState], None] | None = None,
        on_take_out: Callable[[str, str], Awaitable[None]] | None = None,
        check_answer: Callable[[str, str], str | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._all: dict[str, EngineClient] = {c.url: c for c in clients}
        #: url → why it was taken out (servers out of rotation now; `out` given: out from the start)
        self.out: dict[str, str] = dict(out or {})
        self._members: dict[str, _Member] = {c.url: _Member(c) for c in clients if c.url not in self.out}
        self.on_generate = on_generate
        self.on_take_out = on_take_out
        self.check_answer = check_answer
        self.clock = clock
        self._state = EngineState.AWAKE if awake else EngineState.SLEEPING
        self._open_event = anyio.Event()
        if awake:
            self._open_event.set()
        self.weight_version: str | None = None
        for c in clients:
            if isinstance(c, GateWatched):
                c.watch_gate(lambda: self.is_open)
        #: wall-clock times of recent openings and closings (checked against dispatch times by tests)
        self.opened_at: deque[float] = deque(maxlen=1000)
        #: Closings to drain the engines for a weight update (`close(for_update=True)`), and the requests
        #: that came back aborted across one: each is marked `interrupted_for_update`, so its episode
        #: continues the turn under the new weights instead of ending the trajectory.
        self.update_drains = 0
        self.interrupted_for_update = 0
        #: The same, per drain (its number: `update_drains` once it began): an answer can come back after
        #: its update returned (the server's drain loads while the answers are still on their way).
        self.interrupted_by_drain: Counter[int] = Counter()
        self.closed_at: deque[float] = deque(maxlen=1000)

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> EngineState:
        """AWAKE while open; DRAINING once closed; SLEEPING after `mark_sleeping` (or before the first open)."""
        return self._state

    @property
    def is_open(self) -> bool:
        return self._state is EngineState.AWAKE

    @property
    def generations_outside_awake(self) -> int:
        """Generates and `/health` calls whose HTTP request left a client while this gate was closed
        (counted by the clients at the send, after the gate was passed; 0 for clients that cannot count).
        Stays 0: asserted by tests and GPU runs."""
        counts = (c.sent_outside_awake for c in self._all.values() if isinstance(c, GateWatched))
        return sum(n for n in counts if isinstance(n, int))  # (a test wrapper may keep a list of its own)

    @property
    def urls(self) -> list[str]:
        """Servers in rotation."""
        return list(self._members)

    @property
    def clients(self) -> list[EngineClient]:
        return [m.client for m in self._members.values()]

    def in_flight(self, url: str | None = None) -> int:
        if url is not None:
            m = self._members.get(url)
            return m.in_flight if m is not None else 0
        return sum(m.in_flight for m in self._members.values())

    def _set(self, state: EngineState) -> None:
        self._state = state
        if state is EngineState.AWAKE:
            self._open_event.set()
        elif self._open_event.is_set():
            self._open_event = anyio.Event()

    # ------------------------------------------------------------------ moved by a lifecycle (GateControl)
    async def open(self, weight_version: str | None) -> None:
        self.weight_version = weight_version
        if not self.is_open:
            self.opened_at.append(time.time())
        self._set(EngineState.AWAKE)

    async def close(self, *, for_update: bool = False) -> int:
        if for_update:
            self.update_drains += 1
        if self.is_open:
            self.closed_at.append(time.time())
        self._set(EngineState.DRAINING)
        return self.in_flight()

    async def mark_sleeping(self) -> None:
        self._set(EngineState.SLEEPING)

    async def wait_settled(self, url: str, timeout: float) -> int:
        m = self._members.get(url)
        if m is None:
            return 0
        with anyio.move_on_after(timeout):
            while m.in_flight > 0:
                m.settled = anyio.Event()
                await m.settled.wait()
        return m.in_flight

    async def take_out(self, url: str, reason: str) -> None:
        m = self._members.pop(url, None)
        if m is None:
            return
        self.out[url] = reason
        for scope in list(m.scopes):
            scope.cancel()
        if self.on_take_out is not None:
            await self.on_take_out(url, reason)

    async def admit(self, url: str) -> None:
        if url in self._members:
            return
        client = self._all.get(url)
        if client is None:
            raise KeyError(f"{url} is not one of this gate's servers {list(self._all)}")
        self.out.pop(url, None)
        self._members[url] = _Member(client)

    # ------------------------------------------------------------------ the road to the engines
    async def wait_awake(self, timeout: float | None = None) -> None:
        """Block until the gate is open (the engines are AWAKE)."""
        with anyio.fail_after(timeout) if timeout else contextlib.nullcontext():
            while not self.is_open:
                await self._open_event.wait()

    async def generate(
        self,
        url: str,
        input_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        rid: str | None = None,
        timeout: float | None = None,
        gate_timeout: float | None = None,
        priority: int | None = None,
    ) -> GenerateOutput:
        """The one road to an engine's generate: waits for AWAKE, counts the request in flight.

        A request whose server is taken out meanwhile raises `EngineUnavailable` (retry elsewhere).
        `priority` goes to the client only when given, so clients without the keyword keep working."""
        m = self._members.get(url)
        if m is None:
            raise EngineUnavailable("/generate", None, self._gone(url), url=url)
        while not self.is_open:  # checked with no await between it and the increment below
            await self.wait_awake(gate_timeout)
        if self._members.get(url) is not m:
            raise EngineUnavailable("/generate", None, self._gone(url), url=url)
        if self.on_generate is not None:
            self.on_generate(url, self._state)
        if m.in_flight == 0:
            m.progress = self.clock()  # an idle server owes nothing yet: its clock starts now
        m.in_flight += 1
        drains = self.update_drains
        scope = anyio.CancelScope()
        m.scopes.add(scope)
        lost: str | None = None
        try:
            with scope:
                extra = {} if priority is None else {"priority": priority}
                out = await m.client.generate(input_ids, sampling_params, rid=rid, timeout=timeout, **extra)
                m.progress = self.clock()
                if self._members.get(url) is not m:
                    # taken out while this answer was on its way (a cancel lands at the next await, not
                    # on a result already received): the server may serve weights this runtime did not load
                    lost = self._gone(url)
                elif self.check_answer is not None and out.weight_version:
                    lost = self.check_answer(url, out.weight_version)
                if lost is None:
                    out.weight_version = served_version(out.weight_version)  # the lifecycle's mark is not a version
                    if drains != self.update_drains and out.aborted:
                        out.interrupted_for_update = True
                        self.interrupted_for_update += 1
                        self.interrupted_by_drain[drains + 1] += 1
                    return out
            if lost is not None:  # maybe sampled by weights this runtime did not load: dropped, retried elsewhere
                await self.take_out(url, lost)  # (a no-op for a server already out)
                raise EngineUnavailable("/generate", None, f"{self._gone(url)}; its answer was dropped", url=url)
            # only reached when `take_out` cancelled the scope: the router retries on another server
            raise EngineUnavailable("/generate", None, self._gone(url), url=url)
        finally:
            m.scopes.discard(scope)
            m.in_flight -= 1
            if m.in_flight == 0:
                m.settled.set()

    def _gone(self, url: str) -> str:
        why = self.out.get(url)
        return f"server taken out of rotation ({why})" if why else "server is not (or no longer) in rotation"

    async def health(self, url: str) -> bool:
        """Liveness without risk: `/health` (which generates) only while open, else `/model_info`."""
        client = self.client(url)
        try:
            if self.is_open:
                return await client.health()
            await client.model_info()
            return True
        except EngineError:
            return False

    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> list[tuple[str, BaseException]]:
        """Send an abort to every server in rotation directly (routers do not forward aborts);
        returns the servers that could not be told, with their errors."""
        failed: list[tuple[str, BaseException]] = []

        async def one(c: Any) -> None:
            try:
                await c.abort_request(rid, abort_all=abort_all)
            except (EngineError, OSError) as e:
                failed.append((c.url, e))

        async with anyio.create_task_group() as tg:
            for c in self.clients:
                tg.start_soon(one, c)
        return failed

    def client(self, url: str) -> EngineClient:
        """The client of one of this gate's servers (in rotation or not), for calls that never generate."""
        return self._all[url]

    def stalled(self, after: float) -> list[str]:
        """Servers with requests in flight that answered none of them for `after` seconds, the
        longest-silent first."""
        now = self.clock()
        silent = [(m.progress, u) for u, m in self._members.items() if m.in_flight > 0 and now - m.progress > after]
        return [u for _, u in sorted(silent)]
