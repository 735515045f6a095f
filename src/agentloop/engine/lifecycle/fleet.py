"""The lifecycle's fleet: which servers are in rotation (taking one out, admitting one back, every gate
told), the gates it owns (opened and closed together), running a stage on every server in rotation as
one (`stage`: a `StageRecord` each; a server that fails is taken out while the others go on, and only a
stage failing on every server fails), the liveness probe with re-admission, and the sleep work of one
stage on one server (`sleep_work`).

Liveness: before each wake-up and sleep every server in rotation is probed (`/model_info`, never a
generate, within `liveness_timeout`). One that fails the probe, or whose mark lost this lifecycle's
lease, is taken out of rotation (one log line, every gate told) while the others go on; only when no
server is left does the probe fail, with a `LifecycleError` naming each server and why. Before each
wake-up the servers out of rotation are probed too: one that answers (restarted, or no longer hung)
is re-admitted in the memory state it really is in (`ServerDriver.acquire`), put to sleep like the
others (`sleep_alone`), and woken with the step's weights. Between those probes the lease renewal
(`renew_leases`) reads each mark back before writing it, and the gate asks `answer_lost` about every
generate answer's weight version: a server that lost this lifecycle's mark is taken out either way.
"""

from __future__ import annotations

import time
from typing import Any, Awaitable, Callable, Mapping, Sequence

import anyio

from ..base import EngineClient
from ..gate import GateControl
from ..memory_mark import AnswerCheck
from .log import PROBE_ERRORS, log, short_error
from .server import ServerDriver
from .types import SLEEP_STAGES, LifecycleError, StageRecord

__all__ = ["Fleet", "RecordMark"]

#: A position in `Fleet.records` (from `Lifecycle.record_mark()`), to read one call's records back.
RecordMark = int


