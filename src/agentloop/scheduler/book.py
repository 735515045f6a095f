"""The group book of one scheduler run: synchronous bookkeeping of GRPO groups, no I/O, no tasks.

It knows the run's jobs (group members) and their results, and answers the questions the run asks:

- `add(jobs)` / `add_sample(sample)`: register members (the step's samples, or a prompt drawn later);
- `finish(i, traj)` → `Decision`: a trajectory finished; what now (which trajectories to hand to
  `on_trajectory`, whether the target was just reached, whether a group left without counting so
  another prompt should be drawn);
- `groups_wanted()`: how many more groups the target still needs (accepted + running fall short);
- `slot_rank(i)`: trajectory `i`'s key under `slot_order: target_first` (which groups will meet the target);
- `is_final(i)` and `partition(partial_rollout)`: which trajectories the step returns, which are
  carried over to the next one (and how), which groups the filter rejected — in input order.

Grouped runs (`target_groups` or a group filter) decide per complete group: accepted (one of the first
`target_groups` complete groups that pass the filter), rejected (complete, filter said no), final with a
failure (complete, a member failed; returned, not counted), or carried (past the target, or a member was
stopped unfinished). Ungrouped runs decide per trajectory: returned unless stopped unfinished.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import traceback
from collections import Counter
from dataclasses import dataclass
from typing import Literal, Sequence

from ..types import FINISHED_OK, Sample, Trajectory
from ..group_filters import GroupFilter

log = logging.getLogger("agentloop.scheduler")

__all__ = ["Decision", "GroupBook", "expand_samples", "is_unfinished"]

Verdict = Literal["emitted", "pending", "accepted", "rejected", "failed", "carried"]


def expand_samples(samples: Sequence[Sample], n: int) -> list[Sample]:
    """Fresh samples → `n` group members each; members (non-empty `group_id`) pass through once."""
    jobs: list[Sample] = []
    for s in samples:
        if not isinstance(s, Sample):
            raise TypeError(f"scheduler: expected agentloop.types.Sample, got {type(s).__name__}")
        if s.group_id:
            jobs.append(s)
            continue
        for i in range(n):
            uid = s.uid if n == 1 else f"{s.uid}_{i}"
            jobs.append(dataclasses.replace(s, uid=uid, group_id=s.uid, index_in_group=i))
    seen: Counter[str] = Counter(j.uid for j in jobs)
    dups = sorted(u for u, c in seen.items() if c > 1)
    if dups:
        raise ValueError(f"scheduler: trajectory uids must be unique within a step; duplicated: {dups[:5]}")
    return jobs


def is_unfinished(traj: Trajectory | None) -> bool:
    """Stopped before it finished (aborted without error) or never started: carried over, not returned."""
    return traj is None or (traj.status == "aborted" and traj.error is None)


@dataclass(frozen=True)
class Decision:
    """What the run does after a trajectory finished."""

    verdict: Verdict
    #: Trajectory indices to hand to `on_trajectory` now (a whole group at once when grouped).
    emit: tuple[int, ...] = ()
    #: This finish made the accepted groups reach `target_groups`: stop the rest (early stop).
    target_reached: bool = False
    #: A group left the running set (accepted, rejected, failed): draw more prompts if the target needs them.
    refill: bool = False
    #: The whole group was decided now (every member finished, none carried): its indices, for a caller
    #: that takes groups (`on_group`), with `group_verdict` "accepted", "rejected" or "failed". Ungrouped
    #: runs decide a group too once its last member finishes (accepted: every member completed or truncated).
    group: tuple[int, ...] = ()
    group_verdict: str = ""


@dataclass
class _Group:
    size: int
    order: int = 0  # its place among the run's groups (carried first, then as given or drawn)
    done: int = 0
    ok: int = 0
    accepted: bool = False  # one of the first `target_groups` complete groups that pass the filter
    rejected: bool = False  # complete, but the group filter rejected it

    @property
    def complete(self) -> bool:
        return self.done >= self.size


class GroupBook:
    """Members, results and group verdicts of one run (see the module docstring)."""

    def __init__(self, *, n: int = 1, target_groups: int | None = None, group_filter: GroupFilter | None = None,
                 filter_name: str | None = None, group_budget: int | None = None) -> None:
        self.n = n
        self.target_groups = target_groups
        self.group_filter = group_filter
        self.filter_name = filter_name
        self.group_budget = group_budget
        #: Emit and classify whole groups (a target or a filter), not single trajectories.
        self.grouped = target_groups is not None or group_filter is not None
        self.jobs: list[Sample] = []
        self.results: list[Trajectory | None] = []
        self._unfinished = 0
        self._running = 0  # groups with a member not finished yet
        self._groups: dict[str, _Group] = {}
        self._members: dict[str, list[int]] = {}
        self._uids: set[str] = set()
        self.accepted = 0  #: groups accepted (counted toward the target)
        self.rejected = 0  #: complete groups the filter rejected
        self.filter_errors = 0  #: filter calls that raised (their groups were kept)
        self._target_set: set[str] | None = None  # slot_rank's class-0 groups (None: recompute)

    # ------------------------------------------------------------------ members
    def add(self, jobs: Sequence[Sample]) -> range:
        """Register group members; their indices. A group given in parts grows (its size is its members)."""
        first = len(self.jobs)
        self.jobs.extend(jobs)
        self._uids.update(j.uid for j in jobs)
        self.results.extend([None] * len(jobs))
        self._unfinished += len(jobs)
        for i, j in enumerate(jobs, start=first):
            self._members.setdefault(j.group_id, []).append(i)
        for g in dict.fromkeys(j.group_id for j in jobs):
            group = self._groups.get(g)
            if group is None:
                self._groups[g] = _Group(len(self._members[g]), order=len(self._groups))
                self._running += 1
            else:  # more members of a group already here: it grows (and runs again if it was complete)
                self._running -= not group.complete
                group.size = len(self._members[g])
                self._running += not group.complete
        self._target_set = None
        return range(first, len(self.jobs))

    def add_sample(self, sample: Sample) -> range:
        """Register one fresh prompt drawn during the run (`n` members); ValueError/TypeError for a sample
        that is not one, or whose uid or group is already in this run."""
        jobs = expand_samples([sample], self.n)
        clash = sorted({j.uid for j in jobs} & self._uids | {j.group_id for j in jobs} & self._groups.keys())
        if clash:
            raise ValueError(f"uid/group {clash[:3]} already in this step")
        return self.add(jobs)

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    @property
    def running_groups(self) -> int:
        """Groups with a member not finished yet (kept as a count: the feeder asks after every finish)."""
        return self._running

    @property
    def unfinished(self) -> int:
        """Trajectories registered and not finished yet (queued or running)."""
        return self._unfinished

    def budget_reached(self) -> bool:
        return self.group_budget is not None and len(self._groups) >= self.group_budget

    def groups_wanted(self) -> int:
        """How many more groups to draw so that accepted + running groups reach the target (0: none)."""
        if self.target_groups is None:
            return 0
        return max(0, self.target_groups - self.accepted - self.running_groups)

    def slot_rank(self, i: int) -> tuple[int, int, int]:
        """Trajectory `i`'s request-slot key under `slot_order: target_first`, lowest first: (class,
        members of its group still running, the group's order). Class 0: its group is among the groups
        that will meet the target — the undecided groups with the fewest members left (then the oldest),
        as many as the target still wants; class 1: the surplus (over-sampling's extra groups), whose
        requests a class-0 turn may preempt. A run without a target ranks every group class 0."""
        g = self._groups[self.jobs[i].group_id]
        left = g.size - g.done
        if self.target_groups is None:
            return (0, left, g.order)
        if self._target_set is None:
            wanted = max(0, self.target_groups - self.accepted)
            running = [(gr.size - gr.done, gr.order, gid) for gid, gr in self._groups.items() if not gr.complete]
            self._target_set = {gid for _, _, gid in heapq.nsmallest(wanted, running)}
        return (0 if self.jobs[i].group_id in self._target_set else 1, left, g.order)

    # ------------------------------------------------------------------ verdicts
    def finish(self, i: int, traj: Trajectory) -> Decision:
        """Record trajectory `i`'s result and decide what follows."""
        if self.results[i] is not None:
            raise RuntimeError(f"trajectory {self.jobs[i].uid} finished twice")
        self.results[i] = traj
        self._unfinished -= 1
        self._target_set = None
        gid = self.jobs[i].group_id
        g = self._groups[gid]
        g.done += 1
        g.ok += traj.status in FINISHED_OK
        self._running -= g.complete
        idx = tuple(self._members[gid])
        if not self.grouped:
            if is_unfinished(traj):
                return Decision("carried")
            if g.complete and not any(is_unfinished(self.results[k]) for k in idx):
                return Decision("emitted", emit=(i,), group=idx, group_verdict="accepted" if g.ok == g.size else "failed")
            return Decision("emitted", emit=(i,))
        if not g.complete:
            return Decision("pending")
        if g.ok == g.size:
            if self.target_groups is not None and self.accepted >= self.target_groups:
                return Decision("carried")  # past the target: kept for the next step
            if not self._accepts(gid):
                g.rejected = True
                self.rejected += 1
                return Decision("rejected", refill=True, group=idx, group_verdict="rejected")
            g.accepted = True
            self.accepted += 1
            return Decision("accepted", emit=idx, target_reached=self.accepted == self.target_groups, refill=True,
                            group=idx, group_verdict="accepted")
        if any(is_unfinished(self.results[k]) for k in idx):
            return Decision("carried")  # a member was stopped unfinished: the group goes on next step
        return Decision("failed", emit=idx, refill=True, group=idx, group_verdict="failed")  # final, not counted

    def _accepts(self, group_id: str) -> bool:
        """The group filter's verdict on a complete group (no filter: accepted). A filter that raises
        keeps the group (its data is not thrown away for the filter's fault) and is counted."""
        if self.group_filter is None:
            return True
        group = [self.results[k] for k in self._members[group_id]]
        try:
            return bool(self.group_filter(group))  # type: ignore[arg-type]
        except Exception:
            self.filter_errors += 1
            log.error("group filter %r failed on group %s (group kept):\n%s", self.filter_name, group_id,
                      traceback.format_exc())
            return True

    def is_final(self, i: int) -> bool:
        """Returned by this step (rather than carried over or rejected)."""
        gid = self.jobs[i].group_id
        g = self._groups[gid]
        if not self.grouped:
            return not is_unfinished(self.results[i])
        if g.accepted:
            return True
        if g.rejected:
            return False
        return g.ok < g.size and not any(is_unfinished(self.results[k]) for k in self._members[gid])

    def is_rejected(self, i: int) -> bool:
        return self._groups[self.jobs[i].group_id].rejected

    def complete_groups(self) -> int:
        """Groups returned whole with every member completed or truncated."""
        return sum(1 for gid, idx in self._members.items()
                   if self._groups[gid].ok == self._groups[gid].size and all(self.is_final(k) for k in idx))

    def started(self) -> int:
        return sum(r is not None for r in self.results)

    # ------------------------------------------------------------------ the step's answer
    def partition(self, partial_rollout: bool) -> tuple[list[Trajectory], list[Sample], list[Trajectory]]:
        """(returned trajectories, carry-over samples, rejected trajectories), each in input order.

        A carried member resumes from its partial trajectory (`partial_rollout`), or restarts from its
        prompt; a finished member of an unfinished group is carried as it is (nothing left to run)."""
        final: list[Trajectory] = []
        carry: list[Sample] = []
        rejected: list[Trajectory] = []
        for i, job in enumerate(self.jobs):
            traj = self.results[i]
            if self.is_rejected(i):
                rejected.append(traj)  # type: ignore[arg-type]
            elif self.is_final(i):
                final.append(traj)  # type: ignore[arg-type]
            elif traj is None:  # never started: as it came (with its earlier partial, if partial rollout is on)
                carry.append(dataclasses.replace(job, resume_from=job.resume_from if partial_rollout else None))
            elif traj.status == "aborted" and not partial_rollout:
                carry.append(dataclasses.replace(job, resume_from=None))  # restarts from its prompt
            else:
                carry.append(dataclasses.replace(job, resume_from=traj))
        return final, carry, rejected
