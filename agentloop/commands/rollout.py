"""`agentloop rollout`: turn a prompt dataset into trajectory files, one training step at a time.

This module is a thin caller of `agentloop.runtime.Runtime` (the one async step: wake-up in stages
→ roll out → sleep); it owns only what the command adds around it: settings (YAML + flags), the
dataset, running the steps with their prompt batches, streaming finished trajectories to disk, the
progress display, summary.json and timeline.png. Which rows each step takes lives in
`rollout_prompts`; how a run is stopped (signals) and which failures are the engines' lives in
`rollout_stop`; the flags in `rollout_args`.

With no `--engine-url` it starts the embedded CPU engine with the shipped tiny tool model, and with
no `--data` it uses the bundled arithmetic prompts, so `agentloop rollout` alone runs a real
multi-turn tool-calling rollout of two steps. With `--ray` (`runtime.ray.enabled`) the same steps run
through `agentloop.distributed.RayRuntime` (worker and engine actors on a local Ray or a cluster);
outputs and progress are the same.

Exit status: 0 done; 1 the engines failed (unreachable URL, a lifecycle stage failed); 2 bad
settings or data; 74 an output file could not be written (disk full, I/O error: the run stops as on
Ctrl-C, `trajectories.jsonl.partial` keeps whole lines only, and whatever else can be written is; the
message says where the data is); 130 interrupted (Ctrl-C / SIGTERM: in-flight requests aborted, the
engines left as they were found or stopped, finished and partial trajectories and a summary of them written).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import anyio

from ..dataset import Dataset, DatasetError, load_dataset
from ..engine.lifecycle import StageRecord
from ..output import (
    PARQUET_NAME,
    SUMMARY_NAME,
    TIMELINE_NAME,
    OutputWriteError,
    TrajectoryStream,
    clear_outputs,
    summarize_run,
    summarize_step,
    write_parquet,
    write_summary,
)
from ..progress import RolloutProgress
from ..rollout_config import ConfigError, RolloutConfig, load_config
from .rollout_args import overrides_from_args
from .rollout_checks import preflight
from .rollout_prompts import groups_per_step, launched_groups, prompt_statuses, step_prompts, take_prompts
from .rollout_stop import engine_failure_message, exception_leaves, watch_signals
from ..types import Sample, Trajectory

# Re-exported: callers and tests import the prompt walk from here.
__all__ = ["EXIT_ENGINE", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "groups_per_step",
           "run", "step_prompts", "take_prompts"]

EXIT_OK, EXIT_ENGINE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_OUTPUT = 74  # sysexits' EX_IOERR

# ------------------------------------------------------------------------------------ the run
@dataclass
class _StepRecord:
    step: int
    trajectories: list[Trajectory] = field(default_factory=list)
    records: list[StageRecord] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    seconds: float | None = None
    #: {prompt (group) uid: trajectories launched} and the groups continued next step.
    launched: dict[str, int] = field(default_factory=dict)
    carried: set[str] = field(default_factory=set)


@dataclass
class _CommandRun:
    cfg: RolloutConfig
    dataset: Dataset
    progress: RolloutProgress
    steps: list[_StepRecord] = field(default_factory=list)
    stream: TrajectoryStream | None = None
    interrupted: bool = False
    error: str | None = None
    engine_urls: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    written: list[Path] = field(default_factory=list)
    runtime: Any = None
    in_step: bool = False
    #: Output files that could not be written ("name: reason"); the first stops the run.
    write_errors: list[str] = field(default_factory=list)


def _rollout_window(records: Sequence[StageRecord]) -> float | None:
    """Roll-out wall seconds of a step: from the end of its wake-up to the start of its sleep."""
    wake = [r.end for r in records if r.phase == "wake_up"]
    sleep = [r.start for r in records if r.phase == "sleep"]
    if wake and sleep and min(sleep) >= max(wake):
        return min(sleep) - max(wake)
    return None


async def _run_steps(run: _CommandRun) -> None:
    cfg = run.cfg
    out = Path(cfg.out)
    urls = cfg.runtime.engine.urls
    where = f"attaching to {', '.join(urls)}" if urls else "starting the embedded CPU engine"
    rc = cfg.runtime.ray
    # Said before the runtime's imports (torch, seconds on a small machine), so the run shows at once.
    if rc.enabled:
        run.progress.message(f"starting Ray mode ({rc.address or 'a local Ray'}; {rc.num_workers} rollout workers), "
                             f"{where} ...")
        from ..distributed import RayRuntime  # Ray mode: the same step, run by worker and engine actors

        runtime = run.runtime = RayRuntime(cfg.runtime)
    else:
        run.progress.message(f"{where} ...")
        from ..runtime import Runtime  # imported late: `agentloop config`/`--help` stay light

        runtime = run.runtime = Runtime(cfg.runtime)
    try:
        await runtime.start()
        assert runtime.lifecycle is not None
        run.engine_urls = list(runtime.lifecycle.urls)
        # Engines are up: only now is the output folder touched, so a failed start leaves nothing.
        out.mkdir(parents=True, exist_ok=True)
        clear_outputs(out)
        run.stream = TrajectoryStream(out).open()
        carry: list[Sample] = []
        per_step = groups_per_step(cfg)
        drawn = 0  # rows taken from the dataset so far
        for step in range(1, cfg.steps + 1):
            if per_step is None:
                fresh = step_prompts(run.dataset.samples, step, None)
            else:
                # Groups carried over from the last step (over-sampling's unfinished ones) are part
                # of this step's launch, as in the scheduler's feeder contract: fresh rows fill the rest.
                count = max(0, per_step - len({s.group_id for s in carry}))
                fresh = take_prompts(run.dataset.samples, drawn, count)
                drawn += count
            prompts = carry + fresh
            by_group = {p.group_id or p.uid: p for p in prompts}
            n = cfg.runtime.scheduler.n
            rec = _StepRecord(step, launched=launched_groups(prompts, n))
            run.steps.append(rec)
            first_record = len(runtime.lifecycle.records)
            total = sum(rec.launched.values())
            run.progress.begin_step(step, cfg.steps, total)
            t0 = time.monotonic()

            async def done(traj: Trajectory, rec: _StepRecord = rec, step: int = step,
                           by_group: dict[str, Sample] = by_group) -> None:
                row = by_group.get(traj.group_id)
                if row is not None and row.extra:
                    # The data row's free fields travel with its trajectories (the runtime's own keys win).
                    traj.extra = {**row.extra, **traj.extra}
                rec.trajectories.append(traj)
                assert run.stream is not None
                try:
                    run.stream.write(traj, step)
                except OutputWriteError as e:
                    _stop_on_write_error(run, e)
                run.progress.trajectory_done(traj)

            run.in_step = True
            try:
                result = await runtime.step(prompts, on_trajectory=done)
            finally:
                run.in_step = False
                rec.seconds = time.monotonic() - t0
                rec.records = list(runtime.lifecycle.records[first_record:])
            rec.metrics = dict(result.metrics)
            carry = list(result.carry_over)
            # Anything the scheduler returned without announcing it is still written: nothing is lost.
            seen = {id(t) for t in rec.trajectories}
            for t in result.trajectories:
                if id(t) not in seen:
                    await done(t)
            for t in result.rejected:  # groups the group filter turned away: written, and marked
                t.extra["group_filter"] = "rejected"
                await done(t)
            if step == cfg.steps or run.interrupted or run.write_errors:
                # Partial trajectories of unfinished groups would be continued next step; there is
                # none, so they are written as they are (aborted) rather than dropped.
                for s in carry:
                    if s.resume_from is not None:
                        await done(s.resume_from)
            else:
                rec.carried = {s.group_id or s.uid for s in carry}
            run.progress.end_step(_step_summary(rec))
            if run.interrupted or run.write_errors:
                break
    finally:
        with anyio.CancelScope(shield=True):
            await runtime.stop()


def _stop_on_write_error(run: _CommandRun, e: OSError) -> None:
    """The trajectory file cannot be written (disk full?): stop the run as a first Ctrl-C would (the
    step's trajectories come back and are kept in memory for the other outputs); no more steps."""
    if run.write_errors:
        return
    run.write_errors.append(str(e))
    run.progress.message(f"{e}: stopping the run")
    scheduler = getattr(run.runtime, "scheduler", None)
    if scheduler is not None:
        scheduler.stop("output_error")


def _attempt(run: _CommandRun, name: str, write: Callable[[], Path | None]) -> Path | None:
    """`write()`, or None with the failure recorded: one output that cannot be written (a full disk)
    does not keep the others from being tried."""
    try:
        return write()
    except OSError as e:
        run.write_errors.append(f"{name}: {e.strerror or e}")
        return None


def _step_summary(rec: _StepRecord) -> dict[str, Any]:
    rollout = rec.metrics.get("rollout_seconds")
    if not isinstance(rollout, (int, float)) or not math.isfinite(rollout):
        rollout = _rollout_window(rec.records)
    return summarize_step(rec.trajectories, rec.records, step=rec.step, seconds=rec.seconds,
                          rollout_seconds=rollout, weight_version=rec.metrics.get("weight_version"),
                          prompts=prompt_statuses(rec.launched, rec.trajectories, rec.carried))


def _preload_output_modules() -> None:
    """Only a head start: any failure shows again, with its real message, when the files are written."""
    try:
        import pyarrow.parquet  # noqa: F401
        from matplotlib.backends import backend_agg  # noqa: F401

        from .. import timeline  # noqa: F401
    except Exception:  # noqa: BLE001
        pass


def _finish_outputs(run: _CommandRun) -> list[Path]:
    """Close the stream and write Parquet, summary.json and timeline.png for what finished."""
    if run.stream is None:
        return []
    out = Path(run.cfg.out)
    stream = run.stream
    rows = [(rec.step, t) for rec in run.steps for t in rec.trajectories]
    written = [_attempt(run, stream.partial.name, stream.close),
               _attempt(run, PARQUET_NAME, lambda: write_parquet(out / PARQUET_NAME, rows))]
    summaries = [_step_summary(rec) for rec in run.steps]
    summary = summarize_run(
        summaries,
        interrupted=run.interrupted,
        error=run.error,
        data=run.dataset.path,
        prompts=len(run.dataset.samples),
        bad_rows=len(run.dataset.bad_rows),
        engines=run.engine_urls or run.cfg.runtime.engine.urls,
        n=run.cfg.runtime.scheduler.n,
        started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(run.started)),
        wall_seconds=round(time.time() - run.started, 3),
        write_errors=list(run.write_errors),
    )
    written.append(_attempt(run, SUMMARY_NAME, lambda: write_summary(out / SUMMARY_NAME, summary)))
    if run.cfg.timeline and any(rec.trajectories or rec.records for rec in run.steps):
        from ..timeline import StepTimeline, plot_timeline

        panels = [StepTimeline(rec.step, rec.trajectories, rec.records) for rec in run.steps]
        written.append(_attempt(run, TIMELINE_NAME, lambda: plot_timeline(panels, out / TIMELINE_NAME)))
    return [p for p in written if p is not None]


