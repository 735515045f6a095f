"""The timeline picture of a rollout run (`timeline.png`): where each step's time went.

One panel per step. Each trajectory is a row; its `TimelineEvent`s are drawn as colored segments
(generate / tool / wait / queue / simulated user). An aborted or failed trajectory's row is hatched
over its whole extent (grey: aborted, red: failed), ends in a ×, and its label has the same color, so
it cannot be taken for a completed one. The engine's lifecycle stages of that step (`StageRecord`s
from `Lifecycle.records`: wake-up stages before the roll-out, sleep stages after) are shaded bands
across all rows, every stage in the legend; dashed lines mark where the engine became awake and where
its sleep began. Every stage's time is written in the panel's title (stages are often far narrower
than a pixel), above the rows rather than over them. Times are seconds from the step's first recorded
moment. Both events and stage records must use the same clock (`time.monotonic`, as the lifecycle and
scheduler do).

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
AWAKE_COLOR = "#238b45"
SLEEP_LINE_COLOR = "#54278f"
#: Rows of trajectories that did not finish: hatch and label color.
UNFINISHED_COLORS = {"aborted": "#555555", "failed": "#d62728"}
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


def _stage_times(records: Sequence[StageRecord]) -> str:
    """`resume_weights 13 · update_weights 17 ms`: each stage's time, in one unit when all are short."""
    if all(r.seconds < 1 for r in records):
        return " · ".join(f"{r.stage} {r.seconds * 1000:.0f}" for r in records) + " ms"
    return " · ".join(f"{r.stage} {_secs(r.seconds)}" for r in records)


def _phase_marks(records: Sequence[StageRecord], t0: float) -> list[tuple[str, str, float, str]]:
    """(phase, color, x of its dashed line, its stage times) for the wake-up and the sleep of a step."""
    marks = []
    wake = [r for r in records if r.phase == "wake_up"]
    sleep = [r for r in records if r.phase == "sleep"]
    if wake:
        secs = sum(r.seconds for r in wake)
        marks.append(("wake_up", AWAKE_COLOR, max(r.end for r in wake) - t0,
                      f"awake after wake-up {_secs(secs)} ({_stage_times(wake)})"))
    if sleep:
        secs = sum(r.seconds for r in sleep)
        marks.append(("sleep", SLEEP_LINE_COLOR, min(r.start for r in sleep) - t0,
                      f"sleep {_secs(secs)} ({_stage_times(sleep)})"))
    return marks


def _span(st: StepTimeline, t0: float) -> float:
    ends = [r.end for r in st.records] + [e.end for t in st.trajectories for e in t.timeline]
    return max(max(ends, default=t0) - t0, 1e-9)


def panel_title(st: StepTimeline) -> str:
    """`step 1: 32 trajectories (30 completed, 2 aborted)` and, on a second line, every stage's time."""
    counts = {s: sum(1 for t in st.trajectories if t.status == s) for s in ("completed", "truncated", "aborted", "failed")}
    said = ", ".join(f"{v} {k}" for k, v in counts.items() if v) or "none finished"
    title = st.title or f"step {st.step}: {len(st.trajectories)} trajectories ({said})"
    times = "   |   ".join(text for _, _, _, text in _phase_marks(st.records, _origin(st)))
    return title + (f"\n{times}" if times else "")


def stage_colors(steps: Sequence[StepTimeline]) -> dict[tuple[str, str], str]:
    """A color per (phase, stage), in the order the stages first ran (green wake-up, purple sleep)."""
    colors: dict[tuple[str, str], str] = {}
    for st in steps:
        for r in st.records:
            key = (r.phase, r.stage)
            if key not in colors:
                palette = WAKE_COLORS if r.phase == "wake_up" else SLEEP_COLORS
                used = sum(1 for k in colors if k[0] == r.phase)
                colors[key] = palette[used % len(palette)]
    return colors


