"""GRPO group accounting of one scheduler run: members, completion, the group filter, drawing more
prompts toward `target_groups`, early stop, which trajectories are final and which are carried over.

A mixin of `agentloop.scheduler._ScheduleRun` (the run's state lives there); `scheduler.py`'s docstring
says what groups, over-sampling and filtering do for the user.
"""

from __future__ import annotations

import dataclasses
import logging
import traceback
from collections import Counter
from typing import Awaitable, Callable, Iterator, Sequence

import anyio
import anyio.abc

from ..config.settings import SchedulerConfig
from ..engine.router import RouteSession
from ..group_filters import GroupFilter
from ..types import FINISHED_OK, Sample, Trajectory

log = logging.getLogger("agentloop.scheduler")

__all__ = ["GroupsMixin", "expand_samples"]


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


class _Group:
    def __init__(self, size: int) -> None:
        self.size = size
        self.done = 0
        self.ok = 0
        self.counted = False  # accepted: one of the first `target_groups` complete groups that pass the filter
        self.rejected = False  # complete, but the group filter rejected it


class GroupsMixin:
    """Group bookkeeping of a run: which members belong together, when a group is complete, accepted,
    rejected or carried over, and drawing fresh prompts while the target is not reached."""

    cfg: SchedulerConfig
    on_trajectory: Callable[[Trajectory], "Awaitable[None] | None"] | None
    filter: GroupFilter | None
    grouped: bool
    more: Iterator[Sample] | None
    rejected_groups: int
    uids: set[str]
    filter_errors: int
    refill_stop: str
    limit: anyio.Semaphore | None
    clock: Callable[[], float]
    results: list[Trajectory | None]
    jobs: list[Sample]
    groups: dict[str, _Group]
    members: dict[str, list[int]]
    complete_groups: int
    stopping: bool
    tg: anyio.abc.TaskGroup | None
    sessions: dict[int, RouteSession]
    _one: Callable[..., Awaitable[None]]
    stop: Callable[..., None]

    def _add_jobs(self, jobs: Sequence[Sample]) -> range:
        """Register group members (the step's samples, or a prompt drawn later); their indices."""
        first = len(self.jobs)
        self.jobs.extend(jobs)
        self.uids.update(j.uid for j in jobs)
        self.results.extend([None] * len(jobs))
        added: dict[str, list[int]] = {}
        for i, j in enumerate(jobs, start=first):
            added.setdefault(j.group_id, []).append(i)
        for g, idx in added.items():
            self.members.setdefault(g, []).extend(idx)
            self.groups[g] = _Group(len(self.members[g]))
        return range(first, len(self.jobs))

    async def _finish(self, i: int, traj: Trajectory) -> None:
        self.results[i] = traj
        job = self.jobs[i]
        g = self.groups[job.group_id]
        g.done += 1
        g.ok += traj.status in FINISHED_OK
        target = self.cfg.target_groups
        if not self.grouped:
            if not self._carry(traj):
                await self._emit([i])
            return
        if g.done < g.size:
            return
        idx = self.members[job.group_id]
        if g.ok == g.size:
            if target is not None and self.complete_groups >= target:
                return  # past the target: carried over
            if not self._accepts(job.group_id):
                g.rejected = True
                self.rejected_groups += 1
                self._refill()
                return
            g.counted = True
            self.complete_groups += 1
            await self._emit(idx)
            if self.complete_groups == target:
                self._early_stop()
            self._refill()
        elif not any(self._carry(self.results[k]) for k in idx):
            await self._emit(idx)  # finished with a failure: final, not carried, not counted
            self._refill()

    def _accepts(self, group_id: str) -> bool:
        """The group filter's verdict on a complete group (no filter: accepted). A filter that raises
        keeps the group (its data is not thrown away for the filter's fault) and is counted."""
        if self.filter is None:
            return True
        group = [self.results[k] for k in self.members[group_id]]
        try:
            return bool(self.filter(group))  # type: ignore[arg-type]
        except Exception:
            self.filter_errors += 1
            log.error("group filter %r failed on group %s (group kept):\n%s", self.cfg.group_filter, group_id, traceback.format_exc())
            return True

    def _refill(self) -> None:
        """Draw fresh prompts from `more_samples` while accepted + unfinished groups fall short of the target."""
        target = self.cfg.target_groups
        if self.more is None or target is None or self.stopping or self.tg is None or self.limit is None:
            return
        pending = sum(1 for g in self.groups.values() if g.done < g.size)
        budget = self.cfg.group_budget
        while self.complete_groups + pending < target:
            if budget is not None and len(self.groups) >= budget:
                self.refill_stop = f"group_budget of {budget} groups reached"
                return
            try:
                sample = next(self.more)
                jobs = expand_samples([sample], self.cfg.n)
                clash = sorted({j.uid for j in jobs} & self.uids | {j.group_id for j in jobs} & self.groups.keys())
                if clash:
                    raise ValueError(f"uid/group {clash[:3]} already in this step")
            except StopIteration:
                self.more, self.refill_stop = None, "more_samples exhausted"
                return
            except (TypeError, ValueError) as e:  # a bad sample from the source: stop drawing, keep the step
                self.more, self.refill_stop = None, f"more_samples gave a bad sample: {e}"
                log.error("scheduler: %s", self.refill_stop)
                return
            for k in self._add_jobs(jobs):
                self.tg.start_soon(self._one, k, self.limit, self.clock())
            pending += 1

    def _early_stop(self) -> None:
        log.info("target of %d complete groups reached: stopping %d running trajectories", self.cfg.target_groups, len(self.sessions))
        self.stop("early stop: target groups reached", early=True)

    async def _emit(self, idx: Sequence[int]) -> None:
        if self.on_trajectory is None:
            return
        for k in idx:
            r = self.on_trajectory(self.results[k])  # type: ignore[arg-type]
            if r is not None:
                await r

    def _carry(self, traj: Trajectory | None) -> bool:
        """Unfinished (aborted without error, or never started) trajectories are carried over."""
        return traj is None or (traj.status == "aborted" and traj.error is None)

    def _is_final(self, i: int) -> bool:
        traj = self.results[i]
        group = self.groups[self.jobs[i].group_id]
        if self.grouped:
            if group.counted:
                return True
            if group.rejected:
                return False
            return not any(self._carry(self.results[k]) for k in self.members[self.jobs[i].group_id]) and group.ok < group.size
        return not self._carry(traj)
