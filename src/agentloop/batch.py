"""Trajectories → the padded tensor batch a PPO/GRPO trainer consumes (the data contract of `RolloutBatch`).

This module owns collation only. Layout, for B trajectories, P = longest prompt, R = longest
response (or the `pad_to` lengths):

- `prompts`  [B, P]  prompt ids, **left**-padded (so every prompt ends at column P-1),
- `responses` [B, R] response ids, **right**-padded (so every response starts at column P of input_ids),
- `input_ids` [B, P+R] = prompts ‖ responses,
- `attention_mask` [B, P+R] 1 on real tokens, 0 on padding,
- `position_ids` [B, P+R] 0,1,2,... over real tokens (left padding gets 0, right padding repeats the last),
- `response_mask` [B, R] 1 where the policy sampled the token, 0 on tool/user/template tokens and padding,
- `rollout_log_probs` [B, R] the engine's logprob of each sampled token, 0 elsewhere,
- `token_level_rewards` [B, R] the trajectory's reward at its last response token, 0 elsewhere,
- `rewards` [B] the scalar reward (0 where none),
- `trainable` [B] 1 for a trajectory that ran to its end (completed or truncated), 0 for a failed or
  aborted one: a failed trajectory's reward of None shows up as 0.0 in `rewards`, so a trainer must
  drop or mask the rows with `trainable == 0` (the verl/TRL adapters in `agentloop.integrations` do),
- `token_weight_versions` [B, R] the weight version that sampled each mask-1 token, as an int (see
  `weight_version_number`), -1 on mask-0 tokens and padding (a partial rollout can mix versions),

plus per-sample lists (uids, group_ids, statuses, ...). `ragged` gives the same data unpadded, one
list per trajectory. The mask-1 tokens are copied verbatim from the trajectories: nothing is decoded
or re-tokenized here.
"""

from __future__ import annotations

import re
from itertools import chain
from typing import Any, Iterable, Sequence, TypedDict

import numpy as np
import torch

from .types import FINISHED_OK, Trajectory

__all__ = ["CollateError", "RaggedBatch", "RolloutBatch", "collate", "ragged", "token_weight_versions", "weight_version_number"]


class CollateError(ValueError):
    """The trajectories cannot be collated (inconsistent lengths, longer than `pad_to`, ...)."""


_TRAILING_INT = re.compile(r"(\d+)$")


def weight_version_number(version: str) -> int:
    """A weight version as an int: its trailing number ("v3" -> 3, "step-12" -> 12, "7" -> 7); a version
    without one ("default": the weights the server started with) is 0. Versions agentloop assigns are
    "v1", "v2", ... in load order; give your own versions a trailing step number to keep them ordered."""
    m = _TRAILING_INT.search(version or "")
    return int(m.group(1)) if m else 0


def token_weight_versions(t: Trajectory) -> list[int]:
    """Per response token: the number of the weight version that sampled it (its turn's), -1 on mask-0 tokens."""
    out = [-1] * len(t.response_ids)
    for turn in t.turns:
        v = weight_version_number(turn.weight_version)
        out[turn.start:turn.start + turn.length] = [v] * turn.length
    return out


