"""The timeline picture of a rollout run (`timeline.png`): where each step's time went.

One panel per step. Each trajectory is a row; its `TimelineEvent`s are drawn as colored segments
(generate / tool / wait / queue / simulated user). The engine's lifecycle stages of that step (`StageRecord`s from
`Lifecycle.records`: wake-up stages before the roll-out, sleep stages after) are shaded bands across
all rows; the dashed lines where the engine became awake and where its sleep began carry every
stage's time, and only bands wide enough to see get a legend entry. Times are seconds from the step's first recorded moment. Both events and stage
records must use the same clock (`time.monotonic`, as the lifecycle and scheduler do).

Uses matplotlib's Agg backend: no display needed, safe in CI and on servers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ..engine.lifecycle import StageRecord
from ..types import Trajectory

SEGMENT_COLORS = {
    "generate": "#1f77b4",
    "tool": "#ff7f0e",
    "wait": "#b0b0b0",
    "queue": "#e8d9a8",
    "user": "#9467bd",
}
WAKE_COLORS = ["#c7e9c0", "#74c476", "#31a354", "#a1d99b"]
SLEEP_COLORS = ["#dadaeb", "#bcbddc", "#9e9ac8", "#807dba", "#6a51a3"]


@dataclass
class StepTimeline:
    """What one panel shows: a step's trajectories and the lifecycle stages recorded during it."""

    step: int
    trajectories: Sequence[Trajectory]
    records: Sequence[StageRecord] = field(default_factory=list)
    title: str | None = None


def _origin(st: StepTimeline) -> float:
    times = [r.start for r in st.records] + [e.start for t in st.trajectories for e in t.timeline]
    return min(times) if times else 0.0


def _secs(x: float) -> str:
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


#: A stage band narrower than this fraction of its panel's time span cannot be seen: its time is
#: written out in the phase's label instead, and it gets no legend entry of its own.
READABLE_FRACTION = 0.01


def _stage_times(records: Sequence[StageRecord]) -> str:
    """`resume_weights 13 · update_weights 17 ms`: each stage's time, in one unit when all are short."""
    if all(r.seconds < 1 for r in records):
        return " · ".join(f"{r.stage} {r.seconds * 1000:.0f}" for r in records) + " ms"
    return " · ".join(f"{r.stage} {_secs(r.seconds)}" for r in records)


def _phase_marks(records: Sequence[StageRecord], t0: float) -> list[tuple[str, str, float, str]]:
    marks = []
    wake = [r for r in records if r.phase == "wake_up"]
    sleep = [r for r in records if r.phase == "sleep"]
    if wake:
        secs = sum(r.seconds for r in wake)
        marks.append(("wake_up", "#238b45", max(r.end for r in wake) - t0,
                      f"awake (wake-up {_secs(secs)})\n{_stage_times(wake)}"))
    if sleep:
        secs = sum(r.seconds for r in sleep)
        marks.append(("sleep", "#54278f", min(r.start for r in sleep) - t0, f"sleep {_secs(secs)}\n{_stage_times(sleep)}"))
    return marks


def _span(st: StepTimeline, t0: float) -> float:
    ends = [r.end for r in st.records] + [e.end for t in st.trajectories for e in t.timeline]
    return max(max(ends, default=t0) - t0, 1e-9)


def readable_stages(st: StepTimeline) -> set[tuple[str, str]]:
    """The (phase, stage) bands of a panel wide enough to be seen (see `READABLE_FRACTION`)."""
    t0 = _origin(st)
    span = _span(st, t0)
    return {(r.phase, r.stage) for r in st.records if r.seconds >= READABLE_FRACTION * span}


