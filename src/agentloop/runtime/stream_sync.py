"""One job: the streaming mode (`rt.stream(feeder, config)`, stream.py) from synchronous code, through
the runtime's blocking portal — the same coroutines, each call waited for. (It goes through the
runtime's `stream`, so stream.py can re-export it without an import cycle.)"""

from __future__ import annotations

from typing import Any, Iterable

from .stream_types import StreamBatch, StreamConfig

__all__ = ["SyncRolloutStream"]


class SyncRolloutStream:
    """`rollout_stream` from synchronous code, through the runtime's blocking portal (same coroutines):

        with SyncRolloutStream(runtime, feeder, StreamConfig(batch_groups=8, active=64)) as s:
            for batch in s:
                s.update_weights(train_on(batch))
    """

    def __init__(self, runtime: Any, feeder: Iterable[Any], config: StreamConfig, **kwargs: Any) -> None:
        self._portal = runtime._blocking_portal()
        if not isinstance(config, StreamConfig):  # rt.stream would take it for one step's weights
            raise TypeError(f"SyncRolloutStream: config must be a StreamConfig, got {type(config).__name__}")
        self._cm = self._portal.wrap_async_context_manager(runtime.stream(feeder, config, **kwargs))
        self.stream = self._cm.__enter__()  #: the `RolloutStream` (stream.py)

    def __iter__(self) -> "SyncRolloutStream":
        return self

    def __next__(self) -> StreamBatch:
        try:
            return self._portal.call(self.stream.__anext__)
        except StopAsyncIteration:
            raise StopIteration from None

    def update_weights(self, weights: Any, version: str | None = None) -> str | None:
        return self._portal.call(self.stream.update_weights, weights, version)

    @property
    def metrics(self) -> dict[str, Any]:
        return self.stream.metrics

    def close(self) -> None:
        if self._cm is not None:
            cm, self._cm = self._cm, None
            cm.__exit__(None, None, None)

    def __enter__(self) -> "SyncRolloutStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
