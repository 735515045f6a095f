"""Engine servers as Ray actors: the CPU reference engine or SGLang, one server process per actor.

This module owns *where engine servers run*. An `EngineServer` actor starts one server process on
its node and exposes the server's URL; everything afterwards (generate, the lifecycle's
release/resume/weight loads) goes straight to that URL over HTTP with `SGLangClient`, never through
the actor, so the actor is not on the hot path.

- `kind="local"`: the CPU reference engine (`LocalEngineProcess`, i.e. `agentloop serve`).
- `kind="sglang"`: `python -m sglang.launch_server` through `agentloop.engine.launch.SGLangServer`.
  Ray sets `CUDA_VISIBLE_DEVICES` for an actor that asks for `num_gpus`, and the server inherits it,
  so two servers with `num_gpus=0.5` share one GPU. They start one after another (see
  `agentloop.engine.launch.start_by_gpu`): each one's `mem_fraction_static` is SGLang's, a fraction of the GPU memory
  free when that server starts (0.3 and 0.3 on an empty GPU: by SGLang's formula ~30% and ~21% of it).

`EngineFleet` starts servers on different GPUs concurrently. GPU servers are placed on one placement group (a bundle
of `{"GPU": num_gpus, "CPU": num_cpus}` per server, strategy PACK by default) so the fleet is
reserved atomically: all servers get their GPUs or none start. Servers bind `127.0.0.1` unless
`host="node"`, which binds the node's cluster IP so workers on other machines can reach them.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Sequence

import anyio
import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..config.settings import RuntimeConfig
from ..engine.base import EngineClient
from ..engine.launch import start_by_gpu
from ..runtime.backends import EngineBackend, GivenClients, UrlEngines, close_and_stop
from ..runtime.engines import embedded_model, make_client

log = logging.getLogger(__name__)

__all__ = ["EngineFleet", "EngineServer", "EngineSpec", "RayFleetEngines", "ray_engine_backend"]


@dataclass
class EngineSpec:
    """What one engine server actor runs. `launch` holds extra `SGLangLaunchConfig` fields (sglang only)."""

    kind: Literal["local", "sglang"]
    model_path: str
    extra_args: Sequence[str] = ()
    mem_fraction_static: float | None = None
    launch: dict[str, Any] = field(default_factory=dict)
    host: str = "127.0.0.1"  # "node": the node's cluster IP (reachable from other machines)
    log_path: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("local", "sglang"):
            raise ValueError(f"EngineSpec.kind must be 'local' or 'sglang', got {self.kind!r}")


class EngineServer:
    """Ray actor body: one engine server process on this actor's node (created by `EngineFleet`)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = EngineSpec(**spec)
        self.proc: Any = None
        self._url: str | None = None
        self._start_window: tuple[float, float] | None = None

    async def start(self, timeout: float) -> str:
        t0 = time.time()
        s = self.spec
        host = ray.util.get_node_ip_address() if s.host == "node" else s.host
        if s.kind == "local":
            from ..engine.local.process import LocalEngineProcess

            self.proc = LocalEngineProcess(s.model_path, host=host, extra_args=tuple(s.extra_args), log_path=s.log_path)
        else:
            from ..engine.launch import SGLangLaunchConfig, SGLangServer

            kw: dict[str, Any] = dict(s.launch)
            if s.mem_fraction_static is not None:
                kw["mem_fraction_static"] = s.mem_fraction_static
            # gpu_ids stays None: Ray already set CUDA_VISIBLE_DEVICES for this actor and the server inherits it.
            cfg = SGLangLaunchConfig(model_path=s.model_path, host=host, extra_args=tuple(s.extra_args), **kw)
            self.proc = SGLangServer(cfg, log_path=s.log_path)
        self._url = await self.proc.start(timeout=timeout)
        self._start_window = (t0, time.time())
        return self._url

    def url(self) -> str | None:
        return self._url

    def gpu_ids(self) -> list[str]:
        """The GPUs Ray gave this actor (no CUDA context is made to read them)."""
        return [str(g) for g in ray.get_gpu_ids()]

    def info(self) -> dict[str, Any]:
        """Where this server runs: node IP, the GPUs Ray gave the actor, the server's pid and URL."""
        proc = self.proc
        pid = proc.pid if proc is not None else None  # LocalEngineProcess and SGLangServer both say it
        return {
            "url": self._url,
            "kind": self.spec.kind,
            "node_ip": ray.util.get_node_ip_address(),
            "gpu_ids": self.gpu_ids(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "pid": pid,
            "alive": self.alive(),
            "start_window": self._start_window,  # wall-clock seconds: launch began, server ready
        }

    def alive(self) -> bool:
        proc = self.proc
        if proc is None:
            return False
        if self.spec.kind == "local":
            return proc.returncode is None
        return proc.proc is not None and proc.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        return self.proc.log_tail(lines) if self.proc is not None else "(not started)"

    async def stop(self) -> int | None:
        if self.proc is None:
            return None
        return await self.proc.stop()


EngineServerActor = ray.remote(EngineServer)


class EngineFleet:
    """Starts and stops engine server actors; `start()` returns their URLs in spec order.

    `num_gpus` > 0 puts the servers on one placement group. Stopping the fleet stops every server
    process (SIGTERM, then SIGKILL), kills the actors and removes the placement group.
    """

    def __init__(
        self,
        specs: Sequence[EngineSpec],
        *,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        strategy: str = "PACK",
        placement_timeout: float = 300.0,
    ) -> None:
        if not specs:
            raise ValueError("EngineFleet needs at least one EngineSpec")
        self.specs = list(specs)
        self.num_cpus = num_cpus
        self.num_gpus = num_gpus
        self.strategy = strategy
        self.placement_timeout = placement_timeout
        self.actors: list[Any] = []
        #: actors Ray never placed (`_scheduled` timed out): nothing runs in them to ask to stop
        self._unplaced: set[int] = set()
        self.urls: list[str] = []
        self.pg: PlacementGroup | None = None

    async def start(self, timeout: float = 180.0) -> list[str]:
        if self.num_gpus > 0:
            bundle = {"GPU": self.num_gpus, "CPU": self.num_cpus}
            self.pg = placement_group([dict(bundle) for _ in self.specs], strategy=self.strategy)
            try:
                with anyio.fail_after(self.placement_timeout):
                    await self.pg.ready()
            except TimeoutError:
                raise RuntimeError(
                    f"placement group of {len(self.specs)} x {bundle} ({self.strategy}) not placed within "
                    f"{self.placement_timeout:.0f}s: the cluster lacks the GPUs (ray.cluster_resources() = "
                    f"{ray.cluster_resources()})") from None
        for i, spec in enumerate(self.specs):
            opts: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, "max_concurrency": 16}
            if self.pg is not None:
                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=i)
            self.actors.append(EngineServerActor.options(**opts).remote(asdict(spec)))
        await self._scheduled()
        urls: list[str | None] = [None] * len(self.actors)

        async def start(i: int) -> None:
            try:
                urls[i] = await self.actors[i].start.remote(timeout)
            except Exception as e:  # say which server failed; the others are stopped by the caller's stop()
                raise RuntimeError(f"engine server {i} ({self.specs[i].kind}, {self.specs[i].model_path}): {e}") from e

        # Fractional GPUs may put several servers on one GPU: group them by the GPUs Ray gave their actors.
        shared = 0 < self.num_gpus < 1
        gpus = [tuple(await a.gpu_ids.remote()) if shared else i for i, a in enumerate(self.actors)]
        errors = [str(e) for e in await start_by_gpu(range(len(self.actors)), gpus.__getitem__, start)]
        if errors:
            raise RuntimeError("; ".join(errors))
        self.urls = [u for u in urls if u is not None]
        return list(self.urls)

    async def _scheduled(self) -> None:
        """Wait for Ray to place every actor: an actor whose resources no node has free waits forever
        (its `start` and the timeout inside it never begin), so placement gets its own deadline."""
        waiting = set(range(len(self.actors)))

        async def one(i: int) -> None:
            await self.actors[i].gpu_ids.remote()
            waiting.discard(i)

        try:
            with anyio.fail_after(self.placement_timeout):
                async with anyio.create_task_group() as tg:
                    for i in range(len(self.actors)):
                        tg.start_soon(one, i)
        except TimeoutError:
            self._unplaced = set(waiting)
            raise RuntimeError(
                f"engine server actor(s) {sorted(waiting)} of {len(self.specs)} (each {{'CPU': {self.num_cpus}, "
                f"'GPU': {self.num_gpus}}}) not scheduled within {self.placement_timeout:.0f}s: no node has those "
                f"resources free (ray.available_resources() = {ray.available_resources()}); lower "
                f"ray.engine_num_cpus / ray.engine_num_gpus, stop what holds them, or raise ray.placement_timeout"
            ) from None

    async def info(self) -> list[dict[str, Any]]:
        out = []
        for a in self.actors:
            try:
                out.append(await a.info.remote())
            except ray.exceptions.RayActorError as e:
                out.append({"alive": False, "error": str(e)})
        return out

    async def stop(self) -> None:
        async def one(actor: Any, placed: bool) -> None:
            # An unplaced actor's stop call would wait for a placement that never comes (60 s here).
            if placed:
                try:
                    with anyio.fail_after(60):
                        await actor.stop.remote()
                except Exception as e:  # dead actor or stuck server: the kill below ends the actor anyway
                    log.warning("stopping engine server actor failed: %s", e)
            ray.kill(actor)

        async with anyio.create_task_group() as tg:
            for i, a in enumerate(self.actors):
                tg.start_soon(one, a, i not in self._unplaced)
        self.actors.clear()
        self._unplaced = set()
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None



