"""Collation invariants (hypothesis): shapes, padding sides, masks, logprobs, rewards at the last token."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentloop.batch import CollateError, collate
from agentloop.types import Trajectory, TurnRecord

PAD = 0


@st.composite
def trajectories(draw: st.DrawFn, uid: str = "t") -> Trajectory:
    """A trajectory whose response alternates model turns (mask 1) and tool segments (mask 0)."""
    prompt = draw(st.lists(st.integers(1, 500), min_size=0, max_size=12))
    segments = draw(st.lists(st.tuples(st.booleans(), st.integers(1, 6)), max_size=5))
    ids: list[int] = []
    mask: list[int] = []
    lps: list[float] = []
    turns: list[TurnRecord] = []
    for sampled, n in segments:
        toks = draw(st.lists(st.integers(1, 500), min_size=n, max_size=n))
        if sampled:
            turns.append(TurnRecord(start=len(ids), length=n, weight_version=draw(st.sampled_from(["v1", "v2"])), finish_reason={}))
            lps += draw(st.lists(st.floats(-20, 0, allow_nan=False), min_size=n, max_size=n))
        else:
            lps += [0.0] * n
        ids += toks
        mask += [int(sampled)] * n
    reward = draw(st.one_of(st.none(), st.floats(-5, 5, allow_nan=False)))
    return Trajectory(
        uid=uid, group_id=draw(st.sampled_from(["g0", "g1"])), prompt_ids=prompt, response_ids=ids,
        response_mask=mask, response_logprobs=lps, turns=turns, reward=reward,
        status=draw(st.sampled_from(["completed", "truncated", "aborted", "failed"])),
        num_turns=len(turns), weight_version=turns[-1].weight_version if turns else "",
    )


@st.composite
def batches(draw: st.DrawFn) -> list[Trajectory]:
    n = draw(st.integers(0, 6))
    return [draw(trajectories(uid=f"t{i}")) for i in range(n)]


@settings(max_examples=150, deadline=None)
@given(batches())
def test_collate_invariants(trajs: list[Trajectory]) -> None:
    b = collate(trajs, pad_token_id=PAD)
    n = len(trajs)
    p = max((len(t.prompt_ids) for t in trajs), default=0)
    r = max((len(t.response_ids) for t in trajs), default=0)
    assert b["prompts"].shape == (n, p) and b["responses"].shape == (n, r)  # the batch's own longest
    assert b["input_ids"].shape == b["attention_mask"].shape == b["position_ids"].shape == (n, p + r)
    for k in ("response_mask", "rollout_log_probs", "token_level_rewards"):
        assert b[k].shape == (n, r)
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], 1))
    for i, t in enumerate(trajs):
        np_, nr = len(t.prompt_ids), len(t.response_ids)
        # prompts left-padded, responses right-padded
        assert b["prompts"][i, p - np_:].tolist() == t.prompt_ids
        assert (b["prompts"][i, : p - np_] == PAD).all()
        assert b["responses"][i, :nr].tolist() == t.response_ids
        assert (b["responses"][i, nr:] == PAD).all()
        am = b["attention_mask"][i].tolist()
        assert am == [0] * (p - np_) + [1] * np_ + [1] * nr + [0] * (r - nr)
        # positions count real tokens from 0
        pos = b["position_ids"][i]
        real = [j for j, a in enumerate(am) if a]
        assert pos[real].tolist() == list(range(len(real)))
        # mask-1 positions hold exactly the sampled ids with their logprobs, in order
        rm = b["response_mask"][i]
        assert rm[:nr].tolist() == t.response_mask and not rm[nr:].any()
        sampled = [tok for tok, m in zip(t.response_ids, t.response_mask) if m]
        assert b["responses"][i][rm.bool()].tolist() == sampled
        want_lp = [lp for lp, m in zip(t.response_logprobs, t.response_mask) if m]
        assert b["rollout_log_probs"][i][rm.bool()].tolist() == pytest.approx(want_lp, abs=1e-5)
        assert not b["rollout_log_probs"][i][~rm.bool()].any()
        # reward sits at the last response token only
        tr = b["token_level_rewards"][i]
        reward = t.reward or 0.0
        if nr:
            assert tr[nr - 1].item() == pytest.approx(reward, abs=1e-5)
            assert not torch.cat([tr[: nr - 1], tr[nr:]]).any()
        else:
            assert not tr.any()
        assert b["rewards"][i].item() == pytest.approx(reward, abs=1e-5)
    assert b["uids"] == [t.uid for t in trajs]
    assert b["statuses"] == [t.status for t in trajs]
    assert b["turn_weight_versions"] == [t.weight_versions for t in trajs]


@settings(max_examples=40, deadline=None)
@given(batches(), st.integers(0, 4), st.integers(0, 4))
def test_pad_to_fixed_lengths(trajs: list[Trajectory], extra_p: int, extra_r: int) -> None:
    p = max((len(t.prompt_ids) for t in trajs), default=0) + extra_p
    r = max((len(t.response_ids) for t in trajs), default=0) + extra_r
    b = collate(trajs, pad_token_id=PAD, pad_to=(p, r))
    assert b["prompts"].shape == (len(trajs), p) and b["responses"].shape == (len(trajs), r)
    assert int(b["response_mask"].sum()) == sum(sum(t.response_mask) for t in trajs)


def test_pad_to_too_short_names_the_trajectory() -> None:
    t = Trajectory(uid="long-one", group_id="g", prompt_ids=[1, 2, 3], response_ids=[4, 5], response_mask=[1, 1],
                   response_logprobs=[-1.0, -1.0], turns=[TurnRecord(0, 2, "v1", {})])
    with pytest.raises(CollateError, match="long-one.*response of 2 tokens"):
        collate([t], pad_token_id=PAD, pad_to=(None, 1))
    with pytest.raises(CollateError, match="long-one.*prompt of 3 tokens"):
        collate([t], pad_token_id=PAD, pad_to=(2, None))


def test_inconsistent_trajectory_is_refused() -> None:
    t = Trajectory(uid="bad", group_id="g", prompt_ids=[1], response_ids=[4, 5], response_mask=[1],
                   response_logprobs=[-1.0, -1.0])
    with pytest.raises(CollateError, match="bad"):
        collate([t], pad_token_id=PAD)
