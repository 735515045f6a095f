"""Which prompts each step of `agentloop rollout` launches.

Owns the walk over the dataset: rows are taken in order and wrap around (a later lap relabels the
uid so groups stay unique across the run's output), and how many prompt groups a step launches
(`prompts_per_step`, or over-sampling's ceil(target_groups x oversample_factor)).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from ..rollout_config import RolloutConfig
from ..types import Sample


def take_prompts(samples: Sequence[Sample], start: int, count: int) -> list[Sample]:
    """`count` rows from position `start` of the endless repetition of `samples` (in order, wrapping).

    A row seen again (a later lap) gets its uid suffixed with the lap (uids name groups and must
    stay unique across the run's output)."""
    out = []
    for pos in range(start, start + count):
        s = samples[pos % len(samples)]
        lap = pos // len(samples)
        out.append(s if lap == 0 else _relabel(s, f"{s.uid}@{lap}"))
    return out


def step_prompts(samples: Sequence[Sample], step: int, per_step: int | None) -> list[Sample]:
    """The prompts of step `step` (1-based) when every step takes `per_step` fresh rows (None: all)."""
    if per_step is None:
        return take_prompts(samples, (step - 1) * len(samples), len(samples))
    return take_prompts(samples, (step - 1) * per_step, per_step)


def groups_per_step(cfg: RolloutConfig) -> int | None:
    """How many prompt groups each step launches: `prompts_per_step`, or with over-sampling
    (`runtime.scheduler.target_groups` set) ceil(target_groups x oversample_factor), which the
    scheduler cuts back to `target_groups` complete groups (None: every row each step)."""
    sched = cfg.runtime.scheduler
    if sched.target_groups is None:
        return cfg.prompts_per_step
    return sched.prompts_per_step(sched.target_groups)


def _relabel(s: Sample, uid: str) -> Sample:
    return dataclasses.replace(s, uid=uid, extra=dict(s.extra))
