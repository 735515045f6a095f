"""Prompt datasets: JSONL/Parquet rows → Samples; bad rows named by file:line, skipped or stopping."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from agentloop.data import arithmetic_prompts
from agentloop.dataset import DatasetError, load_dataset
from agentloop.tasks.arithmetic import CALCULATOR_TOOL, evaluate_expression

GOOD_MESSAGES = {"uid": "a", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                 "tools": [CALCULATOR_TOOL], "agent": "tool", "reward": "arithmetic", "ground_truth": 3,
                 "extra": {"k": 1}, "source": "unit"}
GOOD_PROMPT = {"prompt": "What is 1 + 2?", "ground_truth": 3}


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_messages_and_prompt_rows(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "d.jsonl", [json.dumps(GOOD_MESSAGES), "", json.dumps(GOOD_PROMPT)])
    ds = load_dataset(p)
    assert [s.uid for s in ds.samples] == ["a", "d-3"]  # default uid: file stem + line number
    a, b = ds.samples
    assert a.messages[1] == {"role": "user", "content": "hi"}
    assert a.tools == [CALCULATOR_TOOL] and a.agent == "tool" and a.reward == "arithmetic" and a.ground_truth == 3
    assert a.extra == {"k": 1, "source": "unit"}  # free keys and `extra` both carried through
    assert b.messages == [{"role": "user", "content": "What is 1 + 2?"}]
    assert b.agent is None and b.tools is None and b.reward is None  # None: the runtime's default agent loop
    assert ds.bad_rows == []


BAD_LINES = [
    ("{not json", "invalid JSON"),
    ('["a", "list"]', "must be a JSON object"),
    ('{"ground_truth": 1}', "exactly one of 'messages'"),
    ('{"prompt": "x", "messages": [{"role": "user", "content": "x"}]}', "exactly one of 'messages'"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "messages.0.role"),
    ('{"messages": []}', "'messages' is empty"),
    ('{"prompt": "x", "tools": [{"type": "function", "function": {}}]}', "tools[0] is not an OpenAI function schema"),
    ('{"prompt": "x", "extra": "not a dict"}', "extra"),
]


@pytest.mark.parametrize("line,problem", BAD_LINES)
def test_bad_row_is_named_and_skipped(tmp_path: Path, line: str, problem: str) -> None:
    p = write_jsonl(tmp_path / "d.jsonl", [json.dumps(GOOD_PROMPT), line, json.dumps({"prompt": "y"})])
    ds = load_dataset(p, on_bad_row="skip")
    assert len(ds.samples) == 2
    assert len(ds.bad_rows) == 1
    bad = ds.bad_rows[0]
    assert bad.line == 2 and bad.path == str(p)
    assert problem in bad.problem
    assert str(bad).startswith(f"{p}:2: ")


@pytest.mark.parametrize("line,problem", BAD_LINES[:3])
def test_bad_row_stops_when_configured(tmp_path: Path, line: str, problem: str) -> None:
    p = write_jsonl(tmp_path / "d.jsonl", [json.dumps(GOOD_PROMPT), line])
    with pytest.raises(DatasetError) as ei:
        load_dataset(p, on_bad_row="stop")
    assert f"{p}:2:" in str(ei.value) and problem in str(ei.value)


def test_duplicate_uid_and_unknown_agent(tmp_path: Path) -> None:
    rows = [{"uid": "x", "prompt": "a"}, {"uid": "x", "prompt": "b"}, {"prompt": "c", "agent": "nope"}]
    p = write_jsonl(tmp_path / "d.jsonl", [json.dumps(r) for r in rows])
    ds = load_dataset(p, known_agents={"tool", "single_turn"})
    assert [s.uid for s in ds.samples] == ["x"]
    assert [(b.line, b.problem.split(":")[0]) for b in ds.bad_rows] == [(2, "uid 'x' already used on line 1"), (3, "agent")]


def test_no_usable_rows_and_missing_file(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "d.jsonl", ["{}", "[]"])
    with pytest.raises(DatasetError, match=r"no usable rows \(2 bad rows"):
        load_dataset(p)
    with pytest.raises(DatasetError, match="no such dataset file"):
        load_dataset(tmp_path / "missing.jsonl")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match="unknown dataset format"):
        load_dataset(tmp_path / "d.csv")


def test_parquet_rows(tmp_path: Path) -> None:
    table = pa.table({
        "prompt": ["What is 2 * 3?", None, "What is 5 - 1?"],
        "ground_truth": [6, 7, 4],
        "uid": ["p0", "p1", "p2"],
        "source": ["s", "s", "s"],
    })
    p = tmp_path / "d.parquet"
    pq.write_table(table, p)
    ds = load_dataset(p)
    assert [s.uid for s in ds.samples] == ["p0", "p2"]
    assert ds.samples[0].messages == [{"role": "user", "content": "What is 2 * 3?"}]
    assert ds.samples[1].extra == {"source": "s"}
    assert len(ds.bad_rows) == 1 and ds.bad_rows[0].line == 2  # Parquet rows are numbered from 1
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DatasetError, match="cannot read as Parquet"):
        load_dataset(tmp_path / "broken.parquet")


def test_limit(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"prompt": f"q{i}"}) for i in range(10)])
    assert len(load_dataset(p, limit=4)) == 4


def test_bundled_arithmetic_prompts_are_valid_and_answers_are_right() -> None:
    ds = load_dataset(arithmetic_prompts(), on_bad_row="stop")
    assert len(ds) >= 64
    for s in ds.samples:
        assert s.tools and s.tools[0]["function"]["name"] == "calculator"
        assert s.messages[-1]["role"] == "user"
        calls = s.extra["expected_calls"]
        assert evaluate_expression(calls[-1]) == s.ground_truth
    assert any(len(s.extra["expected_calls"]) == 2 for s in ds.samples)  # some need two tool calls


def test_invalid_json_names_the_column_where_the_row_broke(tmp_path: Path) -> None:
    cut = '{"prompt": "What is 1 + 2?", "ground_truth": 3'  # the closing brace is missing
    p = (tmp_path / "d.jsonl")
    p.write_bytes(("\ufeff" + json.dumps(GOOD_PROMPT) + "\r\n" + cut + "\r\n"
                   + '{"prompt": "x" "ground_truth": 1}\n').encode("utf-8"))
    ds = load_dataset(p)
    assert len(ds.samples) == 1  # a byte-order mark before the first row is not part of it
    assert [str(b) for b in ds.bad_rows] == [
        f"{p}:2: invalid JSON at column {len(cut) + 1} (the end of the line): Expecting ',' delimiter",
        f"{p}:3: invalid JSON at column 16 ('\"ground_trut'): Expecting ',' delimiter",
    ]
