"""How many weight versions old a token is: the order of the versions a scheduler's runs saw, the
staleness bound of carried trajectories, and the per-step histogram of trained tokens' staleness.

Weight versions are opaque strings (the trainer's, echoed by the engine per request); their order is
the order in which runs first saw them served (`VersionLog.observe`, at each run's start: the
colocated runtime wakes with new weights before every step). A token's staleness is the number of
versions between the one that sampled it and the current one (0: sampled by the current weights). A
version the log never saw (a trajectory carried in from another process) counts as older than every
version it did see.

`max_staleness` bounds a carried trajectory by its *first* token (the oldest one): past the bound it
is restarted from its prompt (`stale_policy: restart`, default: the sample is kept, its stale tokens
are not) or its whole group leaves the step (`drop`: the group's samples come back in
`ScheduleResult.dropped`, for the caller to log or re-queue).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Iterable

from ..types import Trajectory

log = logging.getLogger("agentloop.scheduler")

__all__ = ["VersionLog", "token_staleness"]


class VersionLog:
    """The weight versions seen, in order (see the module docstring)."""

    def __init__(self) -> None:
        self._index: dict[str, int] = {}
        self._warned: set[str] = set()  # versions served again after newer ones (said once each)

    def observe(self, version: str | None) -> None:
        """Record `version` as served now (a version seen before keeps its place)."""
        if not version:
            return
        if version not in self._index:
            self._index[version] = len(self._index)
        elif version != self.current and version not in self._warned:
            # A name served again after newer ones (a rollback, or a trainer's counter reset): the order is by
            # first sight, so the staleness of what it samples is counted from its old place.
            self._warned.add(version)
            log.warning("weight version %r is served again after %d newer version(s) (latest %r): token staleness "
                        "counts versions by first sight, so tokens it samples now count as that many versions old; "
                        "give new weights a new version name", version, len(self._index) - 1 - self._index[version],
                        self.current)

    def check_new(self, version: str | None, *, served: str | None, what: str) -> None:
        """ValueError unless `version` (None: the runtime names it) is a name not served before: every token
        is labelled with the version that sampled it and its staleness counted from the order versions
        were first served, so a reused name would skip the load (the name served now) or make fresh tokens
        look old (a name served earlier)."""
        if version is None:
            return
        if version == served:
            raise ValueError(f"{what}: version {version!r} is the one served now, so nothing would be loaded; "
                             "give new weights a new version (or none: the runtime names it)")
        if version in self._index:
            raise ValueError(f"{what}: version {version!r} was served before in this runtime; a reused name would "
                             "label new tokens as that version's and count their staleness from its place; give a "
                             "new version (or none: the runtime names it)")

    @property
    def versions(self) -> list[str]:
        return list(self._index)

    @property
    def current(self) -> str | None:
        return next(reversed(self._index), None) if self._index else None

    def age(self, version: str, *, now: str | None = None) -> int:
        """Versions between `version` and `now` (default: the latest seen); unknown versions are older
        than every known one."""
        now = now if now is not None else self.current
        if now is None:
            return 0
        cur = self._index.get(now, len(self._index) - 1)
        return cur - self._index.get(version, -1)

    def first_token_age(self, traj: Trajectory) -> int | None:
        """Staleness of a trajectory's first sampled token (None: it sampled nothing yet)."""
        for turn in traj.turns:
            if turn.length > 0:
                return self.age(turn.weight_version)
        return None


def token_staleness(log: VersionLog, trajectories: Iterable[Trajectory]) -> dict[str, Any]:
    """Metrics over every sampled (mask-1) token of `trajectories`: `token_staleness` (histogram:
    versions old → tokens, keys as strings for JSON), `max_token_staleness`, `stale_token_fraction`."""
    hist: Counter[int] = Counter()
    for t in trajectories:
        for turn in t.turns:
            if turn.length > 0:
                hist[log.age(turn.weight_version)] += turn.length
    total = sum(hist.values())
    return {
        "token_staleness": {str(k): hist[k] for k in sorted(hist)},
        "max_token_staleness": max(hist) if hist else 0,
        "stale_token_fraction": (total - hist.get(0, 0)) / total if total else 0.0,
    }
