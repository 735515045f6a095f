"""One `Scheduler.run` call: starts the trajectories, asks the group book what each finish means,
draws more prompts, stops what is left, and turns the book into a `ScheduleResult`.

The parts it orchestrates, each with one job:

- `GroupBook` (book.py, synchronous): members, results, group verdicts, what is final or carried;
- `Watchdog` (watchdog.py): per-trajectory deadlines and hung servers;
- `TrajectoryRunner` (trajectory.py): one agent loop with its context, failure isolation and score;
- the `Router` (engine/router.py): a route session per trajectory (sticky server, this run's slot
  order) and `stop_sessions`, which stops sessions and aborts their requests in flight.

The run's own state is what happens in time: the task group, the concurrency limit, the sessions of
running trajectories, whether (and why) it is stopping, and where fresh prompts come from.

As a stream (a trainer that takes groups as they finish), through `Scheduler`:

    result = await scheduler.run([], more_samples=queue_of_samples,      # sync or async iterable
                                 config=cfg.model_copy(update={"active": 512}),
                                 on_group=hand_group_to_trainer)           # (members, verdict)
    ...
    scheduler.stop("weights changed")   # from another task: returns at once (see stop())

`on_group` gets each group once every member finished (none carried), with its verdict; `stop`
cuts tool waits, aborts the requests in flight in one round and cancels the wait on the feeder, and
`result.carry_over` holds the unfinished trajectories (partials) for the next run. Weight versions
changed in flight are counted for staleness once recorded with `scheduler.versions.observe(v)`.
"""

from __future__ import annotations

import logging
import dataclasses
from typing import AsyncIterable, Awaitable, Callable, Iterable, Sequence

import anyio
import anyio.abc

from ..config.scheduler import CPU_ENGINE_CONCURRENCY, SchedulerConfig
from ..engine.router import RouteSession, Router
from ..types import FINISHED_OK, Sample, TimelineEvent, Trajectory
from .book import GroupBook, expand_samples
from .feeder import Feeder
from ..group_filters import get_group_filter
from .result import ScheduleResult, build_result
from .staleness import VersionLog, token_staleness
from .trajectory import TrajectoryRunner
from .watchdog import Watchdog

log = logging.getLogger("agentloop.scheduler")

__all__ = ["OnGroup", "OnTrajectory", "ScheduleRun"]

OnTrajectory = Callable[[Trajectory], "Awaitable[None] | None"]
#: Called with a decided group's members (input order) and its verdict: "accepted", "failed" (a member
#: failed) or "rejected" (the group filter); a group with a member carried over is not decided.
OnGroup = Callable[[list[Trajectory], str], "Awaitable[None] | None"]


