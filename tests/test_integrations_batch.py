"""What every trainer adapter builds on (no trainer package needed): the batch's `trainable` mask and
per-token `token_weight_versions`, and `StepResult.ragged`, the same rows without padding."""

from __future__ import annotations

from agentloop.batch import collate, ragged, weight_version_number
from agentloop.runtime.types import StepResult
from agentloop.types import Trajectory, TurnRecord


def traj(uid: str, status: str, turns: list[tuple[int, str]], reward: float | None) -> Trajectory:
    ids, mask, lps, recs = [], [], [], []
    for j, (n, version) in enumerate(turns):
        if j:
            ids, mask, lps = ids + [7, 7, 7], mask + [0, 0, 0], lps + [0.0, 0.0, 0.0]
        recs.append(TurnRecord(start=len(ids), length=n, weight_version=version, finish_reason={"type": "stop"}))
        ids, mask, lps = ids + list(range(10, 10 + n)), mask + [1] * n, lps + [-0.5] * n
    return Trajectory(uid=uid, group_id="g", prompt_ids=[1, 2], response_ids=ids, response_mask=mask,
                      response_logprobs=lps, status=status, reward=reward, turns=recs)  # type: ignore[arg-type]


def test_weight_version_numbers() -> None:
    assert [weight_version_number(v) for v in ("v1", "v12", "step-7", "3", "default", "")] == [1, 12, 7, 3, 0, 0]


def test_trainable_and_token_weight_versions_in_the_padded_and_ragged_forms() -> None:
    # a partial rollout: its first turn sampled by v1, the continuation (after a tool turn) by v2
    ts = [traj("a", "completed", [(2, "v1"), (3, "v2")], 1.0), traj("b", "failed", [(1, "v2")], None),
          traj("c", "truncated", [(4, "v2")], 0.0), traj("d", "aborted", [], None)]
    b = collate(ts, pad_token_id=0)
    assert b["trainable"].tolist() == [1, 0, 1, 0]
    assert b["rewards"].tolist() == [1.0, 0.0, 0.0, 0.0]  # why trainable exists: None shows as 0.0
    assert b["token_weight_versions"].dtype == b["responses"].dtype and b["token_weight_versions"].shape == b["responses"].shape
    assert b["token_weight_versions"][0].tolist() == [1, 1, -1, -1, -1, 2, 2, 2]
    assert b["token_weight_versions"][1].tolist() == [2] + [-1] * 7
    assert b["token_weight_versions"][3].tolist() == [-1] * 8
    r = ragged(ts)
    assert r["response_ids"] == [t.response_ids for t in ts] and r["prompt_ids"] == [[1, 2]] * 4
    assert [len(x) for x in r["token_weight_versions"]] == [8, 1, 4, 0]  # unpadded
    assert r["token_weight_versions"][0] == b["token_weight_versions"][0].tolist()
    assert r["trainable"] == [1, 0, 1, 0] and r["rewards"] == [1.0, None, 0.0, None]
    assert r["rollout_log_probs"][0] == [-0.5, -0.5, 0.0, 0.0, 0.0, -0.5, -0.5, -0.5]
    step = StepResult(step=1, weight_version="v2", trajectories=ts, batch=b)
    assert step.ragged == r and step.rejected == []
