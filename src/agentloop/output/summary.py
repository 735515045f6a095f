"""The numbers of `summary.json`: per step (`summarize_step`) and over the run (`summarize_run`) —
counts by status, tool calls, reward mean, generated tokens/s, where the trajectories' time went
(`TIME_KINDS`), the seconds of each wake-up and sleep stage, and what became of every launched prompt
(`PROMPT_STATUSES`) — and `write_summary`, which writes them whole. Non-finite numbers are written as
null, so strict JSON parsers read the file.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from .atomic_file import atomic_write_text
from .engine_use import total_engine_use
from ..engine.lifecycle import StageRecord
from ..types import STATUSES, Trajectory

__all__ = ["PROMPT_STATUSES", "TIME_KINDS", "stage_seconds", "summarize_run", "summarize_step", "time_split",
           "write_summary"]

TIME_KINDS = ("generate", "tool", "queue", "wait", "user")
#: What became of one launched prompt (a GRPO group): its trajectories' worst status, `aborted` if
#: some were stopped or never ran, `not_started` if none ran, `carried_over` if continued next step.
PROMPT_STATUSES = ("completed", "truncated", "failed", "aborted", "not_started", "carried_over")


def _finite(x: float | None, digits: int = 6) -> float | None:
    """JSON has no NaN/inf: write them as null rather than produce a file strict parsers reject.
    Rounded to `digits` (microseconds; nobody reads a summary's 15th digit)."""
    if x is None or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return round(float(x), digits)


def time_split(traj: Trajectory) -> dict[str, float]:
    """Seconds a trajectory spent per kind (generate/tool/queue/wait/user), from its timeline events,
    falling back to `metrics` (`<kind>_seconds`) when a loop records no events of that kind."""
    out = dict.fromkeys(TIME_KINDS, 0.0)
    for ev in traj.timeline:
        if ev.kind in out:
            out[ev.kind] += max(0.0, ev.end - ev.start)
    for kind in TIME_KINDS:
        if out[kind] == 0.0:
            v = traj.metrics.get(f"{kind}_seconds", traj.metrics.get(kind))
            if isinstance(v, (int, float)) and math.isfinite(v):
                out[kind] = float(v)
    return out


def stage_seconds(records: Sequence[StageRecord]) -> dict[str, dict[str, float]]:
    """{"wake_up": {stage: seconds, ...}, "sleep": {...}} summed over the given records."""
    out: dict[str, dict[str, float]] = {"wake_up": {}, "sleep": {}}
    for r in records:
        phase = out.setdefault(r.phase, {})
        phase[r.stage] = round(phase.get(r.stage, 0.0) + r.seconds, 6)
    return out


def summarize_step(
    trajectories: Sequence[Trajectory],
    records: Sequence[StageRecord] = (),
    *,
    step: int = 0,
    seconds: float | None = None,
    rollout_seconds: float | None = None,
    weight_version: str | None = None,
    prompts: Mapping[str, str] | None = None,
    engine_use: Mapping[str, Any] | None = None,
    staleness: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The numbers of one step. `staleness` (the step's `token_staleness` histogram — versions behind
    the step's weights → sampled tokens —, from `scheduler.staleness.token_staleness`, in
    `StepResult.metrics`) is listed as `token_staleness` with `max_token_staleness`. `engine_use` (`agentloop.output.engine_use`: concurrency used, engine
    busy fraction) is listed as given. `rollout_seconds` (wall time of the roll-out phase) is the
    denominator of tokens/s; without it, the span of the trajectories' timeline events is used.
    `prompts` (uid → one of `PROMPT_STATUSES`) is listed and counted as given."""
    statuses = Counter(t.status for t in trajectories)
    rewards = [t.reward for t in trajectories if t.reward is not None and math.isfinite(t.reward)]
    gen_tokens = sum(sum(1 for m in t.response_mask if m == 1) for t in trajectories)
    split = dict.fromkeys(TIME_KINDS, 0.0)
    for t in trajectories:
        for k, v in time_split(t).items():
            split[k] += v
    if rollout_seconds is None:
        starts = [e.start for t in trajectories for e in t.timeline]
        ends = [e.end for t in trajectories for e in t.timeline]
        rollout_seconds = (max(ends) - min(starts)) if starts else None
    stages = stage_seconds(records)
    n = len(trajectories)
    return {
        "step": step,
        "weight_version": weight_version,
        "trajectories": n,
        "status": {s: statuses.get(s, 0) for s in STATUSES},
        "tool_calls": sum(t.tool_calls for t in trajectories),
        "trajectories_with_tool_call": sum(1 for t in trajectories if t.tool_calls > 0),
        "turns_mean": _finite(sum(t.num_turns for t in trajectories) / n) if n else None,
        "reward_mean": _finite(sum(rewards) / len(rewards)) if rewards else None,
        "rewarded": len(rewards),
        "generated_tokens": gen_tokens,
        "response_tokens": sum(len(t.response_ids) for t in trajectories),
        "tokens_per_second": _finite(gen_tokens / rollout_seconds) if rollout_seconds else None,
        "seconds": {
            "step": _finite(seconds),
            "rollout": _finite(rollout_seconds),
            "wake_up": round(sum(stages["wake_up"].values()), 6),
            "sleep": round(sum(stages["sleep"].values()), 6),
        },
        # Summed over trajectories: where the trajectories' time went, not wall time.
        "trajectory_seconds": {k: round(v, 6) for k, v in split.items()},
        "wake_up_stages": stages["wake_up"],
        "sleep_stages": stages["sleep"],
        **({} if engine_use is None else {"engine_use": dict(engine_use)}),
        **({} if staleness is None else _staleness(staleness)),
        **({} if prompts is None else {"prompt_status": _prompt_counts(prompts.values()), "prompts": dict(prompts)}),
    }


def _staleness(hist: Mapping[Any, Any]) -> dict[str, Any]:
    """{"token_staleness": {versions behind: tokens} (keys as strings, in order), "max_token_staleness"}."""
    counts = {int(k): int(v) for k, v in hist.items()}
    return {"token_staleness": {str(k): counts[k] for k in sorted(counts)},
            "max_token_staleness": max((k for k, v in counts.items() if v), default=0)}


def _prompt_counts(statuses: Iterable[str]) -> dict[str, int]:
    counts = Counter(statuses)
    return {s: counts.get(s, 0) for s in PROMPT_STATUSES}


def summarize_run(steps: Sequence[dict[str, Any]], **info: Any) -> dict[str, Any]:
    """Totals over steps (their summaries from `summarize_step`) plus free `info` (config, paths)."""
    total_traj = sum(s["trajectories"] for s in steps)
    status = {k: sum(s["status"][k] for s in steps) for k in STATUSES}
    rewarded = sum(s["rewarded"] for s in steps)
    reward_sum = sum((s["reward_mean"] or 0.0) * s["rewarded"] for s in steps)
    gen = sum(s["generated_tokens"] for s in steps)
    rollout_s = sum(s["seconds"]["rollout"] or 0.0 for s in steps)
    wake: dict[str, float] = {}
    sleep: dict[str, float] = {}
    for s in steps:
        for k, v in s["wake_up_stages"].items():
            wake[k] = round(wake.get(k, 0.0) + v, 6)
        for k, v in s["sleep_stages"].items():
            sleep[k] = round(sleep.get(k, 0.0) + v, 6)
    totals = {
        "steps": len(steps),
        "trajectories": total_traj,
        "status": status,
        "tool_calls": sum(s["tool_calls"] for s in steps),
        "trajectories_with_tool_call": sum(s["trajectories_with_tool_call"] for s in steps),
        "reward_mean": _finite(reward_sum / rewarded) if rewarded else None,
        "generated_tokens": gen,
        "tokens_per_second": _finite(gen / rollout_s) if rollout_s else None,
        "seconds": {
            "rollout": round(rollout_s, 6),
            "wake_up": round(sum(wake.values()), 6),
            "sleep": round(sum(sleep.values()), 6),
        },
        "trajectory_seconds": {k: round(sum(s["trajectory_seconds"][k] for s in steps), 6) for k in TIME_KINDS},
        "wake_up_stages": wake,
        "sleep_stages": sleep,
    }
    if any("engine_use" in s for s in steps):
        totals["engine_use"] = total_engine_use(s.get("engine_use") for s in steps)
    if any("token_staleness" in s for s in steps):
        hist: Counter[int] = Counter()
        for st in steps:
            hist.update({int(k): v for k, v in st.get("token_staleness", {}).items()})
        totals.update(_staleness(hist))
    if any("prompts" in s for s in steps):
        totals["prompt_status"] = _prompt_counts(v for s in steps for v in s.get("prompts", {}).values())
    clash = info.keys() & (totals.keys() | {"total", "per_step"})
    if clash:
        raise ValueError(f"summarize_run: info keys {sorted(clash)} would hide the run totals")
    # The run totals at top level (what a reader looks up first: summary["status"], ["reward_mean"],
    # ["tokens_per_second"], ...) and, unchanged, under "total" next to "per_step"; same object.
    return {**info, **totals, "total": totals, "per_step": list(steps)}


def write_summary(path: str | Path, summary: dict[str, Any]) -> Path:
    return atomic_write_text(path, json.dumps(summary, indent=2, allow_nan=False, default=str) + "\n")
