"""The lifecycle's data contracts: stage names, errors, what to load (`Weights`), the timing record
of a stage (`StageRecord`), the settings every part reads (`LifecycleSettings`), and the named
record of a wake-up in progress (`WakeUp`). `EngineState` lives in `engine/state.py` (the gate needs it
without the lifecycle) and `MemoryMark` in `engine/memory_mark.py` (its format's one owner)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence, Union

import anyio

from ..base import MEMORY_TAGS

__all__ = ["SLEEP_STAGES", "AttachState", "LifecycleError", "LifecycleSettings", "StageRecord", "WakeUp",
           "Weights", "same_weights"]

SLEEP_STAGES: tuple[str, ...] = ("pause", "settle", "continue", "flush_cache", "release")
"""The sleep stages in order (stage names in `LifecycleError.stage` and `StageRecord.stage`)."""

#: "auto" (read each server's mark), "awake" (nothing released), "asleep" (every tag released), or the
#: exact list of released tags.
AttachState = Union[Literal["auto", "awake", "asleep"], Sequence[str]]


class LifecycleError(RuntimeError):
    """A lifecycle stage failed (or was asked for out of order). Names the stage and the server."""

    def __init__(self, stage: str, message: str, *, url: str = "", cause: BaseException | None = None):
        self.stage = stage
        self.url = url
        where = f" on {url}" if url else ""
        super().__init__(f"lifecycle stage '{stage}'{where} failed: {message}")
        if cause is not None:
            self.__cause__ = cause


@dataclass
class Weights:
    """What to load at wake-up: a state dict (name → tensor), a folder/file on disk, or nothing."""

    state_dict: Mapping[str, Any] | None = None
    path: str | None = None
    version: str | None = None
    load_format: str | None = None

    @classmethod
    def coerce(cls, weights: "Weights | Mapping[str, Any] | str | Path | None") -> "Weights | None":
        if weights is None or isinstance(weights, Weights):
            return weights
        if isinstance(weights, (str, Path)):
            return cls(path=str(weights))
        if isinstance(weights, Mapping):
            return cls(state_dict=weights)
        raise TypeError(f"weights must be a state dict, a path, Weights or None; got {type(weights).__name__}")


def same_weights(a: Weights | None, b: Weights | None) -> bool:
    """Whether two wake-up requests ask for the same weights.

    `Weights.coerce` wraps a state dict or a path in a fresh `Weights` on every call, so identity of
    the wrappers says nothing: the same state dict object (`is`: equal tensors cannot be compared
    cheaply, and a trainer passes the one dict it built) or the same path is the same request. An
    explicit `version` different from the other's is a new request (the way to force a reload of a
    path or of a dict updated in place).
    """
    if a is b:
        return True
    if a is None or b is None:
        return False
    if a.version is not None and a.version != b.version:
        return False
    if a.load_format != b.load_format:
        return False
    if a.state_dict is not None or b.state_dict is not None:
        return a.state_dict is b.state_dict
    return a.path is not None and b.path is not None and Path(a.path) == Path(b.path)


@dataclass
class StageRecord:
    """Timing of one lifecycle stage (across all engines), for summaries and the timeline."""

    phase: str  # "wake_up" | "sleep" | "restore" | "update_in_flight" | "update_drained"
    stage: str
    start: float
    end: float
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class LifecycleSettings:
    """The knobs every part of a lifecycle reads (see `Lifecycle` for what each one does)."""

    staged: bool = True
    release_tags: tuple[str, ...] = MEMORY_TAGS
    reload_path: str | None = None
    flush_retries: int = 50
    flush_retry_delay: float = 0.05
    settle_timeout: float = 60.0
    stage_timeout: float = 600.0
    liveness_timeout: float = 5.0
    attach_state: "str | list[str]" = "auto"
    takeover: bool = False
    lease_timeout: float = 600.0
    #: seconds between writing a new lease and reading it back (see `ServerDriver.acquire`)
    acquire_settle: float = 0.5

    def __post_init__(self) -> None:
        unknown = set(self.release_tags) - set(MEMORY_TAGS)
        if unknown:
            raise ValueError(f"unknown memory tags {sorted(unknown)}; known: {list(MEMORY_TAGS)}")
        if isinstance(self.attach_state, str):
            if self.attach_state not in ("auto", "awake", "asleep"):
                raise ValueError(f"attach_state must be auto|awake|asleep or a list of released tags, not {self.attach_state!r}")
        elif set(self.attach_state) - set(MEMORY_TAGS):
            raise ValueError(f"attach_state: unknown memory tags {sorted(set(self.attach_state) - set(MEMORY_TAGS))}")


@dataclass
class WakeUp:
    """A wake-up in progress: the weights it loads, and its outcome for the callers that join it."""

    weights: Weights | None
    done: anyio.Event = field(default_factory=anyio.Event)
    error: BaseException | None = None

    def joins(self, w: Weights | None) -> bool:
        """A call asking for `w` shares this wake-up (no weights, or the same ones)."""
        return w is None or same_weights(w, self.weights)

    async def outcome(self) -> None:
        """Wait for it to end; raise its error if it failed."""
        await self.done.wait()
        if self.error is not None:
            raise self.error
