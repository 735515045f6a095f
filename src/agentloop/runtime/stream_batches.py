"""One job: the streaming mode's batches for the trainer — complete groups made into a `StreamBatch`
(training rows, the padded tensors, the staleness histogram of its trained tokens), numbered in the
order they are handed over."""

from __future__ import annotations

from ..batch import collate
from ..scheduler.staleness import VersionLog, token_staleness
from ..types import Trajectory, training_rows
from .stream_types import StreamBatch

__all__ = ["StreamBatches"]


class StreamBatches:
    """Makes the stream's batches; `count` is how many were made (the last one's `index`)."""

    def __init__(self, versions: VersionLog, pad_token_id: int | None, pad_to: tuple[int | None, int | None] | None) -> None:
        self.versions = versions
        self.pad_token_id = pad_token_id
        self.pad_to = pad_to
        self.count = 0

    def make(self, groups: list[list[Trajectory]], weight_version: str | None, *, in_flight: int,
             buffered_groups: int) -> StreamBatch:
        """The next batch of `groups` (members in order), taken while `weight_version` is served."""
        trajs = [t for g in groups for t in g]
        rows = training_rows(trajs)
        batch = collate(rows, pad_token_id=self.pad_token_id, pad_to=self.pad_to)
        hist = {int(k): v for k, v in token_staleness(self.versions, trajs)["token_staleness"].items()}
        self.count += 1
        return StreamBatch(index=self.count, weight_version=weight_version, groups=groups, trajectories=rows,
                           batch=batch, staleness=hist,
                           metrics={"groups": len(groups), "trained_tokens": sum(hist.values()),
                                    "in_flight": in_flight, "buffered_groups": buffered_groups})
