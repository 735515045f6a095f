"""The driver's pool of rollout workers: hands trajectories to workers as they free up, survives deaths.

This module owns *which worker runs a trajectory* and what happens when a worker dies:

- **No static chunks.** Nothing is split up front. Each trajectory (every member of a GRPO group on
  its own) is handed to the live worker with the fewest trajectories in flight, and only when that
  worker has a free slot (`capacity` each), so a worker that finishes early simply gets the next one
  and slow trajectories never hold a pre-assigned chunk hostage.
- **The gate fan-out.** The pool is the driver lifecycle's `GateControl` for every worker at once:
  `open` / `close` / `mark_sleeping` / `wait_settled` / `take_out` / `admit` move every worker's gate
  and wait for all of them (one step, like the lifecycle's own stages).
- **Faults.** A call that fails with `RayActorError` (the worker died: killed, OOM, node lost) marks
  the worker dead, records the trajectory in `retried`, and runs it again from its start on another
  worker (the engine server it was bound to stays the same, so the prefix cache is still warm). A
  dead worker is replaced by a fresh actor (at most `max_replacements` times), whose gate is opened
  if the driver is awake.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import anyio
import ray
from ray.exceptions import RayActorError

from ..engine.router import RouteSession
from ..runtime.core import AgentloopError
from ..types import Sample, Trajectory
from .worker import RolloutWorker

log = logging.getLogger(__name__)

__all__ = ["NoWorkerError", "WorkerPool", "WorkerStartError"]

RolloutWorkerActor = ray.remote(RolloutWorker)


class NoWorkerError(RuntimeError):
    """Every rollout worker is dead and no replacement may be started."""


class WorkerStartError(AgentloopError):
    """A rollout worker actor could not be built (its constructor failed on the worker)."""


@dataclass
class _Worker:
    index: int
    handle: Any
    load: int = 0
    jobs: int = 0


@dataclass
class PoolEvents:
    """What happened to workers during one step (reported in the step's metrics under "ray")."""

    retried: list[dict[str, Any]] = field(default_factory=list)
    worker_deaths: list[dict[str, Any]] = field(default_factory=list)
    replaced: list[dict[str, Any]] = field(default_factory=list)
    jobs_per_worker: dict[int, int] = field(default_factory=dict)


class WorkerPool:
    """Rollout worker actors plus the dispatch queue in front of them (see the module docstring)."""

    def __init__(
        self,
        *,
        num_workers: int,
        capacity: int,
        make_args: Callable[[int], tuple[Any, ...]],
        actor_options: dict[str, Any],
        max_replacements: int = 4,
        max_attempts: int = 3,
        on_server_removed: Callable[[str, str], Any] | None = None,
    ) -> None:
        if num_workers < 1 or capacity < 1:
            raise ValueError(f"WorkerPool needs num_workers >= 1 and capacity >= 1, got {num_workers}, {capacity}")
        self.capacity = capacity
        self.make_args = make_args
        self.actor_options = {"max_concurrency": capacity + 64, **actor_options}
        self.max_replacements = max_replacements
        self.max_attempts = max_attempts
        self.on_server_removed = on_server_removed
        self.workers: dict[int, _Worker] = {}
        self.replacements = 0
        self.gate_version: str | None = None
        self.gate_open = False
        #: servers out of rotation (url → why), so a replacement worker starts with the others' view
        self.out: dict[str, str] = {}
        self.events = PoolEvents()
        self._next_index = 0
        self._freed = anyio.Event()
        self._gate_lock = anyio.Lock()
        for _ in range(num_workers):
            self._spawn()

    # ------------------------------------------------------------------ actors
    def _spawn(self) -> _Worker:
        i = self._next_index
        self._next_index += 1
        w = _Worker(i, RolloutWorkerActor.options(**self.actor_options).remote(*self.make_args(i)))
        self.workers[i] = w
        return w

    async def ready(self, timeout: float = 300.0) -> None:
        """Wait until every worker has built its tokenizer, tools and scheduler.

        A worker that cannot be built raises `WorkerStartError` saying why (its last error line)."""
        with anyio.fail_after(timeout):
            for w in list(self.workers.values()):
                try:
                    await w.handle.ready.remote()
                except RayActorError as e:
                    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
                    raise WorkerStartError(
                        f"rollout worker {w.index} could not be built: {lines[-1] if lines else type(e).__name__}. "
                        "What RayRuntime sends to workers (tools, tools_factory, reward_fn, interaction) is unpickled "
                        "there: the modules defining them must be importable on every node (an installed package, "
                        "ray.init runtime_env, or ray.cloudpickle.register_pickle_by_value(module))") from None

    @property
    def handles(self) -> dict[int, Any]:
        return {i: w.handle for i, w in self.workers.items()}

    def load(self) -> dict[int, int]:
        return {i: w.load for i, w in self.workers.items()}

    async def shutdown(self) -> None:
        for w in list(self.workers.values()):
            try:
                with anyio.move_on_after(5):
                    await w.handle.shutdown.remote()
            except RayActorError:
                pass
            ray.kill(w.handle)
        self.workers.clear()

    async def _on_death(self, w: _Worker, error: BaseException, uid: str) -> None:
        if self.workers.get(w.index) is not w:
            return  # another trajectory already reported this death
        del self.workers[w.index]
        # Also for a worker that is only unreachable (ActorUnavailableError): once its trajectories
        # are re-run elsewhere it must not come back and run them a second time.
        ray.kill(w.handle, no_restart=True)
        self.events.worker_deaths.append({"worker": w.index, "time": time.time(), "error": _short(error), "first_seen_by": uid})
        log.warning("rollout worker %d died (%s); its unfinished trajectories run again elsewhere", w.index, _short(error))
        if self.replacements < self.max_replacements:
            self.replacements += 1
            async with self._gate_lock:  # the newcomer's gate must match the others'
                new = self._spawn()
                for url, reason in self.out.items():
                    await new.handle.take_out.remote(url, reason)
                if self.gate_open:
                    await new.handle.open_gate.remote(self.gate_version)
            self.events.replaced.append({"dead": w.index, "new": new.index})
        self._freed.set()

    # ------------------------------------------------------------------ gates
    async def _each(self, call: Callable[[Any], Any]) -> list[Any]:
        """Call every live worker concurrently; dead ones answer None (their deaths surface on `run`)."""
        workers = list(self.workers.values())
        out: list[Any] = [None] * len(workers)

        async def one(k: int) -> None:
            try:
                out[k] = await call(workers[k].handle)
            except RayActorError as e:
                log.warning("worker %d unreachable during a gate change: %s", workers[k].index, _short(e))

        async with anyio.create_task_group() as tg:
            for k in range(len(workers)):
                tg.start_soon(one, k)
        return out

    async def open(self, weight_version: str | None) -> None:
        async with self._gate_lock:
            self.gate_version, self.gate_open = weight_version, True
            await self._each(lambda h: h.open_gate.remote(weight_version))

    async def close(self, *, for_update: bool = False) -> int:
        """Close every worker's gate (awaited on all); returns their requests still in flight."""
        async with self._gate_lock:
            self.gate_open = False
            counts = await self._each(lambda h: h.close_gate.remote(for_update))
        return sum(c or 0 for c in counts)

    async def wait_settled(self, url: str, timeout: float) -> int:
        counts = await self._each(lambda h: h.wait_settled.remote(url, timeout))
        return sum(c or 0 for c in counts)

    async def mark_sleeping(self) -> None:
        await self._each(lambda h: h.mark_sleeping.remote())

    async def take_out(self, url: str, reason: str) -> None:
        async with self._gate_lock:
            self.out[url] = reason
            await self._each(lambda h: h.take_out.remote(url, reason))

    async def admit(self, url: str) -> None:
        async with self._gate_lock:
            self.out.pop(url, None)
            await self._each(lambda h: h.admit.remote(url))

    async def stats(self, *, times: bool = False) -> list[dict[str, Any]]:
        return [s for s in await self._each(lambda h: h.stats.remote(times)) if s is not None]

    # ------------------------------------------------------------------ dispatch
    async def _acquire(self) -> _Worker:
        while True:
            if not self.workers:
                raise NoWorkerError("every rollout worker is dead and the replacement budget "
                                    f"({self.max_replacements}) is spent")
            free = [w for w in self.workers.values() if w.load < self.capacity]
            if free:
                w = min(free, key=lambda w: (w.load, w.jobs, w.index))
                w.load += 1
                w.jobs += 1
                return w
            if self._freed.is_set():  # one event shared by every waiter: a release wakes them all
                self._freed = anyio.Event()
            await self._freed.wait()

    def _release(self, w: _Worker) -> None:
        w.load -= 1
        self._freed.set()

    async def run(self, job: Sample, url: str, session: RouteSession, cfg: dict[str, Any], *,
                  timeout: float | None = None) -> Trajectory:
        """Run `job` on some worker, starting on server `url`; re-run elsewhere if that worker dies.

        `timeout` bounds one call to a worker that neither answers nor dies (TimeoutError).
        """
        attempt = 0
        while True:
            attempt += 1
            w = await self._acquire()
            try:
                result = await self._call(w, job, url, session, cfg, timeout)
            except RayActorError as e:
                self.events.retried.append({"uid": job.uid, "worker": w.index, "attempt": attempt, "error": _short(e)})
                await self._on_death(w, e, job.uid)
                if attempt >= self.max_attempts:
                    raise NoWorkerError(f"trajectory {job.uid}: {attempt} workers died running it (last: {_short(e)})") from e
                continue
            finally:
                self._release(w)
            self.events.jobs_per_worker[w.index] = self.events.jobs_per_worker.get(w.index, 0) + 1
            if self.on_server_removed is not None:
                for removed_url, reason in result["removed"].items():
                    await self.on_server_removed(removed_url, reason)
            traj: Trajectory = result["trajectory"]
            if attempt > 1:
                traj.extra["worker_attempts"] = attempt
            return traj

    async def _call(self, w: _Worker, job: Sample, url: str, session: RouteSession, cfg: dict[str, Any],
                    timeout: float | None) -> dict[str, Any]:
        ref = w.handle.run.remote(job, url, cfg)
        result: dict[str, Any] = {}

        async def forward_stop() -> None:
            # The driver's scheduler stops a trajectory by stopping its route session (early stop,
            # sleep mid-step); pass that on to the worker that runs it.
            await session.wait_stopped()
            try:
                await w.handle.stop_trajectory.remote(job.uid, session.stop_reason or "stopped")
            except RayActorError:
                pass  # the run itself reports the death

        error: Exception | None = None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(forward_stop)
                try:
                    with anyio.fail_after(timeout):
                        result = await ref
                except Exception as e:  # raised below, outside the task group, so callers see it unwrapped
                    error = e
                tg.cancel_scope.cancel()
        except anyio.get_cancelled_exc_class():
            # The driver gave up on this trajectory (its step was cancelled): stop it on the worker too,
            # or it would wait at the closed gate and resume, orphaned, when the next step opens it.
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                try:
                    await w.handle.stop_trajectory.remote(job.uid, "cancelled by the driver")
                except RayActorError:
                    pass
            raise
        if isinstance(error, TimeoutError):
            with anyio.move_on_after(5):
                try:
                    await w.handle.stop_trajectory.remote(job.uid, f"no answer from the worker within {timeout}s")
                except RayActorError:
                    pass
        if error is not None:
            raise error
        return result


def default_capacity(concurrency: int, num_workers: int) -> int:
    return max(1, math.ceil(concurrency / num_workers))


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]
