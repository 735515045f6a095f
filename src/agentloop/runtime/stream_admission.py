"""One job: the streaming mode's admission — which prompt starts next (a stale group's prompt
restarted before any fresh one, then the feeder), whether the bounds let one start now (`active`,
backpressure, AReaL's staleness capacity), and the staleness bound applied when the trainer takes a
batch (a group too many versions behind is dropped or its prompt restarted, by `stale_policy`)."""

from __future__ import annotations

import dataclasses
from typing import Any, AsyncIterable, AsyncIterator, Callable, Iterable, Iterator

from ..scheduler.staleness import VersionLog
from ..types import Sample, Trajectory
from .stream_types import StreamConfig

__all__ = ["StreamAdmission"]


class StreamAdmission:
    """The prompts of one stream: drawn from `feeder` (an iterator or async iterator of Samples or rows;
    `to_sample` turns a row into a fresh Sample), every admitted prompt kept by uid (uids must be unique
    across the stream), and the counts `groups_admitted`, `groups_dropped_stale`, `groups_restarted_stale`."""

    def __init__(self, feeder: Iterable[Any] | AsyncIterable[Any], config: StreamConfig,
                 to_sample: Callable[[Any], Sample]) -> None:
        self.config = config
        self._to_sample = to_sample
        self._sync_feed: Iterator[Any] | None = None
        self._async_feed: AsyncIterator[Any] | None = None
        if isinstance(feeder, AsyncIterable):
            self._async_feed = feeder.__aiter__()
        elif isinstance(feeder, Iterable):
            self._sync_feed = iter(feeder)
        else:
            raise TypeError(f"rollout_stream: feeder must be an iterable or async iterable of samples, got {type(feeder).__name__}")
        self.originals: dict[str, Sample] = {}
        self.restarts: list[Sample] = []  # prompts to admit again (stale_policy "restart"), first come first
        self.exhausted = False  # the feeder ran out
        self.counts: dict[str, int] = dict.fromkeys(("groups_admitted", "groups_dropped_stale", "groups_restarted_stale"), 0)

    @property
    def drained(self) -> bool:
        """Nothing more to admit: the feeder ran out and no restart waits."""
        return self.exhausted and not self.restarts

    def allows(self, n: int, *, in_flight: int, buffered_groups: int, updates: int, groups_discarded: int = 0) -> bool:
        """A group of `n` members may start now: under `active` (an empty stream takes one regardless,
        so `active` below the group size still makes progress), the trainer's queue not full, and within
        the staleness capacity (AReaL: groups running or accepted ≤ (updates + η + 1) × batch_groups).
        `groups_discarded`: complete groups that will never reach the trainer (a member failed, the
        group filter said no); with the groups this bound dropped or restarted they give their place
        back, as AReaL counts accepted rollouts: else a failed group would leave the last batch short
        forever and the trainer would wait for it (with η = 0, at the first failure)."""
        c = self.config
        if in_flight + n > c.active and in_flight > 0:
            return False
        if buffered_groups >= c.max_queued_batches * c.batch_groups:
            return False  # backpressure: the trainer is not taking batches
        if c.max_staleness is not None:
            counted = (self.counts["groups_admitted"] - groups_discarded - self.counts["groups_dropped_stale"]
                       - self.counts["groups_restarted_stale"])
            if counted >= (updates + c.max_staleness + 1) * c.batch_groups:
                return False
        return True

    def held_back_by_staleness(self, n: int, *, updates: int, groups_discarded: int = 0) -> bool:
        """Only the staleness capacity stops a group of `n` now (nothing in flight or buffered): the next
        update would let it in. False once the feeder ran out."""
        if self.drained:
            return False
        now = self.allows(n, in_flight=0, buffered_groups=0, updates=updates, groups_discarded=groups_discarded)
        return not now and self.allows(n, in_flight=0, buffered_groups=0, updates=updates + 1,
                                       groups_discarded=groups_discarded)

    async def next(self) -> Sample | None:
        """The next prompt to admit (counted as admitted), or None once the feeder ran out (restarts
        still come after that). A prompt whose uid was admitted before, or one that is not fresh (a
        group_id or resume_from), raises ValueError."""
        if self.restarts:
            sample = self.restarts.pop(0)
        else:
            sample = await self._draw()
            if sample is None:
                self.exhausted = True
                return None
        if sample.uid in self.originals:
            raise ValueError(f"rollout_stream: the feeder gave prompt uid {sample.uid!r} twice (uids must be unique)")
        self.originals[sample.uid] = sample
        self.counts["groups_admitted"] += 1
        return sample

    async def _draw(self) -> Sample | None:
        try:
            row = next(self._sync_feed) if self._sync_feed is not None else await self._async_feed.__anext__()  # type: ignore[union-attr]
        except (StopIteration, StopAsyncIteration):
            return None
        sample = self._to_sample(row)
        if sample.group_id or sample.resume_from is not None:
            raise ValueError(f"rollout_stream: the feeder gave {sample.uid!r} with a group_id or resume_from; "
                             "it takes fresh prompts only")
        return sample

    def bound_staleness(self, groups: list[list[Trajectory]], versions: VersionLog) -> list[list[Trajectory]]:
        """The groups within `max_staleness` of the served version (a group's age: its oldest first
        token's); the others are dropped or queued to restart under a new uid (`stale_policy`)."""
        eta = self.config.max_staleness
        if eta is None:
            return groups
        kept = []
        for trajs in groups:
            age = max(versions.first_token_age(t) or 0 for t in trajs)
            if age <= eta:
                kept.append(trajs)
            elif self.config.stale_policy == "restart":
                self.counts["groups_restarted_stale"] += 1
                gid = trajs[0].group_id
                self.restarts.append(dataclasses.replace(self.originals[gid], uid=f"{gid}.r{self.counts['groups_restarted_stale']}"))
            else:
                self.counts["groups_dropped_stale"] += 1
        return kept
