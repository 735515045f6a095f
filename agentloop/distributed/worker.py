"""Agent-loop workers as async Ray actors, each running the ordinary `Scheduler` over its own router.

This module owns what happens inside one worker process:

- `WorkerGate`: the worker's copy of the lifecycle gate. It is a `Lifecycle` whose state only the
  driver sets (`open` after the driver's staged wake-up completed on every engine, `close` before the
  driver's sleep touches any engine); it never releases, resumes or loads anything itself. Every
  generate of the worker goes through `WorkerGate.generate`, so a worker cannot dispatch unless the
  driver's lifecycle is AWAKE. It counts requests in flight per server, so the driver's sleep can wait
  for the workers' aborted requests to settle before it flushes and releases memory.
- `PinnedRouter`: the ordinary `Router` (retries on another server, dead-server removal, per-server
  limit, gate) whose trajectories start on the server the driver's global balancer chose for them,
  and which can stop one trajectory by uid (the driver's early stop or a sleep mid-step).
- `RolloutWorker`: the actor. `run(job, url, cfg)` runs one trajectory through `Scheduler.run` (agent
  loop, timeouts, failure isolation, reward) and returns it; many `run` calls are in flight at once
  on the actor's event loop. Tools, tokenizer and agents are built once per worker (tools: the
  registry the driver's caller gave, unpickled here as this worker's own copy; else `tools_factory`;
  else `agent.tools` / the built-in ones).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Callable, Sequence

import anyio

from ..config import RuntimeConfig, SchedulerConfig
from ..engine.base import EngineClient
from ..engine.lifecycle import EngineState, Lifecycle, LifecycleError
from ..engine.router import RouteSession, Router
from ..scheduler import Scheduler
from ..types import Sample

log = logging.getLogger(__name__)

__all__ = ["PinnedRouter", "RolloutWorker", "WorkerGate"]


class WorkerGate(Lifecycle):
    """The gate of one worker, following the driver's lifecycle (see the module docstring)."""

    def __init__(self, clients: Sequence[EngineClient], **kwargs: Any) -> None:
        super().__init__(clients, awake=False, **kwargs)
        for s in self._servers.values():
            s.released = set()  # memory is the driver's business; the gate only tracks AWAKE or not
        self.opened_at: deque[float] = deque(maxlen=1000)
        self.closed_at: deque[float] = deque(maxlen=1000)

    def open(self, weight_version: str | None) -> None:
        """The driver's lifecycle is AWAKE with `weight_version`: let generations through."""
        self.weight_version = weight_version
        self.opened_at.append(time.time())
        self._set_state(EngineState.AWAKE)

    def close(self) -> int:
        """The driver is about to sleep: new generations wait from now on. Returns requests in flight."""
        if self._state is EngineState.AWAKE:
            self.closed_at.append(time.time())
        self._set_state(EngineState.DRAINING)
        return self.in_flight()

    def mark_sleeping(self) -> None:
        self._set_state(EngineState.SLEEPING)

    async def wait_settled(self, url: str, timeout: float) -> int:
        """Wait until no request of this worker is in flight on `url`; returns how many still are."""
        server = self._servers.get(url)
        if server is None:
            return 0
        with anyio.move_on_after(timeout):
            while server.in_flight > 0:
                server.settled = anyio.Event()
                await server.settled.wait()
        return server.in_flight

    async def wake_up(self, weights: Any = None) -> str | None:
        raise LifecycleError("wake_up", "a worker's gate follows the driver's lifecycle; wake the engines from the driver")

    async def sleep(self) -> None:
        raise LifecycleError("sleep", "a worker's gate follows the driver's lifecycle; put the engines to sleep from the driver")


class PinnedRouter(Router):
    """`Router` whose trajectories start on the server the driver chose (`pin`), stoppable by uid."""

    def __init__(self, lifecycle: Lifecycle, **kwargs: Any) -> None:
        super().__init__(lifecycle, **kwargs)
        self._pins: dict[str, str] = {}
        self._stops: dict[str, str] = {}
        self.sessions: dict[str, RouteSession] = {}

    def pin(self, key: str, url: str) -> None:
        self._pins[key] = url

    def session(self, key: str) -> RouteSession:
        s = super().session(key)
        url = self._pins.pop(key, None)
        if url is not None and url in self.urls:
            s.url = url  # the driver's balancer bound the trajectory here; RouteSession keeps it sticky
            self._bind(url)
            s.servers.append(url)
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
        s.stop(reason)
        # A request dispatched just before the stop may not be registered on its server yet: repeat the
        # abort until the session has nothing in flight (as the scheduler does for its own stops).
        while s.in_flight_rid is not None:
            await self.abort([s.in_flight_rid])
            await anyio.sleep(0.2)


