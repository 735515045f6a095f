"""What the streaming mode hands a trainer (`StreamBatch`), how it is tuned (`StreamConfig`), and the
staleness arithmetic every mode shares (`VersionBook`, `staleness_histogram`, `apply_staleness_bound`).

Staleness of a token = how many weight updates lie between the weights that sampled it and the
weights the trainer holds when it trains on it (0 = on-policy). Versions are the lifecycle's strings
(`v1`, or a trainer's own); a `VersionBook` numbers them in the order they were served.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Sequence

from ..batch import RolloutBatch
from ..types import Sample, Trajectory

__all__ = ["StalePolicy", "StreamBatch", "StreamConfig", "VersionBook", "apply_staleness_bound",
           "staleness_histogram"]

StalePolicy = Literal["drop", "restart"]


@dataclass
class StreamConfig:
    """How a `RolloutStream` runs (see `agentloop.runtime.stream`).

    - `batch_groups`: complete, accepted groups per `StreamBatch`.
    - `active`: trajectories kept in flight (the engine's fill; ≫ a batch, like the steady state of a
      bare client that refills a finished trajectory's slot at once).
    - `max_queued_batches`: the bound of the queue to the trainer; once that many batches (complete
      groups included that are not yet batched) wait, nothing new is admitted (backpressure).
    - `max_staleness` (AReaL's η): a group is admitted only while groups admitted so far ≤
      (updates applied + η + 1) × batch_groups, and a complete group whose oldest first token is more
      than η versions behind the served version when it is handed out is handled by `stale_policy`.
      None: no bound (only `active` and the queue limit admission).
    - `stale_policy`: "drop" (the group is discarded and counted) or "restart" (its prompt is
      admitted again from scratch, counted). Dropping biases the batches against long trajectories;
      restarting costs their compute again. Both are counted in `RolloutStream.metrics`.
    """

    batch_groups: int
    active: int
    max_queued_batches: int = 2
    max_staleness: int | None = None
    stale_policy: StalePolicy = "drop"

    def __post_init__(self) -> None:
        if not isinstance(self.batch_groups, int) or self.batch_groups < 1:
            raise ValueError(f"StreamConfig.batch_groups must be an int >= 1, got {self.batch_groups!r}")
        if not isinstance(self.active, int) or self.active < 1:
            raise ValueError(f"StreamConfig.active must be an int >= 1, got {self.active!r}")
        if not isinstance(self.max_queued_batches, int) or self.max_queued_batches < 1:
            raise ValueError(f"StreamConfig.max_queued_batches must be an int >= 1, got {self.max_queued_batches!r}")
        if self.max_staleness is not None and (not isinstance(self.max_staleness, int) or self.max_staleness < 0):
            raise ValueError(f"StreamConfig.max_staleness must be None or an int >= 0, got {self.max_staleness!r}")
        if self.stale_policy not in ("drop", "restart"):
            raise ValueError(f"StreamConfig.stale_policy must be 'drop' or 'restart', got {self.stale_policy!r}")


@dataclass
class StreamBatch:
    """Complete groups handed to the trainer. `trajectories` are training rows (a split trajectory is
    one row per segment), `batch` their padded tensors with per-token weight versions. `weight_version`
    is the version served when the batch was handed out; `staleness` maps versions behind it → mask-1
    tokens (the staleness histogram of this batch's trained tokens)."""

    index: int
    weight_version: str | None
    groups: list[list[Trajectory]]
    trajectories: list[Trajectory]
    batch: RolloutBatch
    staleness: dict[int, int] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)


class VersionBook:
    """Weight versions in the order they were served: version string → ordinal (0 = the first)."""

    def __init__(self, first: str | None = None) -> None:
        self._order: dict[str, int] = {}
        if first is not None:
            self.add(first)

    def add(self, version: str | None) -> int:
        """Record `version` as served now (again: keeps its first ordinal); returns the current ordinal."""
        v = version or ""
        if v not in self._order:
            self._order[v] = len(self._order)
        return self._order[v]

    @property
    def current(self) -> int:
        return len(self._order) - 1

    def ordinal(self, version: str, *, where: str) -> int:
        try:
            return self._order[version or ""]
        except KeyError:
            raise ValueError(f"{where}: weight version {version!r} was never served by this runtime "
                             f"(known: {list(self._order)})") from None

    def first_token_age(self, traj: Trajectory, now: int | None = None) -> int:
        """Versions between the weights that sampled the trajectory's first token and `now` (default: current)."""
        now = self.current if now is None else now
        for t in traj.turns:
            if t.length > 0:
                return now - self.ordinal(t.weight_version, where=f"trajectory {traj.uid}")
        return 0


def staleness_histogram(trajectories: Iterable[Trajectory], book: VersionBook, now: int | None = None) -> dict[int, int]:
    """versions behind `now` → mask-1 (sampled, trained) tokens of `trajectories`, from each turn's version."""
    now = book.current if now is None else now
    hist: dict[int, int] = {}
    for traj in trajectories:
        for t in traj.turns:
            if t.length <= 0:
                continue
            k = now - book.ordinal(t.weight_version, where=f"trajectory {traj.uid}")
            hist[k] = hist.get(k, 0) + t.length
    return dict(sorted(hist.items()))


def apply_staleness_bound(carry: Sequence[Sample], book: VersionBook, max_staleness: int | None,
                          policy: StalePolicy = "restart", *, now: int | None = None) -> tuple[list[Sample], list[Sample]]:
    """The colocated step's bound on carried partial rollouts, group by group: a carried group any of
    whose members' first token is more than `max_staleness` versions old is restarted from its prompt
    ("restart": every member's `resume_from` cleared, so the whole group is sampled again under one
    policy) or dropped ("drop"). Ages count to `now` (default: the current version; a trainer about
    to load its next weights passes `book.current + 1`). Returns (samples to pass on, samples
    restarted or dropped). `None`: no bound."""
    if max_staleness is None:
        return list(carry), []
    stale_groups = {s.group_id or s.uid for s in carry
                    if s.resume_from is not None and book.first_token_age(s.resume_from, now) > max_staleness}
    kept: list[Sample] = []
    hit: list[Sample] = []
    for s in carry:
        if (s.group_id or s.uid) not in stale_groups:
            kept.append(s)
            continue
        hit.append(s)
        if policy == "restart":
            kept.append(dataclasses.replace(s, resume_from=None))
    return kept, hit
