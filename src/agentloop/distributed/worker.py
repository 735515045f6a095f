"""Agent-loop workers as async Ray actors, each running the ordinary `Scheduler` over its own router.

This module owns what happens inside one worker process:

- The worker's **gate** is a plain `agentloop.engine.gate.Gate`: it never drives an engine; only the
  driver's `Lifecycle` moves it (through the `WorkerPool`, the lifecycle's `GateControl` for all
  workers): opened after the driver's staged wake-up completed on every engine, closed before the
  driver's sleep touches any engine. Every generate of the worker goes through it, so a worker cannot
  dispatch unless the driver's lifecycle is AWAKE, and it counts requests in flight per server, so
  the driver's sleep can wait for the workers' aborted requests to settle before it flushes and
  releases memory. It also judges every generate answer's weight version as the driver's gate does
  (`answer_check`, the driver's `Fleet.answer_check()`): an answer from a server that no longer carries
  the driver's lease (restarted, or taken by another runtime) is dropped and the server taken out
  here; the trajectory's result reports it, so the driver takes it out everywhere.
- `PinnedRouter`: the ordinary `Router` (retries on another server, dead-server removal, per-server
  limit, gate) whose trajectories start on the server the driver's global balancer chose for them,
  and which can stop one trajectory by uid (the driver's early stop or a sleep mid-step).
- `RolloutWorker`: the actor. `run(job, url, cfg)` runs one trajectory through `Scheduler.run` (agent
  loop, timeouts, failure isolation, reward, step watchdog) and returns it; many `run` calls are in
  flight at once on the actor's event loop. Its router, scheduler and tools are built by
  `agentloop.runtime.assembly` (as the driver's `Runtime` builds its own) and its clients by
  `runtime.engines.make_client`, unless the driver's caller gave a tool registry (unpickled here as
  this worker's own copy) or a `tools_factory`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Callable, Mapping

from ..allocator import tune_allocator
from ..config.settings import RuntimeConfig, SchedulerConfig
from ..engine.gate import Gate
from ..engine.memory_mark import AnswerCheck
from ..engine.router import RouteSession, Router
from ..runtime.assembly import load_tools, make_router, make_scheduler
from ..runtime.engines import make_client
from ..types import Sample

log = logging.getLogger(__name__)

__all__ = ["PinnedRouter", "RolloutWorker"]


class PinnedRouter(Router):
    """`Router` whose trajectories start on the server the driver chose (`pin`), stoppable by uid."""

    def __init__(self, gate: Gate, **kwargs: Any) -> None:
        super().__init__(gate, **kwargs)
        self._pins: dict[str, str] = {}
        self._stops: dict[str, str] = {}
        self.sessions: dict[str, RouteSession] = {}

    def pin(self, key: str, url: str) -> None:
        self._pins[key] = url

    def session(self, key: str, **kwargs: Any) -> RouteSession:
        s = super().session(key, **kwargs)
        url = self._pins.pop(key, None)
        if url is not None and url in self.urls:
            s.bind_to(url)  # the driver's balancer bound the trajectory here; RouteSession keeps it sticky
        self.sessions[key] = s
        if key in self._stops:  # the stop arrived before the trajectory started
            s.stop(self._stops.pop(key))
        return s

    def forget(self, key: str) -> None:
        self.sessions.pop(key, None)
        self._stops.pop(key, None)
        self._pins.pop(key, None)

    async def stop_trajectory(self, key: str, reason: str) -> None:
        """Stop one trajectory: nothing more is dispatched and its in-flight request is aborted by rid."""
        s = self.sessions.get(key)
        if s is None:
            self._stops[key] = reason
            return
        await self.stop_sessions([s], reason)


class RolloutWorker:
    """Ray actor body (async): runs trajectories handed out by the driver's `WorkerPool`."""

    def __init__(
        self,
        index: int,
        config: dict[str, Any],
        urls: list[str],
        out: Mapping[str, str],
        tokenizer: Any,
        tools_factory: Callable[[RuntimeConfig], Any] | None = None,
        reward_fn: Callable[..., Any] | None = None,
        interaction: Any = None,
        tools: Any = None,
        answer_check: AnswerCheck | None = None,
    ) -> None:
        tune_allocator()  # this actor's process holds the trajectories' big buffers (`agentloop.allocator`)
        self.index = index
        self.config = RuntimeConfig.model_validate(config)
        self.clients = [make_client(u, self.config.engine) for u in urls]
        #: Wall-clock time of each recent generate dispatch (for checks against the driver's AWAKE windows).
        self.dispatch_times: deque[float] = deque(maxlen=100_000)
        #: Servers this worker's gate took out itself (an answer `answer_check` judged not the driver's),
        #: reported with each trajectory so the driver takes them out too.
        self.taken_out: dict[str, str] = {}
        self.gate = Gate(self.clients, out=out, on_generate=lambda url, state: self.dispatch_times.append(time.time()),
                         on_take_out=self._taken_out, check_answer=answer_check)
        # wall clock: timelines from workers on different machines line up
        self.router = make_router(self.gate, self.config, router_cls=PinnedRouter, clock=time.time)
        if tools is None:  # the driver's caller gave no registry: build this worker's own
            tools = tools_factory(self.config) if tools_factory is not None else load_tools(self.config)
        self.scheduler = make_scheduler(self.router, self.config, tokenizer=tokenizer, tools=tools,
                                        interaction=interaction, reward_fn=reward_fn, clock=time.time)
        self.jobs_run = 0

    async def _taken_out(self, url: str, reason: str) -> None:
        self.taken_out[url] = reason

    async def ready(self) -> int:
        return self.index

    # ------------------------------------------------------------------ the gate (moved by the driver's lifecycle)
    async def open_gate(self, weight_version: str | None) -> None:
        await self.gate.open(weight_version)

    async def close_gate(self, for_update: bool = False) -> int:
        return await self.gate.close(for_update=for_update)

    async def wait_settled(self, url: str, timeout: float) -> int:
        return await self.gate.wait_settled(url, timeout)

    async def mark_sleeping(self) -> None:
        await self.gate.mark_sleeping()

    async def take_out(self, url: str, reason: str) -> None:
        """The driver took `url` out of rotation: stop routing there (requests on it are retried elsewhere)."""
        await self.gate.take_out(url, reason)

    async def admit(self, url: str) -> None:
        """The driver re-admitted `url`: it is no longer reported as taken out (each trajectory's result
        carries what this worker took out, which the driver takes out too)."""
        self.taken_out.pop(url, None)
        self.router.stats.removed.pop(url, None)
        await self.gate.admit(url)

    # ------------------------------------------------------------------ work
    async def run(self, job: Sample, url: str, cfg: dict[str, Any]) -> dict[str, Any]:
        """Run one trajectory starting on `url`; returns it with what this worker learned about servers.

        `cfg` is the step's scheduler config; the driver already expanded groups and handles
        over-sampling, so the worker runs exactly this member and always hands back its trajectory
        (partial if it was stopped) for the driver's scheduler to classify.
        """
        # Groups, over-admission and the staleness bound are the driver's (it saw every version in order).
        scfg = SchedulerConfig.model_validate({**cfg, "target_groups": None, "group_filter": None, "partial_rollout": True,
                                               "n": 1, "active": None, "max_staleness": None})
        self.router.pin(job.uid, url)
        try:
            res = await self.scheduler.run([job], config=scfg)
        finally:
            self.router.forget(job.uid)
        self.jobs_run += 1
        traj = res.trajectories[0] if res.trajectories else res.carry_over[0].resume_from
        if traj is None:  # cannot happen for a started job; say so instead of returning nothing
            raise RuntimeError(f"worker {self.index}: trajectory {job.uid} produced no result")
        traj.extra["worker"] = self.index
        return {"trajectory": traj, "removed": {**self.taken_out, **self.router.stats.removed}, "worker": self.index}

    async def stop_trajectory(self, uid: str, reason: str) -> None:
        await self.router.stop_trajectory(uid, reason)

    async def stats(self, times: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "worker": self.index,
            "jobs_run": self.jobs_run,
            "gate": self.gate.state.value,
            "in_flight": self.gate.in_flight(),
            "generations_outside_awake": self.gate.generations_outside_awake,
            "servers": self.gate.urls,
            "per_server_limit": self.router.per_server_limit,  #: this worker's share of scheduler.per_server_concurrency
        }
        if times:
            out.update(dispatch_times=list(self.dispatch_times), gate_opened_at=list(self.gate.opened_at),
                       gate_closed_at=list(self.gate.closed_at))
        return out

    async def shutdown(self) -> None:
        await self.scheduler.aclose()  # agent loops' own resources (the openai loop's endpoint server)
        for c in self.clients:
            await c.close()
