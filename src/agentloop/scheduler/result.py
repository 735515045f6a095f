"""What one scheduler run returns: `ScheduleResult` (final trajectories, carry-over samples, rejected
groups, the step's metrics) and how a finished run's state becomes one.

`ResultMixin` is a mixin of `agentloop.scheduler._ScheduleRun` (the run's state lives there).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .groups import GroupsMixin
from ..types import STATUSES, Sample, Trajectory

__all__ = ["ResultMixin", "ScheduleResult"]


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


class ResultMixin(GroupsMixin):
    """Sorts a finished run's trajectories into final / carried over / rejected and sums the metrics."""

    s: Any  # the Scheduler
    external_stop: bool

    def _result(self, wall: float) -> ScheduleResult:
        final: list[Trajectory] = []
        carry: list[Sample] = []
        rejected: list[Trajectory] = []
        for i, job in enumerate(self.jobs):
            traj = self.results[i]
            if self.groups[job.group_id].rejected:
                rejected.append(traj)  # type: ignore[arg-type]
                continue
            if self._is_final(i):
                final.append(traj)  # type: ignore[arg-type]
                continue
            if traj is None:  # never started: as it came (with its earlier partial, if partial rollout is on)
                carry.append(dataclasses.replace(job, resume_from=job.resume_from if self.cfg.partial_rollout else None))
            elif traj.status == "aborted" and not self.cfg.partial_rollout:
                carry.append(dataclasses.replace(job, resume_from=None))  # restarts from its prompt
            else:
                carry.append(dataclasses.replace(job, resume_from=traj))
        sampled = sum(sum(t.response_mask) for t in final)
        statuses = Counter(t.status for t in final)
        target = self.cfg.target_groups
        # Short of the target because the prompts (or the budget) ran out, not because of a sleep.
        short = target - self.complete_groups if target is not None and not self.external_stop else 0
        complete = sum(1 for g, idx in self.members.items()
                       if all(self._is_final(k) for k in idx) and self.groups[g].ok == self.groups[g].size)
        return ScheduleResult(
            trajectories=final,
            carry_over=carry,
            rejected=rejected,
            metrics={
                "rollout_seconds": wall,
                "trajectories": len(final),
                "carried_over": len(carry),
                "started": sum(r is not None for r in self.results),
                "complete_groups": complete,
                "groups_accepted": complete,
                "groups_rejected": self.rejected_groups,
                "groups_sampled": len(self.groups),
                "groups_budget_exhausted": max(0, short),
                "budget_exhausted": short > 0,
                "group_filter": self.cfg.group_filter,
                "group_filter_errors": self.filter_errors,
                "refill_stop": self.refill_stop,
                "status_counts": {s: statuses.get(s, 0) for s in STATUSES},
                "sampled_tokens": sampled,
                "sampled_tokens_per_second": sampled / wall if wall > 0 else 0.0,
                "tool_calls": sum(t.tool_calls for t in final),
                "queue_seconds": sum(t.metrics.get("queue_seconds", 0.0) for t in final),
                "wait_seconds": sum(t.metrics.get("wait_seconds", 0.0) for t in final),
                "generate_seconds": sum(t.metrics.get("generate_seconds", 0.0) for t in final),
                "tool_seconds": sum(t.metrics.get("tool_seconds", 0.0) for t in final),
                "route_retries": self.s.router.stats.retries,
                "servers_removed": dict(self.s.router.stats.removed),
            },
        )
