"""`Lifecycle`: the state machine that drives engine servers' memory through wake and sleep, and moves
the gates it owns; its parts (`ServerDriver`, `Fleet`, `Owner`) do the work. `_state` is written here only.

States: SLEEPING → WEIGHTS_RESUMED → WEIGHTS_LOADED → AWAKE → DRAINING → SLEEPING.

`wake_up(weights)` (staged): liveness probe → resume(["weights"]) → load the new weights →
resume(["kv_cache", "cuda_graph"]) → AWAKE → open every gate. One-stage mode resumes every released
tag at once, then loads. `sleep()`: DRAINING → close every gate → liveness probe → pause(abort)
in-flight requests → wait for them to settle (in every gate) → continue_generation → flush_cache
(retried while busy) → release every tag → SLEEPING. The continue sits in the sleep, not the wake-up:
a paused SGLang server holds new requests until continued, so the engine is unpaused before it sleeps.
`update_weights_in_flight(weights)` (AWAKE only): new weights while requests run (see its docstring).

Every stage fans out to the servers in rotation and is awaited as one; a server that fails a stage,
the liveness probe or, mid-step, the router or the step watchdog is taken out while the others go on.
A stage failing on every server leaves a state from which `wake_up` (resuming where it stopped) or
`sleep` is legal; a failed sleep stage leaves DRAINING, from which `sleep` resumes at the failed stage.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Sequence, Union

import anyio

from ..base import MEMORY_TAGS, EngineClient
from ..gate import Gate
from ..state import EngineState
from .fleet import Fleet, RecordMark
from .log import forward as _forward, log
from .owner import Owner
from .server import ServerDriver
from .types import SLEEP_STAGES, AttachState, LifecycleError, LifecycleSettings, StageRecord, WakeUp, Weights, same_weights

__all__ = ["Lifecycle"]

#: What `wake_up` and `update_weights_in_flight` accept (`Weights.coerce`).
WeightsLike = Union[Weights, Mapping[str, Any], str, Path, None]


class Lifecycle:
    """State machine over `clients` that opens and closes the gates it owns (see the module docstring).

    `awake` declares the engines' present state without asking them (`attach()` asks). `staged=False`
    selects one-stage wake-up (for engines without memory tags). `reload_path` is the folder to reload
    when weights were released and no new weights are given (default: each server's
    `model_info()["model_path"]`). `liveness_timeout` bounds the `/model_info` probe before each
    wake-up and sleep. `attach_state` overrides what `attach()` finds ("auto": read each server's
    mark). `on_generate(url, state)` is the local gate's instrumentation hook. `takeover` lets
    `attach()` take servers whose lease a live (or not yet expired) owner holds; `lease_timeout` is
    how long this lifecycle's own lease lasts unless renewed (`owner.py`).
    """

    #: Seconds between writing a new lease and reading it back (`ServerDriver.acquire`).
    acquire_settle: float = 0.5

    def __init__(self, clients: Sequence[EngineClient], *, awake: bool = True, staged: bool = True,
                 release_tags: Sequence[str] = MEMORY_TAGS, reload_path: str | None = None, flush_retries: int = 50,
                 flush_retry_delay: float = 0.05, settle_timeout: float = 60.0, stage_timeout: float = 600.0,
                 liveness_timeout: float = 5.0, attach_state: AttachState = "auto",
                 on_generate: Callable[[str, EngineState], None] | None = None, takeover: bool = False,
                 lease_timeout: float = 600.0) -> None:
        if not clients:
            raise ValueError("Lifecycle needs at least one engine client")
        self.settings = LifecycleSettings(
            staged=staged, release_tags=tuple(release_tags), reload_path=reload_path, flush_retries=flush_retries,
            flush_retry_delay=flush_retry_delay, settle_timeout=settle_timeout, stage_timeout=stage_timeout,
            liveness_timeout=liveness_timeout, takeover=takeover, lease_timeout=lease_timeout,
            attach_state=attach_state if isinstance(attach_state, str) else list(attach_state),
            acquire_settle=self.acquire_settle)
        self.owner = Owner(self, lease_timeout=lease_timeout, takeover=takeover)
        drivers = [ServerDriver(c, owner=self.owner, settings=self.settings, served=lambda: self.weight_version)
                   for c in clients]
        self._state = EngineState.AWAKE if awake else EngineState.SLEEPING
        for d in drivers:
            d.released = set() if awake else set(self.settings.release_tags)
        #: The gate of this process: the one road to generate and /health (its router's).
        self.gate = Gate(clients, awake=awake, on_generate=on_generate, on_take_out=lambda url, why: self.fleet.take_out(url, why),
                         check_answer=lambda url, version: self.fleet.answer_lost(url, version))
        self.fleet = Fleet(drivers, [self.gate], stage_timeout=stage_timeout, settle_timeout=settle_timeout)
        self._transition_lock = anyio.Lock()
        self._last_weights: Weights | None = None
        self._waking: WakeUp | None = None
        self._sleep_resume_at: str | None = None
        self._version_counter = itertools.count(1)
        self.weight_version: str | None = None

    # ------------------------------------------------------------------ state and records
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

    records = _forward("fleet", "records", "Every stage run so far, in order (`records_since` reads one call's).")
    server_events = _forward("fleet", "server_events", "Servers leaving and re-entering rotation.")
    gate_windows = _forward("fleet", "gate_windows", "Wall-clock spans during which the gates were open.")
    lease = _forward("owner", "lease", "This lifecycle's lease (`owner.py`).")

    def record_mark(self) -> RecordMark:
        """A position in `records`: pass it to `records_since` after a wake-up, sleep or update."""
        return len(self.fleet.records)

    def records_since(self, mark: RecordMark) -> list[StageRecord]:
        """The stages run since `mark` (e.g. one step's wake-up and sleep), a copy."""
        return self.fleet.records_since(mark)

    # ------------------------------------------------------------------ transitions
    async def wake_up(self, weights: WeightsLike = None) -> str | None:
        """Staged wake-up; returns the weight version now served.

        "The same weights" means the same state dict object or the same path (see `same_weights`),
        not the same `Weights` wrapper. Callers that arrive while a wake-up with the same weights
        (or with none) is running share it (and its error). While AWAKE, a call without weights,
        with the same weights as the last load, or with the version already served is a no-op.
        Different weights while AWAKE (another state dict, another path, a new `version`) are loaded
        in place with a new version and logged, never dropped (the engines finish the requests in
        flight first). To reload a path or a dict changed in place while AWAKE, give a new version.
        """
        w = Weights.coerce(weights)
        joining = self._waking
        if joining is not None and joining.joins(w):
            await joining.outcome()
            return self.weight_version
        async with self._transition_lock:
            if self._state is EngineState.AWAKE:
                return await self._load_awake(w, "wake_up")
            if self._state is EngineState.DRAINING:
                # the lock is free, so no sleep is running: the last one (or an update) failed part-way
                raise LifecycleError(
                    "wake_up", f"the last sleep (or in-flight update) failed at stage '{self._sleep_resume_at}' and the "
                    "engines are DRAINING; call sleep() to finish it, then wake_up")
            self._waking = wake = WakeUp(w)
            try:
                if self._state is EngineState.SLEEPING:
                    await self.fleet.probe(readmit=True)
                await self._wake_stages(w)
                self._last_weights = w
                await self.fleet.open_gates(self.weight_version)
            except BaseException as e:
                wake.error = e
                raise
            finally:
                wake.done.set()
                self._waking = None
            return self.weight_version

    async def _load_awake(self, w: Weights | None, phase: str, *, flush_cache: bool = True,
                          abort_all: bool = False) -> str | None:
        """While AWAKE (the transition lock held): load `w` in place unless it is already served
        (`abort_all`: the server aborts its requests and loads once they ended), then open the gates
        on the version served."""
        if w is not None and not self._serves(w):
            version = self._next_version(w)
            log.info("%s while AWAKE with new weights: loading them in place (%s -> %s)",
                     phase, self.weight_version, version)
            await self.fleet.stage(phase, "update_weights", lambda d: d.load(w, version, flush_cache=flush_cache,
                                                                                   abort_all=abort_all))
            self.weight_version, self._last_weights = version, w
        await self.fleet.open_gates(self.weight_version)
        return self.weight_version

    def _serves(self, w: Weights) -> bool:
        return same_weights(w, self._last_weights) or (w.version is not None and w.version == self.weight_version)

    async def _wake_stages(self, w: Weights | None) -> None:
        stage = self.fleet.stage
        if self.settings.staged:
            if self._state is EngineState.SLEEPING:
                await stage("wake_up", "resume_weights", lambda d: d.resume(["weights"]))
                self._set_state(EngineState.WEIGHTS_RESUMED)
            if self._state is EngineState.WEIGHTS_RESUMED:
                await self._load_weights(w)
                self._set_state(EngineState.WEIGHTS_LOADED)
            await stage("wake_up", "resume_kv_cache", lambda d: d.resume([t for t in MEMORY_TAGS if t != "weights"]))
        else:
            await stage("wake_up", "resume_all", lambda d: d.resume(list(MEMORY_TAGS)))
            self._set_state(EngineState.WEIGHTS_RESUMED)
            await self._load_weights(w)
            self._set_state(EngineState.WEIGHTS_LOADED)
        self._set_state(EngineState.AWAKE)

    def _next_version(self, w: Weights) -> str:
        return w.version or self.fresh_version()

    def fresh_version(self) -> str:
        """A name this lifecycle never gave (`auto-v<k>`: never a trainer's own `v1`, `v2`, ...) for unnamed weights."""
        return f"auto-v{next(self._version_counter)}"

    async def _load_weights(self, w: Weights | None) -> None:
        if w is None:
            # Released weights have lost their values (SGLang zeroes them): reload from disk.
            if "weights" in self.settings.release_tags:
                version = self.weight_version or "default"
                await self.fleet.stage("wake_up", "update_weights", lambda d: d.reload(version))
                self.weight_version = version
            return
        version = self._next_version(w)
        await self.fleet.stage("wake_up", "update_weights", lambda d: d.load(w, version))
        self.weight_version = version

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
            await self.fleet.close_gates()  # before any engine is paused: no gate dispatches from here on
            # (re-admission only when nothing is left in rotation: the next wake-up probes the rest)
            await self.fleet.probe(readmit=not self.fleet.in_rotation())
            for stage in SLEEP_STAGES[SLEEP_STAGES.index(first):]:
                # set before the stage runs, so an error or a cancellation leaves it pointing here
                self._sleep_resume_at = stage
                await self.fleet.stage("sleep", stage, self.fleet.sleep_work(stage))
            self._sleep_resume_at = None
            self._set_state(EngineState.SLEEPING)
            await self.fleet.mark_sleeping()

    async def update_weights_drained(self, weights: WeightsLike, *, drain_timeout: float = 60.0,
                                     flush_cache: bool = True, server_drain: bool = False) -> str | None:
        """Load `weights` into AWAKE engines without a sleep, after draining them; returns the version served.

        Close the gates (generates wait there) → abort every request in flight (each returns with the
        tokens it sampled, a turn of the old version; aborted again every 0.2 s while any is out: a
        request sent just before the close may reach its server after an abort) and wait until the
        gates count none → load (the staged wake-up's load stage, same payloads; phase
        "update_drained") → open the gates on the new version. `drain_timeout` bounds the drain and
        the load. `flush_cache=True` flushes the prefix cache with the load, so every context is
        prefilled again under the new weights; `False` keeps it (the KV the old weights wrote is reused
        by the requests that follow: no re-prefill, but their tokens attend to that KV — see
        `StreamConfig.kv_on_update`). Nothing runs during the load, so no request spans two weight
        sets (the gates mark the aborted requests `interrupted_for_update` and their episodes request
        the rest of each turn again, so every token's version is the one that sampled it;
        `update_weights_in_flight` keeps them running instead, and a straddling request is labelled
        with the newer version). SGLang's own `/pause_generation` in `abort` mode polls its lock once
        a second while requests remain (sglang 0.5.17's tokenizer manager); the gates count our
        requests and say when the last one returned.

        `server_drain=True`: the server drains instead. The load goes out at once with
        `abort_all_requests`; the server aborts every request and loads once every generate has ended,
        holding generates that arrive meanwhile until after the load (SGLang's `model_update_lock`: a
        waiting writer blocks new readers; the CPU engine's `ModelUpdateLock` is the same), so the
        aborted answers are parsed here while the weights load. A request still on the wire at the
        close is then served after the load, and its answer reports the new version, which labels its
        tokens (`Gate.generate`). Not the default: see `StreamConfig.drain`.

        Stage records: "drain" (close → the last request of ours back; with `server_drain`, or → the
        load's end, overlapping it, with `left` still out) and "update_weights". If the load fails, the
        gates reopen on the old version and the error is raised.
        """
        if self.state is not EngineState.AWAKE:
            raise RuntimeError(f"update_weights_drained needs AWAKE engines; the lifecycle is {self.state.value}")
        await self.fleet.close_gates(for_update=True)
        try:
            async with self._transition_lock:
                if self._state is not EngineState.AWAKE:
                    raise LifecycleError("update_drained", f"the engines became {self._state.value} before the drain")
                done: dict[str, Any] = {}

                async def load() -> None:
                    try:
                        with anyio.fail_after(drain_timeout):
                            done["served"] = await self._load_awake(Weights.coerce(weights), "update_drained",
                                                                    flush_cache=flush_cache, abort_all=server_drain)
                    except Exception as e:  # raised below as itself, not in the task group's ExceptionGroup
                        done["error"] = e
                    finally:
                        tg.cancel_scope.cancel()

                if not server_drain:
                    with anyio.fail_after(drain_timeout):
                        start = time.monotonic()
                        await self.abort(abort_all=True)
                        await self._abort_until_back(start)
                async with anyio.create_task_group() as tg:
                    if server_drain:
                        tg.start_soon(self._abort_until_back, time.monotonic())
                    tg.start_soon(load)
                if "error" in done:
                    raise done["error"]
                return done["served"]
        except BaseException:
            with anyio.CancelScope(shield=True):
                if self.state is EngineState.AWAKE:
                    await self.fleet.open_gates(self.weight_version)
            raise

    async def _abort_until_back(self, start: float) -> None:
        """The drain's client side: abort stragglers every 0.2 s while requests of ours are out. Records
        the drain: close → the last one back, or → the load's end (cancelled) with `left` still out."""
        try:
            while self.in_flight() > 0:
                with anyio.move_on_after(0.2):
                    for url in self.urls:
                        await self.gate.wait_settled(url, 0.2)
                if self.in_flight() > 0:
                    try:
                        await self.abort(abort_all=True)
                    except LifecycleError as e:  # the load's own abort still drains that server
                        log.warning("update_drained: re-abort failed (%s)", e)
        finally:
            self.fleet.records.append(StageRecord("update_drained", "drain", start, time.monotonic(),
                                                  {"servers": len(self.urls), "left": self.in_flight()}))

    async def update_weights_in_flight(self, weights: WeightsLike,
                                       *, pause_mode: Literal["retract", "in_place"] = "retract") -> str | None:
        """New weights while AWAKE, without draining: the running requests pause, the weights and the
        served version change, the same requests go on under the new version. Returns the version
        served (a no-op, like `wake_up`, for the weights already served). Stages (phase
        "update_in_flight"): close the gates (generates arriving meanwhile wait there) → pause every
        server in rotation → load through the wake-up's path (`ServerDriver.load`, its checks, the new
        version in the same call) → continue → open the gates on the new version.

        `retract`, not `in_place` (sglang 0.5.17's scheduler): `in_place` only stops the loop, so the
        tokens sampled after the continue attend to KV the old weights wrote (a half-updated model);
        `retract` frees the running requests' KV and requeues them, re-prefilled (prompt + tokens so
        far) under the new weights. Cost: one re-prefill of the running contexts. (SGLang's radix cache
        may still hold prefix KV cached before the update: `--disable-radix-cache` where that matters.)
        Paused requests stay queued, so a flush fails and SGLang asserts a load's flush: the load is
        sent with `flush_cache=False`.

        Failure: a pause failing everywhere → servers continued, old weights served (AWAKE). A load or
        continue failing everywhere may leave half-written weights behind paused requests: gates
        closed, DRAINING at "pause" (`sleep()` aborts them, then `wake_up(weights)`). A server failing
        alone is taken out of rotation.
        """
        w = Weights.coerce(weights)
        if w is None:
            raise ValueError("update_weights_in_flight needs weights (a state dict, a path or Weights)")
        phase = "update_in_flight"
        async with self._transition_lock:
            if self._state is not EngineState.AWAKE:
                raise LifecycleError(phase, f"the engines are {self._state.value}, not AWAKE: use wake_up(weights)")
            if self._serves(w):
                return self.weight_version
            version = self._next_version(w)
            await self.fleet.close_gates()
            try:
                await self.fleet.stage(phase, "pause", lambda d: d.pause(pause_mode))
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self.fleet.unpause_best_effort(phase)
                    await self.fleet.open_gates(self.weight_version)
                raise
            try:
                await self.fleet.stage(phase, "update_weights", lambda d: d.load(w, version, flush_cache=False))
                self.weight_version, self._last_weights = version, w
                await self.fleet.stage(phase, "continue", lambda d: d.unpause())
            except BaseException:
                self._set_state(EngineState.DRAINING)
                self._sleep_resume_at = SLEEP_STAGES[0]
                raise
            await self.fleet.open_gates(version)
            log.info("weights updated in flight (%s mode): now serving %s", pause_mode, version)
            return version

    async def park(self) -> None:
        """Mark every sleeping server in rotation as left asleep on purpose (see `MemoryMark.parked`),
        and let them go (`close`)."""
        async with self._transition_lock:
            self._park(self.fleet.in_rotation())
            await self._let_go()

    def _park(self, servers: Sequence[ServerDriver]) -> None:
        if self._state is EngineState.SLEEPING:
            for d in servers:
                d.parked = True

    async def restore(self) -> None:
        """Leave every server in rotation as it was found: a parked one parked; any other awake (resume
        its weights, reload them from its model path under the version it had, resume the rest).
        Called when a runtime that attached to running servers stops."""
        async with self._transition_lock:
            found = [d for d in self.fleet.in_rotation() if d.found is not None]
            self._park([d for d in found if d.found.parked])  # type: ignore[union-attr]
            todo = [d for d in found if not d.found.parked and d.released]  # type: ignore[union-attr]
            if todo and self._state is not EngineState.AWAKE:
                if self._state is not EngineState.SLEEPING:
                    log.warning("restoring engine servers from %s (the last sleep failed at %r)",
                                self._state.value, self._sleep_resume_at)
                await self.fleet.stage("restore", "restore", lambda d: d.restore_as_found(), servers=todo)
                log.info("engine servers %s left awake, as found", [d.url for d in todo])
            await self._let_go()

    async def attach(self) -> None:
        """Learn each server's real memory state (`ServerDriver.resolve`) under this lifecycle's lease,
        before the first call."""
        await self.fleet.attach()
        # servers holding memory are drained and released by the next sleep (each server's own tags)
        tags = set(self.settings.release_tags)
        self._set_state(EngineState.DRAINING if any(not tags <= d.released for d in self.fleet.in_rotation())
                        else EngineState.SLEEPING)
        self._sleep_resume_at = None
        await self.gate.close()

    def _as_setting(self, released: set[str] | frozenset[str]) -> str:
        """The `engine.attach_state` value that says `released`."""
        return next(iter(self.fleet.drivers.values())).as_setting(released)

    # ------------------------------------------------------------------ the owner lease
    async def _let_go(self) -> None:
        self.owner.holding = False
        await self.fleet.clear_leases()
        self.close()

    async def check_liveness(self) -> None:
        """The liveness probe now, while AWAKE (a caller that saw requests fail and will not sleep soon:
        the streaming mode): servers in rotation that do not answer, or are no longer this lifecycle's,
        are taken out; raises `LifecycleError` naming each server and why when none is left."""
        async with self._transition_lock:
            await self.fleet.probe(readmit=False)

    async def keep_lease(self) -> None:
        """Renew this lifecycle's lease in its servers' marks until cancelled (run it beside a step's
        rollout: the wake-up and the sleep renew it, this covers a rollout longer than half of
        `lease_timeout`). A failed write is only logged: the step's own stages say what is wrong."""
        while self.owner.holding:
            await anyio.sleep(self.settings.lease_timeout / 4)
            async with self._transition_lock:
                await self.fleet.renew_leases(self.settings.liveness_timeout)

    def close(self) -> None:
        """This lifecycle drives nothing from now on (`Owner.close`). `restore` and `park` call it; call
        it yourself for a lifecycle abandoned without either."""
        self.owner.close()

    # ------------------------------------------------------------------ rotation and gates (the fleet's)
    urls = _forward("fleet", "urls", "Servers in rotation.")
    clients = _forward("fleet", "clients", "Clients of the servers in rotation.")
    out_of_rotation = _forward("fleet", "out_of_rotation", "Servers out of rotation now, with why.")
    take_out = _forward("fleet", "take_out", "`take_out(url, reason)`: out of every stage and gate until re-admitted.")
    add_gates = _forward("fleet", "add_gates", "Own more gates (Ray: every worker's, through the pool).")
    # The gate's road, for callers holding the lifecycle (the gate does the work).
    on_generate = _forward("gate", "on_generate", "The local gate's dispatch hook (settable).", settable=True)
    generations_outside_awake = _forward("gate", "generations_outside_awake", "See `Gate.generations_outside_awake`.")
    in_flight = _forward("gate", "in_flight", "Requests in flight (on `url`, or on all).")
    wait_awake = _forward("gate", "wait_awake", "Block until the gates are open.")
    generate = _forward("gate", "generate", "`Gate.generate`: the one road to an engine's generate.")
    health = _forward("gate", "health", "`Gate.health`.")

    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        """Abort on every server in rotation; raises naming a server that could not be told."""
        failed = await self.gate.abort(rid, abort_all=abort_all)
        if failed:
            url, e = failed[0]
            raise LifecycleError("abort", str(e), url=url, cause=e)
