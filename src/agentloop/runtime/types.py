"""What a `Runtime` step hands back: `StepResult`, the `StepStream` of a running step, and the
errors that carry a finished rollout's trajectories when the step cannot complete. (The checks of a
step's arguments, `check_pad_to` included, are `runtime_inputs`.)"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from ..batch import RaggedBatch, RolloutBatch, ragged
from ..types import Sample, Trajectory

__all__ = ["AgentloopError", "StepCollateError", "StepError", "StepResult", "StepSleepError", "StepStream"]


class AgentloopError(RuntimeError):
    """The runtime cannot do what was asked (not started, engines failed to start, ...)."""


class StepError(AgentloopError):
    """The rollout finished but the step could not be completed. Nothing is lost: the step's
    `trajectories` and `carry_over` are on the exception."""

    def __init__(self, message: str, trajectories: list[Trajectory], carry_over: list[Sample]) -> None:
        super().__init__(message)
        self.trajectories = trajectories
        self.carry_over = carry_over


class StepCollateError(StepError):
    """The trajectories cannot be collated (e.g. one is longer than `pad_to`)."""


class StepSleepError(StepError):
    """The engines' sleep after the rollout failed (the error names the stage and server). The next
    `step` finishes that sleep from the failed stage before it wakes the engines."""


@dataclass
class StepResult:
    """One step's output. Pass `carry_over` (+ new prompts) to the next `step` for partial rollout.

    `batch` is the padded tensor batch, `ragged` the same rows unpadded (per-trajectory lists, built
    from `trajectories` when not given); both carry `trainable` (0 = failed/aborted: drop or mask)
    and per-token weight versions. `rejected` holds the trajectories of groups the group filter
    turned away (not in `trajectories` or the batch). `agentloop.integrations` converts a
    StepResult for verl and TRL."""

    step: int
    weight_version: str | None
    trajectories: list[Trajectory]
    batch: RolloutBatch
    carry_over: list[Sample] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    rejected: list[Trajectory] = field(default_factory=list)
    ragged: RaggedBatch = None  # type: ignore[assignment]  # filled in __post_init__

    def __post_init__(self) -> None:
        if self.ragged is None:
            self.ragged = ragged(self.trajectories)


class StepStream:
    """Finished trajectories of a running step (`async for`), and its `StepResult` once it is done."""

    def __init__(self, receive: Any) -> None:
        self._receive = receive
        self.result: StepResult | None = None

    def __aiter__(self) -> AsyncIterator[Trajectory]:
        return self._receive.__aiter__()


class StreamBlock:
    """What `Runtime.stream` returns: an `async with` block whose value is iterated. Iterating it
    without the block is refused with the form to use (the block owns the engines' wake-up and sleep
    and the stream's tasks, which must end in the task that started them)."""

    def __init__(self, cm: Any, form: str) -> None:
        self._cm = cm
        self._form = form

    async def __aenter__(self) -> Any:
        return await self._cm.__aenter__()

    async def __aexit__(self, *exc: Any) -> Any:
        return await self._cm.__aexit__(*exc)

    def __aiter__(self) -> Any:
        raise TypeError(f"{self._form} is an async with block: `async with {self._form} as s: async for x in s: ...`")