class ScheduleRun:
    """The state of one `Scheduler.run` call (see the module docstring). Run it once."""

    def __init__(
        self,
        *,
        router: Router,
        runner: TrajectoryRunner,
        config: SchedulerConfig,
        clock: Callable[[], float],
        hung_timeout: float | None = None,
        on_trajectory: OnTrajectory | None = None,
        more_samples: Iterable[Sample] | AsyncIterable[Sample] | None = None,
        on_group: OnGroup | None = None,
        versions: VersionLog | None = None,
    ) -> None:
        self.router = router
        self.runner = runner
        self.cfg = config
        self.clock = clock
        self.on_trajectory = on_trajectory
        self.on_group = on_group
        #: The order of weight versions (the scheduler's, shared across its runs): staleness.
        self.versions = versions if versions is not None else VersionLog()
        self.book = GroupBook(
            n=config.n, target_groups=config.target_groups, group_budget=config.group_budget,
            group_filter=get_group_filter(config.group_filter) if config.group_filter else None,
            filter_name=config.group_filter,
        )
        self.feeder: Feeder | None = Feeder(more_samples) if more_samples is not None else None
        self.refill_stop = ""  # why drawing from more_samples stopped, if it did
        self._room = anyio.Event()  # set when a trajectory finishes or the run stops: the feeder may draw
        self._drawing: anyio.CancelScope | None = None  # an async feeder's wait for its next sample
        self.dropped: list[Sample] = []  # carried groups past max_staleness (stale_policy "drop")
        self.stale_restarted = 0  # carried trajectories past max_staleness restarted from their prompt
        self.slot_preemptions = 0  # requests of this run aborted for a better-ranked turn's slot (target_first)
        self.misaligned_answers = 0  # answers of this run dropped for logprobs not matching their ids, turns asked again
        #: Route sessions of the trajectories running now, by index.
        self.sessions: dict[int, RouteSession] = {}
        self.watchdog = Watchdog(clock=clock, is_running=self.sessions.__contains__, on_expired=self._expired,
                                 router=router, hung_timeout=hung_timeout)
        self.stopping = False
        self.stop_reason = ""
        self.external_stop = False  # stopped from outside (a sleep), not by reaching the target
        self._tg: anyio.abc.TaskGroup | None = None
        self._limit: anyio.Semaphore | None = None

    async def run(self, samples: Sequence[Sample]) -> ScheduleResult:
        cfg, book = self.cfg, self.book
        self.versions.observe(self.router.gate.weight_version)
        book.add(self._bound_staleness(expand_samples(samples, cfg.n)))
        if cfg.target_groups is not None and cfg.target_groups > book.num_groups and self.feeder is None:
            log.warning("target_groups=%d but only %d groups in this step: waiting for all", cfg.target_groups, book.num_groups)
        t0 = self.clock()
        # `auto` is resolved by the Runtime from the engines (agentloop.runtime.concurrency); a scheduler
        # used on its own (verl's AgentLoopManager, tests) has no engine to ask and keeps the CPU default.
        self._limit = anyio.Semaphore(cfg.concurrency if isinstance(cfg.concurrency, int) else CPU_ENGINE_CONCURRENCY)
        async with anyio.create_task_group() as outer:
            if cfg.trajectory_timeout is not None or self.watchdog.hung_timeout is not None:
                outer.start_soon(self.watchdog.run)
            async with anyio.create_task_group() as tg:
                self._tg = tg
                for i in range(len(book.jobs)):
                    tg.start_soon(self._one, i, t0)
                if self.feeder is not None and (cfg.target_groups is not None or cfg.active is not None):
                    tg.start_soon(self._feed)
            self.watchdog.stop()  # every trajectory is done: the watchdog ends
        wall = self.clock() - t0
        result = build_result(book, cfg, wall=wall, refill_stop=self.refill_stop, stopped_from_outside=self.external_stop,
                              router_stats=self.router.stats)
        result.dropped = self.dropped
        result.metrics.update(token_staleness(self.versions, result.trajectories))
        result.metrics["stale_restarted"] = self.stale_restarted
        result.metrics["stale_dropped"] = len(self.dropped)
        result.metrics["slot_preemptions"] = self.slot_preemptions
        result.metrics["misaligned_answers"] = self.misaligned_answers
        result.metrics["samples_drawn"] = self.feeder.drawn if self.feeder is not None else 0
        # Nothing may keep this run in a reference cycle (only a full collection would free it, walking
        # everything it holds; the streaming mode makes one run per trajectory): the watchdog stopped and
        # dropped its callbacks (`Watchdog.stop`), and the trajectories and the task group are let go here
        # (a server watcher's cancelled traceback can still hold the run's frames).
        self.book, self.feeder = GroupBook(), None
        self._tg = None
        return result

    def stop(self, reason: str, *, early: bool = False) -> None:
        """Nothing new starts or is dispatched; running trajectories are stopped and their requests
        aborted (they come back as carry-over). `early`: the target was reached (not a stop from outside)."""
        self.external_stop = self.external_stop or not early
        self.stopping = True
        self.stop_reason = reason
        self._room.set()  # the feeder stops drawing
        if self._drawing is not None:
            self._drawing.cancel()  # nor waits for a sample (an async source's wait takes nothing from it)
        if self._tg is None:
            return
        sessions = list(self.sessions.values())
        if sessions:
            self._tg.start_soon(self.router.stop_sessions, sessions, reason)

    # ------------------------------------------------------------------ one trajectory
    async def _one(self, i: int, t_queued: float) -> None:
        job = self.book.jobs[i]
        prev = job.resume_from
        if prev is not None and prev.status != "aborted":
            # A member that finished in an earlier step (its group did not): nothing to run.
            await self._score(prev, job)
            await self._finish(i, prev)
            return
        limit = self._limit
        assert limit is not None
        # A free slot is taken without `async with limit`'s two checkpoints (a cancel-shielded round trip
        # through the event loop per trajectory); a full limit waits for one as before.
        try:
            limit.acquire_nowait()
        except anyio.WouldBlock:
            await limit.acquire()
        try:
            if self.stopping:  # stopped before it started: carried over untouched
                return
            t_start = self.clock()
            traj = await self._run_agent(i, job)
        finally:
            limit.release()
        traj.timeline = sorted([TimelineEvent("queue", t_queued, t_start), *traj.timeline], key=lambda e: e.start)
        traj.metrics["queue_seconds"] = t_start - t_queued
        await self._score(traj, job)
        await self._finish(i, traj)

    async def _run_agent(self, i: int, job: Sample) -> Trajectory:
        cfg = self.cfg
        book = self.book
        rank = (lambda: book.slot_rank(i)) if cfg.slot_order == "target_first" else None
        session = self.router.session(job.uid, slot_order=cfg.slot_order, server_priority=cfg.server_priority,
                                      slot_rank=rank, preempt=cfg.slot_preemption)
        self.sessions[i] = session
        if self.stopping:
            session.stop(self.stop_reason)
        tt = cfg.trajectory_timeout
        if tt is not None:
            self.watchdog.add_deadline(i, self.clock() + tt)
        try:
            traj, error = await self.runner.run(
                job, session, hard_timeout=None if tt is None else tt + cfg.abort_grace,
                why_hard=f" (timeout {tt}s + grace {cfg.abort_grace}s)")
        finally:
            session.close()
            self.sessions.pop(i, None)
            self.slot_preemptions += session.preempted
            self.misaligned_answers += session.misaligned
        if i in self.watchdog.timed_out and traj.error is None:
            traj.status = "failed"
            traj.finish_reason = "timeout"
            traj.error = f"trajectory timed out after {tt}s (partial result kept)"
        elif error is not None and traj.error is None:
            traj.status, traj.error = "failed", error
        self.runner.annotate(traj, job, session)
        return traj

    async def _score(self, traj: Trajectory, job: Sample) -> None:
        if traj.status in FINISHED_OK and traj.reward is None:
            await self.runner.score(traj, job, timeout=self.cfg.reward_timeout, default=self.cfg.reward)

    def _expired(self, i: int) -> None:
        """The watchdog's call: trajectory `i` is past its deadline; stop it (its partial result is kept)."""
        session = self.sessions.get(i)
        if session is not None and self._tg is not None:
            self._tg.start_soon(self.router.stop_sessions, [session], "timeout")

    # ------------------------------------------------------------------ groups
    async def _finish(self, i: int, traj: Trajectory) -> None:
        decision = self.book.finish(i, traj)
        self._room.set()
        if decision.emit and self.on_trajectory is not None:
            for k in decision.emit:
                r = self.on_trajectory(self.book.results[k])  # type: ignore[arg-type]
                if r is not None:
                    await r
        if self.on_group is not None and decision.group:
            r = self.on_group([self.book.results[k] for k in decision.group], decision.group_verdict)  # type: ignore[misc]
            if r is not None:
                await r
        if decision.target_reached:
            log.info("target of %d complete groups reached: stopping %d running trajectories",
                     self.cfg.target_groups, len(self.sessions))
            self.stop("early stop: target groups reached", early=True)

    # ------------------------------------------------------------------ the feeder
    def _wants_more(self) -> bool:
        """Another group is wanted: accepted + running groups fall short of the target (a filter rejected
        some), or fewer than `active` trajectories are in flight (over-admission)."""
        if self.book.groups_wanted() > 0:
            return True
        active = self.cfg.active
        if active is None:
            return False
        # A whole group is drawn at once: it must fit under `active` (an empty run takes one regardless,
        # so `active` below the group size still makes progress).
        unfinished = self.book.unfinished
        return unfinished == 0 or unfinished + self.cfg.n <= active

    async def _feed(self) -> None:
        """Draw fresh prompts from the feeder whenever one is wanted, until the run stops, the feeder runs
        out, or `group_budget` groups were sampled. Each drawn prompt starts at once."""
        feeder, tg = self.feeder, self._tg
        assert feeder is not None and tg is not None
        while not self.stopping:
            if not self._wants_more():
                self._room = anyio.Event()
                await self._room.wait()
                continue
            if self.book.budget_reached():
                self.refill_stop = f"group_budget of {self.book.group_budget} groups reached"
                return
            with anyio.CancelScope() as scope:
                self._drawing = scope
                sample = await feeder.next()
            self._drawing = None
            if scope.cancelled_caught:  # stopped while waiting: nothing was taken from the source
                return
            if sample is None:
                self.refill_stop = "more_samples exhausted"
                return
            try:
                added = self.book.add_sample(sample)
            except (TypeError, ValueError) as e:  # a bad sample from the source: stop drawing, keep the step
                self.refill_stop = f"more_samples gave a bad sample: {e}"
                log.error("scheduler: %s", self.refill_stop)
                return
            for k in added:  # a run stopped meanwhile carries them over untouched
                tg.start_soon(self._one, k, self.clock())

    # ------------------------------------------------------------------ staleness
    def _bound_staleness(self, jobs: list[Sample]) -> list[Sample]:
        """Apply `max_staleness` to carried jobs (see staleness.py): restart them, or drop their group."""
        bound = self.cfg.max_staleness
        if bound is None:
            return jobs
        stale = {j.uid for j in jobs if j.resume_from is not None
                 and (self.versions.first_token_age(j.resume_from) or 0) > bound}
        if not stale:
            return jobs
        if self.cfg.stale_policy == "drop":
            groups = {j.group_id for j in jobs if j.uid in stale}
            self.dropped = [j for j in jobs if j.group_id in groups]
            log.info("scheduler: %d carried groups past max_staleness=%d dropped", len(groups), bound)
            return [j for j in jobs if j.group_id not in groups]
        self.stale_restarted = len(stale)
        return [dataclasses.replace(j, resume_from=None) if j.uid in stale else j for j in jobs]
