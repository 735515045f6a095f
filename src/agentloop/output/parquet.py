"""`trajectories.parquet`: one row per (step, trajectory) with the `Trajectory` fields plus
`turn_rewards`, the readable `messages` as a list of structs (`MESSAGE_FIELDS`) and `extra` as JSON
text; written once, whole (`atomic_write`). `message_from_parquet` turns a stored message back into
its chat dict.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from .atomic_file import atomic_write
from ..types import Trajectory

__all__ = ["MESSAGE_FIELDS", "message_from_parquet", "parquet_message", "write_parquet"]


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
