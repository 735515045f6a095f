"""`RayRuntime`: the same `Runtime` (same `step`, same `StepResult`), with its work spread over Ray.

This module owns the driver side of Ray mode. `RayRuntime` is `Runtime` (its one step sequence: staged
wake-up → roll out → collate → sleep) given two strategies; only *where* things run changes:

- **Engines** (`engines.ray_engine_backend`) are `EngineServer` actors (`RayFleetEngines`): CPU engines
  for the embedded mode, SGLang servers on a placement group for `engine.launch`; `engine.urls`
  attaches to running servers.
- **Agent loops** (`RayRollout`): joins or starts Ray before any engine actor, then starts the
  `WorkerPool` once the engines sleep, and puts the driver's router and `RayScheduler` over it.
- **One lifecycle over all engines, in the driver**: the `Lifecycle` that `Runtime.start` builds (no
  subclass). The `WorkerPool` is added to it as one more `GateControl`, so every transition moves every
  worker's gate too: `wake_up` opens the workers' gates only after the last stage finished on every
  engine, and `sleep` first closes every worker's gate (awaited) before it pauses any engine, then
  its settle stage waits for the workers' aborted requests too. So a worker can only dispatch while
  the driver's lifecycle is AWAKE; on top of that the driver hands out trajectories only inside
  `step` after `wake_up` returned.
- **The driver's scheduler is the ordinary `Scheduler`**, one per step (`RayScheduler`) (GRPO groups, over-sampling and early stop,
  carry-over, results in input order, metrics), whose agent loop is a `RemoteAgent`: it binds the
  trajectory to a server with the driver's `Router` (least-loaded over every worker's trajectories,
  sticky for the trajectory's life: this router *is* the global load balancer) and has the
  `WorkerPool` run it on whichever worker has a free slot. The worker runs the real agent loop
  through its own `Scheduler` (timeouts, failure isolation, reward) and hands back the trajectory.
- **Faults**: a worker that dies mid-step has its unfinished trajectories re-run elsewhere; a server
  that dies is taken out (by the worker that saw it fail, or by the lifecycle's liveness probe before
  each wake-up and sleep) and re-admitted when it answers again. The step's metrics say what was
  retried (`retried`), which workers died (`worker_deaths`) and which servers were taken out
  (`servers_removed`), at the top level and, with the rest of the Ray counters, under `metrics["ray"]`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Sequence

import ray
from ray import cloudpickle

from ..agents.base import AgentContext, AgentLoop
from ..config.settings import RayConfig, RuntimeConfig, SchedulerConfig
from ..engine.base import EngineClient
from ..engine.lifecycle import EngineState
from ..engine.router import RouteSession, Router
from ..runtime.backends import EngineBackend
from ..runtime.assembly import RolloutParts, make_router, make_scheduler, on_teardown
from ..runtime.core import AgentloopError, Runtime
from ..scheduler.staleness import VersionLog
from ..scheduler.core import ScheduleResult, Scheduler
from ..scheduler.watchdog import Watchdog
from ..types import Sample, Trajectory
from .engines import EngineFleet, ray_engine_backend
from .pool import PoolEvents, WorkerPool, default_capacity

log = logging.getLogger(__name__)

__all__ = ["RayRollout", "RayRuntime", "RayScheduler", "RemoteAgent", "RemoteStep", "worker_config"]


async def _keep_worker_reward(traj: Trajectory, job: Sample, *, timeout: float | None = None) -> float | None:
    """The driver's reward function: the worker already scored the trajectory; keep its value."""
    return traj.reward


@dataclass(frozen=True)
class RemoteStep:
    """One step's settings as the driver and the workers see them (built from the step's scheduler config).

    Timeouts are the workers' job (they stop the trajectory and keep its partial result), so the
    driver's own scheduler runs without `trajectory_timeout` and only bounds a call to a worker that
    neither answers nor dies (`call_timeout`)."""

    worker_config: dict[str, Any]  #: the step's scheduler config, sent with every trajectory
    driver_config: SchedulerConfig
    call_timeout: float | None

    @classmethod
    def of(cls, cfg: SchedulerConfig) -> "RemoteStep":
        call_timeout = (cfg.trajectory_timeout + cfg.abort_grace + 60.0) if cfg.trajectory_timeout else None
        return cls(cfg.model_dump(mode="json"), cfg.model_copy(update={"trajectory_timeout": None}), call_timeout)


