"""What a rollout run leaves in its output folder, and the numbers of its summary.

- `trajectories.jsonl`: one JSON object per finished trajectory (all of `Trajectory`'s fields plus
  `step`), streamed as trajectories finish: each is one `write` of a whole line, flushed, into
  `trajectories.jsonl.partial`, renamed to `trajectories.jsonl` when the run ends (also on Ctrl-C).
  A hard kill therefore leaves a file named `.partial` holding only whole lines.
- `trajectories.parquet`: the same trajectories, one row each, the `Trajectory` fields plus `turn_rewards`
  and the readable `messages` as a list of structs (`MESSAGE_FIELDS`: role, content, name,
  tool_call_id, tool_calls as JSON text of the OpenAI list, and any other keys as JSON text), written
  once at the end. `message_from_parquet` turns a stored message back into its chat dict.
- `summary.json`: counts by status (`status`), tool calls (`tool_calls`), reward mean (`reward_mean`),
  generated tokens/s (`tokens_per_second`), time split generate/tool/queue/wait/user
  (`trajectory_seconds`), wake-up and sleep seconds per lifecycle stage (`wake_up_stages`,
  `sleep_stages`): the run's totals at top level (also under `total`), each step's under `per_step`.
  Each step also lists every prompt it launched with what became of it (`prompts`: uid → one of
  `PROMPT_STATUSES`, `not_started` included, so a stopped run says what to re-run), counted in
  `prompt_status` (per step and in total), and the staleness of its sampled tokens (`token_staleness`:
  weight versions behind the step's → tokens, with `max_token_staleness`; summed in total).

Files other than the stream are written to a temporary name in the same folder and renamed, so no
reader ever sees a half-written file (`atomic_file`).

This module owns the folder's names, the JSONL stream and clearing a previous run; the Parquet table
is `parquet.py`, the summary's numbers `summary.py`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path
from typing import Any

from .atomic_file import FILE_MODE
from ..types import Trajectory

__all__ = [
    "JSONL_NAME", "OUTPUT_NAMES", "PARQUET_NAME", "SUMMARY_NAME", "TIMELINE_NAME", "TRAINING_NAME", "OutputWriteError",
    "TrajectoryStream", "clear_outputs", "trajectory_record",
]

JSONL_NAME = "trajectories.jsonl"
PARQUET_NAME = "trajectories.parquet"
SUMMARY_NAME = "summary.json"
TIMELINE_NAME = "timeline.png"
TRAINING_NAME = "training.png"
OUTPUT_NAMES = (JSONL_NAME, PARQUET_NAME, SUMMARY_NAME, TIMELINE_NAME, TRAINING_NAME)


def _json_safe(x: Any) -> Any:
    """Non-finite floats → None anywhere in a nested structure (metrics, extra, timings)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


_INT_LISTS = ("prompt_ids", "response_ids", "response_mask")


def trajectory_record(traj: Trajectory, step: int) -> dict[str, Any]:
    """The JSON-ready dict of one trajectory (all its fields, `step`, and `weight_versions`)."""
    d = traj.to_dict()
    # Token lists are ints (nothing to clean, and the longest lists): skip them in the walk.
    rec = {k: (v if k in _INT_LISTS else _json_safe(v)) for k, v in d.items()}
    rec["weight_versions"] = traj.weight_versions
    return {"step": step, **rec}


class OutputWriteError(OSError):
    """An output file could not be written (disk full, I/O error, file system gone read-only). The
    message names the file, the reason and what was kept; `errno` is the failed write's."""

    def __str__(self) -> str:
        return str(self.strerror)


class TrajectoryStream:
    """Appends trajectories to `<out>/trajectories.jsonl.partial` as they finish; `close()` renames it.

    Each line goes to the file with unbuffered writes; if the disk fills (or any write fails) part
    way through a line, the file is cut back to its last whole line, the stream is marked `failed`
    (an `OutputWriteError` saying so) and refuses further lines, and `close()` leaves the file under
    its `.partial` name: whole lines only, a prefix of the run's finished trajectories."""

    def __init__(self, out_dir: str | Path) -> None:
        self.path = Path(out_dir) / JSONL_NAME
        self.partial = self.path.with_name(JSONL_NAME + ".partial")
        self.count = 0
        self.failed: OutputWriteError | None = None
        self._fd: int | None = None
        self._size = 0  # bytes of whole lines written

    def open(self) -> "TrajectoryStream":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        self._size = 0
        return self

    def write(self, traj: Trajectory, step: int) -> None:
        if self._fd is None:
            raise RuntimeError("TrajectoryStream.write before open()")
        if self.failed is not None:
            raise self.failed
        line = json.dumps(trajectory_record(traj, step), ensure_ascii=False, allow_nan=False, default=str) + "\n"
        data = memoryview(line.encode("utf-8"))
        size = len(data)
        try:
            while data:  # a reader never sees half a trajectory: whole lines or, on failure, none of it
                data = data[os.write(self._fd, data):]
        except OSError as e:
            with contextlib.suppress(OSError):  # take back the cut line (shrinking frees space on a full disk)
                os.ftruncate(self._fd, self._size)
                os.lseek(self._fd, self._size, os.SEEK_SET)
            self.failed = OutputWriteError(
                e.errno, f"cannot write trajectories to {self.partial}: {e.strerror or e}; it keeps the "
                f"{self.count} trajectories written before, as whole lines")
            raise self.failed from e
        self._size += size
        self.count += 1

    def close(self) -> Path | None:
        """Sync and close; rename to `trajectories.jsonl` unless a write failed (the file then keeps
        its `.partial` name: it is not the whole run). Returns the file's path."""
        if self._fd is None:
            return None
        fd, self._fd = self._fd, None
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if self.failed is not None:
            return self.partial
        os.replace(self.partial, self.path)
        return self.path

    def __enter__(self) -> "TrajectoryStream":
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()


def clear_outputs(out_dir: str | Path) -> None:
    """Remove a previous run's outputs so the folder never mixes two runs."""
    out = Path(out_dir)
    for name in OUTPUT_NAMES + (JSONL_NAME + ".partial",):
        (out / name).unlink(missing_ok=True)
