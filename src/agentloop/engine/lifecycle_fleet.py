"""The lifecycle's fleet: which servers are in rotation (taking one out, admitting one back, every
gate told), the gates it owns (opened and closed together), and running a stage on every server in
rotation as one (`_stage`: a `StageRecord` each; `_fan_out`: a server that fails is taken out while
the others go on, and only a stage failing on every server fails).
"""

from __future__ import annotations

import time
from typing import Any, Awaitable, Callable, Sequence

import anyio

from .base import EngineClient, GenerateOutput, SamplingParams
from .gate import Gate, GateControl
from .lifecycle_owner import OwnerMixin
from .lifecycle_server import PROBE_ERRORS, TrackedServer, log
from .lifecycle_types import EngineState, LifecycleError, StageRecord

__all__ = ["FleetMixin"]


class FleetMixin(OwnerMixin):
    """Rotation, gates and stage fan-out of a `Lifecycle`."""

    gate: Gate
    _gates: list[GateControl]
    records: list[StageRecord]
    server_events: list[dict[str, Any]]
    gate_windows: list[list[float]]

    # ------------------------------------------------------------------ rotation
    @property
    def urls(self) -> list[str]:
        """Servers in rotation."""
        return [s.url for s in self._in_rotation()]

    @property
    def clients(self) -> list[EngineClient]:
        return [s.client for s in self._in_rotation()]

    @property
    def out_of_rotation(self) -> dict[str, str]:
        """Servers out of rotation now, with why."""
        return {u: s.out for u, s in self._servers.items() if s.out is not None}

    async def take_out(self, url: str, reason: str) -> None:
        """Take `url` out of rotation: out of every stage and every gate, until re-admitted."""
        s = self._servers.get(url)
        if s is None or s.out is not None:
            return
        s.out = reason
        self.server_events.append({"time": time.time(), "url": url, "event": "out", "reason": reason})
        log.warning("engine server %s out of rotation: %s", url, reason)
        for g in self._gates:
            await g.take_out(url, reason)

    async def _admit(self, s: TrackedServer) -> None:
        reason, s.out = s.out, None
        self.server_events.append({"time": time.time(), "url": s.url, "event": "in", "reason": f"re-admitted (was: {reason})"})
        log.warning("engine server %s back in rotation (was out: %s)", s.url, reason)
        for g in self._gates:
            await g.admit(s.url)

    def _no_server_left(self, stage: str) -> LifecycleError:
        why = "; ".join(f"{u}: {r}" for u, r in self.out_of_rotation.items())
        return LifecycleError(stage, f"no engine server left ({why})")

    async def _stage(self, phase: str, stage: str, fn: Callable[[TrackedServer], Awaitable[Any]],
                     servers: Sequence[TrackedServer] | None = None) -> None:
        start = time.monotonic()
        targets = list(servers) if servers is not None else self._in_rotation()
        await self._fan_out(stage, fn, targets)
        self.records.append(StageRecord(phase, stage, start, time.monotonic(), {"servers": len(targets)}))

    async def _fan_out(self, stage: str, fn: Callable[[TrackedServer], Awaitable[Any]], targets: Sequence[TrackedServer]) -> None:
        """Run `fn` on every target; servers that fail are taken out while others succeed. If every
        target fails, nothing is taken out and the error (naming each server) is raised."""
        if not targets:
            raise self._no_server_left(stage)
        errors: dict[str, LifecycleError] = {}

        async def one(s: TrackedServer) -> None:
            try:
                with anyio.fail_after(self.stage_timeout):
                    await fn(s)
            except LifecycleError as e:
                errors[s.url] = e
            except PROBE_ERRORS as e:
                errors[s.url] = LifecycleError(stage, str(e), url=s.url, cause=e)

        async with anyio.create_task_group() as tg:
            for s in targets:
                tg.start_soon(one, s)
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
    @property
    def on_generate(self) -> Callable[[str, EngineState], None] | None:
        """The local gate's dispatch hook (`on_generate(url, state)`), settable here as before the
        gate/lifecycle split so instrumentation written against the lifecycle keeps recording."""
        return self.gate.on_generate

    @on_generate.setter
    def on_generate(self, hook: Callable[[str, EngineState], None] | None) -> None:
        self.gate.on_generate = hook

    @property
    def generations_outside_awake(self) -> int:
        return self.gate.generations_outside_awake

    def add_gates(self, gates: GateControl) -> None:
        """Own more gates (Ray: every worker's, through the pool); they follow every later transition."""
        self._gates.append(gates)

    # The gate's road, for callers holding the lifecycle (the gate does the work).
    def in_flight(self, url: str | None = None) -> int:
        return self.gate.in_flight(url)

    async def wait_awake(self, timeout: float | None = None) -> None:
        await self.gate.wait_awake(timeout)

    async def generate(self, url: str, input_ids: Sequence[int], sampling_params: SamplingParams, **kw: Any) -> GenerateOutput:
        return await self.gate.generate(url, input_ids, sampling_params, **kw)

    async def health(self, url: str) -> bool:
        return await self.gate.health(url)

    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        """Abort on every server in rotation; raises naming a server that could not be told."""
        failed = await self.gate.abort(rid, abort_all=abort_all)
        if failed:
            url, e = failed[0]
            raise LifecycleError("abort", str(e), url=url, cause=e)

    async def _open_gates(self) -> None:
        if not self.gate_windows or len(self.gate_windows[-1]) == 2:
            self.gate_windows.append([time.time()])
        for g in self._gates:
            await g.open(self.weight_version)

    async def _close_gates(self) -> None:
        for g in self._gates:
            await g.close()
        if self.gate_windows and len(self.gate_windows[-1]) == 1:
            self.gate_windows[-1].append(time.time())