def legend_entries(steps: Sequence[StepTimeline]) -> list[tuple[str, str, str]]:
    """(style, label, color) of every legend entry: segment kinds present, unfinished statuses present,
    the awake/sleep lines, and every lifecycle stage (bands narrower than a pixel too: their times are
    in the panel titles). style: patch, hatch, line or band."""
    kinds = {e.kind for st in steps for t in st.trajectories for e in t.timeline}
    out = [("patch", k, c) for k, c in SEGMENT_COLORS.items() if k in kinds]
    statuses = {t.status for st in steps for t in st.trajectories if t.timeline}
    out += [("hatch", f"{s} (×)", c) for s, c in UNFINISHED_COLORS.items() if s in statuses]
    if any(r.phase == "wake_up" for st in steps for r in st.records):
        out.append(("line", "engine awake", AWAKE_COLOR))
    if any(r.phase == "sleep" for st in steps for r in st.records):
        out.append(("line", "sleep begins", SLEEP_LINE_COLOR))
    out += [("band", f"{phase.replace('_', '-')}: {stage}", c) for (phase, stage), c in stage_colors(steps).items()]
    return out


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
    # Stages can be far shorter than a pixel (a CPU engine wakes in milliseconds): dashed lines mark where
    # the engine became AWAKE and where its sleep began; their stage times go in the title, not over rows.
    marks = _phase_marks(st.records, t0)
    for _, color, at, _ in marks:
        ax.axvline(at, color=color, ls="--", lw=1.0, zorder=3)
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
    # Aborted/failed rows: hatched over their extent and ended with a ×, so they stand out from completed ones.
    for y, t in enumerate(rows):
        color = UNFINISHED_COLORS.get(t.status)
        if color is None:
            continue
        start = min(e.start for e in t.timeline) - t0
        end = max(e.end for e in t.timeline) - t0
        ax.barh([y], [max(end - start, 1e-4)], left=[start], height=0.8, facecolor="none", edgecolor=color,
                hatch="////", lw=0.6, zorder=2.5)
        ax.plot([end], [y], marker="x", color=color, ms=6, mew=1.5, zorder=3)
    ax.set_ylim(-0.7, n - 0.3)
    ax.invert_yaxis()
    ax.set_ylabel("trajectory")
    if len(rows) <= 40:
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([t.uid for t in rows], fontsize=5)
        for label, t in zip(ax.get_yticklabels(), rows):
            if t.status in UNFINISHED_COLORS:
                label.set_color(UNFINISHED_COLORS[t.status])
    ax.set_title(panel_title(st), fontsize=8, loc="left")
    ax.grid(axis="x", alpha=0.3, zorder=1)


def plot_timeline(steps: Sequence[StepTimeline], path: str | Path, *, dpi: int = 120) -> Path:
    """Draw one panel per step into `path` (PNG), written atomically."""
    # A bare Figure on the Agg canvas: no pyplot global state, no display, no backend switching.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    from .atomic_file import atomic_write

    if not steps:
        raise ValueError("plot_timeline needs at least one step")
    colors = stage_colors(steps)
    heights = [1.2 + 0.12 * min(max(len(st.trajectories), 4), 60) for st in steps]
    fig = Figure(figsize=(11, sum(heights) + 1.3))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(steps), 1, squeeze=False, gridspec_kw={"height_ratios": heights})
    for ax, st in zip(axes[:, 0], steps):
        _draw_step(ax, st, colors)
    axes[-1, 0].set_xlabel("seconds since the step began")
    handles = []
    for style, label, color in legend_entries(steps):
        if style == "line":
            handles.append(Line2D([], [], color=color, ls="--", label=label))
        elif style == "hatch":
            handles.append(Patch(facecolor="none", edgecolor=color, hatch="////", label=label))
        else:
            handles.append(Patch(color=color, alpha=0.55 if style == "band" else 1.0, label=label))
    ncol = min(len(handles), 7)
    legend_rows = -(-len(handles) // ncol)
    fig.legend(handles=handles, loc="upper center", ncol=ncol, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - (0.25 + 0.2 * legend_rows) / (sum(heights) + 1.0)))
    return atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=dpi))
