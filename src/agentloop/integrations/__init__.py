"""Adapters from agentloop's step output to the trainers people use.

- `agentloop.integrations.verl` (extra `agentloop[verl]`): `to_dataproto(step_result)` builds a real
  `verl.DataProto` (uid = GRPO group, `token_level_scores`, verl's attention/position layout, failed
  trajectories dropped or masked, padded to a divisor with verl's `pad_dataproto_to_divisor`), and
  `AgentLoopManager`, a drop-in for verl's agent-loop manager (`verl_rollout`).
- `agentloop.integrations.trl` (extra `agentloop[trl]`): `AgentloopRollout`, a `rollout_func` for
  TRL's `GRPOTrainer` that runs agentloop's multi-turn tool rollouts with the trainer's weights.

Each imports its trainer package, so import the one you use; `docs/trainers.md` shows all three ways in.
"""
