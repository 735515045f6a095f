"""Run outputs: streamed JSONL (whole lines, renamed at close), Parquet, summary numbers, atomic files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from agentloop.engine.lifecycle import StageRecord
from agentloop.output import (
    JSONL_NAME,
    MESSAGE_FIELDS,
    TrajectoryStream,
    atomic_write,
    clear_outputs,
    message_from_parquet,
    summarize_run,
    summarize_step,
    write_parquet,
    write_summary,
)
from agentloop.types import TimelineEvent, Trajectory, TurnRecord


def make_traj(uid: str, *, status: str = "completed", tool_calls: int = 1, reward: float | None = 1.0,
              t0: float = 100.0) -> Trajectory:
    # Two model turns (mask 1) around a tool result (mask 0), laid out like a real tool trajectory.
    ids = [5, 6, 7, 50, 51, 8, 9]
    mask = [1, 1, 1, 0, 0, 1, 1]
    lps = [-0.1, -0.2, -0.3, 0.0, 0.0, -0.4, -0.5]
    return Trajectory(
        uid=uid, group_id=uid.split("#")[0], prompt_ids=[1, 2, 3], response_ids=ids, response_mask=mask,
        response_logprobs=lps, weight_version="v1", num_turns=2, tool_calls=tool_calls, status=status,
        finish_reason="stop", reward=reward, metrics={"generate_seconds": 0.3, "tool_seconds": 0.1},
        messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        turns=[TurnRecord(0, 3, "v1", {"type": "stop"}), TurnRecord(5, 2, "v1", {"type": "stop"})],
        timeline=[TimelineEvent("queue", t0, t0 + 0.05), TimelineEvent("generate", t0 + 0.05, t0 + 0.2),
                  TimelineEvent("tool", t0 + 0.2, t0 + 0.3), TimelineEvent("generate", t0 + 0.3, t0 + 0.45)],
        extra={"expected_calls": ["1 + 2"]},
    )


RECORDS = [
    StageRecord("wake_up", "resume_weights", 99.0, 99.1),
    StageRecord("wake_up", "update_weights", 99.1, 99.5),
    StageRecord("wake_up", "resume_kv_cache", 99.5, 99.6),
    StageRecord("sleep", "pause", 101.0, 101.01),
    StageRecord("sleep", "release", 101.01, 101.2),
]


def test_stream_writes_whole_flushed_lines_and_renames(tmp_path: Path) -> None:
    s = TrajectoryStream(tmp_path).open()
    s.write(make_traj("a#0"), step=1)
    # Before close: the finished trajectory is already on disk (flushed) in the .partial file.
    lines = s.partial.read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["uid"] == "a#0"
    assert not (tmp_path / JSONL_NAME).exists()
    t = make_traj("b#0", reward=None)
    t.response_logprobs[0] = float("nan")  # JSON has no NaN: written as null, file stays strict JSON
    t.metrics["odd"] = float("inf")
    s.write(t, step=2)
    assert s.close() == tmp_path / JSONL_NAME
    assert not s.partial.exists()
    rows = [json.loads(line) for line in (tmp_path / JSONL_NAME).read_text().splitlines()]
    assert [(r["uid"], r["step"]) for r in rows] == [("a#0", 1), ("b#0", 2)]
    assert rows[1]["response_logprobs"][0] is None and rows[1]["reward"] is None and rows[1]["metrics"]["odd"] is None
    r = rows[0]
    assert len(r["response_ids"]) == len(r["response_mask"]) == len(r["response_logprobs"])
    assert r["weight_versions"] == ["v1", "v1"] and r["timeline"][0]["kind"] == "queue"


def test_parquet_one_row_per_trajectory(tmp_path: Path) -> None:
    trajs = [(1, make_traj("a#0")), (1, make_traj("a#1", reward=None)), (2, make_traj("b#0", status="failed"))]
    path = write_parquet(tmp_path / "t.parquet", trajs)
    table = pq.read_table(path)
    assert table.num_rows == 3
    d = table.to_pylist()
    assert [x["step"] for x in d] == [1, 1, 2]
    assert d[0]["response_ids"] == trajs[0][1].response_ids
    assert d[0]["response_mask"] == trajs[0][1].response_mask
    assert d[0]["response_logprobs"] == pytest.approx(trajs[0][1].response_logprobs)
    assert d[1]["reward"] is None and d[2]["status"] == "failed"
    assert dict(d[0]["metrics"]) == {"generate_seconds": 0.3, "tool_seconds": 0.1}
    assert list(tmp_path.iterdir()) == [path]  # no temp file left behind


def test_parquet_messages_are_structs_and_turn_rewards_floats(tmp_path: Path) -> None:
    import pyarrow as pa

    t = make_traj("a#0")
    t.messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "q"}], "lang": "en"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": {"expression": "1 + 2"}}}]},
        {"role": "tool", "content": "3", "name": "calculator", "tool_call_id": "c1"},
        {"role": "assistant", "content": "It is 3."},
    ]
    t.turn_rewards = [0.5, 1.0]
    path = write_parquet(tmp_path / "t.parquet", [(1, t), (1, make_traj("a#1"))])
    table = pq.read_table(path)
    assert table.schema.field("messages").type == pa.list_(pa.struct([(f, pa.string()) for f in MESSAGE_FIELDS]))
    assert table.schema.field("turn_rewards").type == pa.list_(pa.float64())
    df = table.to_pydict()  # column → values, like a DataFrame (`table.to_pandas()` reads the same)
    # Readable without decoding JSON: the messages are a list of records.
    assert df["messages"][0][0]["role"] == "system" and df["messages"][0][0]["content"] == "be brief"
    assert [m["role"] for m in df["messages"][0]] == ["system", "user", "assistant", "tool", "assistant"]
    tool = df["messages"][0][3]
    assert (tool["name"], tool["tool_call_id"], tool["content"]) == ("calculator", "c1", "3")
    assert json.loads(df["messages"][0][2]["tool_calls"])[0]["function"]["arguments"] == {"expression": "1 + 2"}
    assert list(df["turn_rewards"][0]) == [0.5, 1.0] and list(df["turn_rewards"][1]) == []
    # Nothing of a message is lost: other keys and list content come back through `extra`.
    rows = table.to_pylist()
    assert [message_from_parquet(m) for m in rows[0]["messages"]] == t.messages
    assert [message_from_parquet(m) for m in rows[1]["messages"]] == make_traj("a#1").messages


def test_summary_numbers() -> None:
    trajs = [make_traj("a#0"), make_traj("a#1", tool_calls=0, reward=0.0),
             make_traj("b#0", status="failed", reward=None), make_traj("b#1", status="truncated", tool_calls=2)]
    s = summarize_step(trajs, RECORDS, step=1, seconds=3.0, rollout_seconds=0.5, weight_version="v1")
    assert s["trajectories"] == 4
    assert s["status"] == {"completed": 2, "truncated": 1, "aborted": 0, "failed": 1}
    assert s["tool_calls"] == 4 and s["trajectories_with_tool_call"] == 3
    assert s["reward_mean"] == pytest.approx(2 / 3) and s["rewarded"] == 3
    assert s["generated_tokens"] == 4 * 5
    assert s["tokens_per_second"] == pytest.approx(20 / 0.5)
    assert s["trajectory_seconds"]["generate"] == pytest.approx(4 * 0.3)
    assert s["trajectory_seconds"]["tool"] == pytest.approx(4 * 0.1)
    assert s["trajectory_seconds"]["queue"] == pytest.approx(4 * 0.05)
    assert s["wake_up_stages"] == pytest.approx({"resume_weights": 0.1, "update_weights": 0.4, "resume_kv_cache": 0.1})
    assert s["sleep_stages"] == pytest.approx({"pause": 0.01, "release": 0.19})
    assert s["seconds"]["wake_up"] == pytest.approx(0.6)
    # Without an explicit roll-out time, the span of the trajectories' events is the denominator.
    s2 = summarize_step(trajs, step=2)
    assert s2["seconds"]["rollout"] == pytest.approx(0.45)
    run = summarize_run([s, s2], out="x")
    assert run["out"] == "x" and run["total"]["trajectories"] == 8
    # The run totals are at top level too, under the same names as in each step's summary.
    assert run["status"] == {"completed": 4, "truncated": 2, "aborted": 0, "failed": 2}
    assert run["tool_calls"] == 8 and run["trajectories"] == 8 and run["steps"] == 2
    assert run["reward_mean"] == pytest.approx(2 / 3)
    assert run["tokens_per_second"] == pytest.approx(40 / (0.5 + 0.45))
    assert run["trajectory_seconds"]["generate"] == pytest.approx(8 * 0.3)
    assert run["trajectory_seconds"]["tool"] == pytest.approx(8 * 0.1)
    assert run["trajectory_seconds"]["queue"] == pytest.approx(8 * 0.05)
    assert run["wake_up_stages"] == pytest.approx({"resume_weights": 0.1, "update_weights": 0.4, "resume_kv_cache": 0.1})
    assert run["sleep_stages"] == pytest.approx({"pause": 0.01, "release": 0.19})
    assert {k: run[k] for k in run["total"]} == run["total"]
    with pytest.raises(ValueError, match="would hide the run totals"):
        summarize_run([s], status="done")
    assert run["total"]["status"]["completed"] == 4
    assert run["total"]["reward_mean"] == pytest.approx(2 / 3)
    assert run["total"]["wake_up_stages"]["update_weights"] == pytest.approx(0.4)
    json.dumps(run, allow_nan=False)


def test_summary_of_nothing_is_valid_json(tmp_path: Path) -> None:
    s = summarize_step([], step=1)
    assert s["reward_mean"] is None and s["tokens_per_second"] is None
    write_summary(tmp_path / "summary.json", summarize_run([s]))
    assert json.loads((tmp_path / "summary.json").read_text())["total"]["trajectories"] == 0


def test_atomic_write_leaves_old_file_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "summary.json"
    target.write_text("old")

    def boom(f) -> None:  # noqa: ANN001
        f.write(b"half")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        atomic_write(target, boom)
    assert target.read_text() == "old"
    assert list(tmp_path.iterdir()) == [target]


def test_clear_outputs(tmp_path: Path) -> None:
    for name in ("trajectories.jsonl", "trajectories.jsonl.partial", "summary.json", "timeline.png", "keep.txt"):
        (tmp_path / name).write_text("x")
    clear_outputs(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_reward_nan_is_null() -> None:
    s = summarize_step([make_traj("a#0", reward=math.nan)], step=1)
    assert s["reward_mean"] is None


def test_summary_lists_token_staleness_per_step_and_in_total() -> None:
    """The issue-27 report: the staleness of every trained token, per step, in summary.json."""
    trajs = [make_traj("a#0")]
    s1 = summarize_step(trajs, step=1, staleness={"0": 30})
    s2 = summarize_step(trajs, step=2, staleness={"1": 5, "0": 12, "3": 0})  # carried partials: older tokens
    assert s1["token_staleness"] == {"0": 30} and s1["max_token_staleness"] == 0
    assert s2["token_staleness"] == {"0": 12, "1": 5, "3": 0} and s2["max_token_staleness"] == 1
    run = summarize_run([s1, s2])
    assert run["token_staleness"] == {"0": 42, "1": 5, "3": 0} and run["max_token_staleness"] == 1
    assert "token_staleness" not in summarize_step(trajs, step=3)  # not given: not made up
    json.dumps(run, allow_nan=False)
