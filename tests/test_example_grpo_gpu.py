"""Runs `examples/grpo_gpu.py` (the one-GPU GRPO loop) for 2 steps with the embedded CPU engine standing in
for SGLang — the example's own code path, as a subprocess — so the GPU example cannot rot between GPU runs.

Checked in its JSON report: 2 steps with a new weight version each, rolled out with that version's weights,
a staged wake-up and a full sleep every step, nothing generated outside AWAKE, the trainer's logprobs of
the sampled tokens agree with the engine's, the held-out evaluation ran before and after, and the plot
was written."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WAKE = ["wake_up/resume_weights", "wake_up/update_weights", "wake_up/resume_kv_cache"]
SLEEP = ["sleep/pause", "sleep/settle", "sleep/continue", "sleep/flush_cache", "sleep/release"]


@pytest.mark.slow
def test_grpo_gpu_example_two_steps_on_the_cpu_engine(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "examples" / "grpo_gpu.py"), "--mode", "tiny", "--engine", "cpu", "--steps", "2",
           "--prompts", "2", "--n", "2", "--eval-prompts", "2", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "grpo_gpu_tiny.json").read_text())
    assert report["engine"] == "cpu" and report["dryrun_on_cpu_engine"] is True
    steps = report["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    assert len({s["weight_version"] for s in steps}) == 2  # the trainer's new weights every step
    for s in steps:
        assert s["trajectory_weight_versions"] == [s["weight_version"]]
        assert s["stages"] == WAKE + SLEEP  # staged wake-up, then a full sleep, every step
        assert s["lifecycle_state_after_step"] == "SLEEPING"
        assert s["trajectories"] == 4 and s["trained_rows"] > 0
        assert math.isfinite(s["loss"]) and 0.0 <= s["reward_mean"] <= 1.0
        assert s["logprob_abs_diff_max"] < 1e-3, s  # same weights, same tokens: the trainer reproduces them
        for key in ("wake_up_seconds", "rollout_seconds", "sleep_seconds", "train_seconds"):
            assert s[key] > 0.0, key
    assert report["generations_outside_awake"] == 0
    for key in ("eval_before", "eval_after"):
        assert report[key]["questions"] == 2, report[key]
    assert report["eval_after"]["weight_version"] != report["eval_before"]["weight_version"]
    assert (tmp_path / "grpo_gpu_tiny.png").stat().st_size > 10_000
    summary = report["summary"]
    assert summary["steps"] == 2 and summary["generations_outside_awake"] == 0
    assert summary["eval_before_reward"] == report["eval_before"]["reward_mean"]
    assert summary["reward_last_steps_mean"] == steps[-1]["reward_mean"]  # a window of 1 step out of 2
