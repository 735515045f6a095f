"""What an `agentloop rollout` run leaves and says at its end: trajectories.parquet, summary.json,
timeline.png and training.png (reward, length, tool calls, status, tokens/s per step) for what
finished (each tried even when another cannot be written, failures recorded),
the step summaries they are built from, and the lines printed: the result, or what could not be
written and where the run's data is. The file formats themselves are `agentloop.output`.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..engine.lifecycle import StageRecord
from ..output.engine_use import engine_use
from ..output.parquet import write_parquet
from ..output.summary import summarize_run, summarize_step, write_summary
from ..output.writer import PARQUET_NAME, SUMMARY_NAME, TIMELINE_NAME, TRAINING_NAME
from .rollout_prompts import data_use, groups_per_step, prompt_statuses
from .rollout_state import CommandRun, StepRecord

if TYPE_CHECKING:  # the runtime package imports torch: not at this module's import (`agentloop --help`)
    from ..runtime.concurrency import ConcurrencyInfo

__all__ = ["finish_outputs", "preload_output_modules", "print_result", "step_summary", "write_failure_message"]


def _rollout_window(records: Sequence[StageRecord]) -> float | None:
    """Roll-out wall seconds of a step: from the end of its wake-up to the start of its sleep."""
    wake = [r.end for r in records if r.phase == "wake_up"]
    sleep = [r.start for r in records if r.phase == "sleep"]
    if wake and sleep and min(sleep) >= max(wake):
        return min(sleep) - max(wake)
    return None


def _attempt(run: CommandRun, name: str, write: Callable[[], Path | None]) -> Path | None:
    """`write()`, or None with the failure recorded: one output that cannot be written (a full disk)
    does not keep the others from being tried."""
    try:
        return write()
    except OSError as e:
        run.write_errors.append(f"{name}: {e.strerror or e}")
        return None


def step_summary(rec: StepRecord, concurrency: "ConcurrencyInfo | None" = None) -> dict[str, Any]:
    rollout = rec.metrics.get("rollout_seconds")
    if not isinstance(rollout, (int, float)) or not math.isfinite(rollout):
        rollout = _rollout_window(rec.records)
    use = engine_use(rec.trajectories, concurrency=concurrency.used if concurrency else None,
                     engine_capacity=concurrency.engine_capacity if concurrency else None)
    return summarize_step(rec.trajectories, rec.records, step=rec.step, seconds=rec.seconds,
                          rollout_seconds=rollout, weight_version=rec.metrics.get("weight_version"),
                          prompts=prompt_statuses(rec.launched, rec.trajectories, rec.carried), engine_use=use,
                          staleness=rec.metrics.get("token_staleness"))


def preload_output_modules() -> None:
    """Only a head start: any failure shows again, with its real message, when the files are written."""
    try:
        import pyarrow.parquet  # noqa: F401
        from matplotlib.backends import backend_agg  # noqa: F401

        from ..output import timeline, training_plot  # noqa: F401
    except Exception:  # noqa: BLE001
        pass


def finish_outputs(run: CommandRun) -> list[Path]:
    """Close the stream and write Parquet, summary.json, timeline.png and training.png for what finished."""
    if run.stream is None:
        return []
    out = Path(run.cfg.out)
    stream = run.stream
    rows = [(rec.step, t) for rec in run.steps for t in rec.trajectories]
    written = [_attempt(run, stream.partial.name, stream.close),
               _attempt(run, PARQUET_NAME, lambda: write_parquet(out / PARQUET_NAME, rows))]
    concurrency = getattr(run.runtime, "concurrency", None)
    summaries = [step_summary(rec, concurrency) for rec in run.steps]
    summary = summarize_run(
        summaries,
        interrupted=run.interrupted,
        error=run.error,
        # As given, or the bundled prompts named as such (not the install's absolute path).
        data=run.cfg.data if run.cfg.data is not None else "agentloop/data/arithmetic.jsonl (bundled)",
        prompts=len(run.dataset.samples),
        # Whether the run reused rows (a dataset smaller than what it drew), said once at the start too.
        data_use=data_use(len(run.dataset.samples), run.drawn, groups_per_step(run.cfg)),
        bad_rows=len(run.dataset.bad_rows),
        engines=run.engine_urls or run.cfg.runtime.engine.urls,
        n=run.cfg.runtime.scheduler.n,
        # What scheduler.concurrency resolved to and why; per step, engine_use says how busy that kept the engines.
        concurrency=concurrency.as_dict() if concurrency is not None else None,
        started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(run.started)),
        wall_seconds=round(time.time() - run.started, 3),
        write_errors=list(run.write_errors),
    )
    written.append(_attempt(run, SUMMARY_NAME, lambda: write_summary(out / SUMMARY_NAME, summary)))
    if run.cfg.timeline and any(rec.trajectories or rec.records for rec in run.steps):
        from ..output.timeline import StepTimeline, plot_timeline

        panels = [StepTimeline(rec.step, rec.trajectories, rec.records) for rec in run.steps]
        written.append(_attempt(run, TIMELINE_NAME, lambda: plot_timeline(panels, out / TIMELINE_NAME)))
    if run.cfg.timeline and any(rec.trajectories for rec in run.steps):
        from ..output.training_plot import plot_training, step_stats

        stats = [step_stats(rec.step, rec.trajectories, rec.metrics.get("rollout_seconds"))
                 for rec in run.steps if rec.trajectories]
        written.append(_attempt(run, TRAINING_NAME, lambda: plot_training(stats, out / TRAINING_NAME)))
    return [p for p in written if p is not None]


def write_failure_message(run: CommandRun) -> str:
    """What could not be written, and where the run's data is."""
    stream = run.stream
    kept = f"{stream.count} complete trajectories (whole lines) are in {stream.partial}" if stream is not None \
        and stream.failed is not None else None
    lines = ["could not write the run's outputs; the run was stopped:", *run.write_errors]
    if kept:
        lines.append(kept)
    if run.written:
        lines.append("written: " + ", ".join(str(p) for p in run.written))
    return "\n  ".join(lines)


def print_result(state: CommandRun, head: str) -> None:
    """The run's result in a few lines, headed `head` (done, failed, interrupted), when files were written."""
    written = state.written
    if not written:
        return
    summary_path = Path(state.cfg.out) / SUMMARY_NAME
    if not summary_path.exists():  # it could not be written: the error message says what there is
        return
    total = json.loads(summary_path.read_text())["total"]
    st = total.get("status", {})
    tps = total.get("tokens_per_second")
    reward = total.get("reward_mean")
    reward_s = f"{reward:.3f}" if reward is not None else "n/a"
    tps_s = f"{tps:.1f}" if tps is not None else "n/a"
    lines = [
        f"{head}: {total.get('trajectories', 0)} trajectories in {total.get('steps', 0)} step(s) "
        f"({', '.join(f'{k} {v}' for k, v in st.items() if v) or 'none finished'}); "
        f"{total.get('trajectories_with_tool_call', 0)} with tool calls ({total.get('tool_calls', 0)} calls); "
        f"reward mean {reward_s}; {tps_s} generated tokens/s",
        "wrote: " + ", ".join(str(p) for p in written),
    ]
    prompts = total.get("prompt_status", {})
    if any(prompts.get(k) for k in ("aborted", "not_started")):
        # What to re-run: every prompt's status is in summary.json.
        lines.insert(1, "prompts: " + ", ".join(f"{k} {v}" for k, v in prompts.items() if v)
                     + f" (each prompt's status: {summary_path} per_step[].prompts)")
    print("\n".join(lines))
