"""Runs `examples/grpo_cpu.py` (a GRPO trainer embedding `Runtime`) for 3 steps as a real subprocess and
checks what a trainer relies on: each step's trajectories carry that step's weight_version, the engine
slept between steps (staged wake-up every time), and the trainer reproduces the engine's logprobs of
the sampled tokens (mask and offsets right)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_grpo_example_three_steps(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    cmd = [sys.executable, str(ROOT / "examples" / "grpo_cpu.py"), "--steps", "3", "--prompts", "3", "--n", "3",
           "--max-new-tokens", "40", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    steps = report["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3]
    versions = [s["weight_version"] for s in steps]
    assert len(set(versions)) == 3, versions  # every step served new weights
    for s in steps:
        assert s["trajectory_weight_versions"] == [s["weight_version"]]  # rolled out with this step's weights
        assert s["lifecycle_state_after_step"] == "SLEEPING"
        assert s["trajectories"] == 9
        assert math.isfinite(s["loss"]) and s["trained_rows"] > 0
        assert s["logprob_max_abs_diff"] < 1e-3, s  # trainer and engine agree on the sampled tokens
    assert steps[0]["tool_calls"] > 0  # the tiny model really calls the calculator
    # Staged wake-up each step, and a full sleep (ending in release) between steps.
    stages = steps[-1]["stages"]
    wake = ["wake_up/resume_weights", "wake_up/update_weights", "wake_up/resume_kv_cache"]
    sleep = ["sleep/pause", "sleep/settle", "sleep/continue", "sleep/flush_cache", "sleep/release"]
    assert stages == ["sleep/pause", "sleep/settle", "sleep/continue", "sleep/flush_cache", "sleep/release"] + (wake + sleep) * 3
    assert report["generations_outside_awake"] == 0
