"""One trajectory's agent loop as the scheduler runs it: its context, failure isolation, the hard
timeout, the timings it is annotated with, and scoring.

`TrajectoryRunner` holds what every trajectory of a runtime shares (tokenizer, agent config, tools,
interaction, reward function, the agent loops by name); `ScheduleRun` (run.py) decides *when* a
trajectory runs and hands it a route session.
"""

from __future__ import annotations

import dataclasses
import logging
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import anyio

from .. import rewards
from ..agents.base import AgentConfig, AgentContext, AgentLoop
from ..engine.router import RouteSession
from ..types import FINISHED_OK, Sample, Trajectory

log = logging.getLogger("agentloop.scheduler")

__all__ = ["TrajectoryRunner"]


@dataclass
class TrajectoryRunner:
    """Runs and scores single trajectories (see the module docstring)."""

    tokenizer: Any
    agent_config: AgentConfig
    #: The agent loop of a registry name (the scheduler's, cached per name).
    agent: Callable[[str], AgentLoop]
    clock: Callable[[], float]
    tools: Any = None
    interaction: Any = None
    default_agent: str | None = None
    #: The trainer's reward function (any signature `rewards.call_reward` takes); None: each sample's named one.
    reward_fn: Callable[..., Any] | None = None

    async def run(self, job: Sample, session: RouteSession, *, hard_timeout: float | None,
                  why_hard: str = "") -> tuple[Trajectory, str | None]:
        """Run `job`'s agent loop with `session` as its generate function: (trajectory, error). Never
        raises for the loop's fault: an exception, a wrong return type or outliving `hard_timeout`
        becomes the error (the trajectory is then the partial one, or an empty one keeping the prompt)."""
        ctx = AgentContext(generate=session, tokenizer=self.tokenizer, config=self.agent_config, tools=self.tools,
                           interaction=self.interaction, clock=self.clock, stop=session)
        name = job.agent or self.default_agent or "tool"
        traj: Trajectory | None = None
        error: str | None = None
        with anyio.move_on_after(hard_timeout) as scope:
            try:
                traj = await self.agent(name).run(job, ctx)
                if not isinstance(traj, Trajectory):
                    raise TypeError(f"agent loop {name!r} returned {type(traj).__name__}, not a Trajectory")
            except Exception as e:  # failure isolation: this trajectory fails, the step goes on
                traj = None
                error = f"{type(e).__name__}: {e}"
                log.warning("trajectory %s failed in agent %r:\n%s", job.uid, name, traceback.format_exc())
        if scope.cancelled_caught:
            error = f"trajectory did not return within {hard_timeout:.1f}s{why_hard}"
        if traj is None:
            traj = self.empty(job, "failed", error or "agent loop returned nothing")
        return traj, error

    def empty(self, job: Sample, status: str, error: str) -> Trajectory:
        """The trajectory of a job whose loop returned nothing: its earlier partial (a resumed job), else
        just its rendered prompt, so a trajectory that failed before its first turn still shows it."""
        prev = job.resume_from
        if prev is not None:  # keep what the earlier step produced
            t = dataclasses.replace(prev, timeline=list(prev.timeline), metrics=dict(prev.metrics))
        else:
            t = Trajectory(uid=job.uid, group_id=job.group_id, prompt_ids=self._prompt_ids(job), messages=list(job.messages))
        t.status, t.error, t.finish_reason = status, error, "error"  # type: ignore[assignment]
        return t

    def _prompt_ids(self, job: Sample) -> list[int]:
        try:
            from ..chat import render_ids

            return render_ids(self.tokenizer, job.messages, tools=job.tools)
        except Exception:  # the prompt itself may be what failed; the error is already recorded
            return []

    @staticmethod
    def annotate(traj: Trajectory, job: Sample, session: RouteSession) -> None:
        """Identity fields from the job; the session's wait/generate spans, route retries and servers."""
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

    async def score(self, traj: Trajectory, job: Sample, *, timeout: float | None, default: str | None) -> None:
        """Score through `rewards.score` (the trainer's function, else the sample's named one, else
        `default` for a sample with a ground truth): sync graders run off the event loop, under
        `timeout`. A reward that cannot be computed makes the trajectory untrainable: it is marked
        failed with the grader's error; the step goes on. A trajectory that arrives scored (by a Ray
        worker's scheduler) keeps its reward and the worker's timings."""
        if traj.reward is not None or traj.status not in FINISHED_OK:
            return
        await rewards.score(traj, job, timeout=timeout, default=default, fn=self.reward_fn)
        error = traj.extra.get("reward_error")
        if error:
            traj.status, traj.error = "failed", f"reward failed: {error}"
            log.warning("reward of %s failed: %s", traj.uid, error)
