"""Runs one step's trajectories concurrently: limits, GRPO groups, timeouts, over-sampling, failure isolation.

This module owns *how many trajectories run, and when they stop*. `Scheduler.run(samples)`:

- **Groups**: a fresh sample (empty `group_id`) becomes `n` trajectories sharing `group_id` (the
  sample's uid) with uids `"{uid}_{i}"` (just `uid` when n == 1); a sample that already has a
  `group_id` (a member carried over from an earlier step) runs once, as that member.
- **Concurrency**: every trajectory's agent loop runs in ONE anyio task group; at most `concurrency`
  run at once (FIFO, so earlier prompts start first); the router enforces the per-server limit.
- **Timeouts**: past `trajectory_timeout` a trajectory is stopped (its in-flight request aborted by rid,
  later generates not dispatched) so the loop returns its partial result, marked `failed` with the
  error; if it has not returned `abort_grace` seconds later it is cancelled.
- **Hung servers**: with `hung_timeout`, a watchdog takes out any server that has requests in flight and
  answers none of them for that long nor a `/model_info` probe (a stopped or wedged process); its requests are retried on the
  other servers by the router, so the step fails over well inside `trajectory_timeout`.
- **Failure isolation**: an exception in one loop becomes that trajectory's `failed` status and error;
  the others go on. Results come back in input order.
- **Rewards**: completed and truncated trajectories are scored by `agentloop.rewards.score` with the
  trainer's `reward_fn` (sync or async, off the event loop, under `reward_timeout`), else the sample's
  named reward function, else `reward` (the dataset default) if the sample has a ground truth; a
  grader that fails or times out marks its trajectory failed with the error.
- **Over-sampling + early stop**: with `target_groups`, once that many groups are complete (every
  member completed or truncated) the rest are stopped and aborted on the servers; their groups come
  back as `carry_over` samples (`Sample.resume_from` = the partial trajectory, each turn tagged with
  its weight_version) to be passed to the next step, so nothing is lost and exactly `target_groups`
  complete groups are returned.
- **Group filtering**: with `group_filter` (a predicate over a complete group, see
  `agentloop.group_filters`; built-in `drop_zero_variance`) a complete group is accepted or rejected
  when its last member finishes. Rejected groups leave the batch (`ScheduleResult.rejected`, never
  emitted to `on_trajectory`) and do not count toward `target_groups`; while accepted + running
  groups fall short of `target_groups`, fresh prompts are drawn from `more_samples` (an iterator of
  samples, e.g. the trainer's dataloader) until the target is reached, `group_budget` groups were
  sampled, or the iterator runs out. Metrics: `groups_accepted`, `groups_rejected`, `groups_sampled`,
  `budget_exhausted` (the step ended short of `target_groups`) and `groups_budget_exhausted` (how many
  short).

Each trajectory gets `metrics` (queue/wait/generate/tool seconds) and "queue"/"wait" timeline spans.

Layout: this module runs the trajectories (`Scheduler`, `_ScheduleRun`: one trajectory's agent loop,
failure isolation, scoring); `scheduler_groups.py` keeps the group accounting (completion, filter,
refill, early stop, carry-over), `scheduler_watch.py` the deadlines, the server watchdog and stopping
sessions, `scheduler_result.py` turns a finished run into a `ScheduleResult`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback
from typing import Any, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence

import anyio
import anyio.abc

from .. import rewards
from ..agents.base import AgentConfig, AgentContext, AgentLoop, get_agent
from ..config.settings import CPU_ENGINE_CONCURRENCY, SchedulerConfig
from ..engine.router import RouteSession, Router
from .gc_scope import frozen_heap
from .filters import GroupFilter, get_group_filter
from .groups import _Group, expand_samples
from .result import ResultMixin, ScheduleResult
from .watch import WatchMixin
from ..types import FINISHED_OK, Sample, TimelineEvent, Trajectory

log = logging.getLogger(__name__)

__all__ = ["ScheduleResult", "Scheduler", "expand_samples"]

OnTrajectory = Callable[[Trajectory], "Awaitable[None] | None"]
RewardFn = Callable[..., Any]  #: sync or async; see `agentloop.rewards.call_reward`


class Scheduler:
    """Runs agent loops for a step. Build once per runtime; `run` may be called once per step."""

    def __init__(
        self,
        router: Router,
        *,
        tokenizer: Any,
        agent_config: AgentConfig,
        config: SchedulerConfig | None = None,
        tools: Any = None,
        interaction: Any = None,
        default_agent: str | None = None,
        reward_fn: RewardFn | None = None,
        clock: Callable[[], float] = time.monotonic,
        hung_timeout: float | None = None,
    ) -> None:
        self.router = router
        self.tokenizer = tokenizer
        self.agent_config = agent_config
        self.config = config or SchedulerConfig()
        self.tools = tools
        self.interaction = interaction
        self.default_agent = default_agent
        #: The trainer's reward function for every trajectory (any signature `rewards.call_reward` takes);
        #: None: each sample's named reward function.
        self.reward_fn = reward_fn
        self.clock = clock
        #: The step watchdog: a server with requests in flight that answers none for this long is hung
        #: and taken out (its requests retried elsewhere). None: no watchdog.
        self.hung_timeout = hung_timeout
        self._agents: dict[str, AgentLoop] = {}
        self._runs: list[_ScheduleRun] = []

    def _agent(self, name: str) -> AgentLoop:
        if name not in self._agents:
            self._agents[name] = get_agent(name)
        return self._agents[name]

    async def run(
        self,
        samples: Sequence[Sample],
        *,
        on_trajectory: OnTrajectory | None = None,
        config: SchedulerConfig | None = None,
        more_samples: Iterable[Sample] | None = None,
    ) -> ScheduleResult:
        """Run every sample's agent loop (see the module docstring); never raises for a trajectory's fault.
        `more_samples` supplies fresh prompts while a group filter keeps the step short of `target_groups`."""
        run = _ScheduleRun(self, config or self.config, on_trajectory, more_samples)
        self._runs.append(run)
        try:
            with frozen_heap(run.cfg.gc_freeze):
                return await run.run(samples)
        finally:
            self._runs.remove(run)

    async def aclose(self) -> None:
        """Release what the agent loops hold across trajectories (the runtime is stopping)."""
        for agent in self._agents.values():
            await agent.aclose()

    def stop(self, reason: str = "stopped") -> None:
        """Stop every running `run`: nothing new starts or is dispatched, in-flight requests are aborted;
        the stopped trajectories come back as carry-over. (Used before a sleep in the middle of a step.)"""
        for run in self._runs:
            run.stop(reason)


class _ScheduleRun(ResultMixin, WatchMixin):
    """The state of one `Scheduler.run` call."""

    def __init__(self, sched: Scheduler, cfg: SchedulerConfig, on_trajectory: OnTrajectory | None,
                 more_samples: Iterable[Sample] | None = None) -> None:
        self.s = sched
        self.cfg = cfg
        self.on_trajectory = on_trajectory
        self.filter: GroupFilter | None = get_group_filter(cfg.group_filter) if cfg.group_filter else None
        #: Emit and classify whole groups (target_groups or a filter), not single trajectories.
        self.grouped = cfg.target_groups is not None or self.filter is not None
        self.more: Iterator[Sample] | None = iter(more_samples) if more_samples is not None else None
        self.rejected_groups = 0
        self.uids: set[str] = set()  # every trajectory uid of this run (a drawn prompt must not reuse one)
        self.filter_errors = 0
        self.refill_stop = ""  # why drawing from more_samples stopped, if it did
        self.external_stop = False  # stopped from outside (a sleep), not by reaching the target
        self.limit: anyio.Semaphore | None = None
        self.t0 = 0.0
        self.clock = sched.clock
        self.results: list[Trajectory | None] = []
        self.jobs: list[Sample] = []
        self.groups: dict[str, _Group] = {}
        self.members: dict[str, list[int]] = {}
        self.complete_groups = 0
        self.stopping = False
        self.stop_reason = ""
        self.tg: anyio.abc.TaskGroup | None = None
        self.sessions: dict[int, RouteSession] = {}
        self.timed_out: set[int] = set()
        self.deadlines: list[tuple[float, int]] = []  # heap of (deadline, trajectory index)
        self._deadline_added = anyio.Event()

    async def run(self, samples: Sequence[Sample]) -> ScheduleResult:
        self._add_jobs(expand_samples(samples, self.cfg.n))
        if self.cfg.target_groups is not None and self.cfg.target_groups > len(self.groups) and self.more is None:
            log.warning("target_groups=%d but only %d groups in this step: waiting for all", self.cfg.target_groups, len(self.groups))
        self.t0 = t0 = self.clock()
        # `auto` is resolved by the Runtime from the engines (agentloop.runtime.concurrency); a scheduler
        # used on its own (verl's AgentLoopManager, tests) has no engine to ask and keeps the CPU default.
        conc = self.cfg.concurrency
        self.limit = anyio.Semaphore(conc if isinstance(conc, int) else CPU_ENGINE_CONCURRENCY)
        self.s.router.slot_order = self.cfg.slot_order  # one step at a time (the runtime's step lock)
        async with anyio.create_task_group() as outer:
            if self.cfg.trajectory_timeout is not None:
                outer.start_soon(self._watch_deadlines)
            if self.s.hung_timeout is not None:
                outer.start_soon(self._watch_servers, self.s.hung_timeout)
            async with anyio.create_task_group() as tg:
                self.tg = tg
                for i in range(len(self.jobs)):
                    tg.start_soon(self._one, i, self.limit, t0)
                self._refill()  # fewer groups given than the target: draw the rest now
            outer.cancel_scope.cancel()  # every trajectory is done: the watchers end
        wall = self.clock() - t0
        result = self._result(wall)
        # A cancelled watcher's traceback (its frame holds `self`) keeps this run in a reference cycle that
        # only a full garbage collection frees; let go of the trajectories here, so that they are freed when
        # the caller drops the result rather than at some later full collection (which must also walk them).
        self.results, self.jobs, self.more, self.groups, self.members, self.uids = [], [], None, {}, {}, set()
        return result

    # ------------------------------------------------------------------ one trajectory
    async def _one(self, i: int, limit: anyio.Semaphore, t_queued: float) -> None:
        job = self.jobs[i]
        prev = job.resume_from
        if prev is not None and prev.status != "aborted":
            # A member that finished in an earlier step (its group did not): nothing to run.
            if prev.status in FINISHED_OK and prev.reward is None:
                await self._score(prev, job)
            await self._finish(i, prev)
            return
        # A free slot is taken without `async with limit`'s two checkpoints (a cancel-shielded round trip
        # through the event loop per trajectory); a full limit waits for one as before.
        try:
            limit.acquire_nowait()
        except anyio.WouldBlock:
            await limit.acquire()
        try:
            if self.stopping:  # early stop before it started: carried over untouched
                return
            t_start = self.clock()
            traj = await self._run_agent(i, job)
        finally:
            limit.release()
        traj.timeline = sorted([TimelineEvent("queue", t_queued, t_start), *traj.timeline], key=lambda e: e.start)
        traj.metrics["queue_seconds"] = t_start - t_queued
        if traj.status in FINISHED_OK:
            await self._score(traj, job)
        await self._finish(i, traj)

    async def _run_agent(self, i: int, job: Sample) -> Trajectory:
        cfg = self.cfg
        session = self.s.router.session(job.uid)
        self.sessions[i] = session
        if self.stopping:
            session.stop(self.stop_reason)
        ctx = AgentContext(
            generate=session,
            tokenizer=self.s.tokenizer,
            config=self.s.agent_config,
            tools=self.s.tools,
            interaction=self.s.interaction,
            clock=self.clock,
        )
        name = job.agent or self.s.default_agent or "tool"
        traj: Trajectory | None = None
        error: str | None = None
        hard = (cfg.trajectory_timeout + cfg.abort_grace) if cfg.trajectory_timeout is not None else None
        if cfg.trajectory_timeout is not None:
            self._add_deadline(self.clock() + cfg.trajectory_timeout, i)
        try:
            with anyio.move_on_after(hard) as scope:
                try:
                    traj = await self.s._agent(name).run(job, ctx)
                    if not isinstance(traj, Trajectory):
                        raise TypeError(f"agent loop {name!r} returned {type(traj).__name__}, not a Trajectory")
                except Exception as e:  # failure isolation: this trajectory fails, the step goes on
                    traj = None
                    error = f"{type(e).__name__}: {e}"
                    log.warning("trajectory %s failed in agent %r:\n%s", job.uid, name, traceback.format_exc())
            if scope.cancelled_caught:
                error = f"trajectory did not return within {hard:.1f}s (timeout {cfg.trajectory_timeout}s + grace {cfg.abort_grace}s)"
        finally:
            session.close()
            self.sessions.pop(i, None)
        if traj is None:
            traj = self._empty(job, "failed", error or "agent loop returned nothing")
        if i in self.timed_out and traj.error is None:
            traj.status = "failed"
            traj.finish_reason = "timeout"
            traj.error = f"trajectory timed out after {cfg.trajectory_timeout}s (partial result kept)"
        elif error is not None and traj.error is None:
            traj.status, traj.error = "failed", error
        self._annotate(traj, job, session)
        return traj

    def _empty(self, job: Sample, status: str, error: str) -> Trajectory:
        prev = job.resume_from
        if prev is not None:  # keep what the earlier step produced
            t = dataclasses.replace(prev, timeline=list(prev.timeline), metrics=dict(prev.metrics))
        else:
            t = Trajectory(uid=job.uid, group_id=job.group_id, prompt_ids=self._prompt_ids(job), messages=list(job.messages))
        t.status, t.error, t.finish_reason = status, error, "error"  # type: ignore[assignment]
        return t

    def _prompt_ids(self, job: Sample) -> list[int]:
        """The rendered prompt, so a trajectory that failed before its first turn still shows its prompt."""
        try:
            from ..chat import render_ids

            return render_ids(self.s.tokenizer, job.messages, tools=job.tools)
        except Exception:  # the prompt itself may be what failed; the error is already recorded
            return []

    def _annotate(self, traj: Trajectory, job: Sample, session: RouteSession) -> None:
        traj.uid = traj.uid or job.uid
        traj.group_id = traj.group_id or job.group_id
        traj.index_in_group = job.index_in_group
        kinds = {e.kind for e in traj.timeline}
        extra = [e for e in session.events if e.kind == "wait" or "generate" not in kinds]
        traj.timeline = sorted(traj.timeline + extra, key=lambda e: e.start)
        m = traj.metrics
        m["wait_seconds"] = m.get("wait_seconds", 0.0) + sum(e.end - e.start for e in session.events if e.kind == "wait")
        m.setdefault("generate_seconds", sum(e.end - e.start for e in session.events if e.kind == "generate"))
        m.setdefault("tool_seconds", sum(e.end - e.start for e in traj.timeline if e.kind == "tool"))
        m["route_retries"] = m.get("route_retries", 0) + session.retries
        if session.servers:
            traj.extra["servers"] = list(dict.fromkeys(traj.extra.get("servers", []) + session.servers))

    async def _score(self, traj: Trajectory, job: Sample) -> None:
        """Score through `rewards.score` (the trainer's function, else the sample's named one, else
        `config.reward` for a sample with a ground truth): sync graders run off the event loop, under
        `reward_timeout`. A reward that cannot be computed makes the trajectory untrainable: it is
        marked failed with the grader's error; the step goes on. A trajectory that arrives scored (by
        a Ray worker's scheduler) keeps its reward and the worker's timings."""
        if traj.reward is not None:
            return
        await rewards.score(traj, job, timeout=self.cfg.reward_timeout, default=self.cfg.reward, fn=self.s.reward_fn)
        error = traj.extra.get("reward_error")
        if error:
            traj.status, traj.error = "failed", f"reward failed: {error}"
            log.warning("reward of %s failed: %s", traj.uid, error)



def with_overrides(config: SchedulerConfig, overrides: Mapping[str, Any]) -> SchedulerConfig:
    """`config` with some fields replaced, validated (unknown names raise naming them)."""
    unknown = sorted(set(overrides) - set(SchedulerConfig.model_fields))
    if unknown:
        raise TypeError(f"unknown scheduler settings {unknown}; known: {sorted(SchedulerConfig.model_fields)}")
    # The router's per-server slots are built once at start; a per-step value would be silently ignored.
    if "per_server_concurrency" in overrides and overrides["per_server_concurrency"] != config.per_server_concurrency:
        raise TypeError("per_server_concurrency is fixed when the runtime starts (the router's per-server limit); "
                        "set it in RuntimeConfig.scheduler, not per step")
    return SchedulerConfig.model_validate({**config.model_dump(), **overrides})
