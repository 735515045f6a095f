"""`StreamBatches`: complete groups made into the trainer's `StreamBatch` — rows in group order, padded
tensors, the staleness histogram of the mask-1 tokens (versions behind the served one), numbered."""

from __future__ import annotations

from agentloop.runtime.stream_batches import StreamBatches
from agentloop.scheduler.staleness import VersionLog
from agentloop.types import Trajectory, TurnRecord


def traj(uid: str, versions: list[str], tokens: int = 2) -> Trajectory:
    """A completed trajectory of one model turn per version (`tokens` sampled each), a tool token between."""
    t = Trajectory(uid=uid, group_id=uid.split("_")[0], prompt_ids=[1, 2])
    for k, v in enumerate(versions):
        if k:
            t.response_ids.append(9)
            t.response_mask.append(0)
            t.response_logprobs.append(0.0)
        start = len(t.response_ids)
        t.response_ids += [3] * tokens
        t.response_mask += [1] * tokens
        t.response_logprobs += [-0.5] * tokens
        t.turns.append(TurnRecord(start=start, length=tokens, weight_version=v, finish_reason={"type": "stop"}))
    t.status, t.reward = "completed", 1.0
    return t


def test_batches_are_numbered_padded_and_count_trained_tokens_by_staleness() -> None:
    log = VersionLog()
    for v in ("v0", "v1", "v2"):
        log.observe(v)
    batches = StreamBatches(log, pad_token_id=0, pad_to=None)
    groups = [[traj("a_0", ["v2"]), traj("a_1", ["v0", "v2"])], [traj("b_0", ["v1", "v1"], tokens=3)]]
    b = batches.make(groups, "v2", in_flight=5, buffered_groups=1)
    assert b.index == batches.count == 1 and b.weight_version == "v2" and b.groups is groups
    assert [r.uid for r in b.trajectories] == ["a_0", "a_1", "b_0"]  # group order, members in order
    # a_0: 2 tokens of v2 (0 behind); a_1: 2 of v0 (2 behind) + 2 of v2; b_0: 6 of v1 (1 behind)
    assert b.staleness == {0: 4, 1: 6, 2: 2}
    assert b.metrics == {"groups": 2, "trained_tokens": 12, "in_flight": 5, "buffered_groups": 1}
    mask = b.batch["response_mask"]
    assert int(mask.sum()) == 12 and tuple(mask.shape) == (3, 7)  # padded to the longest response (b_0's)
    assert batches.make([groups[1]], "v2", in_flight=0, buffered_groups=0).index == 2
