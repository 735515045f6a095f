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


@pytest.mark.parametrize("old_logprob", [-60.0, float("-inf"), float("nan")])
def test_grpo_update_stays_finite_for_a_far_off_policy_token(old_logprob: float) -> None:
    """A stale token the trainer now finds far likelier than its sampler did (ratio e^60) in a group
    with negative advantage made the loss and the gradient norm infinite on the H200's streaming run;
    clip_grad_norm_ then wrote NaN into every weight and the next in-flight update was refused. The
    dual clip bounds that loss; a non-finite rollout logprob is left out and counted."""
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    from grpo_gpu import grpo_train_step

    torch.manual_seed(0)
    vocab, p_len, r_len = 11, 3, 4

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, vocab)

        def forward(self, input_ids, attention_mask=None, position_ids=None):  # noqa: ANN001, ANN201
            return type("Out", (), {"logits": self.emb(input_ids) * 5})()

    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, vocab, (2, p_len + r_len))
    with torch.no_grad():  # on-policy logprobs, then one token made far off-policy
        logp = torch.log_softmax(model(ids).logits[:, p_len - 1:-1], -1).gather(-1, ids[:, p_len:, None])[..., 0]
    old = logp.clone()
    old[1, 2] = old_logprob
    batch = {"statuses": ["completed", "completed"], "rewards": torch.tensor([1.0, 0.0]), "group_ids": ["g", "g"],
             "response_mask": torch.ones(2, r_len), "rollout_log_probs": old, "prompts": ids[:, :p_len],
             "responses": ids[:, p_len:], "input_ids": ids, "attention_mask": torch.ones_like(ids),
             "position_ids": torch.arange(p_len + r_len).expand(2, -1)}
    out = grpo_train_step(model, opt, batch, torch.device("cpu"))
    assert math.isfinite(out["loss"]) and math.isfinite(out["grad_norm"]), out
    assert not out["skipped_nonfinite_update"]
    assert out["nonfinite_rollout_logprobs"] == (0 if math.isfinite(old_logprob) else 1)
    assert all(torch.isfinite(p).all() for p in model.parameters())