async def _main(run: _CommandRun) -> int:
    code = EXIT_OK
    async with anyio.create_task_group() as tg:
        work = anyio.CancelScope()
        tg.start_soon(watch_signals, run, tg, work)
        if run.cfg.timeline:
            # The plotting and Parquet modules load in the background while the step waits on the
            # engines, instead of after it, when the user is waiting for the files.
            tg.start_soon(anyio.to_thread.run_sync, _preload_output_modules)
        with work:
            try:
                await _run_steps(run)
            except Exception as e:
                message = engine_failure_message(e)
                if message is None:
                    raise
                run.error = message
                code = EXIT_ENGINE
        if run.interrupted:
            code = EXIT_INTERRUPTED
        with anyio.CancelScope(shield=True):
            if run.stream is not None:
                # Seconds on a small machine (Parquet, the plot): say so rather than look stuck.
                files = "trajectories.parquet, summary.json" + (", timeline.png" if run.cfg.timeline else "")
                run.progress.message(f"writing {files} to {run.cfg.out} ...")
            run.written = await anyio.to_thread.run_sync(_finish_outputs, run)
        if run.write_errors:
            code = EXIT_OUTPUT
            run.error = _write_failure_message(run)
        tg.cancel_scope.cancel()
    return code


def _write_failure_message(run: _CommandRun) -> str:
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


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, overrides_from_args(args))
    except ConfigError as e:
        print(f"agentloop rollout: {e}", file=sys.stderr)
        return EXIT_USAGE
    if cfg.runtime.ray.enabled and importlib.util.find_spec("ray") is None:
        print("agentloop rollout: Ray mode (--ray / runtime.ray.enabled) needs Ray: pip install 'agentloop[ray]'",
              file=sys.stderr)
        return EXIT_USAGE
    refusal = _model_problem(cfg) or (_previous_run(Path(cfg.out)) if not cfg.overwrite else None)
    if refusal:
        print(f"agentloop rollout: {refusal}", file=sys.stderr)
        return EXIT_USAGE
    try:
        dataset = _load_data(cfg)
    except DatasetError as e:
        print(f"agentloop rollout: {e}", file=sys.stderr)
        return EXIT_USAGE
    problems = preflight(cfg)  # before any engine starts
    if problems:
        print("agentloop rollout: " + "\n  ".join(problems), file=sys.stderr)
        return EXIT_USAGE
    progress = RolloutProgress(quiet=cfg.quiet)
    if dataset.bad_rows:
        shown = "\n  ".join(str(b) for b in dataset.bad_rows[:10])
        more = f"\n  ... and {len(dataset.bad_rows) - 10} more" if len(dataset.bad_rows) > 10 else ""
        print(f"agentloop rollout: skipped {len(dataset.bad_rows)} bad row(s) of {dataset.path} "
              f"(on_bad_row=skip):\n  {shown}{more}", file=sys.stderr)
    state = _CommandRun(cfg, dataset, progress)
    try:
        with progress:
            code = anyio.run(_main, state)
    except BaseException as e:
        # Ctrl-C before the signal handler was installed, or a third one (possibly inside a group).
        if all(isinstance(leaf, KeyboardInterrupt) for leaf in exception_leaves(e)):
            print("agentloop rollout: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        raise
    if state.error:
        print(f"agentloop rollout: {state.error}", file=sys.stderr)
    _print_result(state, code)
    return code


def _model_problem(cfg: RolloutConfig) -> str | None:
    """Why the embedded engine's model folder cannot be served (a bad setting, exit 2), or None.
    Not checked for a Ray cluster given by address: the folder need only exist on its nodes."""
    eng = cfg.runtime.engine
    if eng.model is None or eng.urls or eng.launch is not None or cfg.runtime.ray.address:
        return None
    model = Path(eng.model)
    if not model.is_dir():
        return f"--model {model} (runtime.engine.model): no such folder"
    if not (model / "config.json").is_file():
        return f"--model {model} (runtime.engine.model): no config.json in it (a Hugging Face model folder is needed)"
    return None


def _previous_run(out: Path) -> str | None:
    """Why `out` may not be written without --overwrite (it holds files), or None."""
    if not out.exists():
        return None
    if not out.is_dir():
        return f"--out {out} is a file, not a folder"
    held = sorted(p.name for p in out.iterdir())
    if not held:
        return None
    shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
    return (f"output folder {out} is not empty ({shown}); pass --overwrite to replace its run's files "
            f"(config: overwrite: true), or give another --out")


def _load_data(cfg: RolloutConfig) -> Dataset:
    from ..agents.base import registered_agents
    from ..rewards import registered_rewards

    if cfg.data is None:
        from ..data import arithmetic_prompts

        path: Path = arithmetic_prompts()
    else:
        path = Path(cfg.data)
    return load_dataset(path, on_bad_row=cfg.on_bad_row, known_agents=registered_agents(),
                        known_rewards=registered_rewards())


def _print_result(state: _CommandRun, code: int) -> None:
    written = state.written
    if not written:
        return
    summary_path = Path(state.cfg.out) / SUMMARY_NAME
    if not summary_path.exists():  # it could not be written: the error message says what there is
        return
    total = json.loads(summary_path.read_text())["total"]
    st = total.get("status", {})
    head = "interrupted" if code == EXIT_INTERRUPTED else ("failed" if code else "done")
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
