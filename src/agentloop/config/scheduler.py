"""`SchedulerConfig`: how one step's trajectories are run (concurrency, GRPO groups, timeouts,
over-sampling and partial rollout, staleness, request slots), validated. The `scheduler` section of
`RuntimeConfig` (`settings.py`), and all a `Scheduler` used on its own needs."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from ..engine.route_session import ServerPriority, SlotOrder
from .strict import Strict

__all__ = ["CPU_ENGINE_CONCURRENCY", "SchedulerConfig"]


#: `scheduler.concurrency: auto` on the embedded CPU engine, for a server that reports no capacity, and
#: in a Scheduler used without a Runtime (nothing resolved it): the library's measured default before auto.
CPU_ENGINE_CONCURRENCY = 64


class SchedulerConfig(Strict):
    """How one step's trajectories are run: limits, GRPO groups, timeouts, over-sampling."""

    concurrency: int | Literal["auto"] = Field(
        "auto",
        description="Most trajectories in flight at once (all servers together). auto: what the engines can run, "
        "read when the runtime starts: on SGLang the sum of the servers' max running requests (/server_info "
        "internal_states[].effective_max_running_requests_per_dp), on the embedded CPU engine 64; see "
        "agentloop.runtime.concurrency. summary.json's `concurrency` says what was used and why.",
    )
    per_server_concurrency: int | Literal["auto"] | None = Field(
        None, description="Most generate requests in flight on one server (None: no per-server limit). auto: the "
        "servers' decode CUDA graph batch, read from /server_info when the runtime starts (the smallest over the "
        "servers; no limit if none reports one), so SGLang keeps decoding inside its graphs when many more "
        "trajectories are in flight; summary.json's `concurrency` says what was used and why. In Ray mode it is "
        "split evenly over the workers (each gets limit // num_workers, at least 1).",
    )
    slot_order: SlotOrder = Field(
        "fifo",
        description="With per_server_concurrency, who gets a freed request slot first: fifo = arrival order; "
        "depth_first = the trajectory with the most model turns behind it (then the oldest). Measured on an H200 "
        "at 256 slots: depth_first 0.94x fifo's throughput. oldest_first = the trajectory that started first in the step "
        "(its samples' order: carried groups first), so with over-sampling the surplus only fills slots the older "
        "groups leave free. target_first = the groups that will meet target_groups first (the undecided groups with "
        "the fewest members left, then the oldest, as many as the target still wants), then the surplus; with "
        "slot_preemption a target group's turn that finds every slot taken aborts a surplus request, which "
        "continues its turn in place later (tokens and logprobs kept). Without target_groups every group is a "
        "target group (fewest members left first, no preemption). Ray workers rank only their own trajectories.",
    )
    slot_preemption: bool = Field(
        False, description="With slot_order target_first: a target group's turn may take a surplus request's slot "
        "(the surplus request is aborted and its turn continued in place later). No effect with other orders. Off "
        "by default: on SGLang (one H100) the aborts and re-prefills cost more than the wait they saved "
        "(benchmarks/results/long_tail_sglang_h100_target_first.json: 1.15x wait-all against 1.43x without).",
    )
    server_priority: ServerPriority = Field(
        "none",
        description="oldest_first: every generate request carries SGLang's `priority` (older trajectories higher), "
        "for servers launched with --enable-priority-scheduling (default direction, higher first) and a "
        "--max-running-requests below the trajectories in flight: the server then admits the oldest trajectories' "
        "turns first and preempts younger running requests for them (over-sampling's surplus only fills what the "
        "target groups leave idle). Checked against each server's /server_info when the runtime starts: a server "
        "that schedules low values first is refused; one without priority scheduling is warned about (it ignores "
        "the priorities, or refuses them with --abort-on-priority-when-disabled, which is an error). On sglang 0.5.17 "
        "launch with --disable-priority-preemption: its preemption returned output ids without logprobs (refused, so "
        "those turns failed; warned at start). Measured on an H100 without preemption: 1.18x wait-all's returned "
        "tokens/s against 1.16x for the server's arrival-order queue (long_tail_sglang_h100_priority_no_preempt.json). "
        "In Ray mode each worker numbers its own trajectories.",
    )
    n: int = Field(1, ge=1, description="Trajectories per prompt (a GRPO group shares the prompt's `group_id`).")
    trajectory_timeout: float | None = Field(
        600.0, gt=0, description="Wall-clock seconds one trajectory may run; past it it is stopped and marked failed."
    )
    abort_grace: float = Field(
        10.0, gt=0, description="Seconds a stopped trajectory gets to return its partial result before it is cancelled."
    )
    reward_timeout: float = Field(30.0, gt=0, description="Seconds one reward computation may take.")
    reward: str | None = Field(
        "arithmetic",
        description="Reward function (registered name, see `agentloop.rewards`) for samples that name none but "
        "carry a `ground_truth`; samples with neither are not scored. Default: the arithmetic task's grader. None: "
        "only samples naming a reward are scored. A trainer's `Runtime(reward_fn=...)` replaces both.",
    )
    target_groups: int | None = Field(
        None,
        ge=1,
        description="Over-sampling: stop the step once this many groups are complete; the unfinished ones are aborted "
        "and carried over. None: wait for every trajectory.",
    )
    oversample_factor: float = Field(
        1.0, ge=1.0, description="Over-sampling for whoever draws the prompts: a step launches ceil(target_groups * "
        "oversample_factor) groups. Read by `agentloop rollout` (and by a trainer's feeder through "
        "`SchedulerConfig.prompts_per_step`); `Runtime.step` runs exactly the samples it is given."
    )
    group_filter: str | None = Field(
        None,
        description="Group filter (registered name, see `agentloop.group_filters`; built-in: drop_zero_variance) "
        "applied to every complete group: a rejected group leaves the batch and, with target_groups, does not count "
        "toward it (the step samples more prompts from `more_samples` instead). None: every group is kept.",
    )
    group_budget: int | None = Field(
        None,
        ge=1,
        description="With target_groups and a group filter: most groups one step may sample (the given prompts "
        "plus those drawn from `more_samples`); reaching it ends the step short of target_groups, reported as "
        "budget_exhausted. None: until `more_samples` runs out.",
    )
    partial_rollout: bool = Field(
        True,
        description="Carry aborted trajectories over and continue them next step (True), or restart their prompts "
        "from scratch (False).",
    )
    active: int | None = Field(
        None,
        ge=1,
        description="Over-admission: keep this many trajectories in flight, drawing fresh prompts from the step's "
        "feeder (`more_samples`, an iterator or async iterator) as soon as one finishes, until target_groups groups "
        "are accepted (the rest are stopped and carried over) or the feeder runs out. None: run the given samples "
        "(drawing only while a group filter keeps the step short of target_groups).",
    )
    max_staleness: int | None = Field(
        None,
        ge=0,
        description="Staleness bound of carried trajectories: one whose first token was sampled more than this many "
        "weight versions before the step's is not resumed but handled by stale_policy. None: no bound.",
    )
    stale_policy: Literal["restart", "drop"] = Field(
        "restart",
        description="A carried trajectory past max_staleness: restart = run its sample again from the prompt this "
        "step (its tokens are discarded); drop = its whole group leaves the step (ScheduleResult.dropped).",
    )
    max_turn_retries: int = Field(
        3, ge=0, description="How often one model turn is retried on another server when its server fails."
    )
    server_failure_threshold: int = Field(
        2, ge=1, description="Consecutive failed requests after which a server is taken out of the rotation."
    )
    gc_freeze: bool = Field(
        False,
        description="Freeze the garbage collector's view of the objects that exist when a step starts "
        "(gc.freeze) until it ends (gc.unfreeze), so the step's collections skip the trainer's heap: less client "
        "CPU per token in a process with a large heap. Process-wide while the step runs (cycles among older "
        "objects are collected after it); skipped if anything else has frozen objects. See agentloop.gc_scope.",
    )

    @field_validator("concurrency", "per_server_concurrency", mode="before")
    @classmethod
    def _int_or_auto(cls, v: Any, info: Any) -> Any:
        # One message for the union (pydantic would give one per member, under odd location names).
        if v == "auto" or (v is None and info.field_name == "per_server_concurrency"):
            return v
        if isinstance(v, bool) or not isinstance(v, (int, str)) or (isinstance(v, str) and not v.strip().isdigit()):
            raise ValueError("Input should be a valid integer or 'auto'")
        if int(v) < 1:
            raise ValueError("Input should be greater than or equal to 1 (or 'auto')")
        return int(v)

    @field_validator("group_filter")
    @classmethod
    def _known_group_filter(cls, v: str | None) -> str | None:
        if v is not None:
            from ..group_filters import get_group_filter

            get_group_filter(v)  # raises naming the registered filters
        return v

    def prompts_per_step(self, default: int) -> int:
        """How many prompts a feeder should draw: `default`, or the over-sampled count if `target_groups` is set."""
        if self.target_groups is None:
            return default
        import math

        return math.ceil(self.target_groups * self.oversample_factor)
