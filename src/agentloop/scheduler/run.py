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
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable, Iterable, Iterator, Sequence

import anyio
import anyio.abc

from ..config.settings import SchedulerConfig
from ..engine.router import RouteSession, Router
from ..types import FINISHED_OK, Sample, TimelineEvent, Trajectory
from .book import GroupBook, expand_samples
from .filters import get_group_filter
from .result import ScheduleResult, build_result
from .trajectory import TrajectoryRunner
from .watchdog import Watchdog

log = logging.getLogger("agentloop.scheduler")

__all__ = ["OnTrajectory", "ScheduleRun"]

OnTrajectory = Callable[[Trajectory], "Awaitable[None] | None"]


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
        more_samples: Iterable[Sample] | None = None,
    ) -> None:
        self.router = router
        self.runner = runner
        self.cfg = config
        self.clock = clock
        self.on_trajectory = on_trajectory
        self.book = GroupBook(
            n=config.n, target_groups=config.target_groups, group_budget=config.group_budget,
            group_filter=get_group_filter(config.group_filter) if config.group_filter else None,
            filter_name=config.group_filter,
        )
        self.more: Iterator[Sample] | None = iter(more_samples) if more_samples is not None else None
        self.refill_stop = ""  # why drawing from more_samples stopped, if it did
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
        book.add(expand_samples(samples, cfg.n))
        if cfg.target_groups is not None and cfg.target_groups > book.num_groups and self.more is None:
            log.warning("target_groups=%d but only %d groups in this step: waiting for all", cfg.target_groups, book.num_groups)
        t0 = self.clock()
        self._limit = anyio.Semaphore(cfg.concurrency)
        async with anyio.create_task_group() as outer:
            if cfg.trajectory_timeout is not None or self.watchdog.hung_timeout is not None:
                outer.start_soon(self.watchdog.run)
            async with anyio.create_task_group() as tg:
                self._tg = tg
                for i in range(len(book.jobs)):
                    tg.start_soon(self._one, i, t0)
                self._refill()  # fewer groups given than the target: draw the rest now
            outer.cancel_scope.cancel()  # every trajectory is done: the watchdog ends
        wall = self.clock() - t0
        result = build_result(book, cfg, wall=wall, refill_stop=self.refill_stop, stopped_from_outside=self.external_stop,
                              router_stats=self.router.stats)
        # A cancelled watcher's traceback (its frame holds `self`) keeps this run in a reference cycle that
        # only a full garbage collection frees; let go of the trajectories here, so that they are freed when
        # the caller drops the result rather than at some later full collection (which must also walk them).
        self.book, self.more = GroupBook(), None
        return result

    def stop(self, reason: str, *, early: bool = False) -> None:
        """Nothing new starts or is dispatched; running trajectories are stopped and their requests
        aborted (they come back as carry-over). `early`: the target was reached (not a stop from outside)."""
        self.external_stop = self.external_stop or not early
        self.stopping = True
        self.stop_reason = reason
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
        session = self.router.session(job.uid, slot_order=cfg.slot_order)
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
        if decision.emit and self.on_trajectory is not None:
            for k in decision.emit:
                r = self.on_trajectory(self.book.results[k])  # type: ignore[arg-type]
                if r is not None:
                    await r
        if decision.target_reached:
            log.info("target of %d complete groups reached: stopping %d running trajectories",
                     self.cfg.target_groups, len(self.sessions))
            self.stop("early stop: target groups reached", early=True)
        if decision.refill:
            self._refill()

    def _refill(self) -> None:
        """Draw fresh prompts from `more_samples` while accepted + running groups fall short of the target."""
        if self.more is None or self.stopping or self._tg is None:
            return
        while self.book.groups_wanted() > 0:
            if self.book.budget_reached():
                self.refill_stop = f"group_budget of {self.book.group_budget} groups reached"
                return
            try:
                added = self.book.add_sample(next(self.more))
            except StopIteration:
                self.more, self.refill_stop = None, "more_samples exhausted"
                return
            except (TypeError, ValueError) as e:  # a bad sample from the source: stop drawing, keep the step
                self.more, self.refill_stop = None, f"more_samples gave a bad sample: {e}"
                log.error("scheduler: %s", self.refill_stop)
                return
            for k in added:
                self._tg.start_soon(self._one, k, self.clock())
