"""agentloop → verl: a step's trajectories as the `verl.DataProto` verl's PPO/GRPO code consumes.

`to_dataproto(result)` maps a `StepResult` (or a list of trajectories) the way verl's own agent loop
lays out its output (`verl/experimental/agent_loop/agent_loop.py`), avoiding the traps of a
hand-written mapping:

- **`uid` is the GRPO group** (agentloop's `group_id`, the prompt), not the trajectory: verl groups
  advantages on `non_tensor_batch["uid"]`. The trajectory's own uid is `trajectory_uid`.
- **Scores, not rewards**: `token_level_scores` holds the reward at the last response token; verl
  derives `token_level_rewards` from it itself (a KL penalty, or a copy). For a plain
  `compute_grpo_outcome_advantage` call pass the scores as its `token_level_rewards`.
- **Failed and aborted trajectories** (`trainable == 0`; their reward of None must not become a 0.0
  that drags their group's mean) follow `failed=`:
  `"drop"` (default) removes the rows; `"mask"` keeps them with `response_mask` all 0, score 0 and a
  `uid` of their own (`"<group>/<trajectory uid>:untrainable"`), so they join no group's mean or std
  and get advantage 0. Either way the other members' advantages are exactly those of the group
  without them. A trainable row without a reward is an error (nothing to train it towards).
- **Layout as verl builds it**: prompts left-padded, responses right-padded, `input_ids` = both,
  `attention_mask` 1 on real tokens, `position_ids` from verl's `compute_position_id_with_mask`,
  `response_mask` 1 on policy-sampled tokens, `rollout_log_probs` the engine's logprobs (for verl's
  rollout-correction / bypass mode), plus `token_weight_versions` (int per token, -1 on mask-0
  positions) and per-row `trainable`, `status`, `index_in_group`, `__num_turns__`, `tool_calls`.
- **Batch size**: `size_divisor=k` pads the rows to a multiple of k (verl needs the batch divisible
  by its data-parallel world size) with verl's own `pad_dataproto_to_divisor`. Its pad rows are
  copies of real rows, so they are neutralised here (`response_mask` 0, score 0, a `uid` of their
  own, `trainable` 0, `is_pad` True); `meta_info["pad_size"]` says how many (verl's
  `unpad_dataproto` removes them).

`AgentLoopManager` (a drop-in for verl's, in `agentloop.integrations.verl_rollout`) is re-exported here.
"""

from __future__ import annotations

from typing import Any, Literal, Sequence

import numpy as np

try:
    from verl import DataProto
    from verl.protocol import pad_dataproto_to_divisor
    from verl.utils.model import compute_position_id_with_mask
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f"agentloop.integrations.verl needs verl (pip install 'agentloop[verl]'): {e}") from e

from ..batch import collate
from ..runtime.types import StepResult
from ..types import FINISHED_OK, Trajectory

__all__ = ["AgentLoopManager", "FailedPolicy", "to_dataproto", "trajectories_to_dataproto"]

FailedPolicy = Literal["drop", "mask"]


def to_dataproto(
    result: StepResult | Sequence[Trajectory],
    *,
    failed: FailedPolicy = "drop",
    size_divisor: int = 1,
    pad_token_id: int = 0,
    pad_to: tuple[int | None, int | None] | None = None,
) -> DataProto:
    """A step's trajectories as a verl `DataProto` (see the module docstring for the layout and policies).

    `pad_to=(prompt_length, response_length)` pads to verl's fixed `rollout.prompt_length` /
    `response_length` (a longer trajectory raises `CollateError`). Raises ValueError for an unknown
    policy, a trainable trajectory without a reward, or no row left to train on.
    """
    trajectories = result.trajectories if isinstance(result, StepResult) else list(result)
    meta: dict[str, Any] = {}
    if isinstance(result, StepResult):
        meta = {"agentloop_step": result.step, "weight_version": result.weight_version}
    return trajectories_to_dataproto(trajectories, failed=failed, size_divisor=size_divisor,
                                     pad_token_id=pad_token_id, pad_to=pad_to, meta_info=meta)


