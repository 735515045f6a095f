"""Where a run's fresh samples come from: `Feeder` over the trainer's iterator or async iterator.

The run draws from it whenever it wants another group (a group filter keeps the step short of its
target, or over-admission keeps `active` trajectories in flight). A sync iterator is read inline; an
async one is awaited (it may wait for the trainer's data loader). A sample the feeder has produced
is never lost: the run registers it even if it stopped meanwhile (it then comes back as carry-over).
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterable
from typing import Any, AsyncIterator, Iterator

from ..types import Sample

__all__ = ["Feeder"]


class Feeder:
    """The next sample of a sync or async iterable (`None` once it is exhausted)."""

    def __init__(self, source: Iterable[Sample] | AsyncIterable[Sample]) -> None:
        self._sync: Iterator[Sample] | None = None
        self._async: AsyncIterator[Sample] | None = None
        if isinstance(source, AsyncIterable):
            self._async = aiter(source)
        elif isinstance(source, Iterable):
            self._sync = iter(source)
        else:
            raise TypeError(f"more_samples must be an iterable or async iterable of Samples, got {type(source).__name__}")
        self.drawn = 0
        self.exhausted = False

    async def next(self) -> Any:
        """The next item (checked by the caller), or None when the source is exhausted."""
        if self.exhausted:
            return None
        try:
            if self._async is not None:
                item = await self._async.__anext__()
            else:
                assert self._sync is not None
                item = next(self._sync)
        except (StopIteration, StopAsyncIteration):
            self.exhausted = True
            return None
        self.drawn += 1
        return item
