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

- **Over-admission** (`active`): the run keeps `active` trajectories in flight, drawing a fresh prompt
  from the feeder (`more_samples`: an iterator or async iterator) as soon as one finishes, until
  `target_groups` groups are accepted; the rest are stopped at once and carried over. A carried
  trajectory past `max_staleness` (its first token that many weight versions old) is restarted or
  dropped (`stale_policy`, see `staleness.py`); every step reports the staleness of its sampled tokens
  (`token_staleness` histogram, `max_token_staleness`, `stale_token_fraction`).
- **Stopping at once**: an early stop (or `stop()`, a sleep) stops every route session, cuts the
  trajectories' tool waits (`AgentContext.interruptible`: the loop ends aborted with its tokens and
  reruns the cut call when resumed) and aborts the requests in flight in one round
  (`Router.stop_sessions`), so the step returns in milliseconds, not after the longest tool call.

Each trajectory gets `metrics` (queue/wait/generate/tool seconds) and "queue"/"wait" timeline spans.

Layout: this module is the entry point (`Scheduler`: what a runtime shares across steps, the agent
loops by name, `stop`); `run.py` runs one call (`ScheduleRun`), composed of `book.py` (the synchronous
group book: verdicts, final vs carried), `watchdog.py` (deadlines, hung servers), `trajectory.py` (one
agent loop, failure isolation, scoring) and `result.py` (`ScheduleResult` from the finished book).
"""

from __future__ import annotations

import logging
import time
from typing import Any, AsyncIterable, Callable, Iterable, Mapping, Sequence

from ..agents.base import AgentConfig, AgentLoop
from ..agents.registry import get_agent
from ..config.scheduler import SchedulerConfig
from ..engine.router import Router
from ..types import Sample
from .book import expand_samples
from .gc_scope import frozen_heap
from .result import ScheduleResult
from .run import OnGroup, OnTrajectory, ScheduleRun
from .staleness import VersionLog
from .trajectory import TrajectoryRunner
from .watchdog import Watchdog

log = logging.getLogger(__name__)

__all__ = ["ScheduleResult", "Scheduler", "expand_samples", "with_overrides"]

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
        agents: Callable[[str], AgentLoop] | None = None,
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
        #: How an agent name becomes a loop (one instance per name); default: the agent registry. Ray's
        #: driver passes one whose loops run the trajectory on a worker.
        self._make_agent = agents or get_agent
        self._agents: dict[str, AgentLoop] = {}
        self._runs: list[ScheduleRun] = []
        #: The weight versions this scheduler's runs saw, in order (how stale a token is).
        self.versions = VersionLog()

    def server_watchdog(self) -> Watchdog | None:
        """A watchdog of this scheduler's servers alone (no deadlines): `run()` it in a task to take out
        a server silent for `hung_timeout` with requests in flight, as each run's own watchdog does.
        None without a `hung_timeout`."""
        return Watchdog.servers_only(self.router, self.hung_timeout, clock=self.clock)

    def agent(self, name: str) -> AgentLoop:
        """The agent loop registered as `name` (one instance per scheduler). Ray's driver overrides it."""
        if name not in self._agents:
            self._agents[name] = self._make_agent(name)
        return self._agents[name]

    async def run(
        self,
        samples: Sequence[Sample],
        *,
        on_trajectory: OnTrajectory | None = None,
        config: SchedulerConfig | None = None,
        more_samples: Iterable[Sample] | AsyncIterable[Sample] | None = None,
        on_group: OnGroup | None = None,
        watch_servers: bool = True,
    ) -> ScheduleResult:
        """Run every sample's agent loop (see the module docstring); never raises for a trajectory's fault.
        `more_samples` (the feeder: an iterator or async iterator of fresh samples) supplies prompts while a
        group filter keeps the step short of `target_groups`, or to keep `active` trajectories in flight.
        `on_group(members, verdict)` is called when a group is decided (every member finished, none carried).
        `watch_servers=False`: this run does not watch for hung servers itself (a caller running many
        small runs at once, the streaming mode, runs one `server_watchdog()` for all of them instead)."""
        cfg = config or self.config
        run = ScheduleRun(router=self.router, runner=self._runner(), config=cfg, clock=self.clock,
                          hung_timeout=self.hung_timeout if watch_servers else None,
                          on_trajectory=on_trajectory, more_samples=more_samples,
                          on_group=on_group, versions=self.versions)
        self._runs.append(run)
        try:
            with frozen_heap(cfg.gc_freeze):
                return await run.run(samples)
        finally:
            self._runs.remove(run)

    def _runner(self) -> TrajectoryRunner:
        return TrajectoryRunner(
            tokenizer=self.tokenizer, agent_config=self.agent_config, agent=self.agent, clock=self.clock,
            tools=self.tools, interaction=self.interaction, default_agent=self.default_agent, reward_fn=self.reward_fn,
        )

    async def aclose(self) -> None:
        """Release what the agent loops hold across trajectories (the runtime is stopping)."""
        for agent in self._agents.values():
            await agent.aclose()

    def stop(self, reason: str = "stopped") -> None:
        """Stop every running `run`: nothing new starts or is dispatched, in-flight requests are aborted;
        the stopped trajectories come back as carry-over. (Used before a sleep in the middle of a step.)"""
        for run in self._runs:
            run.stop(reason)


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
