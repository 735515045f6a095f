"""Hostile dataset rows (issue 29, items 5 and 6 and the smaller ones): a 30 MB row is a named bad row
found before it is parsed; rows `a` and `a@1` relabelled collision-free on later laps; a NaN or
infinite ground truth refused at load naming the row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentloop.commands.rollout_prompts import lap_uid, step_prompts, take_prompts
from agentloop.dataset import load_dataset, row_budget
from agentloop.types import Sample

ROW = {"messages": [{"role": "user", "content": "What does 2 plus 3 equal?"}], "agent": "tool", "reward": "arithmetic",
       "ground_truth": 5}


def sample(uid: str) -> Sample:
    return Sample(uid=uid, messages=[{"role": "user", "content": uid}])


def test_lap_labels_never_collide_with_real_uids() -> None:
    rows = [sample("a"), sample("a@1")]
    uids = [s.uid for s in step_prompts(rows, 1, 4)]
    assert len(set(uids)) == 4, uids  # main: ['a', 'a@1', 'a@1', 'a@1@1']
    assert uids == ["a", "a@1", "a@1~1", "a@1@1"]
    # Every label over many laps of an adversarial dataset is unique and never a dataset uid.
    rows = [sample(u) for u in ("a", "a@1", "a@1~1", "a@2", "a@1@1", "b@1~1")]
    seen = [s.uid for s in take_prompts(rows, 0, 60)]
    assert len(set(seen)) == 60
    assert lap_uid("a", 1, {"a"}) == "a@1"


def write_rows(path: Path, rows: list[dict | str]) -> Path:
    with path.open("w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-Infinity", "[1, NaN]", '{"x": Infinity}'])
def test_non_finite_ground_truth_is_a_named_bad_row(tmp_path: Path, bad: str) -> None:
    good = json.dumps({**ROW, "uid": "ok"})
    row = json.dumps({**ROW, "uid": "bad"}).replace('"ground_truth": 5', f'"ground_truth": {bad}')
    spec = json.dumps({**ROW, "uid": "spec", "reward": {"name": "arithmetic"}, "ground_truth": None}).replace(
        '"reward": {"name": "arithmetic"}', f'"reward": {{"name": "arithmetic", "ground_truth": {bad}}}')
    data = write_rows(tmp_path / "rows.jsonl", [good, row, spec])
    ds = load_dataset(data)
    assert [s.uid for s in ds.samples] == ["ok"]
    assert [b.line for b in ds.bad_rows] == [2, 3]
    for b in ds.bad_rows:
        assert "ground_truth" in b.problem and "not a finite number" in b.problem, b.problem
        assert str(b).startswith(f"{data}:{b.line}: ")


def test_a_30_mb_row_is_a_named_bad_row_before_it_is_parsed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    big = {**ROW, "uid": "big", "messages": [{"role": "user", "content": "x" * (30 << 20)}]}
    data = write_rows(tmp_path / "rows.jsonl", [{**ROW, "uid": "first"}, big, {**ROW, "uid": "last"}])
    import agentloop.dataset as dataset_module

    parsed: list[int] = []  # the length of every row the loader parsed
    real_loads = dataset_module.json.loads

    def counting_loads(text, *a, **kw):
        parsed.append(len(text))
        return real_loads(text, *a, **kw)

    monkeypatch.setattr(dataset_module.json, "loads", counting_loads)
    ds = load_dataset(data, max_row_bytes=row_budget(4096))
    monkeypatch.undo()
    assert [s.uid for s in ds.samples] == ["first", "last"]
    assert len(ds.bad_rows) == 1 and ds.bad_rows[0].line == 2
    assert "row is 31.5 MB" in ds.bad_rows[0].problem and "cannot fit the context" in ds.bad_rows[0].problem
    assert len(parsed) == 2 and max(parsed) < (1 << 20), parsed  # read past, never parsed (main: parsed, validated, rendered)
    # Parquet: the same budget, counted on the row's strings.
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"uid": "p1", "prompt": "hi"}, {"uid": "p2", "prompt": "y" * (30 << 20)}]),
                   tmp_path / "rows.parquet")
    ds = load_dataset(tmp_path / "rows.parquet", max_row_bytes=row_budget(4096))
    assert [s.uid for s in ds.samples] == ["p1"] and ds.bad_rows[0].line == 2 and "row is 31.5 MB" in ds.bad_rows[0].problem


@pytest.mark.slow
def test_cli_rollout_with_colliding_uids_a_huge_row_and_a_nan_truth(tmp_path: Path) -> None:
    """The issue's rows through `agentloop rollout` (2 steps, 4 prompts per step over 2 good rows):
    main dies in step 1 with an uncaught ExceptionGroup ("duplicated: a@1_0"), exit 1, no summary."""
    rows = [{**ROW, "uid": "a"}, {**ROW, "uid": "a@1"}, {**ROW, "uid": "huge", "prompt": "z" * (30 << 20)},
            json.dumps({**ROW, "uid": "nan"}).replace('"ground_truth": 5', '"ground_truth": NaN')]
    rows[2].pop("messages")
    data = write_rows(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "out"
    src = Path(__file__).resolve().parents[1] / "src"
    r = subprocess.run([sys.executable, "-m", "agentloop", "rollout", "--quiet", "--no-timeline", "--data", str(data),
                        "--steps", "2", "--prompts-per-step", "4", "--n", "2", "--max-new-tokens", "24",
                        "--out", str(out)], capture_output=True, text=True, timeout=500,
                       env={**os.environ, "PYTHONPATH": str(src)})
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    assert "ExceptionGroup" not in r.stderr and "Traceback" not in r.stderr
    assert f"{data}:3: row is 31.5 MB" in r.stderr
    assert f"{data}:4: ground_truth: the value is not a finite number" in r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trajectories"] == 16 and summary["bad_rows"] == 2
    uids = [json.loads(line)["uid"] for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(uids) == len(set(uids)) == 16
