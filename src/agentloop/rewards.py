"""Reward functions by name, and `score`, which runs one on a finished trajectory.

A reward function takes `(trajectory, sample)` (and `timeout=` if it declares that keyword) and
returns a float, a `RewardResult` (a reward plus optional per-turn rewards and details), a dict
`{"reward": x, "turn_rewards": [...], ...other details}`, None (does not score this trajectory), or
an awaitable of one of these. `call_reward` runs one: sync functions in a worker thread
(`anyio.to_thread.run_sync`) so a slow grader never blocks the event loop, every call under a
timeout. Registered functions (by name) and a trainer's own function (`Runtime(reward_fn=...)`)
go through the same `call_reward`. `score` picks the function: the trainer's, else `sample.reward`,
else a default (`SchedulerConfig.reward`) for samples with a ground truth. A function that raises,
times out or returns garbage leaves `trajectory.reward` None and records the error in
`trajectory.metrics["reward_error"]` and `trajectory.extra["reward_error"]` — one bad grader never
crashes a step.

Built-in: `arithmetic` (the last assistant message states `The answer is N.` with N ==
`sample.ground_truth`, via `agentloop.tasks.arithmetic`); `tool_success` (a per-turn reward: the
fraction of successful tool results after each tool-calling turn, final reward = arithmetic).
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, Union

import anyio

from .registry import Registry
from .tasks import arithmetic as arith
from .types import Sample, Trajectory

__all__ = [
    "REWARDS",
    "RewardFn",
    "RewardResult",
    "register_reward",
    "get_reward",
    "registered_rewards",
    "score",
    "call_reward",
    "RewardTimeout",
    "reward_name",
    "to_reward_result",
    "last_assistant_text",
]


@dataclass
class RewardResult:
    """A reward with optional per-turn rewards (one per assistant turn) and details for `extra`."""

    reward: float
    turn_rewards: list[float] | None = None
    info: dict[str, Any] = field(default_factory=dict)


class RewardTimeout(TimeoutError):
    """A reward function ran past its timeout (and was cancelled)."""


RewardValue = Union[float, int, bool, RewardResult]
RewardFn = Callable[[Trajectory, Sample], Union[RewardValue, Awaitable[RewardValue]]]

def _check_callable(name: str, fn: Any) -> None:
    if not callable(fn):
        raise TypeError(f"reward {name!r}: {fn!r} is not callable")


REWARDS: Registry[RewardFn] = Registry("reward function", check=_check_callable)


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: `@register_reward("name")` makes a function selectable by `sample.reward`."""
    if not name:
        raise ValueError("a reward function needs a name")
    return REWARDS.register(name)


def get_reward(name: str) -> RewardFn:
    return REWARDS.get(name)


def registered_rewards() -> list[str]:
    return REWARDS.names()


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _accepts(fn: Any, name: str) -> bool:
    """Whether `fn` takes a keyword argument `name` (by name or through **kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins and C callables have no signature
        return False
    return any((p.name == name and p.kind is not p.POSITIONAL_ONLY) or p.kind is p.VAR_KEYWORD for p in params)


def to_reward_result(value: Any, name: str) -> RewardResult:
    """A reward function's value (float, `RewardResult`, dict with "reward") as a checked `RewardResult`;
    raises TypeError/ValueError naming `name` for anything else."""
    if isinstance(value, RewardResult):
        result = value
    elif isinstance(value, numbers.Real):  # also numpy scalars
        result = RewardResult(float(value))
    elif isinstance(value, Mapping) and "reward" in value:
        info = {k: v for k, v in value.items() if k not in ("reward", "turn_rewards")}
        result = RewardResult(value["reward"], turn_rewards=value.get("turn_rewards"), info=info)
    else:
        raise TypeError(
            f"reward {name!r} returned {type(value).__name__}; expected a float, a RewardResult or a dict with 'reward'"
        )
    if not isinstance(result.reward, numbers.Real):
        raise TypeError(f"reward {name!r} returned reward={result.reward!r}; expected a number")
    if not math.isfinite(float(result.reward)):
        raise ValueError(f"reward {name!r} returned a non-finite value {result.reward!r}")
    result.reward = float(result.reward)
    if result.turn_rewards is not None:
        result.turn_rewards = [float(x) for x in result.turn_rewards]
    return result


def reward_name(fn: Any) -> str:
    """How errors name a reward function: its registered name if it has one, else its qualified name."""
    for name in REWARDS.names():
        registered = REWARDS.get(name)
        if registered is fn:
            return name
    return getattr(fn, "__qualname__", None) or type(fn).__name__


async def call_reward(
    fn: Callable[..., Any],
    trajectory: Trajectory,
    sample: Sample,
    *,
    timeout: float,
    name: str | None = None,
) -> RewardResult | None:
    """Run one reward function on a finished trajectory and return its result (None: it returned None,
    i.e. it does not score this trajectory). Raises what the function raised, or `RewardTimeout`.

    `fn(trajectory, sample, **sample.reward_kwargs)` — plus `timeout=` if it takes that keyword, so it
    can bound its own work (it then gets one extra second before it is cut off, to report its own
    error). Async functions are awaited; sync ones run in a worker thread so a slow grader never
    blocks the event loop; either way the call is cancelled past `timeout` seconds.
    """
    name = name or reward_name(fn)
    kwargs = dict(sample.reward_kwargs)
    limit = timeout
    if _accepts(fn, "timeout"):
        kwargs["timeout"] = timeout
        limit = timeout + 1.0
    scope = None
    try:
        with anyio.fail_after(limit) as scope:
            if _is_async(fn):
                value = await fn(trajectory, sample, **kwargs)
            else:
                # abandon_on_cancel: a grader stuck in C code cannot be interrupted; the timeout
                # frees the trajectory and the thread ends on its own.
                value = await anyio.to_thread.run_sync(
                    functools.partial(fn, trajectory, sample, **kwargs), abandon_on_cancel=True)
                if inspect.isawaitable(value):
                    value = await value
    except TimeoutError:
        if scope is None or not scope.cancel_called:
            raise  # the grader's own timeout (e.g. an HTTP call of a judge): its message says what
        raise RewardTimeout(f"reward {name!r} timed out after {timeout:g} s") from None
    return None if value is None else to_reward_result(value, name)


async def score(
    trajectory: Trajectory,
    sample: Sample,
    *,
    timeout: float = 10.0,
    default: str | None = None,
    fn: Callable[..., Any] | None = None,
) -> None:
    """Score a finished trajectory: with `fn` if given, else the function named by `sample.reward`,
    else `default` (only for a sample with a `ground_truth`: a dataset-wide grader needs an answer to
    grade against); no function → nothing is scored. Sets `trajectory.reward` (and `turn_rewards`,
    `extra["reward_info"]`). Never raises for a grader's fault: the error goes to
    `extra["reward_error"]` / `metrics["reward_error"]` (see `call_reward` for how it runs)."""
    if fn is None:
        name = sample.reward or (default if sample.ground_truth is not None else None)
        if not name:
            return
    else:
        name = reward_name(fn)
    t0 = time.monotonic()
    try:
        if fn is None:
            fn = get_reward(name)
        result = await call_reward(fn, trajectory, sample, timeout=timeout, name=name)
    except RewardTimeout as e:
        _record_error(trajectory, name, str(e))
    except Exception as e:
        _record_error(trajectory, name, f"reward {name!r} failed: {type(e).__name__}: {e}")
    else:
        if result is not None:
            trajectory.reward = result.reward
            if result.turn_rewards is not None:
                trajectory.turn_rewards = list(result.turn_rewards)
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
