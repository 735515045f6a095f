"""The engine lifecycle: the state machine that drives engine servers' memory through wake and sleep,
and opens and closes the gates it owns.

States: SLEEPING → WEIGHTS_RESUMED → WEIGHTS_LOADED → AWAKE → DRAINING → SLEEPING.

`wake_up(weights)` (staged): liveness probe → resume(["weights"]) → load the new weights →
resume(["kv_cache", "cuda_graph"]) → AWAKE → open every gate. One-stage mode resumes every released
tag at once, then loads. `sleep()`: DRAINING → close every gate → liveness probe → pause(abort)
in-flight requests → wait for them to settle (in every gate) → continue_generation → flush_cache
(retried while busy) → release every tag → SLEEPING. The continue sits in the sleep, not the
wake-up: a paused SGLang server holds new requests until continued, so the engine is unpaused
before it sleeps and wakes up ready to serve; the gates (closed from DRAINING until AWAKE) keep
generations out meanwhile.

**Gates.** Generation never goes through this class's own code: `agentloop.engine.gate.Gate` is the
only road to an engine's generate and `/health`. A `Lifecycle` owns a local `Gate` (`.gate`, the
one its process's router uses) and any number of other `GateControl`s added with `add_gates` (Ray
mode: the `WorkerPool`, which moves every worker's gate at once); every transition moves all of them
the same way, so no subclass re-implements `wake_up` or `sleep`.

**Servers in and out of rotation.** Every stage fans out to the servers in rotation and is awaited
as one; a server that fails a stage, the liveness probe or, mid-step, the router or the step
watchdog is taken out while the others go on. A stage failing on every server leaves a state from
which `wake_up` (resuming where it stopped) or `sleep` is legal; a failed sleep stage leaves
DRAINING, from which `sleep` resumes at the failed stage.

The state machine is this module; its parts, each below the next (`Lifecycle` puts them together):

- `lifecycle_types.py`: the contracts (states, stage names, `LifecycleError`, `Weights`,
  `StageRecord`, `MemoryMark`); `lifecycle_server.py`: one server as the lifecycle tracks it.
- `lifecycle_marks.py`: the memory calls and the `MemoryMark` recorded in each server around them.
- `lifecycle_owner.py`: owner leases, one runtime per server (`lease.py` is the lease itself).
- `lifecycle_fleet.py`: servers in and out of rotation, the gates, fanning a stage out to the servers.
- `lifecycle_drain.py`: what each sleep stage does on one server.
- `lifecycle_attach.py`: attach state, knowing each server's memory before the first call (and the
  remedies for the one ambiguous case).
- `lifecycle_liveness.py`: the liveness probe and re-admission of servers out of rotation.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import anyio

from .base import MEMORY_TAGS, EngineClient
from .gate import Gate, GateControl
from .lease import Lease, new_lease, register
from .lifecycle_attach import AttachState
from .lifecycle_liveness import LivenessMixin
from .lifecycle_server import TrackedServer, log
from .lifecycle_types import (
    SLEEP_STAGES,
    EngineState,
    LifecycleError,
    MemoryMark,  # noqa: F401  (importable from here, as before the split)
    StageRecord,
    Weights,
    same_weights,
)

__all__ = ["SLEEP_STAGES", "AttachState", "EngineState", "Lifecycle", "LifecycleError", "StageRecord", "Weights"]


class Lifecycle(LivenessMixin):
    """State machine over `clients` that opens and closes the gates it owns (see the module docstring).

    `awake` declares the engines' present state without asking them (`attach()` asks). `staged=False`
    selects one-stage wake-up (for engines without memory tags). `reload_path` is the folder to reload
    when weights were released and no new weights are given (default: each server's
    `model_info()["model_path"]`). `liveness_timeout` bounds the `/model_info` probe before each
    wake-up and sleep. `attach_state` overrides what `attach()` finds ("auto": read each server's
    mark). `on_generate(url, state)` is the local gate's instrumentation hook. `takeover` lets
    `attach()` take servers whose lease a live (or not yet expired) owner holds; `lease_timeout` is
    how long this lifecycle's own lease lasts unless renewed (see `lifecycle_owner.py`).
    """

    def __init__(
        self,
        clients: Sequence[EngineClient],
        *,
        awake: bool = True,
        staged: bool = True,
        release_tags: Sequence[str] = MEMORY_TAGS,
        reload_path: str | None = None,
        flush_retries: int = 50,
        flush_retry_delay: float = 0.05,
        settle_timeout: float = 60.0,
        stage_timeout: float = 600.0,
        liveness_timeout: float = 5.0,
        attach_state: AttachState = "auto",
        on_generate: Callable[[str, EngineState], None] | None = None,
        takeover: bool = False,
        lease_timeout: float = 600.0,
    ) -> None:
        if not clients:
            raise ValueError("Lifecycle needs at least one engine client")
        if isinstance(attach_state, str):
            if attach_state not in ("auto", "awake", "asleep"):
                raise ValueError(f"attach_state must be auto|awake|asleep or a list of released tags, not {attach_state!r}")
        elif set(attach_state) - set(MEMORY_TAGS):
            raise ValueError(f"attach_state: unknown memory tags {sorted(set(attach_state) - set(MEMORY_TAGS))}")
        self._servers: dict[str, TrackedServer] = {c.url: TrackedServer(c) for c in clients}
        self.staged = staged
        self.release_tags = tuple(release_tags)
        unknown = set(self.release_tags) - set(MEMORY_TAGS)
        if unknown:
            raise ValueError(f"unknown memory tags {sorted(unknown)}; known: {list(MEMORY_TAGS)}")
        self.reload_path = reload_path
        self.flush_retries = flush_retries
        self.flush_retry_delay = flush_retry_delay
        self.settle_timeout = settle_timeout
        self.stage_timeout = stage_timeout
        self.liveness_timeout = liveness_timeout
        self.attach_state: AttachState = attach_state if isinstance(attach_state, str) else list(attach_state)
        self.takeover = takeover
        self.lease_timeout = lease_timeout
        #: this lifecycle's claim on its servers, written into their marks until it lets them go
        self.lease: Lease = new_lease(lease_timeout)
        self._holding = True
        register(self.lease, self)
        self._state = EngineState.AWAKE if awake else EngineState.SLEEPING
        if not awake:
            for s in self._servers.values():
                s.released = set(self.release_tags)
        #: The gate of this process: the one road to generate and /health (its router's).
        self.gate = Gate(clients, awake=awake, on_generate=on_generate, on_take_out=self.take_out)
        self._gates: list[GateControl] = [self.gate]
        self._transition_lock = anyio.Lock()
        self._last_weights: Weights | None = None
        self._waking: tuple[Weights | None, anyio.Event, list[BaseException]] | None = None
        self._sleep_resume_at: str | None = None
        self._version_counter = itertools.count(1)
        self.weight_version: str | None = None
        self.records: list[StageRecord] = []
        #: Servers leaving and re-entering rotation: {"time", "url", "event": "out" | "in", "reason"}.
        self.server_events: list[dict[str, Any]] = []
        #: Wall-clock spans during which the gates were open: [opened, closing). Each starts after
        #: AWAKE was reached and ends before AWAKE is left (checked against dispatch times by tests).
        self.gate_windows: list[list[float]] = []

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def sleep_resume_at(self) -> str | None:
        """The sleep stage a retried `sleep()` starts at (None unless a sleep failed part-way)."""
        return self._sleep_resume_at

    def _set_state(self, state: EngineState) -> None:
        log.debug("lifecycle %s -> %s", self._state.value, state.value)
        self._state = state

    # ------------------------------------------------------------------ transitions
    async def wake_up(self, weights: "Weights | Mapping[str, Any] | str | Path | None" = None) -> str | None:
        """Staged wake-up; returns the weight version now served.

        "The same weights" means the same state dict object or the same path (see `same_weights`),
        not the same `Weights` wrapper. Callers that arrive while a wake-up with the same weights
        (or with none) is running share it (and its error). While AWAKE, a call without weights,
        with the same weights as the last load, or with the version already served is a no-op.
        Different weights while AWAKE (another state dict, another path, a new `version`) are loaded
        in place with a new version and logged, never dropped: this is how a trainer pushes weights
        without a sleep. To reload a path or a dict changed in place while AWAKE, give a new version.
        """
        w = Weights.coerce(weights)
        joining = self._waking
        if joining is not None and (w is None or same_weights(w, joining[0])):
            await joining[1].wait()
            if joining[2]:
                raise joining[2][0]
            return self.weight_version
        async with self._transition_lock:
            if self._state is EngineState.AWAKE:
                already = w is None or same_weights(w, self._last_weights) or (
                    w.version is not None and w.version == self.weight_version)
                if w is not None and not already:
                    version = self._next_version(w)
                    log.info("wake_up while AWAKE with new weights: loading them in place (%s -> %s)",
                             self.weight_version, version)
                    await self._stage("wake_up", "update_weights", lambda s: self._load(s, w, version))
                    self._last_weights = w
                await self._open_gates()
                return self.weight_version
            if self._state is EngineState.DRAINING:
                # the lock is free, so no sleep is running: the last one failed part-way
                raise LifecycleError(
                    "wake_up", f"the last sleep failed at stage '{self._sleep_resume_at}' and the "
                    "engines are DRAINING; call sleep() to finish it, then wake_up")
            self._waking = (w, anyio.Event(), [])
            try:
                if self._state is EngineState.SLEEPING:
                    await self._probe(readmit=True)
                await self._wake_stages(w)
                self._last_weights = w
                await self._open_gates()
            except BaseException as e:
                self._waking[2].append(e)
                raise
            finally:
                self._waking[1].set()
                self._waking = None
            return self.weight_version

    async def _wake_stages(self, w: Weights | None) -> None:
        if self.staged:
            if self._state is EngineState.SLEEPING:
                await self._stage("wake_up", "resume_weights", lambda s: self._resume(s, ["weights"]))
                self._set_state(EngineState.WEIGHTS_RESUMED)
            if self._state is EngineState.WEIGHTS_RESUMED:
                await self._load_weights(w)
                self._set_state(EngineState.WEIGHTS_LOADED)
            await self._stage("wake_up", "resume_kv_cache", lambda s: self._resume(s, [t for t in MEMORY_TAGS if t != "weights"]))
        else:
            await self._stage("wake_up", "resume_all", lambda s: self._resume(s, list(MEMORY_TAGS)))
            self._set_state(EngineState.WEIGHTS_RESUMED)
            await self._load_weights(w)
            self._set_state(EngineState.WEIGHTS_LOADED)
        self._set_state(EngineState.AWAKE)

    async def sleep(self) -> None:
        """Close every gate, abort and settle in-flight requests, flush, release every tag.

        From AWAKE every stage runs. After a failed sleep (state DRAINING) a retry resumes at the
        stage that failed, like a retried wake-up: a failed flush_cache is flushed again before the
        release, a failed release is only released again (each server's released tags are tracked,
        so nothing is released twice). From a wake-up that stopped part-way nothing was generated,
        so only the release runs. Servers with nothing that can run skip the draining stages.
        """
        async with self._transition_lock:
            if self._state is EngineState.SLEEPING:
                return
            if self._state is EngineState.AWAKE:
                first = SLEEP_STAGES[0]
            elif self._state is EngineState.DRAINING:
                first = self._sleep_resume_at or SLEEP_STAGES[0]
            else:
                first = "release"
            self._set_state(EngineState.DRAINING)
            self._sleep_resume_at = first
            await self._close_gates()  # before any engine is paused: no gate dispatches from here on
            # (re-admission only when nothing is left in rotation: the next wake-up probes the rest)
            await self._probe(readmit=not self._in_rotation())
            for stage in SLEEP_STAGES[SLEEP_STAGES.index(first):]:
                # set before the stage runs, so an error or a cancellation leaves it pointing here
                self._sleep_resume_at = stage
                await self._stage("sleep", stage, self._sleep_stage(stage))
            self._sleep_resume_at = None
            self._set_state(EngineState.SLEEPING)
            for g in self._gates:
                await g.mark_sleeping()

    async def park(self) -> None:
        """Mark every sleeping server in rotation as left asleep on purpose (see `MemoryMark.parked`),
        and let them go (`close`)."""
        async with self._transition_lock:
            self._park(self._in_rotation())
            await self._let_go()

    def _park(self, servers: Sequence[TrackedServer]) -> None:
        if self._state is EngineState.SLEEPING:
            for s in servers:
                s.parked = True

    async def restore(self) -> None:
        """Leave every server in rotation as it was found (see `lifecycle_attach.py`): a parked one
        parked; any other awake (resume its weights, reload them from its model path under the version
        it had, resume the rest). Called when a runtime that attached to running servers stops."""
        async with self._transition_lock:
            self._park([s for s in self._in_rotation() if s.found is not None and s.found.parked])
            todo = [s for s in self._in_rotation() if s.found is not None and not s.found.parked and s.released]
            if todo and self._state is not EngineState.AWAKE:
                await self._restore(todo)
            await self._let_go()

    async def _restore(self, todo: Sequence[TrackedServer]) -> None:
        if self._state is not EngineState.SLEEPING:
            log.warning("restoring engine servers from %s (the last sleep failed at %r)",
                        self._state.value, self._sleep_resume_at)

        async def one(s: TrackedServer) -> None:
            reload = "weights" in s.released
            await self._resume(s, ["weights"])
            assert s.found is not None
            if reload:
                await self._reload(s, s.found.version)
            await self._resume(s, sorted(s.released))
            await self._mark(s)

        await self._stage("restore", "restore", one, servers=todo)
        log.info("engine servers %s left awake, as found", [s.url for s in todo])

    # ------------------------------------------------------------------ stages
    def _next_version(self, w: Weights) -> str:
        return w.version or f"v{next(self._version_counter)}"

    async def _load_weights(self, w: Weights | None) -> None:
        if w is None:
            # Released weights have lost their values (SGLang zeroes them): reload from disk.
            if "weights" in self.release_tags:
                version = self.weight_version or "default"
                await self._stage("wake_up", "update_weights", lambda s: self._reload(s, version))
            return
        version = self._next_version(w)
        await self._stage("wake_up", "update_weights", lambda s: self._load(s, w, version))
