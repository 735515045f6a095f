"""What a `Runtime.step` accepts, checked before any engine wakes: `pad_to`, the samples (dataset-style
rows become `Sample`s through the dataset's own validation) and the default reward's name.

Each refusal is a ValueError naming the argument (and the row's index), raised before the step
touches an engine, so a bad call never costs a wake-up and a sleep.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence

from ..types import Sample

__all__ = ["check_pad_to", "check_reward_name", "rows_to_samples"]


def check_pad_to(pad_to: Any) -> tuple[int | None, int | None] | None:
    """`pad_to` checked before any engine wakes: None or (prompt_len, response_len), each None or >= 1."""
    if pad_to is None:
        return None
    if not isinstance(pad_to, (tuple, list)) or len(pad_to) != 2 or not all(
            v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1) for v in pad_to):
        raise ValueError(f"pad_to must be None or (prompt_len, response_len), each a positive int or None; got {pad_to!r}")
    return (pad_to[0], pad_to[1])


def check_reward_name(reward: str | None) -> None:
    """A step's default reward (`scheduler.reward`) must be registered: refused once, not per trajectory."""
    if reward is None:
        return
    from ..rewards import registered_rewards

    if reward not in registered_rewards():
        raise ValueError(f"scheduler.reward: unknown reward function {reward!r}; registered: {registered_rewards()}")


def rows_to_samples(
    samples: Sequence[Sample | Mapping[str, Any]], row_numbers: Iterator[int], *, trainer_reward: bool,
) -> list[Sample]:
    """Samples as given; dict rows through the dataset's own validation (`row_to_sample`), with the
    uid `row-<k>` (k from `row_numbers`, counting over the runtime's life) when a row has none.
    `trainer_reward`: a trainer's reward_fn scores every trajectory, so rows' reward names are not
    checked against the registry."""
    if not any(isinstance(s, Mapping) for s in samples):
        return list(samples)  # type: ignore[arg-type]
    from ..agents.registry import registered_agents
    from ..dataset import row_to_sample
    from ..rewards import registered_rewards

    out: list[Sample] = []
    for i, s in enumerate(samples):
        if not isinstance(s, Mapping):
            out.append(s)
            continue
        try:
            out.append(row_to_sample(
                dict(s), default_uid=f"row-{next(row_numbers)}", known_agents=registered_agents(),
                known_rewards=None if trainer_reward else registered_rewards()))
        except ValueError as e:
            raise ValueError(f"step: samples[{i}] is not a usable row: {e}") from None
    return out