def trajectories_to_dataproto(
    trajectories: Sequence[Trajectory],
    *,
    failed: FailedPolicy = "drop",
    size_divisor: int = 1,
    pad_token_id: int = 0,
    pad_to: tuple[int | None, int | None] | None = None,
    meta_info: dict[str, Any] | None = None,
) -> DataProto:
    """`to_dataproto` for a plain list of trajectories."""
    if failed not in ("drop", "mask"):
        raise ValueError(f"to_dataproto: failed must be 'drop' or 'mask', got {failed!r}")
    if not isinstance(size_divisor, int) or size_divisor < 1:
        raise ValueError(f"to_dataproto: size_divisor must be a positive int, got {size_divisor!r}")
    for t in trajectories:
        if t.status in FINISHED_OK and t.reward is None:
            raise ValueError(f"to_dataproto: trajectory {t.uid} ({t.status}) has no reward; score it (a sample "
                             "`reward`/`ground_truth`, or Runtime(reward_fn=...)) or drop it before converting")
    rows = [t for t in trajectories if t.status in FINISHED_OK] if failed == "drop" else list(trajectories)
    if not any(t.status in FINISHED_OK for t in rows):
        raise ValueError(f"to_dataproto: none of the {len(trajectories)} trajectories is trainable "
                         f"(statuses: {sorted({t.status for t in trajectories})})")
    b = collate(rows, pad_token_id=pad_token_id, pad_to=pad_to)
    trainable = b["trainable"]
    keep = trainable.unsqueeze(1)
    scores = b["token_level_rewards"] * keep
    uids = [t.group_id if ok else f"{t.group_id}/{t.uid}:untrainable" for t, ok in zip(rows, trainable.tolist())]
    tensors = {
        "prompts": b["prompts"],
        "responses": b["responses"],
        "input_ids": b["input_ids"],
        "attention_mask": b["attention_mask"],
        "position_ids": compute_position_id_with_mask(b["attention_mask"]),
        "response_mask": b["response_mask"] * keep,
        "rollout_log_probs": b["rollout_log_probs"] * keep,
        "token_level_scores": scores,
        "token_weight_versions": b["token_weight_versions"],
    }
    non_tensors = {
        "uid": _objects(uids),
        "trajectory_uid": _objects(b["uids"]),
        "index_in_group": np.array(b["index_in_group"], dtype=np.int64),
        "status": _objects(b["statuses"]),
        "trainable": trainable.numpy().astype(np.int64),
        "is_pad": np.zeros(len(rows), dtype=bool),
        "__num_turns__": np.array(b["num_turns"], dtype=np.int32),
        "tool_calls": np.array(b["tool_calls"], dtype=np.int64),
        "weight_version": _objects(b["weight_versions"]),
    }
    meta = {**(meta_info or {}), "failed_policy": failed, "dropped": len(trajectories) - len(rows)}
    data = DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta)
    data, pad_size = pad_dataproto_to_divisor(data, size_divisor)
    if pad_size:
        _neutralise_tail(data, pad_size)
    data.meta_info["pad_size"] = pad_size
    return data


def _objects(values: Sequence[Any]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = list(values)
    return out


def _neutralise_tail(data: DataProto, pad_size: int) -> None:
    """verl pads with copies of real rows; make the copies weightless and groupless."""
    for key in ("response_mask", "token_level_scores", "rollout_log_probs"):
        data.batch[key][-pad_size:] = 0
    nt = data.non_tensor_batch
    n = len(data)
    nt["uid"][-pad_size:] = [f"agentloop-pad-{k}" for k in range(pad_size)]
    nt["trainable"][-pad_size:] = 0
    nt["is_pad"][n - pad_size:] = True


from .verl_rollout import AgentLoopManager  # noqa: E402  (the drop-in uses the converters above)