def ray_engine_backend(config: RuntimeConfig, clients: Sequence[EngineClient] | None = None) -> EngineBackend:
    """The engines of a Ray runtime: the clients given, the servers at `engine.urls`, or a fleet of actors."""
    if clients is not None:
        return GivenClients(clients)
    if config.engine.mode == "urls":
        return UrlEngines(config.engine)
    return RayFleetEngines(config)


class RayFleetEngines:
    """The embedded CPU engines or the `engine.launch` SGLang servers as an `EngineFleet` of Ray actors
    (placed by Ray: `ray.engine_num_cpus` / `ray.engine_num_gpus` per server). Ray must be running."""

    def __init__(self, config: RuntimeConfig) -> None:
        self.config = config
        self.model_path: str | None = None
        self.processes: list[Any] = []  #: the fleet, once started (stopped like any engine process)
        self.fleet: EngineFleet | None = None

    def _fleet(self) -> EngineFleet:
        ecfg, rc = self.config.engine, self.config.ray
        lc = ecfg.launch
        if lc is None:  # embedded: CPU engines
            self.model_path = str(embedded_model(ecfg))
            specs = [EngineSpec("local", self.model_path, extra_args=tuple(ecfg.local.serve_args()), host=rc.engine_host)
                     for _ in range(ecfg.num_local_servers)]
            return EngineFleet(specs, num_cpus=rc.engine_num_cpus, num_gpus=0.0, placement_timeout=rc.placement_timeout)
        if lc.gpu_ids is not None:
            log.warning("engine.launch.gpu_ids is ignored in Ray mode: Ray assigns GPUs (ray.engine_num_gpus per server)")
        self.model_path = lc.model_path
        specs = [EngineSpec("sglang", lc.model_path, extra_args=tuple(lc.flags), mem_fraction_static=lc.mem_fraction_static,
                            host=rc.engine_host) for _ in range(lc.num_servers)]
        return EngineFleet(specs, num_cpus=rc.engine_num_cpus, num_gpus=rc.engine_num_gpus, strategy=rc.placement_strategy,
                           placement_timeout=rc.placement_timeout)

    async def start(self, stack: Any) -> list[EngineClient]:
        clients: list[EngineClient] = []
        stack.callback(setattr, self, "fleet", None)  # (runs last: after the fleet stopped)
        close_and_stop(stack, clients, self.processes)
        fleet = self.fleet = self._fleet()
        self.processes.append(fleet)
        ecfg = self.config.engine
        urls = await fleet.start(timeout=ecfg.start_timeout)
        clients.extend(make_client(u, ecfg) for u in urls)
        return clients