def _draw_step(ax, st: StepTimeline, stage_colors: dict[tuple[str, str], str]) -> None:  # noqa: ANN001
    t0 = _origin(st)
    rows = sorted(
        (t for t in st.trajectories if t.timeline),
        key=lambda t: (min(e.start for e in t.timeline), t.uid, t.index_in_group),
    )
    n = max(len(rows), 1)
    for r in st.records:
        color = stage_colors[(r.phase, r.stage)]
        ax.axvspan(r.start - t0, max(r.end - t0, r.start - t0 + 1e-4), color=color, alpha=0.55, lw=0, zorder=0)
    # Stages can be far shorter than a pixel (a CPU engine wakes in milliseconds): mark where the
    # engine became AWAKE and where its sleep began with lines, labelled with every stage's time.
    for phase, color, at, text in _phase_marks(st.records, t0):
        ax.axvline(at, color=color, ls="--", lw=1.0, zorder=3)
        ax.annotate(text, (at, 1), xycoords=("data", "axes fraction"), xytext=(3 if phase == "wake_up" else -3, -3),
                    textcoords="offset points", fontsize=7, color=color, va="top", zorder=4,
                    ha="left" if phase == "wake_up" else "right",
                    bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": color, "lw": 0.5, "alpha": 0.9})
    for kind, color in SEGMENT_COLORS.items():
        ys, lefts, widths = [], [], []
        for y, t in enumerate(rows):
            for e in t.timeline:
                if e.kind == kind:
                    ys.append(y)
                    lefts.append(e.start - t0)
                    widths.append(max(e.end - e.start, 1e-4))
        if ys:
            ax.barh(ys, widths, left=lefts, height=0.8, color=color, lw=0, zorder=2)
    # Failed/aborted rows get a marker at their end so problems stand out in the picture.
    for y, t in enumerate(rows):
        if t.status in ("failed", "aborted"):
            end = max(e.end for e in t.timeline) - t0
            ax.plot([end], [y], marker="x", color="#d62728" if t.status == "failed" else "#555555", ms=4, zorder=3)
    ax.set_ylim(-0.7, n - 0.3)
    ax.invert_yaxis()
    ax.set_ylabel("trajectory")
    if len(rows) <= 40:
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([t.uid for t in rows], fontsize=5)
    done = sum(1 for t in st.trajectories if t.status == "completed")
    title = st.title or f"step {st.step}: {len(st.trajectories)} trajectories ({done} completed)"
    ax.set_title(title, fontsize=9, loc="left")
    ax.grid(axis="x", alpha=0.3, zorder=1)


def plot_timeline(steps: Sequence[StepTimeline], path: str | Path, *, dpi: int = 120) -> Path:
    """Draw one panel per step into `path` (PNG), written atomically."""
    # A bare Figure on the Agg canvas: no pyplot global state, no display, no backend switching.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    from .atomic_file import atomic_write

    if not steps:
        raise ValueError("plot_timeline needs at least one step")
    stage_colors: dict[tuple[str, str], str] = {}
    for st in steps:
        for r in st.records:
            key = (r.phase, r.stage)
            if key not in stage_colors:
                palette = WAKE_COLORS if r.phase == "wake_up" else SLEEP_COLORS
                used = sum(1 for k in stage_colors if k[0] == r.phase)
                stage_colors[key] = palette[used % len(palette)]
    heights = [1.2 + 0.12 * min(max(len(st.trajectories), 4), 60) for st in steps]
    fig = Figure(figsize=(11, sum(heights) + 1.0))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(steps), 1, squeeze=False, gridspec_kw={"height_ratios": heights})
    for ax, st in zip(axes[:, 0], steps):
        _draw_step(ax, st, stage_colors)
    axes[-1, 0].set_xlabel("seconds since the step began")
    kinds = {e.kind for st in steps for t in st.trajectories for e in t.timeline}
    handles = [Patch(color=c, label=k) for k, c in SEGMENT_COLORS.items() if k in kinds]
    # Only bands someone can see get a legend entry; the others' times are in the phase labels.
    visible = set().union(*(readable_stages(st) for st in steps))
    handles += [Patch(color=c, alpha=0.55, label=f"{phase.replace('_', '-')}: {stage}")
                for (phase, stage), c in stage_colors.items() if (phase, stage) in visible]
    fig.legend(handles=handles, loc="upper center", ncol=min(len(handles), 6), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / (sum(heights) + 1.0)))
    return atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=dpi))
