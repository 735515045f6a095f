"""Prompt datasets: JSONL or Parquet rows → `agentloop.types.Sample`.

A row holds `messages` (OpenAI chat format) or `prompt` (a string, becomes one user message), and
optionally `tools` (OpenAI function schemas), `agent` (agent-loop name), `reward`, `ground_truth`,
`uid`/`id`, and `extra`. `reward` is a reward-function name or a spec `{"name": ..., "ground_truth":
..., **kwargs}` (the kwargs go to the function as keyword arguments, `Sample.reward_kwargs`); a row
without one is scored by the runtime's default reward (`SchedulerConfig.reward`) if it has a ground
truth. Any other top-level key is carried through in `Sample.extra` untouched, next to the row's own
`extra` dict.

A bad row is never dropped silently: it becomes a `BadRow` naming the file, the line (JSONL) or
row number (Parquet, 1-based) and the problem. With `on_bad_row="skip"` it is counted and reported
and loading goes on; with `"stop"` loading raises `DatasetError` at the first one.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from .input_budget import bytes_budget
from .types import Sample

OnBadRow = Literal["skip", "stop"]
ROLES = ("system", "user", "assistant", "tool")


class DatasetError(ValueError):
    """The dataset (or one row of it) cannot be used. The message names the file and line."""


@dataclass(frozen=True)
class BadRow:
    path: str
    line: int
    problem: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.problem}"


@dataclass
class Dataset:
    samples: list[Sample] = field(default_factory=list)
    bad_rows: list[BadRow] = field(default_factory=list)
    path: str = ""

    def __len__(self) -> int:
        return len(self.samples)


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[Any] | None = None


class _Row(BaseModel):
    """The schema of one row. Unknown keys are allowed and end up in `Sample.extra`."""

    model_config = ConfigDict(extra="allow")

    messages: list[_Message] | None = None
    prompt: str | None = None
    tools: list[dict[str, Any]] | None = None
    agent: str | None = None
    reward: str | dict[str, Any] | None = None
    ground_truth: Any = None
    uid: str | int | None = None
    id: str | int | None = None
    extra: dict[str, Any] | None = None

    @field_validator("tools")
    @classmethod
    def _tools_are_functions(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, t in enumerate(tools or []):
            fn = t.get("function") if t.get("type", "function") == "function" else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ValueError(
                    f"tools[{i}] is not an OpenAI function schema "
                    '({"type": "function", "function": {"name": ..., "parameters": ...}})')
        return tools

    @field_validator("reward")
    @classmethod
    def _reward_spec(cls, reward: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if isinstance(reward, dict) and (not isinstance(reward.get("name"), str) or not reward["name"]):
            raise ValueError('a reward spec needs a "name" (a reward-function name), e.g. '
                             '{"name": "arithmetic", "ground_truth": 3}')
        if isinstance(reward, str) and not reward:
            raise ValueError("reward name is empty")
        return reward

    def reward_parts(self) -> tuple[str | None, Any, dict[str, Any]]:
        """(reward name, ground truth, reward kwargs) from `reward` (name or spec) and `ground_truth`."""
        if not isinstance(self.reward, dict):
            return self.reward, self.ground_truth, {}
        kwargs = dict(self.reward)
        name = kwargs.pop("name")
        gt = self.ground_truth
        if "ground_truth" in kwargs:
            spec_gt = kwargs.pop("ground_truth")
            if gt is not None and gt != spec_gt:
                raise ValueError(f"ground_truth given twice with different values: {gt!r} and reward.ground_truth {spec_gt!r}")
            gt = spec_gt
        return name, gt, kwargs

    @model_validator(mode="after")
    def _one_prompt(self) -> "_Row":
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("a row needs exactly one of 'messages' (OpenAI chat list) or 'prompt' (string)")
        if self.messages is not None and not self.messages:
            raise ValueError("'messages' is empty")
        if self.prompt is not None and not self.prompt.strip():
            raise ValueError("'prompt' is empty")
        return self


def _non_finite(value: Any, path: str = "") -> str | None:
    """Where in `value` a NaN or infinite float is (`""` for the value itself, `[0].x` inside), or None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else path
    if isinstance(value, dict):
        items: Iterable[tuple[Any, Any]] = ((f".{k}", v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for key, v in items:
        found = _non_finite(v, path + key)
        if found is not None:
            return found
    return None


def _format_validation_error(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def row_to_sample(
    row: Any,
    *,
    default_uid: str,
    known_agents: Iterable[str] | None = None,
    known_rewards: Iterable[str] | None = None,
) -> Sample:
    """Validate one decoded row and build its Sample. Raises ValueError with the problem."""
    if not isinstance(row, dict):
        raise ValueError(f"a row must be a JSON object, got {type(row).__name__}")
    try:
        r = _Row.model_validate(row)
    except ValidationError as e:
        raise ValueError(_format_validation_error(e)) from None
    if known_agents is not None and r.agent is not None and r.agent not in set(known_agents):
        raise ValueError(f"agent: unknown agent loop {r.agent!r}; known: {sorted(known_agents)}")
    reward, ground_truth, reward_kwargs = r.reward_parts()
    where = _non_finite(ground_truth)
    if where is not None:
        raise ValueError(f"ground_truth{where}: {where and 'a value' or 'the value'} is not a finite number "
                         "(NaN or infinity can never be matched by a reward)")
    if known_rewards is not None and reward is not None and reward not in set(known_rewards):
        raise ValueError(f"reward: unknown reward function {reward!r}; known: {sorted(known_rewards)}")
    if r.messages is not None:
        messages = [m.model_dump(exclude_none=False) for m in r.messages]
    else:
        messages = [{"role": "user", "content": r.prompt}]
    extra: dict[str, Any] = dict(r.model_extra or {})
    extra.update(r.extra or {})
    uid = r.uid if r.uid is not None else r.id
    return Sample(
        uid=str(uid) if uid is not None else default_uid,
        messages=messages,
        tools=r.tools,
        ground_truth=ground_truth,
        reward=reward,
        reward_kwargs=reward_kwargs,
        agent=r.agent,  # None: the runtime's default agent loop
        extra=extra,
    )


def _jsonl_rows(path: Path, max_row_bytes: int | None = None) -> Iterator[tuple[int, Any, str | None]]:
    try:
        yield from _jsonl_lines(path, max_row_bytes)
    except OSError as e:  # unreadable (permissions, an I/O error mid-file): say so, naming the file
        raise DatasetError(f"{path}: cannot read the dataset file: {e.strerror or e}") from None


def too_big(size: int, max_row_bytes: int) -> str:
    """The bad-row problem of a row over the byte budget."""
    return (f"row is {size / 1e6:.1f} MB ({size} bytes), over the {max_row_bytes}-byte budget: it cannot fit the "
            "context (refused before parsing)")


def _lines(f: Any, max_row_bytes: int | None) -> Iterator[tuple[bytes | None, int]]:
    """(line, size) per line; a line over `max_row_bytes` is (None, its size), read past in 1 MiB pieces
    without ever being held whole."""
    if max_row_bytes is None:
        for raw in f:
            yield raw, len(raw)
        return
    while True:
        raw = f.readline(max_row_bytes + 2)  # + room for "\r\n"
        if not raw:
            return
        if len(raw.rstrip(b"\r\n")) <= max_row_bytes:  # then the line ended within what was read
            yield raw, len(raw)
            continue
        size = len(raw)
        while not raw.endswith(b"\n"):
            raw = f.readline(1 << 20)
            if not raw:
                break
            size += len(raw)
        yield None, size


def _jsonl_lines(path: Path, max_row_bytes: int | None = None) -> Iterator[tuple[int, Any, str | None]]:
    with path.open("rb") as f:
        for lineno, (raw, size) in enumerate(_lines(f, max_row_bytes), start=1):
            if raw is None:
                assert max_row_bytes is not None
                yield lineno, None, too_big(size, max_row_bytes)
                continue
            try:
                # utf-8-sig on the first line: a byte-order mark some editors write is not part of the row.
                text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                yield lineno, None, f"not UTF-8 ({e.reason} at byte {e.start})"
                continue
            if not text.strip():
                continue  # blank lines (e.g. a trailing newline) are not rows
            try:
                yield lineno, json.loads(text), None
            except json.JSONDecodeError as e:
                # The column in the row itself (without its newline, which made json report a row cut
                # short as "line 2, column 1"); characters, counted from 1.
                where = "the end of the line" if e.pos >= len(text) else repr(text[e.pos:e.pos + 12])
                yield lineno, None, f"invalid JSON at column {e.pos + 1} ({where}): {e.msg.removesuffix(' at')}"


def _value_bytes(value: Any) -> int:
    """About how many bytes a decoded value's text takes (strings and bytes counted, containers walked)."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, dict):
        return sum(_value_bytes(k) + _value_bytes(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(_value_bytes(v) for v in value)
    return 8


def _parquet_rows(path: Path, max_row_bytes: int | None = None) -> Iterator[tuple[int, Any, str | None]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for non-parquet bytes
        raise DatasetError(f"{path}: cannot read as Parquet: {e}") from e
    lineno = 0
    for batch in pf.iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            lineno += 1
            # Parquet has no "absent" key: a null column value means the field was not given.
            if max_row_bytes is not None and (size := _value_bytes(row)) > max_row_bytes:
                yield lineno, None, too_big(size, max_row_bytes)
                continue
            yield lineno, {k: v for k, v in row.items() if v is not None}, None


def iter_rows(path: str | Path, max_row_bytes: int | None = None) -> Iterator[tuple[int, Any, str | None]]:
    """(line or row number, decoded row or None, decode problem or None) for every row of a file. A row
    over `max_row_bytes` (None: no bound) is a problem found before it is decoded."""
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"{p}: no such dataset file")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return _jsonl_rows(p, max_row_bytes)
    if suffix in (".parquet", ".pq"):
        return _parquet_rows(p, max_row_bytes)
    raise DatasetError(f"{p}: unknown dataset format {suffix!r}; use .jsonl or .parquet")


def row_budget(max_context_tokens: int) -> int:
    """The largest row (bytes) that may hold a prompt of at most `max_context_tokens` tokens (a 30 MB row
    otherwise took 124 s and 7.4 GB to parse and render); see `input_budget`."""
    return bytes_budget(max_context_tokens)


def load_dataset(
    path: str | Path,
    *,
    on_bad_row: OnBadRow = "skip",
    limit: int | None = None,
    known_agents: Iterable[str] | None = None,
    known_rewards: Iterable[str] | None = None,
    max_row_bytes: int | None = None,
) -> Dataset:
    """Read every row of `path` (stopping after `limit` good rows, if given).

    `max_row_bytes`: rows larger than this (raw JSONL bytes; Parquet: the row's strings) are bad rows,
    found before they are parsed, validated or rendered (see `row_budget`; None: no bound).

    Bad rows are collected in `Dataset.bad_rows` (skip) or raise `DatasetError` (stop). Duplicate
    uids are bad rows too: the uid names a prompt group, two groups must not share one.
    """
    if on_bad_row not in ("skip", "stop"):
        raise ValueError(f"on_bad_row must be 'skip' or 'stop', not {on_bad_row!r}")
    agents = set(known_agents) if known_agents is not None else None
    rewards = set(known_rewards) if known_rewards is not None else None
    ds = Dataset(path=str(path))
    seen: dict[str, int] = {}
    stem = Path(path).stem
    for lineno, row, problem in iter_rows(path, max_row_bytes):
        if limit is not None and len(ds.samples) >= limit:
            break
        sample = None
        if problem is None:
            try:
                sample = row_to_sample(row, default_uid=f"{stem}-{lineno}", known_agents=agents, known_rewards=rewards)
            except ValueError as e:
                problem = str(e)
        if sample is not None and sample.uid in seen:
            problem = f"uid {sample.uid!r} already used on line {seen[sample.uid]}"
            sample = None
        if sample is None:
            bad = BadRow(str(path), lineno, problem or "unusable row")
            if on_bad_row == "stop":
                raise DatasetError(f"bad row {bad} (on_bad_row=stop)")
            ds.bad_rows.append(bad)
            continue
        seen[sample.uid] = lineno
        ds.samples.append(sample)
    if not ds.samples:
        detail = f" ({len(ds.bad_rows)} bad rows, first: {ds.bad_rows[0]})" if ds.bad_rows else ""
        raise DatasetError(f"{path}: no usable rows{detail}")
    return ds
