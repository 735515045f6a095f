"""`training.png`: the training signal per step, what a verl or TRL user looks at first.

Six panels over the steps: reward mean with its std (and the share of GRPO groups whose rewards differ,
i.e. that give a non-zero advantage), response length in tokens (mean and 10th-90th percentile),
tool calls per trajectory, trajectories by status (stacked), and generated tokens/s.

`step_stats` computes one step's numbers from its trajectories (what `agentloop rollout` has);
`StepStats.from_result` from a `Runtime` `StepResult` (what a trainer has), so a trainer draws the
same picture with `plot_training([StepStats.from_result(r) for r in results], "training.png")`, or
simply `plot_training(results, path)`. Rewards that are None (unscored) are left out of the reward
panel; a step with none shows a gap.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ..types import STATUSES, Trajectory

__all__ = ["StepStats", "plot_training", "step_stats"]

STATUS_COLORS = {"completed": "#2ca02c", "truncated": "#ff7f0e", "aborted": "#7f7f7f", "failed": "#d62728"}


@dataclass
class StepStats:
    """One step's training-signal numbers (one x position of every panel)."""

    step: int
    trajectories: int
    reward_mean: float | None
    reward_std: float | None
    #: Share of GRPO groups (group_id, 2+ scored members) whose rewards are not all equal.
    varied_groups: float | None
    response_tokens_mean: float | None
    response_tokens_p10: float | None
    response_tokens_p90: float | None
    tool_calls_mean: float | None
    status: dict[str, int] = field(default_factory=dict)
    tokens_per_second: float | None = None

    @classmethod
    def from_result(cls, result: Any) -> "StepStats":
        """From a `Runtime` `StepResult` (its trajectories and `metrics['rollout_seconds']`)."""
        secs = result.metrics.get("rollout_seconds") if isinstance(result.metrics, dict) else None
        return step_stats(result.step, result.trajectories, secs)


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def step_stats(step: int, trajectories: Sequence[Trajectory], rollout_seconds: float | None = None) -> StepStats:
    """The numbers of one step. `rollout_seconds`: wall time of its roll-out (tokens/s); None: the
    span of the trajectories' timeline events."""
    rewards = [t.reward for t in trajectories if t.reward is not None and math.isfinite(t.reward)]
    groups: dict[str, list[float]] = {}
    for t in trajectories:
        if t.reward is not None and math.isfinite(t.reward):
            groups.setdefault(t.group_id, []).append(t.reward)
    multi = [g for g in groups.values() if len(g) > 1]
    lengths = [float(len(t.response_ids)) for t in trajectories]
    generated = sum(sum(1 for m in t.response_mask if m == 1) for t in trajectories)
    if rollout_seconds is None or not (isinstance(rollout_seconds, (int, float)) and math.isfinite(rollout_seconds)):
        events = [e for t in trajectories for e in t.timeline]
        rollout_seconds = (max(e.end for e in events) - min(e.start for e in events)) if events else None
    counts = Counter(t.status for t in trajectories)
    n = len(trajectories)
    return StepStats(
        step=step,
        trajectories=n,
        reward_mean=statistics.fmean(rewards) if rewards else None,
        reward_std=statistics.pstdev(rewards) if rewards else None,
        varied_groups=sum(1 for g in multi if max(g) != min(g)) / len(multi) if multi else None,
        response_tokens_mean=statistics.fmean(lengths) if lengths else None,
        response_tokens_p10=_quantile(lengths, 0.1) if lengths else None,
        response_tokens_p90=_quantile(lengths, 0.9) if lengths else None,
        tool_calls_mean=sum(t.tool_calls for t in trajectories) / n if n else None,
        status={s: counts.get(s, 0) for s in STATUSES},
        tokens_per_second=generated / rollout_seconds if rollout_seconds else None,
    )


def _series(stats: Sequence[StepStats], attr: str) -> tuple[list[int], list[float]]:
    """(steps, values) with None as NaN, so matplotlib leaves a gap."""
    return [s.step for s in stats], [math.nan if getattr(s, attr) is None else getattr(s, attr) for s in stats]


def plot_training(steps: Sequence[StepStats | Any], path: str | Path, *, title: str | None = None,
                  dpi: int = 110) -> Path:
    """Draw the six panels into `path` (PNG, written atomically). `steps`: `StepStats` or `StepResult`s."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    from .atomic_file import atomic_write

    stats = [s if isinstance(s, StepStats) else StepStats.from_result(s) for s in steps]
    if not stats:
        raise ValueError("plot_training needs at least one step")
    fig = Figure(figsize=(12, 6.5))
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3, sharex=True)
    x, mean = _series(stats, "reward_mean")
    _, std = _series(stats, "reward_std")
    ax = axes[0, 0]
    ax.plot(x, mean, "o-", color="#1f77b4", label="mean")
    ax.fill_between(x, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], color="#1f77b4",
                    alpha=0.2, lw=0, label="± std")
    ax.set_title("reward", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[0, 1]
    ax.plot(*_series(stats, "varied_groups"), "o-", color="#9467bd")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("groups with differing rewards (non-zero advantage)", fontsize=9)
    ax = axes[0, 2]
    _, lo = _series(stats, "response_tokens_p10")
    _, hi = _series(stats, "response_tokens_p90")
    ax.plot(*_series(stats, "response_tokens_mean"), "o-", color="#8c564b", label="mean")
    ax.fill_between(x, lo, hi, color="#8c564b", alpha=0.2, lw=0, label="10th-90th percentile")
    ax.set_title("response length (tokens, tool results included)", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[1, 0]
    ax.plot(*_series(stats, "tool_calls_mean"), "o-", color="#ff7f0e")
    ax.set_title("tool calls per trajectory", fontsize=9)
    ax = axes[1, 1]
    bottom = [0] * len(stats)
    for status in STATUSES:
        vals = [s.status.get(status, 0) for s in stats]
        if any(vals):
            ax.bar(x, vals, bottom=bottom, color=STATUS_COLORS.get(status, "#bcbd22"), label=status, width=0.8)
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_title("trajectories by status", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[1, 2]
    ax.plot(*_series(stats, "tokens_per_second"), "o-", color="#17becf")
    ax.set_title("generated tokens/s (roll-out wall time)", fontsize=9)
    for a in axes.flat:
        a.grid(alpha=0.3)
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
        lo, hi = a.get_ylim()
        a.set_ylim(min(0, lo), hi + 0.05 * (hi - min(0, lo)))  # from 0, with room above the top point
    for a in axes[1]:
        a.set_xlabel("step")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=dpi))
