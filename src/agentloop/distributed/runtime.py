"""`RayRuntime`: the same `Runtime` (same `step`, same `StepResult`), with its work spread over Ray.

This module owns the driver side of Ray mode. `RayRuntime` subclasses `Runtime` and inherits its one
step sequence (staged wake-up → roll out → collate → sleep); only *where* things run changes:

- **Engines** are `EngineServer` actors (`engines.py`): CPU engines for the embedded mode, SGLang
  servers on a placement group for `engine.launch`; `engine.urls` attaches to running servers.
- **One lifecycle over all engines, in the driver**: the `Lifecycle` that `Runtime.start` builds (no
  subclass). The `WorkerPool` is added to it as one more `GateControl`, so every transition moves every
  worker's gate too: `wake_up` opens the workers' gates only after the last stage finished on every
  engine, and `sleep` first closes every worker's gate (awaited) before it pauses any engine, then
  its settle stage waits for the workers' aborted requests too. So a worker can only dispatch while
  the driver's lifecycle is AWAKE; on top of that the driver hands out trajectories only inside
  `step` after `wake_up` returned.
- **The driver's scheduler is the ordinary `Scheduler`** (GRPO groups, over-sampling and early stop,
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

import dataclasses
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Sequence

import anyio
import ray
from ray import cloudpickle

from ..agents.base import AgentContext, AgentLoop
from ..config.settings import RayConfig, RuntimeConfig, SchedulerConfig
from ..engine.base import EngineClient
from ..engine.lifecycle import EngineState
from ..engine.router import RouteSession, Router
from ..runtime.core import AgentloopError, Runtime, StepResult
from ..scheduler.core import ScheduleResult, Scheduler
from ..types import Sample, Trajectory
from .engines import EngineFleet, EngineSpec
from .pool import PoolEvents, WorkerPool, default_capacity

log = logging.getLogger(__name__)

__all__ = ["RayConfig", "RayRuntime", "RayScheduler", "RemoteAgent"]


async def _keep_worker_reward(traj: Trajectory, job: Sample, *, timeout: float | None = None) -> float | None:
    """The driver's reward function: the worker already scored the trajectory; keep its value."""
    return traj.reward


class RemoteAgent(AgentLoop):
    """The driver's agent loop: bind the trajectory to a server, run it on a worker, return its result."""

    name = "ray-remote"

    def __init__(self, scheduler: "RayScheduler", agent: str) -> None:
        self.scheduler = scheduler
        self.agent = agent

    async def run(self, sample: Sample, ctx: AgentContext) -> Trajectory:
        session = ctx.generate
        if not isinstance(session, RouteSession):
            raise TypeError(f"RemoteAgent needs the driver's RouteSession as ctx.generate, got {type(session).__name__}")
        # Least-loaded live server over all workers' trajectories; the binding lasts for the trajectory.
        url = session.current_server()
        job = dataclasses.replace(sample, agent=self.agent)
        s = self.scheduler
        return await s.pool.run(job, url, session, s.worker_config, timeout=s.call_timeout)


