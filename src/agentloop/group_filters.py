"""Group filters: predicates over a finished GRPO group that decide whether it goes into the batch.

A group whose members all earned the same reward carries no GRPO signal (every advantage is 0), so
a trainer wants informative groups instead (DAPO's dynamic sampling). The scheduler applies the
filter named by `SchedulerConfig.group_filter` to every complete group (all members completed or
truncated, all scored); a rejected group's trajectories leave the batch (they come back on
`ScheduleResult.rejected`) and, with `target_groups`, the scheduler keeps sampling fresh prompts
until that many groups are accepted or its budget is spent.

Built-in: `drop_zero_variance` (accept a group only if its members' rewards are not all equal; a
group of one is never informative). Register your own with `@register_group_filter("name")`: the
function gets the group's trajectories (in member order) and returns True to accept it.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from .registry import Registry
from .types import Trajectory

__all__ = ["GROUP_FILTERS", "GroupFilter", "get_group_filter", "register_group_filter", "registered_group_filters"]

GroupFilter = Callable[[Sequence[Trajectory]], bool]


def _check_callable(name: str, fn: Any) -> None:
    if not callable(fn):
        raise TypeError(f"group filter {name!r}: {fn!r} is not callable")


#: An unknown name is a ValueError: `SchedulerConfig.group_filter` validates through it.
GROUP_FILTERS: Registry[GroupFilter] = Registry("group filter", error=ValueError, check=_check_callable)


def register_group_filter(name: str) -> Callable[[GroupFilter], GroupFilter]:
    """Decorator: `@register_group_filter("name")` makes a predicate selectable by `SchedulerConfig.group_filter`."""
    if not name:
        raise ValueError("a group filter needs a name")
    return GROUP_FILTERS.register(name)


def get_group_filter(name: str) -> GroupFilter:
    return GROUP_FILTERS.get(name)


def registered_group_filters() -> list[str]:
    return GROUP_FILTERS.names()


@register_group_filter("drop_zero_variance")
def drop_zero_variance(group: Sequence[Trajectory]) -> bool:
    """Accept the group if its rewards differ (a scoreless member counts as uninformative)."""
    rewards = [t.reward for t in group]
    if len(rewards) < 2 or any(r is None for r in rewards):
        return False
    return max(rewards) > min(rewards)  # type: ignore[type-var]
