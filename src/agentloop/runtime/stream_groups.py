"""One job: assemble the streaming mode's groups — each prompt's members as they finish, a complete
group judged (a failed member drops it, the group filter rejects or accepts it), accepted groups kept
in order until the batcher takes them, and at close what is left handed back without loss."""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

from ..types import FINISHED_OK, Sample, Trajectory

log = logging.getLogger(__name__)

__all__ = ["StreamGroup", "StreamGroups"]


class StreamGroup:
    """One prompt's members while they run."""

    def __init__(self, sample: Sample, members: list[Sample]) -> None:
        self.sample = sample
        self.members = members
        self.results: dict[int, Trajectory] = {}

    @property
    def complete(self) -> bool:
        return len(self.results) == len(self.members)

    def trajectories(self) -> list[Trajectory]:
        return [self.results[i] for i in range(len(self.members))]


class StreamGroups:
    """The groups of one stream: running (`running`), accepted and not yet batched (`ready`), and the
    counts of how complete groups ended (`counts`: groups_accepted / groups_rejected / groups_failed)."""

    def __init__(self, group_filter: Callable[[list[Trajectory]], bool] | None = None,
                 filter_name: str | None = None) -> None:
        self.filter, self.filter_name = group_filter, filter_name
        self.running: dict[str, StreamGroup] = {}
        self.ready: list[list[Trajectory]] = []
        self.counts: dict[str, int] = dict.fromkeys(("groups_accepted", "groups_rejected", "groups_failed"), 0)

    def open(self, sample: Sample, members: list[Sample]) -> StreamGroup:
        group = self.running[sample.uid] = StreamGroup(sample, members)
        return group

    def finish(self, group: StreamGroup, i: int, traj: Trajectory) -> bool:
        """Member `i` ended with `traj`; True when that completed its group and the group was accepted."""
        group.results[i] = traj
        if not group.complete:
            return False
        del self.running[group.sample.uid]
        trajs = group.trajectories()
        if any(t.status not in FINISHED_OK for t in trajs):
            self.counts["groups_failed"] += 1
            log.info("group %s dropped: a member failed (%s)", group.sample.uid,
                     next(t.error for t in trajs if t.status not in FINISHED_OK))
            return False
        if self.filter is not None and not self._accepts(trajs):
            self.counts["groups_rejected"] += 1
            return False
        self.counts["groups_accepted"] += 1
        self.ready.append(trajs)
        return True

    def _accepts(self, trajs: list[Trajectory]) -> bool:
        try:
            return bool(self.filter(trajs))  # type: ignore[misc]
        except Exception as e:  # the filter's fault must not lose the data
            log.error("group filter %r failed on group %s (group kept): %s", self.filter_name, trajs[0].group_id, e)
            return True

    def take(self, k: int) -> list[list[Trajectory]]:
        """The first `k` ready groups (fewer if fewer are ready), in the order they were accepted."""
        taken, self.ready = self.ready[:k], self.ready[k:]
        return taken

    def close(self) -> tuple[list[list[Trajectory]], list[Sample]]:
        """Everything left: the ready groups, and every member of an incomplete group as a sample to
        continue (a finished one with `resume_from` = its trajectory, as a step's carry-over does, so
        a later step runs only the unfinished ones and completes the group). Empties this object."""
        ready, self.ready = self.ready, []
        partials = [dataclasses.replace(group.members[i], resume_from=traj)
                    for group in self.running.values() for i, traj in sorted(group.results.items())]
        self.running = {}
        return ready, partials