class RemoteAgent(AgentLoop):
    """The driver's agent loop: bind the trajectory to a server, run it on a worker, return its result."""

    name = "ray-remote"

    def __init__(self, pool: WorkerPool, agent: str, step: RemoteStep) -> None:
        self.pool = pool
        self.agent = agent
        self.step = step

    async def run(self, sample: Sample, ctx: AgentContext) -> Trajectory:
        session = ctx.generate
        if not isinstance(session, RouteSession):
            raise TypeError(f"RemoteAgent needs the driver's RouteSession as ctx.generate, got {type(session).__name__}")
        # Least-loaded live server over all workers' trajectories; the binding lasts for the trajectory.
        url = session.current_server()
        job = dataclasses.replace(sample, agent=self.agent)
        return await self.pool.run(job, url, session, self.step.worker_config, timeout=self.step.call_timeout)


class RayScheduler:
    """The driver's scheduler: each step, the ordinary `Scheduler` (groups, over-sampling, carry-over,
    results in input order) whose agent loops are `RemoteAgent`s carrying that step's `RemoteStep`;
    the step's metrics get the Ray counters (see the module docstring)."""

    def __init__(self, router: Router, pool: WorkerPool, config: RuntimeConfig, tokenizer: Any) -> None:
        self.router = router
        self.pool = pool
        self.config = config
        self.tokenizer = tokenizer
        self._running: list[Scheduler] = []
        self.versions = VersionLog()

    async def run(self, samples: Sequence[Sample], *, on_trajectory: Any = None,
                  config: SchedulerConfig | None = None, more_samples: Any = None, on_group: Any = None,
                  watch_servers: bool = True) -> ScheduleResult:
        step = RemoteStep.of(config or self.config.scheduler)
        sched = make_scheduler(self.router, self.config, tokenizer=self.tokenizer, reward_fn=_keep_worker_reward,
                               clock=time.time, agents=lambda name: RemoteAgent(self.pool, name, step))
        sched.versions = self.versions  # the weight versions of every step, in order (staleness)
        self.pool.events = PoolEvents()
        self._running.append(sched)
        try:
            result = await sched.run(samples, on_trajectory=on_trajectory, config=step.driver_config,
                                     more_samples=more_samples, on_group=on_group, watch_servers=watch_servers)
        finally:
            self._running.remove(sched)
        stats = await self.pool.stats()
        ev = self.pool.events
        retried, deaths = list(ev.retried), list(ev.worker_deaths)
        # The same objects at the top level (where a trainer looks first) and under "ray".
        removed = result.metrics.setdefault("servers_removed", {})
        result.metrics["retried"] = retried
        result.metrics["worker_deaths"] = deaths
        result.metrics["ray"] = {
            "workers_alive": len(self.pool.workers),
            "jobs_per_worker": dict(ev.jobs_per_worker),
            "retried": retried,
            "worker_deaths": deaths,
            "workers_replaced": list(ev.replaced),
            "servers_removed": removed,
            "worker_generations_outside_awake": sum(s["generations_outside_awake"] for s in stats),
        }
        return result

    def server_watchdog(self) -> Any:
        """`Scheduler.server_watchdog` over the driver's router (the servers are the driver's to judge)."""
        return Watchdog.servers_only(self.router, self.config.engine.hung_timeout, clock=time.time)

    def stop(self, reason: str = "stopped") -> None:
        """Stop the running step (see `Scheduler.stop`); the workers' trajectories are stopped through their sessions."""
        for sched in self._running:
            sched.stop(reason)

    async def aclose(self) -> None:
        """Nothing to release: the agent loops' resources live on the workers (`WorkerPool.shutdown`)."""


