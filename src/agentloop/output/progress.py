"""Progress of a rollout run for people watching it.

On a terminal: a rich live bar per step with trajectories done/total, generated tokens/s, tool
calls and errors, and a line per finished step. In quiet mode (or when stderr is not a terminal,
e.g. CI logs): plain timestamped log lines, at step start and end and at most every `log_every` seconds.
It only displays; the numbers of record are in `summary.json` (`agentloop.output`).
"""

from __future__ import annotations

import math
import sys
import time
from typing import IO, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from ..types import Trajectory


class RolloutProgress:
    """Feed it events (`begin_step`, `trajectory_done`, `end_step`, `message`); use as a context manager."""

    def __init__(self, *, quiet: bool = False, stream: IO[str] | None = None, log_every: float = 5.0) -> None:
        self.stream = stream or sys.stderr
        self.console = Console(file=self.stream, highlight=False)
        self.live = not quiet and self.console.is_terminal
        self.log_every = log_every
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._step = 0
        self._steps = 0
        self._reset_counts(0)

    def _reset_counts(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.tokens = 0
        self.tool_calls = 0
        self.errors = 0
        self.aborted = 0
        self._t_start = time.monotonic()
        self._last_log = -math.inf  # the first finished trajectory is always logged

    # ------------------------------------------------------------------ context
    def __enter__(self) -> "RolloutProgress":
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]step {task.fields[step]}[/]"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[tps]:>7.0f} tok/s"),
                TextColumn("tool calls {task.fields[tools]}"),
                TextColumn("errors {task.fields[errors]}"),
                TimeElapsedColumn(),
                console=self.console,
                transient=False,
            )
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    # ------------------------------------------------------------------ events
    def message(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text)
        else:
            self._log(text)

    def _log(self, text: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        self.stream.write(f"[{stamp}] {text}\n")
        self.stream.flush()

    def begin_step(self, step: int, steps: int, total: int) -> None:
        self._step, self._steps = step, steps
        self._reset_counts(total)
        if self._progress is not None:
            self._task = self._progress.add_task("", total=total, step=f"{step}/{steps}", tps=0.0, tools=0, errors=0)
        else:
            self._log(f"step {step}/{steps}: rolling out {total} trajectories")

    def trajectory_done(self, traj: Trajectory) -> None:
        self.done += 1
        self.tokens += sum(1 for m in traj.response_mask if m == 1)
        self.tool_calls += traj.tool_calls
        if traj.status == "failed":
            self.errors += 1
        elif traj.status == "aborted":
            self.aborted += 1
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=self.done, tps=self.tokens_per_second,
                                  tools=self.tool_calls, errors=self.errors)
        else:
            now = time.monotonic()
            if now - self._last_log >= self.log_every or self.done == self.total:
                self._last_log = now
                self._log(self.status_line())

    @property
    def tokens_per_second(self) -> float:
        dt = time.monotonic() - self._t_start
        return self.tokens / dt if dt > 0 else 0.0

    def status_line(self) -> str:
        return (f"step {self._step}/{self._steps}: {self.done}/{self.total} done, "
                f"{self.tokens_per_second:.0f} tok/s, {self.tool_calls} tool calls, "
                f"{self.errors} errors, {self.aborted} aborted")

    def end_step(self, summary: dict[str, Any]) -> None:
        st = summary.get("status", {})
        secs = summary.get("seconds", {})
        tps = summary.get("tokens_per_second")
        if self._progress is not None and self._task is not None:
            self._progress.stop_task(self._task)  # freezes its elapsed time
        rate = f"{tps:.0f} tok/s; " if tps is not None else ""
        use = summary.get("engine_use") or {}
        if use.get("concurrency") is not None:
            # So a throttled run is visible: the concurrency used against what the engines could run.
            busy = use.get("engine_busy_fraction")
            rate += (f"concurrency {use['concurrency']}, engine busy "
                     + (f"{busy:.0%} ({use['generate_in_flight_mean']:.1f} of {use['engine_capacity']} requests "
                        f"in flight on average); " if busy is not None else "n/a; "))
        self.message(
            f"step {self._step}/{self._steps} done: {st.get('completed', 0)} completed, "
            f"{st.get('truncated', 0)} truncated, {st.get('aborted', 0)} aborted, {st.get('failed', 0)} failed; "
            f"{summary.get('tool_calls', 0)} tool calls; {rate}"
            f"wake-up {secs.get('wake_up', 0):.3f}s, sleep {secs.get('sleep', 0):.3f}s"
        )
