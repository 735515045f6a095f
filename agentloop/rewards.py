"""Reward functions by name, and `score`, which runs one on a finished trajectory.

A reward function takes `(trajectory, sample)` and returns a float, a `RewardResult` (a reward plus
optional per-turn rewards and details), or an awaitable of either. Sync functions run in a worker
thread (`anyio.to_thread.run_sync`) so a slow grader never blocks the event loop; every call runs
under a timeout. A function that raises, times out or returns garbage leaves `trajectory.reward`
None and records the error in `trajectory.metrics["reward_error"]` and `trajectory.extra
["reward_error"]` — one bad grader never crashes a step.

Built-in: `arithmetic` (the last assistant message states `The answer is N.` with N ==
`sample.ground_truth`, via `agentloop.tasks.arithmetic`); `tool_success` (a per-turn reward: the
fraction of successful tool results after each tool-calling turn, final reward = arithmetic).
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Union

import anyio

from .tasks import arithmetic as arith
from .types import Sample, Trajectory

__all__ = [
    "RewardFn",
    "RewardResult",
    "register_reward",
    "get_reward",
    "registered_rewards",
    "score",
    "last_assistant_text",
]


@dataclass
class RewardResult:
    """A reward with optional per-turn rewards (one per assistant turn) and details for `extra`."""

    reward: float
    turn_rewards: list[float] | None = None
    info: dict[str, Any] = field(default_factory=dict)


RewardValue = Union[float, int, bool, RewardResult]
RewardFn = Callable[[Trajectory, Sample], Union[RewardValue, Awaitable[RewardValue]]]

_REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: `@register_reward("name")` makes a function selectable by `sample.reward`."""
    if not name:
        raise ValueError("a reward function needs a name")

    def deco(fn: RewardFn) -> RewardFn:
        if not callable(fn):
            raise TypeError(f"reward {name!r}: {fn!r} is not callable")
        _REWARDS[name] = fn
        return fn

    return deco


def get_reward(name: str) -> RewardFn:
    try:
        return _REWARDS[name]
    except KeyError:
        raise KeyError(f"unknown reward function {name!r}; registered: {sorted(_REWARDS)}") from None


def registered_rewards() -> list[str]:
    return sorted(_REWARDS)


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _coerce(value: Any, name: str) -> RewardResult:
    if isinstance(value, RewardResult):
        result = value
    elif isinstance(value, (bool, int, float)):
        result = RewardResult(float(value))
    else:
        raise TypeError(f"reward {name!r} returned {type(value).__name__}; expected a float or RewardResult")
    if not math.isfinite(float(result.reward)):
        raise ValueError(f"reward {name!r} returned a non-finite value {result.reward!r}")
    result.reward = float(result.reward)
    return result


async def score(
    trajectory: Trajectory,
    sample: Sample,
    *,
    timeout: float = 10.0,
    default: str | None = None,
) -> None:
    """Set `trajectory.reward` (and `turn_rewards`) with the function named by `sample.reward`, else
    `default`; no name → nothing is scored. Never raises for a grader's fault (errors go to metrics)."""
    name = sample.reward or default
    if not name:
        return
    t0 = time.monotonic()
    try:
        fn = get_reward(name)
        with anyio.fail_after(timeout):
            if _is_async(fn):
                value = await fn(trajectory, sample)  # type: ignore[misc]
            else:
                # abandon_on_cancel: a grader stuck in C code cannot be interrupted; the timeout
                # frees the trajectory and the thread ends on its own.
                value = await anyio.to_thread.run_sync(fn, trajectory, sample, abandon_on_cancel=True)
                if inspect.isawaitable(value):
                    value = await value
        result = _coerce(value, name)
    except TimeoutError:
        _record_error(trajectory, name, f"reward {name!r} timed out after {timeout:g} s")
    except Exception as e:
        _record_error(trajectory, name, f"reward {name!r} failed: {type(e).__name__}: {e}")
    else:
        trajectory.reward = result.reward
        if result.turn_rewards is not None:
            trajectory.turn_rewards = [float(x) for x in result.turn_rewards]
        if result.info:
            trajectory.extra["reward_info"] = dict(result.info)
        trajectory.metrics.pop("reward_error", None)
        trajectory.extra.pop("reward_error", None)
    trajectory.metrics["reward_seconds"] = time.monotonic() - t0


def _record_error(trajectory: Trajectory, name: str, message: str) -> None:
    trajectory.reward = None
    trajectory.metrics["reward_error"] = 1.0
    trajectory.extra["reward_error"] = message
    trajectory.extra["reward_fn"] = name


# ---------------------------------------------------------------------------------------------
# Built-in rewards
# ---------------------------------------------------------------------------------------------


def last_assistant_text(trajectory: Trajectory) -> str:
    """Content of the last assistant message of the (readable) conversation, '' if none."""
    for m in reversed(trajectory.messages):
        if m.get("role") == "assistant":
            content = m.get("content")
            return content if isinstance(content, str) else ""
    return ""


def _ground_truth_int(sample: Sample) -> int:
    gt = sample.ground_truth
    if isinstance(gt, dict):
        gt = gt.get("answer")
    if isinstance(gt, bool) or gt is None:
        raise ValueError(f"sample {sample.uid}: arithmetic reward needs an integer ground_truth, got {gt!r}")
    try:
        return int(str(gt).strip())
    except ValueError:
        raise ValueError(f"sample {sample.uid}: ground_truth {gt!r} is not an integer") from None


@register_reward("arithmetic")
def arithmetic_reward(trajectory: Trajectory, sample: Sample) -> RewardResult:
    """1.0 if the last assistant message says `The answer is N.` with N the ground truth, else 0.0."""
    answer = _ground_truth_int(sample)
    text = last_assistant_text(trajectory)
    got = arith.extract_final_answer(text)
    return RewardResult(float(arith.is_correct(text, answer)), info={"extracted": got, "expected": answer})


@register_reward("tool_success")
def tool_success_reward(trajectory: Trajectory, sample: Sample) -> RewardResult:
    """Final reward as `arithmetic`; per assistant turn, the fraction of its tool calls that
    succeeded (1.0 for a turn without calls), from the loop's `extra["tool_results"]` record."""
    final = arithmetic_reward(trajectory, sample)
    by_turn = {int(r["turn"]): r["ok"] for r in trajectory.extra.get("tool_results", [])}
    per_turn = []
    for turn in range(1, trajectory.num_turns + 1):
        oks = by_turn.get(turn)
        per_turn.append(sum(1 for ok in oks if ok) / len(oks) if oks else 1.0)
    return RewardResult(final.reward, turn_rewards=per_turn, info=final.info)
