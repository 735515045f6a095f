"""`agentloop rollout`: turn a prompt dataset into trajectory files, one training step at a time.

This module is a thin caller of `agentloop.runtime.Runtime` (the one async step: wake-up in stages
→ roll out → sleep); it owns only what the command adds around it: settings (YAML + flags), the
dataset, running the steps with their prompt batches, streaming finished trajectories to disk, the
progress display and the exit status. Which rows each step takes lives in `rollout_prompts`; how a
run is stopped (signals) and which failures are the engines' lives in `rollout_stop`; the flags in
`rollout_args`; what is refused before any engine starts in `rollout_checks`; the run's state in
`rollout_state`; the files written at the end (Parquet, summary.json, timeline.png) and the closing
lines in `rollout_outputs`.

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
import sys
import time
from pathlib import Path

import anyio

from ..dataset import Dataset, DatasetError, load_dataset, row_budget
from ..output.writer import OutputWriteError, TrajectoryStream, clear_outputs
from ..output.progress import RolloutProgress
from ..config.rollout import ConfigError, RolloutConfig, load_config
from .rollout_args import overrides_from_args
from .rollout_checks import model_problem, preflight, previous_run
from .rollout_outputs import finish_outputs, preload_output_modules, print_result, step_summary, write_failure_message
from .rollout_prompts import groups_per_step, launched_groups, step_prompts, take_prompts, wrap_notice
from .rollout_state import CommandRun, StepRecord
from .rollout_stop import engine_failure_message, exception_leaves, watch_signals
from ..types import Sample, Trajectory

__all__ = ["EXIT_ENGINE", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "run"]

EXIT_OK, EXIT_ENGINE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_OUTPUT = 74  # sysexits' EX_IOERR

async def _run_steps(run: CommandRun) -> None:
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
        c = getattr(runtime, "concurrency", None)  # a runtime given by a test may not resolve one
        if c is not None:
            cap = f", the engines run {c.engine_capacity} requests at once" if c.engine_capacity else ""
            run.progress.message(f"concurrency {c.used} trajectories in flight ({c.rule}{cap})")
        # Engines are up: only now is the output folder touched, so a failed start leaves nothing.
        out.mkdir(parents=True, exist_ok=True)
        clear_outputs(out)
        run.stream = TrajectoryStream(out).open()
        carry: list[Sample] = []
        per_step = groups_per_step(cfg)
        for step in range(1, cfg.steps + 1):
            if per_step is None:
                fresh = step_prompts(run.dataset.samples, step, None)
                run.drawn += len(fresh)
            else:
                # Groups carried over from the last step (over-sampling's unfinished ones) are part
                # of this step's launch, as in the scheduler's feeder contract: fresh rows fill the rest.
                count = max(0, per_step - len({s.group_id for s in carry}))
                fresh = take_prompts(run.dataset.samples, run.drawn, count)
                run.drawn += count
            prompts = carry + fresh
            by_group = {p.group_id or p.uid: p for p in prompts}
            n = cfg.runtime.scheduler.n
            rec = StepRecord(step, launched=launched_groups(prompts, n))
            run.steps.append(rec)
            first_record = len(runtime.lifecycle.records)
            total = sum(rec.launched.values())
            run.progress.begin_step(step, cfg.steps, total)
            t0 = time.monotonic()

            async def done(traj: Trajectory, rec: StepRecord = rec, step: int = step,
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
            run.progress.end_step(step_summary(rec, getattr(runtime, "concurrency", None)))
            if run.interrupted or run.write_errors:
                break
    finally:
        with anyio.CancelScope(shield=True):
            await runtime.stop()


def _stop_on_write_error(run: CommandRun, e: OSError) -> None:
    """The trajectory file cannot be written (disk full?): stop the run as a first Ctrl-C would (the
    step's trajectories come back and are kept in memory for the other outputs); no more steps."""
    if run.write_errors:
        return
    run.write_errors.append(str(e))
    run.progress.message(f"{e}: stopping the run")
    scheduler = getattr(run.runtime, "scheduler", None)
    if scheduler is not None:
        scheduler.stop("output_error")


async def _main(run: CommandRun) -> int:
    code = EXIT_OK
    async with anyio.create_task_group() as tg:
        work = anyio.CancelScope()
        tg.start_soon(watch_signals, run, tg, work)
        if run.cfg.timeline:
            # The plotting and Parquet modules load in the background while the step waits on the
            # engines, instead of after it, when the user is waiting for the files.
            tg.start_soon(anyio.to_thread.run_sync, preload_output_modules)
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
                files = "trajectories.parquet, summary.json" + (", timeline.png, training.png" if run.cfg.timeline else "")
                run.progress.message(f"writing {files} to {run.cfg.out} ...")
            run.written = await anyio.to_thread.run_sync(finish_outputs, run)
        if run.write_errors:
            code = EXIT_OUTPUT
            run.error = write_failure_message(run)
        tg.cancel_scope.cancel()
    return code


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
    refusal = model_problem(cfg) or (previous_run(Path(cfg.out)) if not cfg.overwrite else None)
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
    wrap = wrap_notice(len(dataset.samples), groups_per_step(cfg), cfg.steps)
    if wrap:  # said once, before the run; summary.json's data_use records what was drawn
        print(f"agentloop rollout: note: {wrap}", file=sys.stderr)
    state = CommandRun(cfg, dataset, progress)
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
    print_result(state, "interrupted" if code == EXIT_INTERRUPTED else ("failed" if code else "done"))
    return code


def _load_data(cfg: RolloutConfig) -> Dataset:
    from ..agents.registry import registered_agents
    from ..rewards import registered_rewards

    if cfg.data is None:
        from ..data import arithmetic_prompts

        path: Path = arithmetic_prompts()
    else:
        path = Path(cfg.data)
    # Rows that cannot fit the context are bad rows before they are parsed (a 30 MB row otherwise
    # costs minutes of parsing and rendering on the event loop).
    return load_dataset(path, on_bad_row=cfg.on_bad_row, known_agents=registered_agents(),
                        known_rewards=registered_rewards(), max_row_bytes=row_budget(cfg.runtime.agent.max_context_tokens))
