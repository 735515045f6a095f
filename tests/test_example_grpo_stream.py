"""Runs `examples/grpo_stream.py` (GRPO in the streaming mode beside the synchronous one) with the embedded CPU
engine standing in for SGLang — the example's own code path, as a subprocess — so it cannot rot between GPU runs.

Checked in its JSON report: both modes ran the same number of steps from the same checkpoint; the
synchronous steps train on-policy tokens only, the streaming ones within the staleness bound; the
streaming run applied its weights in flight (one update per step but the last) and never generated
outside AWAKE; held-out rewards before and after each run; the plot was written."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_grpo_stream_example_on_the_cpu_engine(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "examples" / "grpo_stream.py"), "--engine", "cpu", "--steps", "3", "--prompts", "2",
           "--n", "2", "--eval-prompts", "2", "--active", "8", "--max-staleness", "1", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "grpo_stream_cpu.json").read_text())
    assert report["generations_outside_awake"] == 0
    runs = {r["mode"]: r for r in report["runs"]}
    assert set(runs) == {"sync", "over", "stream"}
    for r in runs.values():
        assert [s["step"] for s in r["steps"]] == [1, 2, 3]
        assert all(math.isfinite(s["loss"]) and 0.0 <= s["reward_mean"] <= 1.0 for s in r["steps"])
        assert 0.0 <= r["eval_before"] <= 1.0 and 0.0 <= r["eval_after"] <= 1.0
        assert r["train_wall_s"] > 0
    assert all(set(s["staleness"]) == {"0"} for s in runs["sync"]["steps"])
    assert all(max(int(k) for k in s["staleness"]) <= 1 for s in runs["stream"]["steps"])
    assert all(max(int(k) for k in s["staleness"]) <= 1 for s in runs["over"]["steps"])
    m = runs["stream"]["stream_metrics"]
    assert m["updates"] == 2 and m["generations_outside_awake"] == 0
    assert set(report["summary"]) >= {"sync", "over", "stream", "stream_over_sync_wall", "over_over_sync_wall"}
    assert (tmp_path / "grpo_stream_cpu.png").read_bytes()[:4] == b"\x89PNG"