class RayScheduler(Scheduler):
    """The ordinary scheduler, whose agent loops run on Ray workers (see the module docstring)."""

    def __init__(self, router: Router, pool: WorkerPool, **kwargs: Any) -> None:
        super().__init__(router, reward_fn=_keep_worker_reward, clock=time.time, **kwargs)
        self.pool = pool
        self.worker_config: dict[str, Any] = {}
        self.call_timeout: float | None = None

    def agent(self, name: str) -> AgentLoop:
        return RemoteAgent(self, name)

    async def run(self, samples: Sequence[Sample], *, on_trajectory: Any = None,
                  config: SchedulerConfig | None = None, more_samples: Any = None, on_group: Any = None) -> ScheduleResult:
        cfg = config or self.config
        self.worker_config = cfg.model_dump(mode="json")
        # Timeouts are the workers' job (they stop the trajectory and keep its partial result); the
        # driver only bounds a call to a worker that neither answers nor dies.
        self.call_timeout = (cfg.trajectory_timeout + cfg.abort_grace + 60.0) if cfg.trajectory_timeout else None
        driver_cfg = SchedulerConfig.model_validate({**cfg.model_dump(), "trajectory_timeout": None})
        self.pool.events = PoolEvents()
        result = await super().run(samples, on_trajectory=on_trajectory, config=driver_cfg, more_samples=more_samples,
                                   on_group=on_group)
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
    - `ray_config`: the Ray settings (default: `config.ray`); given, it replaces `config.ray`.
    Anything that cannot be sent raises TypeError here, naming the argument, before anything starts.
    """

    runs_on_ray = True

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
        super().__init__(cfg, clients=clients, tokenizer=tokenizer, tools=tools, interaction=interaction,
                         reward_fn=reward_fn, on_trajectory=on_trajectory)
        self.ray_config = cfg.ray
        self.tools_factory = tools_factory
        #: The caller's registry, sent to the workers (None: each worker builds its tools itself).
        self._given_tools = tools
        self.pool: WorkerPool | None = None
        self.fleet: EngineFleet | None = None
        self._owns_ray = False

    # ------------------------------------------------------------------ start / stop
    async def start(self) -> "RayRuntime":
        if self.started:
            return self
        rc = self.ray_config
        if not ray.is_initialized():
            _init_ray(rc)
            self._owns_ray = True
        # engines (as actors, below), tokenizer, the one lifecycle (engines put to sleep), then the
        # workers and the scheduler (`_build_scheduler`, below)
        await super().start()
        return self

    async def _build_scheduler(self) -> None:
        """The workers (whose gates the lifecycle then moves too), the driver's router and scheduler."""
        lc = self.lifecycle
        assert lc is not None and lc.state is EngineState.SLEEPING
        rc, cfg = self.ray_config, self.config
        scfg, ecfg = cfg.scheduler, cfg.engine
        tokenizer_ref = ray.put(self.tokenizer)
        tools_ref = ray.put(self._given_tools) if self._given_tools is not None else None
        cfg_json = cfg.model_dump(mode="json")
        all_urls = [c.url for c in self.clients]

        def make_args(index: int) -> tuple[Any, ...]:
            return (index, cfg_json, all_urls, lc.out_of_rotation, tokenizer_ref, self.tools_factory, self.reward_fn,
                    self.interaction, tools_ref)

        self.pool = WorkerPool(
            num_workers=rc.num_workers,
            capacity=rc.worker_capacity or default_capacity(scfg.concurrency, rc.num_workers),
            make_args=make_args,
            actor_options={"num_cpus": rc.worker_num_cpus},
            max_replacements=rc.max_worker_replacements,
            max_attempts=rc.max_worker_attempts,
            on_server_removed=self._server_removed,
        )
        await self.pool.ready(timeout=ecfg.start_timeout)
        lc.add_gates(self.pool)
        # The driver's router is the global balancer (it binds trajectories to servers); the per-server
        # limit is enforced by each worker's own router.
        self.router = Router(lc.gate, max_retries=scfg.max_turn_retries, failure_threshold=scfg.server_failure_threshold,
                             request_timeout=ecfg.request_timeout)
        self.scheduler = RayScheduler(
            self.router, self.pool, tokenizer=self.tokenizer, agent_config=cfg.agent,
            config=scfg, default_agent=cfg.agent.agent,
        )

    async def _shutdown(self) -> None:
        if self.pool is not None:
            await self.pool.shutdown()
            self.pool = None
        await super()._shutdown()  # closes clients, stops the engine fleet
        self.fleet = None
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False

    async def _start_embedded(self) -> None:
        ecfg, rc = self.config.engine, self.ray_config
        model = self._embedded_model()
        specs = [EngineSpec("local", str(model), extra_args=tuple(ecfg.local_args), host=rc.engine_host)
                 for _ in range(ecfg.num_local_servers)]
        await self._start_fleet(EngineFleet(specs, num_cpus=rc.engine_num_cpus, num_gpus=0.0))

    async def _launch(self) -> None:
        lc, rc = self.config.engine.launch, self.ray_config
        assert lc is not None
        if lc.gpu_ids is not None:
            log.warning("engine.launch.gpu_ids is ignored in Ray mode: Ray assigns GPUs (ray.engine_num_gpus per server)")
        self.model_path = lc.model_path
        specs = [EngineSpec("sglang", lc.model_path, extra_args=tuple(lc.flags), mem_fraction_static=lc.mem_fraction_static,
                            host=rc.engine_host) for _ in range(lc.num_servers)]
        await self._start_fleet(EngineFleet(specs, num_cpus=rc.engine_num_cpus, num_gpus=rc.engine_num_gpus,
                                            strategy=rc.placement_strategy))

    async def _start_fleet(self, fleet: EngineFleet) -> None:
        self.fleet = fleet
        self.processes.append(fleet)  # Runtime's shutdown stops it like any engine process
        urls = await fleet.start(timeout=self.config.engine.start_timeout)
        self.clients = [self._client(u) for u in urls]

    # ------------------------------------------------------------------ servers that die
    async def _server_removed(self, url: str, reason: str) -> None:
        """A worker took `url` out: take it out of the driver's lifecycle too (which tells every gate).
        Like a router, the driver keeps the last server in rotation; its failures fail the trajectories."""
        lc = self.lifecycle
        if lc is not None and url in lc.urls and len(lc.urls) > 1:
            await lc.take_out(url, reason)

    # ------------------------------------------------------------------ introspection
    async def worker_stats(self, *, times: bool = False) -> list[dict[str, Any]]:
        """Each live worker's gate state and counters; `times=True` adds the wall-clock times of its
        recent generate dispatches and gate changes (to check them against `lifecycle.gate_windows`)."""
        return await self.pool.stats(times=times) if self.pool is not None else []

    async def engine_info(self) -> list[dict[str, Any]]:
        """Where each engine server actor runs (node, GPUs, pid); empty when attached by URL."""
        return await self.fleet.info() if self.fleet is not None else []


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
