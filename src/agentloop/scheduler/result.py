"""What one scheduler run returns: `ScheduleResult` (final trajectories, carry-over samples, rejected
groups, the step's metrics), built from a finished run's group book by `build_result`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..config.scheduler import SchedulerConfig
from ..types import STATUSES, Sample, Trajectory
from .book import GroupBook

__all__ = ["ScheduleResult", "build_result"]


@dataclass
class ScheduleResult:
    """What one `Scheduler.run` produced."""

    #: Finished trajectories (every status), in input order; excludes those carried over.
    trajectories: list[Trajectory]
    #: Samples to pass to the next step: members of groups not finished this step (partial rollout).
    carry_over: list[Sample] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    #: Trajectories of complete groups the group filter rejected (not in `trajectories`).
    rejected: list[Trajectory] = field(default_factory=list)
    #: Carried samples whose group was dropped for staleness (`max_staleness` with `stale_policy: drop`).
    dropped: list[Sample] = field(default_factory=list)


def build_result(book: GroupBook, cfg: SchedulerConfig, *, wall: float, refill_stop: str,
                 stopped_from_outside: bool, router_stats: Any) -> ScheduleResult:
    """Sort the book's trajectories into final / carried over / rejected and sum the step's metrics.
    `stopped_from_outside`: a sleep ended the run (a step short of its target then is not the
    prompts' or the budget's fault); `router_stats`: the router's `RouterStats`."""
    final, carry, rejected = book.partition(cfg.partial_rollout)
    sampled = sum(sum(t.response_mask) for t in final)
    statuses = Counter(t.status for t in final)
    target = cfg.target_groups
    # Short of the target because the prompts (or the budget) ran out, not because of a sleep.
    short = target - book.accepted if target is not None and not stopped_from_outside else 0
    complete = book.complete_groups()
    return ScheduleResult(
        trajectories=final,
        carry_over=carry,
        rejected=rejected,
        metrics={
            "rollout_seconds": wall,
            "trajectories": len(final),
            "carried_over": len(carry),
            "started": book.started(),
            "complete_groups": complete,
            "groups_accepted": complete,
            "groups_rejected": book.rejected,
            "groups_sampled": book.num_groups,
            "groups_budget_exhausted": max(0, short),
            "budget_exhausted": short > 0,
            "group_filter": cfg.group_filter,
            "group_filter_errors": book.filter_errors,
            "refill_stop": refill_stop,
            "status_counts": {s: statuses.get(s, 0) for s in STATUSES},
            "sampled_tokens": sampled,
            "sampled_tokens_per_second": sampled / wall if wall > 0 else 0.0,
            "tool_calls": sum(t.tool_calls for t in final),
            "queue_seconds": sum(t.metrics.get("queue_seconds", 0.0) for t in final),
            "wait_seconds": sum(t.metrics.get("wait_seconds", 0.0) for t in final),
            "generate_seconds": sum(t.metrics.get("generate_seconds", 0.0) for t in final),
            "tool_seconds": sum(t.metrics.get("tool_seconds", 0.0) for t in final),
            "route_retries": router_stats.retries,
            "servers_removed": dict(router_stats.removed),
        },
    )
