"""Which prompts each step of `agentloop rollout` launches.

Owns the walk over the dataset: rows are taken in order and wrap around (a later lap relabels the
uid so groups stay unique across the run's output), and how many prompt groups a step launches
(`prompts_per_step`, or over-sampling's ceil(target_groups x oversample_factor)), and what became
of each launched prompt (`prompt_statuses`, listed in summary.json).

A dataset smaller than what the run draws is reused, not refused (a few rows for many steps is an
ordinary epoch loop), but never silently: `wrap_notice` is said once before the run starts and
summary.json's `data_use` (`data_use`) records the rows, the prompts drawn and the laps.
"""

from __future__ import annotations

import dataclasses
from typing import Collection, Mapping, Sequence

from ..config.rollout import RolloutConfig
from ..types import Sample, Trajectory


def take_prompts(samples: Sequence[Sample], start: int, count: int) -> list[Sample]:
    """`count` rows from position `start` of the endless repetition of `samples` (in order, wrapping).

    A row seen again (a later lap) gets its uid suffixed with the lap (uids name groups and must
    stay unique across the run's output): see `lap_uid`."""
    out = []
    uids = {s.uid for s in samples} if start + count > len(samples) else set()
    for pos in range(start, start + count):
        s = samples[pos % len(samples)]
        lap = pos // len(samples)
        out.append(s if lap == 0 else _relabel(s, lap_uid(s.uid, lap, uids)))
    return out


def lap_uid(uid: str, lap: int, dataset_uids: Collection[str]) -> str:
    """The uid of row `uid` on lap `lap` (>= 1): `uid@lap`, or, when the dataset itself has a row of that
    name (rows `a` and `a@1`), `uid@lap~k` with the smallest k that no row has. Never a dataset uid,
    and never another (row, lap)'s label: the label ends in `@<digits>` or `@<digits>~<digits>`, so
    its row and lap can be read back from it."""
    label = f"{uid}@{lap}"
    k = 1
    candidate = label
    while candidate in dataset_uids:
        candidate = f"{label}~{k}"
        k += 1
    return candidate


def step_prompts(samples: Sequence[Sample], step: int, per_step: int | None) -> list[Sample]:
    """The prompts of step `step` (1-based) when every step takes `per_step` fresh rows (None: all)."""
    if per_step is None:
        return take_prompts(samples, (step - 1) * len(samples), len(samples))
    return take_prompts(samples, (step - 1) * per_step, per_step)


def wrap_notice(rows: int, per_step: int | None, steps: int) -> str | None:
    """One line saying that the run will reuse rows (None when it will not, or takes every row each step)."""
    if per_step is None or rows <= 0 or per_step * steps <= rows:
        return None
    drawn = per_step * steps
    laps = -(-drawn // rows)
    within = (f"; {per_step} prompts per step > {rows} rows, so each step repeats rows within itself (more "
              f"trajectories of one prompt: --n)" if per_step > rows else "")
    return (f"the data has {rows} row(s) and {steps} step(s) x {per_step} prompts draw up to {drawn}: rows are "
            f"reused in order, wrapping around, up to {laps} times each (a reuse's uid gets @1, @2, ...){within}")


def data_use(rows: int, drawn: int, per_step: int | None) -> dict[str, int | bool]:
    """summary.json's `data_use`: rows, fresh prompts drawn, laps over the data, whether it wrapped."""
    return {"rows": rows, "prompts_drawn": drawn, "laps": -(-drawn // rows) if rows else 0,
            "wrapped": per_step is not None and drawn > rows}


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


def launched_groups(prompts: Sequence[Sample], n: int) -> dict[str, int]:
    """{prompt (group) uid: trajectories it launches} for a step's prompts: a fresh prompt is a group
    of `n`, a member carried over from the last step (group_id set) is one of its group."""
    out: dict[str, int] = {}
    for p in prompts:
        key = p.group_id or p.uid
        out[key] = out.get(key, 0) + (1 if p.group_id else n)
    return out


def prompt_statuses(launched: Mapping[str, int], trajectories: Sequence[Trajectory],
                    carried: Collection[str] = ()) -> dict[str, str]:
    """Every launched prompt with what became of it, so a stopped run says what to re-run:
    `carried_over` (continued next step), `not_started` (no trajectory of it ran), `aborted` (some of
    its trajectories were stopped or never ran), else the worst of its trajectories' statuses."""
    seen: dict[str, list[str]] = {}
    for t in trajectories:
        seen.setdefault(t.group_id or t.uid, []).append(t.status)
    out: dict[str, str] = {}
    for uid, size in launched.items():
        got = seen.get(uid, [])
        if uid in carried:
            out[uid] = "carried_over"
        elif not got:
            out[uid] = "not_started"
        elif len(got) < size or "aborted" in got:
            out[uid] = "aborted"
        else:
            out[uid] = next(s for s in ("failed", "truncated", "completed") if s in got)
    return out