class RolloutWorker:
    """Ray actor body (async): runs trajectories handed out by the driver's `WorkerPool`."""

    def __init__(
        self,
        index: int,
        config: dict[str, Any],
        urls: list[str],
        tokenizer: Any,
        tools_factory: Callable[[RuntimeConfig], Any] | None = None,
        reward_fn: Callable[..., Any] | None = None,
        interaction: Any = None,
        tools: Any = None,
    ) -> None:
        from ..runtime import Runtime

        self.index = index
        self.config = RuntimeConfig.model_validate(config)
        ecfg, scfg = self.config.engine, self.config.scheduler
        # Not started: only its client and default-tools recipes are used. This worker is the in-process
        # side of Ray mode, so the recipe object is built without the Ray section.
        local = Runtime(self.config.model_copy(update={"ray": self.config.ray.model_copy(update={"enabled": False})}))
        self.clients = [local._client(u) for u in urls]
        #: Wall-clock time of each recent generate dispatch (for checks against the driver's AWAKE windows).
        self.dispatch_times: deque[float] = deque(maxlen=100_000)
        self.gate = WorkerGate(self.clients, settle_timeout=ecfg.settle_timeout,
                               on_generate=lambda url, state: self.dispatch_times.append(time.time()))
        self.router = PinnedRouter(
            self.gate,
            per_server_limit=scfg.per_server_concurrency,
            max_retries=scfg.max_turn_retries,
            failure_threshold=scfg.server_failure_threshold,
            request_timeout=ecfg.request_timeout,
            clock=time.time,  # wall clock: timelines from workers on different machines line up
        )
        if tools is None:  # the driver's caller gave no registry: build this worker's own
            tools = tools_factory(self.config) if tools_factory is not None else local._load_tools()
        self.scheduler = Scheduler(
            self.router,
            tokenizer=tokenizer,
            agent_config=self.config.agent,
            config=scfg,
            tools=tools,
            interaction=interaction,
            default_agent=self.config.agent.agent,
            reward_fn=reward_fn,
            clock=time.time,
        )
        self.jobs_run = 0

    async def ready(self) -> int:
        return self.index

    # ------------------------------------------------------------------ the gate (set by the driver)
    async def open_gate(self, weight_version: str | None) -> None:
        self.gate.open(weight_version)

    async def close_gate(self) -> int:
        return self.gate.close()

    async def wait_settled(self, url: str, timeout: float) -> int:
        return await self.gate.wait_settled(url, timeout)

    async def mark_sleeping(self) -> None:
        self.gate.mark_sleeping()

    async def remove_server(self, url: str, reason: str) -> None:
        """The driver took `url` out (dead): stop routing there."""
        if url in self.gate.urls and len(self.gate.urls) > 1:
            self.gate.remove_server(url)
            self.router.stats.removed.setdefault(url, reason)

    # ------------------------------------------------------------------ work
    async def run(self, job: Sample, url: str, cfg: dict[str, Any]) -> dict[str, Any]:
        """Run one trajectory starting on `url`; returns it with what this worker learned about servers.

        `cfg` is the step's scheduler config; the driver already expanded groups and handles
        over-sampling, so the worker runs exactly this member and always hands back its trajectory
        (partial if it was stopped) for the driver's scheduler to classify.
        """
        scfg = SchedulerConfig.model_validate({**cfg, "target_groups": None, "group_filter": None, "partial_rollout": True, "n": 1})
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
        return {"trajectory": traj, "removed": dict(self.router.stats.removed), "worker": self.index}

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
        }
        if times:
            out.update(dispatch_times=list(self.dispatch_times), gate_opened_at=list(self.gate.opened_at),
                       gate_closed_at=list(self.gate.closed_at))
        return out

    async def shutdown(self) -> None:
        await self.scheduler.aclose()  # agent loops' own resources (the openai loop's endpoint server)
        for c in self.clients:
            await c.close()
