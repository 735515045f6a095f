"""The synchronous facade of `Runtime`: `start_sync` / `step_sync` / `stop_sync` and `with Runtime(...)`.

Each runs the runtime's own coroutine through one anyio blocking portal that lives as long as the
runtime (its HTTP sessions and subprocesses belong to that one event loop). No second implementation.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Mapping, Sequence, TypeVar

import anyio.from_thread

from .stream import StreamConfig
from .stream_sync import SyncRolloutStream
from .types import StepResult
from ..types import Sample

__all__ = ["SyncFacade"]

_Self = TypeVar("_Self", bound="SyncFacade")


class SyncFacade:
    """Mixed into `Runtime`: the blocking forms of `start`, `step` and `stop`."""

    _portal_cm: Any = None
    _portal: anyio.from_thread.BlockingPortal | None = None

    start: Callable[[], Awaitable[Any]]
    step: Callable[..., Awaitable[StepResult]]
    stop: Callable[[], Awaitable[None]]

    def _blocking_portal(self) -> anyio.from_thread.BlockingPortal:
        if self._portal is None:
            self._portal_cm = anyio.from_thread.start_blocking_portal()
            self._portal = self._portal_cm.__enter__()
        return self._portal

    def start_sync(self: _Self) -> _Self:
        self._blocking_portal().call(self.start)
        return self

    def step_sync(self, samples: Sequence[Sample | Mapping[str, Any]], weights: Any = None, **kwargs: Any) -> StepResult:
        """`step` from synchronous code (same coroutine, run in the runtime's event-loop thread)."""
        portal = self._blocking_portal()
        return portal.call(lambda: self.step(samples, weights, **kwargs))

    def stream_sync(self, feeder: Any, config: StreamConfig, **kwargs: Any) -> SyncRolloutStream:
        """The streaming mode from synchronous code: `runtime.stream.SyncRolloutStream(self, feeder,
        config, **kwargs)` (`with rt.stream_sync(prompts, StreamConfig(...)) as s: for batch in s:
        s.update_weights(w)`)."""
        return SyncRolloutStream(self, feeder, config, **kwargs)

    def stop_sync(self) -> None:
        if self._portal is None:
            return
        try:
            self._portal.call(self.stop)
        finally:
            cm, self._portal, self._portal_cm = self._portal_cm, None, None
            cm.__exit__(None, None, None)

    def __enter__(self: _Self) -> _Self:
        return self.start_sync()

    def __exit__(self, *exc: object) -> None:
        self.stop_sync()