class RayRollout:
    """Where a `RayRuntime`'s agent loops run: the `WorkerPool`'s actors (the `RolloutBackend` for Ray).

    `open` joins (or starts, and then at stop shuts down) Ray before any engine actor is placed;
    `build` starts the workers, adds them to the lifecycle's gates, and puts the driver's router (the
    global balancer; the per-server limit is each worker's) and `RayScheduler` over them."""

    def __init__(self, config: RuntimeConfig, *, tools: Any = None,
                 tools_factory: Callable[[RuntimeConfig], Any] | None = None) -> None:
        self.ray_config = config.ray
        #: The caller's registry, sent to the workers (None: each worker builds its tools itself).
        self.tools = tools
        self.tools_factory = tools_factory
        self.pool: WorkerPool | None = None

    async def open(self, stack: contextlib.AsyncExitStack) -> None:
        if not ray.is_initialized():
            _init_ray(self.ray_config)
            stack.callback(ray.shutdown)

    async def build(self, parts: RolloutParts, stack: contextlib.AsyncExitStack) -> tuple[Router, RayScheduler]:
        lc = parts.lifecycle
        assert lc.state is EngineState.SLEEPING
        rc, cfg = self.ray_config, parts.config
        tokenizer_ref = ray.put(parts.tokenizer)
        tools_ref = ray.put(self.tools) if self.tools is not None else None
        cfg_json = worker_config(cfg, rc.num_workers).model_dump(mode="json")
        all_urls = [c.url for c in parts.clients]
        answer_check = lc.fleet.answer_check()  # the servers are attached (leased) by now

        def make_args(index: int) -> tuple[Any, ...]:
            return (index, cfg_json, all_urls, lc.out_of_rotation, tokenizer_ref, self.tools_factory, parts.reward_fn,
                    parts.interaction, tools_ref, answer_check)

        async def server_removed(url: str, reason: str) -> None:
            """A worker took `url` out: take it out of the driver's lifecycle too (which tells every gate).
            Like a router, the driver keeps the last server in rotation; its failures fail the trajectories."""
            if url in lc.urls and len(lc.urls) > 1:
                await lc.take_out(url, reason)

        pool = self.pool = WorkerPool(
            num_workers=rc.num_workers,
            capacity=rc.worker_capacity or default_capacity(cfg.scheduler.concurrency, rc.num_workers),
            make_args=make_args,
            actor_options={"num_cpus": rc.worker_num_cpus},
            max_replacements=rc.max_worker_replacements,
            max_attempts=rc.max_worker_attempts,
            on_server_removed=server_removed,
        )
        on_teardown(stack, "stopping the Ray workers", self._stop_pool)
        await pool.ready(timeout=cfg.engine.start_timeout)
        lc.add_gates(pool)
        router = make_router(lc.gate, cfg, per_server=False)
        return router, RayScheduler(router, pool, cfg, parts.tokenizer)

    async def _stop_pool(self) -> None:
        pool, self.pool = self.pool, None
        if pool is not None:
            await pool.shutdown()


