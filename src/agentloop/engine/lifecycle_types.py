"""The lifecycle's data contracts: its states, stage names, errors, what to load at wake-up
(`Weights`) and the timing record of a stage. `lifecycle.py` owns the state machine that uses them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .lease import Lease


SLEEP_STAGES: tuple[str, ...] = ("pause", "settle", "continue", "flush_cache", "release")
"""The sleep stages in order (stage names in `LifecycleError.stage` and `StageRecord.stage`)."""


class EngineState(str, enum.Enum):
    SLEEPING = "SLEEPING"
    WEIGHTS_RESUMED = "WEIGHTS_RESUMED"
    WEIGHTS_LOADED = "WEIGHTS_LOADED"
    AWAKE = "AWAKE"
    DRAINING = "DRAINING"


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

    phase: str  # "wake_up" | "sleep"
    stage: str
    start: float
    end: float
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.end - self.start


MARK_SEPARATOR = "~agentloop:"
"""Separates the served weight version from the memory state the lifecycle records in it."""


@dataclass(frozen=True)
class MemoryMark:
    """A server's memory state as the lifecycle records it in the server's own `weight_version`.

    SGLang cannot be asked which memory tags it has released, and a release of released memory or a
    resume of resident memory crashes it; so before and after every release/resume the lifecycle
    writes this mark with `/update_weight_version` (and passes it as the `weight_version` of weight
    loads), and a later runtime reads it back from `/model_info`. `pending` names a call that was
    sent but not (yet) answered ("release:weights,kv_cache"): a runtime killed during it leaves it.
    `parked`: a runtime left the server asleep on purpose when it stopped (`engine.restore_on_stop:
    false`); without it, a server found asleep was left so by a runtime that did not get to stop.
    `lease`: the runtime that drives the server now (`agentloop.engine.lease`), present from its
    attach until it lets the server go, awake or asleep.
    A plain version (no mark) means nothing is released and nobody holds the server: a fresh server,
    or one a runtime woke completely and let go. The mark lives in the server process, so a
    restarted server never carries a stale one.
    """

    version: str
    released: frozenset[str] = frozenset()
    pending: str | None = None
    parked: bool = False
    lease: Lease | None = None

    def encode(self) -> str:
        if not self.released and self.pending is None and self.lease is None:
            return self.version
        text = f"{self.version}{MARK_SEPARATOR}released={','.join(sorted(self.released))}"
        text += (f";pending={self.pending}" if self.pending else "") + (";parked=1" if self.parked else "")
        return text + "".join(f";{k}={v}" for k, v in (self.lease.fields().items() if self.lease else ()))

    @classmethod
    def decode(cls, weight_version: str) -> "MemoryMark":
        version, sep, rest = str(weight_version).partition(MARK_SEPARATOR)
        if not sep:
            return cls(version)
        fields = dict(part.partition("=")[::2] for part in rest.split(";") if part)
        released = frozenset(t for t in fields.get("released", "").split(",") if t)
        return cls(version, released, fields.get("pending") or None, fields.get("parked") == "1",
                   Lease.from_fields(fields))


def served_version(weight_version: str) -> str:
    """The weight version a server serves, without the lifecycle's mark (generate responses carry
    the server's whole weight version string, mark included, while a runtime holds the server)."""
    return str(weight_version).partition(MARK_SEPARATOR)[0]
