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
  `prompt_status` (per step and in total).

Files other than the stream are written to a temporary name in the same folder and renamed, so no
reader ever sees a half-written file.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Mapping, Sequence

from .engine.lifecycle import StageRecord
from .types import STATUSES, Trajectory

JSONL_NAME = "trajectories.jsonl"
PARQUET_NAME = "trajectories.parquet"
SUMMARY_NAME = "summary.json"
TIMELINE_NAME = "timeline.png"
OUTPUT_NAMES = (JSONL_NAME, PARQUET_NAME, SUMMARY_NAME, TIMELINE_NAME)
TIME_KINDS = ("generate", "tool", "queue", "wait", "user")
#: What became of one launched prompt (a GRPO group): its trajectories' worst status, `aborted` if
#: some were stopped or never ran, `not_started` if none ran, `carried_over` if continued next step.
PROMPT_STATUSES = ("completed", "truncated", "failed", "aborted", "not_started", "carried_over")


def _file_mode() -> int:
    # mkstemp creates 0600 files; outputs are ordinary files, so give them the umask's usual mode.
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


_FILE_MODE = _file_mode()


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], None]) -> Path:
    """Call `write(f)` on a temp file next to `path`, fsync, then rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, _FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def _finite(x: float | None, digits: int = 6) -> float | None:
    """JSON has no NaN/inf: write them as null rather than produce a file strict parsers reject.
    Rounded to `digits` (microseconds; nobody reads a summary's 15th digit)."""
    if x is None or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return round(float(x), digits)


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
        self._fd = os.open(self.partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, _FILE_MODE)
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


#: The struct fields of one Parquet `messages` element. The string fields hold the message's keys
#: of that name; `tool_calls` the JSON text of its list (arguments may be objects or strings, so no
#: fixed struct fits them); `extra` the JSON text of every other key (and of a `content` that is
#: not a string, e.g. a list of content parts), so nothing of a message is lost.
MESSAGE_FIELDS = ("role", "content", "name", "tool_call_id", "tool_calls", "extra")


def parquet_message(m: dict[str, Any]) -> dict[str, str | None]:
    """One chat message as a Parquet `messages` struct (see `MESSAGE_FIELDS`)."""
    rest = {k: v for k, v in m.items() if k not in MESSAGE_FIELDS[:5]}
    content = m.get("content")
    if content is not None and not isinstance(content, str):
        rest["content"] = content
        content = None
    calls = m.get("tool_calls")

    def text(key: str) -> str | None:
        v = m.get(key)
        return v if v is None or isinstance(v, str) else str(v)

    return {
        "role": text("role"),
        "content": content,
        "name": text("name"),
        "tool_call_id": text("tool_call_id"),
        "tool_calls": None if calls is None else json.dumps(calls, ensure_ascii=False, default=str),
        "extra": json.dumps(rest, ensure_ascii=False, default=str) if rest else None,
    }


def message_from_parquet(row: dict[str, Any]) -> dict[str, Any]:
    """A Parquet `messages` struct back as its chat dict (fields that were absent are left out)."""
    msg: dict[str, Any] = {k: row[k] for k in ("role", "content", "name", "tool_call_id") if row.get(k) is not None}
    msg.setdefault("content", None)
    if row.get("tool_calls") is not None:
        msg["tool_calls"] = json.loads(row["tool_calls"])
    if row.get("extra") is not None:
        msg.update(json.loads(row["extra"]))
    return msg


def _parquet_schema() -> Any:
    import pyarrow as pa

    message = pa.struct([(name, pa.string()) for name in MESSAGE_FIELDS])
    return pa.schema([
        ("step", pa.int32()),
        ("uid", pa.string()),
        ("group_id", pa.string()),
        ("index_in_group", pa.int32()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("response_ids", pa.list_(pa.int32())),
        ("response_mask", pa.list_(pa.int8())),
        ("response_logprobs", pa.list_(pa.float64())),
        ("weight_version", pa.string()),
        ("weight_versions", pa.list_(pa.string())),
        ("num_turns", pa.int32()),
        ("tool_calls", pa.int32()),
        ("status", pa.string()),
        ("finish_reason", pa.string()),
        ("reward", pa.float64()),
        ("error", pa.string()),
        ("metrics", pa.map_(pa.string(), pa.float64())),
        ("turn_rewards", pa.list_(pa.float64())),
        ("messages", pa.list_(message)),
        ("extra", pa.string()),
    ])


def write_parquet(path: str | Path, rows: Iterable[tuple[int, Trajectory]]) -> Path:
    """One row per (step, trajectory); `messages` as a list of structs, `extra` as JSON text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = _parquet_schema()
    cols: dict[str, list[Any]] = {name: [] for name in schema.names}
    for step, t in rows:
        cols["step"].append(step)
        cols["uid"].append(t.uid)
        cols["group_id"].append(t.group_id)
        cols["index_in_group"].append(t.index_in_group)
        cols["prompt_ids"].append(list(t.prompt_ids))
        cols["response_ids"].append(list(t.response_ids))
        cols["response_mask"].append(list(t.response_mask))
        cols["response_logprobs"].append([float(x) for x in t.response_logprobs])
        cols["weight_version"].append(t.weight_version)
        cols["weight_versions"].append(t.weight_versions)
        cols["num_turns"].append(t.num_turns)
        cols["tool_calls"].append(t.tool_calls)
        cols["status"].append(t.status)
        cols["finish_reason"].append(t.finish_reason)
        cols["reward"].append(t.reward)
        cols["error"].append(t.error)
        cols["metrics"].append([(k, float(v)) for k, v in t.metrics.items() if isinstance(v, (int, float))])
        cols["turn_rewards"].append([None if x is None else float(x) for x in t.turn_rewards])
        cols["messages"].append([parquet_message(m) for m in t.messages])
        cols["extra"].append(json.dumps(t.extra, ensure_ascii=False, default=str))
    table = pa.table(cols, schema=schema)
    return atomic_write(path, lambda f: pq.write_table(table, f))


# ---------------------------------------------------------------------------------------- summary
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
) -> dict[str, Any]:
    """The numbers of one step. `rollout_seconds` (wall time of the roll-out phase) is the
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
        **({} if prompts is None else {"prompt_status": _prompt_counts(prompts.values()), "prompts": dict(prompts)}),
    }


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