class Fleet:
    """Servers in and out of rotation, the gates they are in, and stages fanned out over them."""

    def __init__(self, drivers: Sequence[ServerDriver], gates: Sequence[GateControl], *, stage_timeout: float,
                 settle_timeout: float) -> None:
        self.drivers: dict[str, ServerDriver] = {d.url: d for d in drivers}
        self.gates: list[GateControl] = list(gates)
        self.stage_timeout = stage_timeout
        self.settle_timeout = settle_timeout
        self.records: list[StageRecord] = []
        #: Servers leaving and re-entering rotation: {"time", "url", "event": "out" | "in", "reason"}.
        self.server_events: list[dict[str, Any]] = []
        #: Wall-clock spans during which the gates were open: [opened, closing). Each starts after
        #: AWAKE was reached and ends before AWAKE is left (checked against dispatch times by tests).
        self.gate_windows: list[list[float]] = []

    # ------------------------------------------------------------------ rotation
    def in_rotation(self) -> list[ServerDriver]:
        return [d for d in self.drivers.values() if d.out is None]

    @property
    def urls(self) -> list[str]:
        return [d.url for d in self.in_rotation()]

    @property
    def clients(self) -> list[EngineClient]:
        return [d.client for d in self.in_rotation()]

    @property
    def out_of_rotation(self) -> dict[str, str]:
        return {u: d.out for u, d in self.drivers.items() if d.out is not None}

    async def take_out(self, url: str, reason: str) -> None:
        """Take `url` out of rotation: out of every stage and every gate, until re-admitted."""
        d = self.drivers.get(url)
        if d is None or d.out is not None:
            return
        d.out = reason
        self.server_events.append({"time": time.time(), "url": url, "event": "out", "reason": reason})
        log.warning("engine server %s out of rotation: %s", url, reason)
        for g in self.gates:
            await g.take_out(url, reason)

    async def admit(self, d: ServerDriver) -> None:
        reason, d.out = d.out, None
        self.server_events.append({"time": time.time(), "url": d.url, "event": "in", "reason": f"re-admitted (was: {reason})"})
        log.warning("engine server %s back in rotation (was out: %s)", d.url, reason)
        for g in self.gates:
            await g.admit(d.url)

    def no_server_left(self, stage: str) -> LifecycleError:
        why = "; ".join(f"{u}: {r}" for u, r in self.out_of_rotation.items())
        return LifecycleError(stage, f"no engine server left ({why})")

    # ------------------------------------------------------------------ stages
    def records_since(self, mark: RecordMark) -> list[StageRecord]:
        """The stage records appended since `mark` (a length of `records` taken before a call)."""
        return list(self.records[mark:])

    async def stage(self, phase: str, stage: str, fn: Callable[[ServerDriver], Awaitable[Any]],
                    servers: Sequence[ServerDriver] | None = None) -> None:
        """Run `fn` on every server in rotation (or `servers`) as one stage, recorded."""
        start = time.monotonic()
        targets = list(servers) if servers is not None else self.in_rotation()
        await self.fan_out(stage, fn, targets)
        self.records.append(StageRecord(phase, stage, start, time.monotonic(), {"servers": len(targets)}))

    async def fan_out(self, stage: str, fn: Callable[[ServerDriver], Awaitable[Any]], targets: Sequence[ServerDriver]) -> None:
        """Run `fn` on every target; servers that fail are taken out while others succeed. If every
        target fails, nothing is taken out and the error (naming each server) is raised."""
        if not targets:
            raise self.no_server_left(stage)
        errors: dict[str, LifecycleError] = {}

        async def one(d: ServerDriver) -> None:
            try:
                with anyio.fail_after(self.stage_timeout):
                    await fn(d)
            except LifecycleError as e:
                errors[d.url] = e
            except PROBE_ERRORS as e:
                errors[d.url] = LifecycleError(stage, str(e), url=d.url, cause=e)

        async with anyio.create_task_group() as tg:
            for d in targets:
                tg.start_soon(one, d)
        if not errors:
            return
        if len(errors) == len(targets):
            if len(errors) == 1:
                raise next(iter(errors.values()))
            raise LifecycleError(stage, "failed on every engine server (" + "; ".join(
                f"{u}: {e}" for u, e in errors.items()) + ")")
        for url, e in errors.items():
            await self.take_out(url, str(e))

    # ------------------------------------------------------------------ gates
    def add_gates(self, gates: GateControl) -> None:
        self.gates.append(gates)

    async def open_gates(self, weight_version: str | None) -> None:
        if not self.gate_windows or len(self.gate_windows[-1]) == 2:
            self.gate_windows.append([time.time()])
        for g in self.gates:
            await g.open(weight_version)

    async def close_gates(self, *, for_update: bool = False) -> None:
        for g in self.gates:
            await g.close(for_update=for_update)
        if self.gate_windows and len(self.gate_windows[-1]) == 1:
            self.gate_windows[-1].append(time.time())

    async def mark_sleeping(self) -> None:
        for g in self.gates:
            await g.mark_sleeping()

    async def settle(self, d: ServerDriver) -> None:
        """Wait until no request the gates dispatched to `d` is in flight."""
        if not d.may_be_running:
            return
        left = 0
        for g in self.gates:
            left += await g.wait_settled(d.url, self.settle_timeout)
        if left:
            raise LifecycleError("settle", f"{left} requests still in flight after {self.settle_timeout:.0f}s", url=d.url)

    # ------------------------------------------------------------------ the sleep's work on one server
    def sleep_work(self, stage: str) -> Callable[[ServerDriver], Awaitable[Any]]:
        """What sleep stage `stage` (`SLEEP_STAGES`) does on one server. The draining stages skip a
        server holding no weights or KV cache (nothing can run there)."""
        work: dict[str, Callable[[ServerDriver], Awaitable[Any]]] = {
            "pause": lambda d: d.pause("abort"),
            "settle": self.settle,
            # the engine is not left paused while asleep, so a wake-up needs no continue
            "continue": lambda d: d.unpause(),
            "flush_cache": lambda d: d.flush(),
            "release": lambda d: d.release(),
        }
        return work[stage]

    async def sleep_alone(self, d: ServerDriver) -> None:
        """Put one (re-admitted) server to sleep on its own: every sleep stage, in order."""
        for stage in SLEEP_STAGES:
            with anyio.fail_after(self.stage_timeout):
                await self.sleep_work(stage)(d)

    # ------------------------------------------------------------------ liveness
    async def probe(self, *, readmit: bool) -> None:
        """Liveness of every server in rotation (and, with `readmit`, re-admission of those out)."""
        targets = [d for d in self.drivers.values() if d.out is None or readmit]
        answers: dict[str, Any] = {}

        async def one(d: ServerDriver) -> None:
            try:
                answers[d.url] = await d.probe()
            except PROBE_ERRORS as e:
                answers[d.url] = e

        async with anyio.create_task_group() as tg:
            for d in targets:
                tg.start_soon(one, d)
        for d in targets:
            a = answers[d.url]
            if d.out is None and isinstance(a, BaseException):
                await self.take_out(d.url, f"failed the liveness probe ({short_error(a)})")
            elif d.out is None:
                lost = d.lost(a)
                if lost is None:
                    try:
                        await d.mark()  # renews the lease when it is half gone
                        continue
                    except PROBE_ERRORS as e:
                        lost = f"cannot renew this runtime's lease in its mark ({short_error(e)})"
                await self.take_out(d.url, lost)
                if readmit:  # held by nobody now (restarted, or let go): ours again, in its real state
                    await self.readmit(d, a)
            elif not isinstance(a, BaseException):
                await self.readmit(d, a)
        if not self.in_rotation():
            raise self.no_server_left("liveness")

    async def readmit(self, d: ServerDriver, info: Mapping[str, Any]) -> None:
        """A server out of rotation answers again: learn its real state, put it to sleep, admit it."""
        try:
            await d.acquire(info, initial=False)
            await self.sleep_alone(d)
        except (LifecycleError, *PROBE_ERRORS) as e:
            reason = f"answers again but cannot be re-admitted: {e}"
            if d.out != reason:
                d.out = reason
                log.warning("engine server %s stays out of rotation: %s", d.url, reason)
            return
        await self.admit(d)

    async def attach(self) -> None:
        """Acquire every server (`ServerDriver.acquire`), concurrently. Those that fail are taken out;
        raises when none can be attached."""
        errors: dict[str, BaseException] = {}

        async def one(d: ServerDriver) -> None:
            try:
                await d.acquire(await d.probe(), initial=True)
            except (LifecycleError, *PROBE_ERRORS) as e:
                errors[d.url] = e

        async with anyio.create_task_group() as tg:
            for d in self.drivers.values():
                tg.start_soon(one, d)
        if errors and len(errors) == len(self.drivers):
            if len(errors) == 1:
                url, e = next(iter(errors.items()))
                raise e if isinstance(e, LifecycleError) else LifecycleError("attach", short_error(e), url=url, cause=e)
            raise LifecycleError("attach", "no engine server can be attached (" + "; ".join(
                f"{u}: {e}" for u, e in errors.items()) + ")")
        for url, e in errors.items():
            await self.take_out(url, f"cannot be attached: {e}")

    async def unpause_best_effort(self, phase: str) -> None:
        """`/continue_generation` on every server in rotation, failures only logged (called after a
        failed pause, whose error is the one to raise)."""
        try:
            with anyio.fail_after(self.stage_timeout):
                await self.stage(phase, "continue", lambda d: d.unpause())
        except Exception as e:
            log.warning("continue_generation after a failed pause failed too: %s", short_error(e))

    # ------------------------------------------------------------------ leases in the marks
    async def renew_leases(self, timeout: float) -> None:
        """Rewrite every mark in rotation (renewing the lease when half gone), after reading it back: a
        server no longer ours (restarted, taken over) is taken out, never re-marked as ours (its weights
        are not the ones the mark would name). Other failures are only logged: the next stage says
        what is wrong."""
        for d in self.in_rotation():
            try:
                with anyio.fail_after(timeout):
                    lost = d.lost(await d.probe())
                    if lost is None:
                        await d.mark()
            except (*PROBE_ERRORS, LifecycleError) as e:
                log.warning("engine server %s: could not renew this runtime's lease (%s)", d.url, short_error(e))
                continue
            if lost is not None:
                await self.take_out(d.url, lost)

    def answer_lost(self, url: str, weight_version: str) -> str | None:
        """Why a generate answer's whole weight version says `url` is no longer this lifecycle's
        (`ServerDriver.lost`), or None. The gate drops such an answer and takes the server out. The mark
        before the last load is still ours: a request the load's drain aborted is answered with it."""
        d = self.drivers.get(url)
        if d is None or not d.leased or weight_version in (d.mark_text, d.mark_before_load):
            return None
        return d.lost({"weight_version": weight_version})

    def answer_check(self) -> AnswerCheck:
        """`answer_lost`'s judgement as plain data, for gates in other processes (Ray rollout workers):
        this lifecycle's lease owner and the servers in rotation it holds with a lease now."""
        held = [d for d in self.in_rotation() if d.leased]
        return AnswerCheck(held[0].owner.lease.owner if held else "", frozenset(d.url for d in held))

    async def clear_leases(self) -> None:
        """After the owner let go: marks lose the lease (a server woken completely reports its plain
        weight version again)."""
        for d in self.in_rotation():
            if d.leased or d.parked:
                try:
                    await d.mark()
                except PROBE_ERRORS as e:  # unreachable: its lease lapses when this process ends
                    log.warning("engine server %s: could not clear this runtime's lease (%s)", d.url, short_error(e))