class RaggedBatch(TypedDict):
    """The step's data without padding: one list per trajectory, row-aligned with `RolloutBatch`."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    response_mask: list[list[int]]  #: 1 = sampled by the policy
    rollout_log_probs: list[list[float]]  #: the engine's logprobs at mask-1 positions, 0.0 elsewhere
    token_weight_versions: list[list[int]]  #: see `token_weight_versions`
    rewards: list[float | None]  #: None where the trajectory was not scored
    trainable: list[int]  #: 1 = completed/truncated, 0 = failed/aborted
    uids: list[str]
    group_ids: list[str]
    index_in_group: list[int]
    statuses: list[str]


def ragged(trajectories: Sequence[Trajectory]) -> RaggedBatch:
    """The trajectories as unpadded per-trajectory lists (copies: editing them leaves the trajectories alone)."""
    return RaggedBatch(
        prompt_ids=[list(t.prompt_ids) for t in trajectories],
        response_ids=[list(t.response_ids) for t in trajectories],
        response_mask=[list(t.response_mask) for t in trajectories],
        rollout_log_probs=[[lp if m else 0.0 for lp, m in zip(t.response_logprobs, t.response_mask)] for t in trajectories],
        token_weight_versions=[token_weight_versions(t) for t in trajectories],
        rewards=[t.reward for t in trajectories],
        trainable=[int(t.status in FINISHED_OK) for t in trajectories],
        uids=[t.uid for t in trajectories],
        group_ids=[t.group_id for t in trajectories],
        index_in_group=[t.index_in_group for t in trajectories],
        statuses=[t.status for t in trajectories],
    )


class RolloutBatch(TypedDict):
    """The hand-off to the trainer. Tensors are row-aligned with the per-sample lists."""

    prompts: torch.Tensor  #: [B, P] long, left-padded with pad_token_id
    responses: torch.Tensor  #: [B, R] long, right-padded with pad_token_id
    input_ids: torch.Tensor  #: [B, P+R] long
    attention_mask: torch.Tensor  #: [B, P+R] long, 1 = real token
    position_ids: torch.Tensor  #: [B, P+R] long
    response_mask: torch.Tensor  #: [B, R] long, 1 = token sampled by the policy (train on these)
    rollout_log_probs: torch.Tensor  #: [B, R] float32, engine logprobs at mask-1 positions, else 0
    token_level_rewards: torch.Tensor  #: [B, R] float32, reward at the last response token
    rewards: torch.Tensor  #: [B] float32, scalar reward per trajectory (0.0 where None)
    trainable: torch.Tensor  #: [B] long, 1 = completed/truncated, 0 = failed/aborted (drop or mask these rows)
    token_weight_versions: torch.Tensor  #: [B, R] long, weight version number of each mask-1 token, else -1
    prompt_lengths: torch.Tensor  #: [B] long
    response_lengths: torch.Tensor  #: [B] long
    uids: list[str]
    group_ids: list[str]
    index_in_group: list[int]
    statuses: list[str]
    finish_reasons: list[str]
    num_turns: list[int]
    tool_calls: list[int]
    weight_versions: list[str]  #: the trajectory's (last) weight version
    turn_weight_versions: list[list[str]]  #: weight version of each model turn (partial rollouts can mix)
    errors: list[str | None]


def _flat(rows: Iterable[Sequence[Any]], dtype: type) -> np.ndarray:
    """The rows' values end to end as one array (numpy converts a list of Python numbers ~3x faster than
    `torch.tensor` does, to the same values: ints exact, floats rounded to float32 alike)."""
    return np.array(list(chain.from_iterable(rows)), dtype=dtype)


def collate(
    trajectories: Sequence[Trajectory],
    *,
    pad_token_id: int,
    pad_to: tuple[int | None, int | None] | None = None,
) -> RolloutBatch:
    """Pad `trajectories` into a `RolloutBatch`.

    Pads to the batch's own longest prompt and response; `pad_to=(prompt_len, response_len)` pads to
    fixed lengths instead (either may be None = batch longest) and raises `CollateError` if a
    trajectory is longer. Each trajectory's invariants are checked first.
    """
    if not isinstance(pad_token_id, int):
        raise CollateError(f"pad_token_id must be an int, got {pad_token_id!r}")
    for t in trajectories:
        try:
            t.check_invariants()
        except ValueError as e:
            raise CollateError(f"cannot collate: {e}") from None
    b = len(trajectories)
    p_len = max((len(t.prompt_ids) for t in trajectories), default=0)
    r_len = max((len(t.response_ids) for t in trajectories), default=0)
    if pad_to is not None:
        want_p, want_r = pad_to
        if want_p is not None:
            if p_len > want_p:
                uid = next(t.uid for t in trajectories if len(t.prompt_ids) == p_len)
                raise CollateError(f"trajectory {uid}: prompt of {p_len} tokens is longer than pad_to prompt length {want_p}")
            p_len = want_p
        if want_r is not None:
            if r_len > want_r:
                uid = next(t.uid for t in trajectories if len(t.response_ids) == r_len)
                raise CollateError(f"trajectory {uid}: response of {r_len} tokens is longer than pad_to response length {want_r}")
            r_len = want_r

    # The whole batch is assembled in numpy and handed over as tensors at the end: one array per field,
    # filled through a padding mask (row-major order = each row's tokens in order). Per-row torch calls
    # cost ~0.1 ms a row, and torch's intra-op threads spin on the large ops (CPU time the client pays).
    p_lens = np.array([len(t.prompt_ids) for t in trajectories], dtype=np.int64)
    r_lens = np.array([len(t.response_ids) for t in trajectories], dtype=np.int64)
    prompt_at = np.arange(p_len)[None, :] >= (p_len - p_lens)[:, None]  # left padding
    response_at = np.arange(r_len)[None, :] < r_lens[:, None]  # right padding

    prompts = np.full((b, p_len), pad_token_id, dtype=np.int64)
    prompts[prompt_at] = _flat((t.prompt_ids for t in trajectories), np.int64)
    responses = np.full((b, r_len), pad_token_id, dtype=np.int64)
    responses[response_at] = _flat((t.response_ids for t in trajectories), np.int64)
    flat_mask = _flat((t.response_mask for t in trajectories), np.int64)
    response_mask = np.zeros((b, r_len), dtype=np.int64)
    response_mask[response_at] = flat_mask
    # logprobs only where sampled: mask-0 positions may carry placeholders in the trajectory
    logprobs = np.zeros((b, r_len), dtype=np.float32)
    logprobs[response_at] = _flat((t.response_logprobs for t in trajectories), np.float32) * flat_mask.astype(np.float32)
    versions = np.full((b, r_len), -1, dtype=np.int64)
    versions[response_at] = _flat((token_weight_versions(t) for t in trajectories), np.int64)
    rewards = np.array([float(t.reward) if t.reward is not None else 0.0 for t in trajectories], dtype=np.float32)
    token_rewards = np.zeros((b, r_len), dtype=np.float32)
    rows = np.flatnonzero(r_lens > 0)
    token_rewards[rows, r_lens[rows] - 1] = rewards[rows]

    attention_mask = np.concatenate([prompt_at, response_at], axis=1).astype(np.int64)
    # Positions count real tokens only; left padding gets 0 (as HF/verl do for left-padded prompts).
    position_ids = np.maximum(np.cumsum(attention_mask, axis=1) - 1, 0)
    trainable = np.array([int(t.status in FINISHED_OK) for t in trajectories], dtype=np.int64)
    t_ = torch.from_numpy
    return RolloutBatch(
        prompts=t_(prompts),
        responses=t_(responses),
        input_ids=t_(np.concatenate([prompts, responses], axis=1)),
        attention_mask=t_(attention_mask),
        position_ids=t_(position_ids),
        response_mask=t_(response_mask),
        rollout_log_probs=t_(logprobs),
        token_level_rewards=t_(token_rewards),
        rewards=t_(rewards),
        trainable=t_(trainable),
        token_weight_versions=t_(versions),
        prompt_lengths=t_(p_lens),
        response_lengths=t_(r_lens),
        uids=[t.uid for t in trajectories],
        group_ids=[t.group_id for t in trajectories],
        index_in_group=[t.index_in_group for t in trajectories],
        statuses=[t.status for t in trajectories],
        finish_reasons=[t.finish_reason for t in trajectories],
        num_turns=[t.num_turns for t in trajectories],
        tool_calls=[t.tool_calls for t in trajectories],
        weight_versions=[t.weight_version for t in trajectories],
        turn_weight_versions=[t.weight_versions for t in trajectories],
        errors=[t.error for t in trajectories],
    )


def batch_summary(batch: RolloutBatch) -> dict[str, Any]:
    """Shapes and token counts of a batch, for logs."""
    return {
        "size": len(batch["uids"]),
        "prompt_length": int(batch["prompts"].shape[1]),
        "response_length": int(batch["responses"].shape[1]),
        "sampled_tokens": int(batch["response_mask"].sum()),
    }
