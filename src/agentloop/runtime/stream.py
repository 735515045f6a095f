"""The streaming mode: the engine stays awake, `active` trajectories stay in flight, complete groups
reach the trainer through a bounded queue, and new weights are applied in flight.

For a trainer that does not need the GPU back (disaggregated, or a small trainer beside the engine):

    async with rollout_stream(runtime, feeder, StreamConfig(batch_groups=8, active=256, max_staleness=1)) as s:
        async for batch in s:                      # StreamBatch: complete, filtered groups + tensors
            weights = train_on(batch)
            await s.update_weights(weights)        # in flight: end what runs → load → go on

and from synchronous code `SyncRolloutStream(runtime, feeder, config)` (stream_sync.py: the runtime's
blocking portal, same coroutines). What happens:

- **Wake-up once**: the stream takes the runtime's step lock for its whole life (no `step` runs
  meanwhile), finishes a failed sleep if one is pending, and wakes the engines with the staged
  wake-up; the gate opens only once that is complete, so the first generate waits for it. On close
  every running trajectory is stopped (its partial kept on `leftover`) and the engines sleep again,
  so the runtime's next `step` starts SLEEPING as always. Groups finished and not taken are on
  `unconsumed`, also when the trainer's own error ends the block (raised as itself).
- **Engines that die or hang** (`EngineWatch`, stream_engines.py): a failed trajectory, or a server
  silent for `engine.hung_timeout` with requests in flight, runs the lifecycle's liveness probe (at
  most once per `ENGINE_CHECK_INTERVAL`); with no server left the stream stops admitting and the trainer's next
  batch raises that `LifecycleError`. A server restarted (or taken over) mid-stream is taken out by
  the gate at its first answer, which is dropped (`Gate.check_answer`), and the stream goes on with
  the others. A server silent for `engine.hung_timeout` with requests in flight (and to `/model_info`)
  is taken out by the router as in a step, its requests retried on the others: one watch
  (`Scheduler.server_watchdog`) for the whole stream, not one per trajectory's scheduler run.
- **Admission** (`StreamAdmission`, stream_admission.py): a prompt is drawn from `feeder` (Samples or dataset rows; an iterator
  or an async iterator) and its `n` members start whenever fewer than `active` trajectories are in
  flight, the queue to the trainer is not full (backpressure: a trainer that stops consuming stops
  admission; what waits is bounded by `max_queued_batches` batches plus what was in flight), no
  weight update is under way, and the staleness bound allows it (AReaL's rule: groups running or accepted ≤
  (updates + η + 1) × batch_groups; a failed, rejected or stale group gives its place back). Every trajectory runs through `Scheduler.run` (failure
  isolation, timeouts, rewards as in a step) and every generate through the router and the gate.
- **Groups**: a group is complete when all its members finished; one with a failed member is
  dropped (counted), the group filter (`group_filter`) rejects or accepts it, and accepted groups
  are batched `batch_groups` at a time. When the trainer takes a batch, a group whose oldest first
  token is more than η versions behind the served version is dropped or restarted
  (`stale_policy`), and the batch's staleness histogram (versions behind → trained tokens) is set.
- **Weights in flight** (`update_weights`; `Lifecycle.update_weights_drained`; what each cost: `UpdateLog`):
  the gates close (generates wait there), every request in flight is aborted — by this process
  (`drain="client"`, the default: abort all, wait until every answer is back) or by the server with the
  load (`"server"`: `abort_all_requests`) — the weights load (the prefix cache flushed unless
  `kv_on_update="reuse"`) and the gates reopen on the new version, which must be a name not served
  before (`VersionLog.check_new`). An aborted turn goes on in place (`Episode.generate`): its tokens
  so far are a piece with the old version, the rest is sampled by the new weights, so every token's
  version is the one that sampled it and no trajectory ends for an update. Not SGLang's `in_place` or
  `retract` pause: SGLang reports one `weight_version` per response, so a request spanning the update
  would label its earlier tokens with the new version (docs/trainers.md, "Which pause mode").
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, AsyncIterable, AsyncIterator, Iterable, Mapping

import anyio
import anyio.abc

from ..engine.lifecycle import EngineState, Lifecycle
from ..scheduler import expand_samples, with_overrides
from ..group_filters import get_group_filter
from ..scheduler.gc_scope import frozen_heap
from ..scheduler.staleness import VersionLog
from ..types import Sample, Trajectory
from .inputs import check_pad_to, check_reward_name, rows_to_samples
from .stream_admission import StreamAdmission
from .stream_batches import StreamBatches
from .stream_engines import EngineWatch
from .stream_groups import StreamGroup, StreamGroups
from .stream_queue import BatchQueue
from .stream_sync import SyncRolloutStream
from .stream_types import StreamBatch, StreamConfig
from .stream_updates import UpdateLog

log = logging.getLogger(__name__)

__all__ = ["RolloutStream", "SyncRolloutStream", "StreamBatch", "StreamConfig", "rollout_stream"]

#: A trajectory interrupted this many times in a row (weight updates, engine aborts) fails instead of
#: being resumed again: an engine that aborts everything must not loop a trajectory forever.
MAX_RESUMES = 100
#: Seconds admission may be held back by the staleness capacity alone, nothing in flight, before it says so.
STALL_WARNING_S = 10.0
#: Seconds between two liveness probes that failed trajectories ask for (`EngineWatch`).
ENGINE_CHECK_INTERVAL = 1.0


class RolloutStream:
    """A running stream (see the module docstring); made by `rollout_stream`."""

    def __init__(self, runtime: Any, feeder: Iterable[Any] | AsyncIterable[Any], config: StreamConfig, *,
                 pad_to: tuple[int | None, int | None] | None = None, overrides: Mapping[str, Any] | None = None) -> None:
        if not isinstance(config, StreamConfig):
            raise TypeError(f"rollout_stream: config must be a StreamConfig, got {type(config).__name__}")
        self.rt = runtime
        self.config = config
        self.pad_to = check_pad_to(pad_to)
        self.scfg = with_overrides(runtime.config.scheduler, dict(overrides or {}))
        if runtime.reward_fn is None:
            check_reward_name(self.scfg.reward)
        # Each trajectory is its own scheduler run: no step-level target, filter or heap freeze there
        # (groups are assembled and filtered here, across runs).
        self._traj_cfg = self.scfg.model_copy(update={"target_groups": None, "group_filter": None, "gc_freeze": False,
                                                      "group_budget": None, "active": None, "max_staleness": None})
        self.groups = StreamGroups(get_group_filter(self.scfg.group_filter) if self.scfg.group_filter else None,
                                   self.scfg.group_filter)
        self.admission = StreamAdmission(
            feeder, config,
            lambda row: rows_to_samples([row], runtime._row_numbers, trainer_reward=runtime.reward_fn is not None)[0])
        #: The order of weight versions: the scheduler's log (its runs observe the served version too), so
        #: the runtime's later steps count staleness in the same order.
        self.versions: VersionLog = runtime.scheduler.versions
        self._tg: anyio.abc.TaskGroup | None = None
        self._changed = anyio.Event()
        self.queue: BatchQueue[list[list[Trajectory]]] = BatchQueue(config.max_queued_batches)
        self.engines = EngineWatch(runtime.lifecycle, self._stop_with, hung_timeout=runtime.config.engine.hung_timeout,
                                   interval=ENGINE_CHECK_INTERVAL)
        self._closing = False
        self._stall_warned = False
        self._trainer_waiting = False  # in `__anext__`, waiting for a batch
        self._error: Exception | None = None  # why admission stopped, if the feeder failed
        self.in_flight = 0
        self.batches = StreamBatches(self.versions, runtime.pad_token_id, self.pad_to)
        #: Samples of trajectories still unfinished when the stream closed (partials on `resume_from`):
        #: pass them to a later `step` or stream to continue them.
        self.leftover: list[Sample] = []
        #: Complete, accepted groups the trainer had not taken when the stream closed (nothing is lost).
        self.unconsumed: list[list[Trajectory]] = []
        self._counts: dict[str, int] = dict.fromkeys(("trajectories_finished", "trajectories_resumed"), 0)
        #: What each in-flight update cost (`trajectories_resumed` counts trajectories resumed as partial
        #: rollouts instead of going on in place).
        self.updates = UpdateLog(runtime.lifecycle, self.versions, flush_cache=config.kv_on_update == "recompute",
                                 gc_paused=self.scfg.gc_freeze, server_drain=config.drain == "server",
                                 on_change=self._poke)
        self.max_buffered_groups = 0  # most complete groups waiting for the trainer at once (backpressure)
        self.t_awake: float | None = None

    # ------------------------------------------------------------------ life
    async def _open(self, weights: Any, tg: anyio.abc.TaskGroup) -> None:
        lc: Lifecycle = self.rt.lifecycle
        if lc.state is EngineState.DRAINING:
            log.warning("finishing the previous step's sleep (failed at stage %r) before streaming", lc.sleep_resume_at)
            await lc.sleep()
        self.versions.observe(await lc.wake_up(weights))
        self.t_awake = time.monotonic()
        self._tg = tg
        tg.start_soon(self._admit)
        tg.start_soon(self._batcher)
        tg.start_soon(lc.keep_lease)
        tg.start_soon(self.engines.watch)
        servers = self.rt.scheduler.server_watchdog()
        if servers is not None:  # hung servers taken out (their requests retried elsewhere), as in a step
            tg.start_soon(servers.run)

    async def _close(self) -> None:
        """Stop admitting, stop every running trajectory (kept on `leftover`), put the engines to sleep."""
        self._closing = True
        self._poke()
        sched = self.rt.scheduler
        if sched is not None:
            sched.stop("rollout stream closed")
        with anyio.move_on_after(self.scfg.abort_grace + 5):
            while self.in_flight > 0:
                await self._wait_change()
        assert self._tg is not None
        self._tg.cancel_scope.cancel()

    def _collect_unconsumed(self) -> None:
        """After the tasks ended: the groups still queued or waiting to be batched go to `unconsumed`."""
        for groups in self.queue.drain():
            self.unconsumed.extend(groups)
        ready, partials = self.groups.close()
        self.unconsumed.extend(ready)
        self.leftover.extend(partials)

    # ------------------------------------------------------------------ the trainer's side
    def __aiter__(self) -> "RolloutStream":
        return self

    async def __anext__(self) -> StreamBatch:
        while True:
            if self._error is not None:
                raise self._error
            self._trainer_waiting = True
            try:
                groups = await self.queue.get()
            except (anyio.EndOfStream, anyio.ClosedResourceError):  # closed: the stream's block has ended
                if self._error is not None:
                    raise self._error from None
                raise StopAsyncIteration from None
            finally:
                self._trainer_waiting = False
            self._poke()  # room in the queue: admission may go on
            groups = self.admission.bound_staleness(groups, self.versions)  # a restart is admitted on the poke above
            if groups:
                return self.batches.make(groups, self.weight_version,
                                         in_flight=self.in_flight, buffered_groups=self.buffered_groups)

    async def update_weights(self, weights: Any, version: str | None = None) -> str | None:
        """Apply new weights in flight (see the module docstring; `UpdateLog.apply`: one at a time, a version
        not served before, or none: the lifecycle names it); returns the version now served."""
        if self._closing:
            raise RuntimeError("update_weights on a rollout stream that is closed (its block ended and the engines "
                               "sleep): load the weights with the next rt.step(samples, weights) or stream's weights=")
        return await self.updates.apply(weights, version)  # its end pokes admission (`on_change`)

    # Each update's cost, one entry per update (`UpdateLog`; also in `metrics`): public since before the split.
    update_seconds = property(lambda self: self.updates.seconds, doc="seconds of each update")
    update_drain_seconds = property(lambda self: self.updates.drain_seconds, doc="of which the drain")
    update_load_seconds = property(lambda self: self.updates.load_seconds, doc="of which the load")
    update_cpu_seconds = property(lambda self: self.updates.cpu_seconds, doc="this process's CPU seconds")
    update_interrupted = property(lambda self: self.updates.interrupted, doc="requests each update interrupted")

    @property
    def weight_version(self) -> str | None:
        return self.rt.lifecycle.weight_version

    @property
    def buffered_groups(self) -> int:
        """Complete groups waiting for the trainer: not yet batched, in a batch the queue has no room
        for, or in the queue."""
        return len(self.groups.ready) + self.queue.waiting * self.config.batch_groups

    @property
    def counts(self) -> dict[str, int]:
        """Prompts admitted, groups dropped or restarted for staleness, trajectories finished and resumed,
        updates applied."""
        return {**self.admission.counts, **self._counts, "updates": self.updates.count}

    @property
    def metrics(self) -> dict[str, Any]:
        return {**self.counts, **self.groups.counts, "in_flight": self.in_flight, "batches": self.batches.count,
                "buffered_groups": self.buffered_groups, "max_buffered_groups": self.max_buffered_groups,
                **self.updates.metrics(), "kv_on_update": self.config.kv_on_update,
                "drain": self.config.drain,
                "weight_version": self.weight_version,
                "generations_outside_awake": self.rt.lifecycle.generations_outside_awake}

    # ------------------------------------------------------------------ admission
    def _poke(self) -> None:
        self._changed.set()

    async def _wait_change(self) -> None:
        if self._changed.is_set():
            self._changed = anyio.Event()
        await self._changed.wait()

    def _admissible(self, n: int) -> bool:
        if self._closing or self.updates.updating or self._error is not None:
            return False
        return self.admission.allows(n, in_flight=self.in_flight, buffered_groups=self.buffered_groups,
                                     updates=self.updates.count, groups_discarded=self._discarded)

    @property
    def _discarded(self) -> int:
        """Complete groups that will never reach the trainer (a member failed, the filter said no)."""
        return self.groups.counts["groups_failed"] + self.groups.counts["groups_rejected"]

    async def _admit(self) -> None:
        try:
            await self._admit_loop()
        except Exception as e:  # noqa: BLE001 - a bad prompt, or the feeder itself raised: the trainer
            # hears it (as itself) at its next batch; what runs and what finished is kept, not torn down
            log.error("rollout stream: admission stopped after %d prompts: %s: %s",
                      self.admission.counts["groups_admitted"], type(e).__name__, e)
            self._stop_with(e)

    def _stop_with(self, error: Exception) -> None:
        """Admission stops; the trainer gets `error` at its next batch."""
        self._error = error
        self._poke()

    async def _admit_loop(self) -> None:
        n = self.scfg.n
        while True:
            # After the feeder ran out, only restarted prompts (stale_policy "restart") are admitted.
            while not self._admissible(n) or self.admission.drained:
                with anyio.move_on_after(STALL_WARNING_S) as waited:
                    await self._wait_change()
                if waited.cancelled_caught:
                    self._warn_if_stalled(n)
            sample = await self.admission.next()
            if sample is None:
                self._poke()
                continue
            members = expand_samples([sample], n)
            group = self.groups.open(sample, members)
            self.in_flight += len(members)
            assert self._tg is not None
            for i, m in enumerate(members):
                self._tg.start_soon(self._run_member, group, i, m)

    def _warn_if_stalled(self, n: int) -> None:
        """Said once: the trainer waits for a batch, nothing runs or waits, and only the staleness capacity
        holds admission back, so no batch comes until `update_weights` (from another task, or never)."""
        idle = not (self.in_flight or self.groups.ready or self.queue.waiting or self._closing or self.updates.updating)
        if self._stall_warned or not (self._trainer_waiting and idle) or self._error is not None:
            return
        if self.admission.held_back_by_staleness(n, updates=self.updates.count, groups_discarded=self._discarded):
            self._stall_warned = True
            log.warning("rollout stream: nothing in flight for %.0f s, max_staleness=%d admits no more groups until "
                        "the next update_weights (%d applied), and the trainer waits for a batch: unless another "
                        "task updates the weights, it waits forever", STALL_WARNING_S, self.config.max_staleness,
                        self.updates.count)

    # ------------------------------------------------------------------ one trajectory
    async def _run_member(self, group: StreamGroup, i: int, job: Sample) -> None:
        traj: Trajectory | None = None
        try:
            for _ in range(MAX_RESUMES + 1):
                if self._closing:
                    self.leftover.append(job)
                    return
                # One server watch for the whole stream (`_open`), not one task per trajectory in flight.
                res = await self.rt.scheduler.run([job], config=self._traj_cfg, watch_servers=False)
                if res.trajectories:
                    traj = res.trajectories[0]
                    break
                if not res.carry_over:  # cannot happen without a filter; say so rather than lose it
                    raise RuntimeError(f"scheduler returned nothing for {job.uid}")
                job = res.carry_over[0]  # interrupted (an update's pause, a stop): resume at once
                if not self._closing:
                    self._counts["trajectories_resumed"] += 1
            else:
                prev = job.resume_from
                traj = prev if prev is not None else Trajectory(uid=job.uid, group_id=job.group_id, prompt_ids=[])
                traj.status, traj.error = "failed", f"interrupted {MAX_RESUMES} times in a row"
        finally:
            self.in_flight -= 1
            self._poke()
        self._counts["trajectories_finished"] += 1
        if self.groups.finish(group, i, traj):
            self.max_buffered_groups = max(self.max_buffered_groups, self.buffered_groups)
        self._poke()
        if traj.status == "failed" and not self._closing:
            await self.engines.check()  # a dead fleet would fail every prompt the feeder has

    # ------------------------------------------------------------------ batches
    async def _batcher(self) -> None:
        B = self.config.batch_groups
        try:
            while True:
                while len(self.groups.ready) < B and not (self._done and self.groups.ready):
                    if self._done or self._error is not None:
                        return
                    await self._wait_change()
                try:
                    await self.queue.put(self.groups.take(B))  # blocks while the queue is full
                finally:
                    self._poke()
        finally:
            self.queue.close_producer()

    @property
    def _done(self) -> bool:
        """Nothing more will come: the feeder ran out (or the stream closes) and nothing is in flight."""
        return (self.admission.exhausted or self._closing) and self.in_flight == 0 and not self.admission.restarts


@contextlib.asynccontextmanager
async def rollout_stream(runtime: Any, feeder: Iterable[Any] | AsyncIterable[Any], config: StreamConfig, *,
                         weights: Any = None, pad_to: tuple[int | None, int | None] | None = None,
                         **overrides: Any) -> AsyncIterator[RolloutStream]:
    """Run a `RolloutStream` over `runtime`'s engines until the block ends (see the module docstring).
    `weights` are loaded by the first (staged) wake-up; `overrides` replace scheduler settings (`n=4`,
    `group_filter=...`) as in `Runtime.step`."""
    if not runtime.started:
        await runtime.start()
    stream = RolloutStream(runtime, feeder, config, pad_to=pad_to, overrides=overrides)
    # `scheduler.gc_freeze` over the stream's whole life (a step freezes for its own): the collections
    # then walk what the stream allocated, not the trainer's heap, which at hundreds of trajectories in
    # flight made full collections stall the event loop for ~0.5 s each on the H200 host.
    async with runtime._step_lock:  # no step runs while the stream holds the engines awake
        try:
            trainer_error: Exception | None = None
            with frozen_heap(stream.scfg.gc_freeze):
                try:
                    async with anyio.create_task_group() as tg:
                        await stream._open(weights, tg)
                        try:
                            yield stream
                        except Exception as e:  # re-raised below as itself, not in the task group's ExceptionGroup
                            trainer_error = e
                        finally:
                            with anyio.CancelScope(shield=True):
                                await stream._close()
                finally:  # also when the trainer's block raised: what finished is kept on the stream
                    stream._collect_unconsumed()
            if trainer_error is not None:
                raise trainer_error
        finally:
            with anyio.CancelScope(shield=True):
                await runtime.lifecycle.sleep()