class RayRuntime(Runtime):
    """`Runtime` on Ray. `async with RayRuntime(cfg) as rt: await rt.step(...)`.

    Takes every argument `Runtime` takes, with the same meaning; what the workers need is sent to
    them (they are other processes, possibly on other machines), so it must be picklable by Ray
    (cloudpickle: module-level functions and classes, plain data; no locks, sockets or open files):

    - `tools`: a `ToolRegistry` (each worker gets its own copy, built from the pickled registry), or the
      path of a tools YAML file (sets `agent.tools`: every worker loads it; the path must exist on
      every node). Or `tools_factory(config) -> ToolRegistry`, called once in each worker, for tools
      that cannot be pickled. Neither: the tools of `agent.tools` / the built-in ones, as in local mode.
    - `reward_fn`, `interaction`: shipped to every worker. `tokenizer`: sent once through the object store.
    - `clients`: the driver's clients of running servers; workers connect to the same URLs.
    - `engines`: an engine backend of your own (default: `ray_engine_backend(config, clients)`).
    - `ray_config`: the Ray settings (default: `config.ray`); given, it replaces `config.ray`.
    Anything that cannot be sent raises TypeError here, naming the argument, before anything starts.

    It is `Runtime` given the Ray strategies: `ray_engine_backend` (engine actors, or the URLs/clients
    given) and `RayRollout` (the workers); it adds only introspection.
    """

    def __init__(
        self,
        config: RuntimeConfig | Mapping[str, Any] | None = None,
        *,
        clients: Sequence[EngineClient] | None = None,
        tokenizer: Any = None,
        tools: Any = None,
        interaction: Any = None,
        reward_fn: Callable[..., Awaitable[Any]] | None = None,
        on_trajectory: Any = None,
        engines: EngineBackend | None = None,
        ray_config: RayConfig | Mapping[str, Any] | None = None,
        tools_factory: Callable[[RuntimeConfig], Any] | None = None,
    ) -> None:
        cfg = config if isinstance(config, RuntimeConfig) else RuntimeConfig.model_validate(config or {})
        if ray_config is not None:
            rc = ray_config if isinstance(ray_config, RayConfig) else RayConfig.model_validate(ray_config)
            cfg = cfg.model_copy(update={"ray": rc})  # a copy: the caller's config object is left as given
        if tools is not None and tools_factory is not None:
            raise TypeError("RayRuntime: give `tools` or `tools_factory`, not both")
        if isinstance(tools, (str, os.PathLike)):
            path = Path(tools)
            if not path.is_file():
                raise FileNotFoundError(f"RayRuntime(tools={str(tools)!r}): no such tools YAML file")
            cfg = cfg.model_copy(update={"agent": cfg.agent.model_copy(update={"tools": str(path.resolve())})})
            tools = None
        for name, value, hint in (
            ("tools", tools, "pass tools_factory=<module-level function building the registry> or a tools YAML path"),
            ("tools_factory", tools_factory, "use a module-level function"),
            ("reward_fn", reward_fn, "use a module-level function"),
            ("interaction", interaction, "use an object of a module-level class holding plain data"),
        ):
            _check_shippable(name, value, hint)
        self.ray_rollout = RayRollout(cfg, tools=tools, tools_factory=tools_factory)
        super().__init__(cfg, tokenizer=tokenizer, tools=tools, interaction=interaction, reward_fn=reward_fn,
                         on_trajectory=on_trajectory, rollout=self.ray_rollout,
                         engines=engines if engines is not None else ray_engine_backend(cfg, clients))
        self.ray_config = cfg.ray
        self.tools_factory = tools_factory

    @property
    def pool(self) -> WorkerPool | None:
        """The rollout workers (None before start and after stop)."""
        return self.ray_rollout.pool

    @property
    def fleet(self) -> EngineFleet | None:
        """The engine server actors this runtime started (None when attached by URL)."""
        return getattr(self.engines, "fleet", None)

    # ------------------------------------------------------------------ introspection
    async def worker_stats(self, *, times: bool = False) -> list[dict[str, Any]]:
        """Each live worker's gate state and counters; `times=True` adds the wall-clock times of its
        recent generate dispatches and gate changes (to check them against `lifecycle.gate_windows`)."""
        return await self.pool.stats(times=times) if self.pool is not None else []

    async def engine_info(self) -> list[dict[str, Any]]:
        """Where each engine server actor runs (node, GPUs, pid); empty when attached by URL."""
        return await self.fleet.info() if self.fleet is not None else []


def worker_config(cfg: RuntimeConfig, num_workers: int) -> RuntimeConfig:
    """The config each rollout worker builds from: `scheduler.per_server_concurrency` split evenly over the
    workers (each worker's router holds its own slots), so the workers together send a server at most the
    limit (its decode CUDA graphs' batch, with `auto`) rather than `num_workers` times it. A share is at least 1."""
    limit = cfg.scheduler.per_server_concurrency
    if not isinstance(limit, int) or num_workers <= 1:
        return cfg
    share = max(1, limit // num_workers)
    if share * num_workers != limit:
        log.info("scheduler.per_server_concurrency %d over %d Ray workers: %d per worker (%d in all)",
                 limit, num_workers, share, share * num_workers)
    return cfg.model_copy(update={"scheduler": cfg.scheduler.model_copy(update={"per_server_concurrency": share})})


def _check_shippable(name: str, value: Any, hint: str) -> None:
    """Raise TypeError naming `name` if Ray cannot send `value` to the workers (it uses cloudpickle)."""
    if value is None:
        return
    try:
        cloudpickle.dumps(value)
    except Exception as e:
        raise TypeError(f"RayRuntime({name}=...): this {type(value).__name__} cannot be sent to the Ray workers, "
                        f"which are separate processes ({type(e).__name__}: {e}); {hint}") from None


def _init_ray(rc: RayConfig) -> None:
    """`ray.init`, keeping the process's own SIGTERM handler.

    `ray.init` sets SIGTERM to `sys.exit` in the main thread. A handler the process installed itself
    (a trainer's, or an event loop's signal receiver, like `agentloop rollout`'s graceful stop that
    aborts requests and writes partial trajectories) is put back; the default one stays Ray's."""
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if main else None
    try:
        ray.init(address=rc.address, **rc.init_kwargs)
    except Exception as e:  # no cluster at the address, arguments Ray refuses, ...: say which settings
        raise AgentloopError(f"cannot start or join Ray (ray.address={rc.address!r}, ray.init_kwargs={rc.init_kwargs}): "
                            f"{type(e).__name__}: {e}") from e
    if main and callable(before):
        signal.signal(signal.SIGTERM, before)
