"""A drop-in for verl 0.9's `AgentLoopManager`: verl's trainer, verl's servers, agentloop's agent loops.

Select it in a verl config with
`actor_rollout_ref.rollout.agent.agent_loop_manager_class=agentloop.integrations.verl.AgentLoopManager`
(verl's `RayPPOTrainer` loads that class and calls `create(config=, llm_client=, teacher_client=,
reward_loop_worker_handles=)` and then `generate_sequences(batch)` once per step).

What it replaces: verl's `AgentLoopWorker`s and their agent loops — the multi-turn tool loop,
tokenization (agentloop's token buffer: model tokens verbatim, tool turns as chat-template deltas),
tool calling (agentloop's parsers and the verl-style tool YAML of `rollout.multi_turn.tool_config_path`),
per-trajectory timeouts and failure isolation (agentloop's `Scheduler`). Generation still goes through
verl's `LLMServerClient` (`VerlServerEngine` below), so verl's load balancer and sticky sessions apply.

What it does not replace: verl's server launch (`LLMServerManager`), weight sync and sleep/wake
(`CheckpointEngineManager.update_weights` wakes the replicas before `generate_sequences`,
`sleep_replicas` puts them to sleep after — agentloop's `Lifecycle` is held AWAKE here and never
wakes or sleeps verl's servers), the reward model, advantages and the actor update. Aborting a stopped
trajectory's in-flight request on the server is not possible through `LLMServerClient`; a timed-out
trajectory's request is cancelled client-side only.

Output: row-aligned with the input batch (verl unions them), laid out as verl's `_postprocess` does
(prompts/responses padded to `rollout.prompt_length`/`response_length`, `rm_scores` at the last
response token when rewards were computed). A failed or aborted trajectory cannot be dropped (the
batch must stay aligned) nor regrouped (verl asserts `uid` unchanged), so it gets `response_mask`
all 0 and, as score, the mean of its group's scored members: the group's mean baseline is unchanged
and the failed row gets advantage 0; with `norm_adv_by_std_in_grpo` the group's std is taken over that
extra value at the mean. For exact exclusion use `to_dataproto` in your own loop.

Rewards: with verl's `reward_loop_worker_handles` each finished trajectory is scored by verl's reward
loop (`compute_score.remote`, as verl's agent loop does); without them, by agentloop's reward
function named in `rollout.agent.agentloop.scheduler.reward` for rows with a `reward_model.ground_truth`.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from verl import DataProto
from verl.utils.model import compute_position_id_with_mask
from verl.utils.ray_utils import auto_await

from ..batch import collate
from ..agents.base import AgentConfig
from ..config.scheduler import SchedulerConfig
from ..engine.base import EngineError, GenerateOutput, SamplingParams
from ..engine.lifecycle import Lifecycle
from ..engine.router import Router
from ..scheduler.core import Scheduler
from ..types import FINISHED_OK, Sample, Trajectory

log = logging.getLogger(__name__)

__all__ = ["AgentLoopManager", "VerlServerEngine"]


def _cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    """`cfg.key` for an OmegaConf DictConfig, a dict or an object; `default` when absent or None."""
    value = cfg.get(key, None) if hasattr(cfg, "get") else getattr(cfg, key, None)
    return default if value is None else value


class VerlServerEngine:
    """agentloop's `EngineClient` over verl's `LLMServerClient`: generation only (see the module docstring)."""

    def __init__(self, llm_client: Any, *, url: str = "verl://llm-servers") -> None:
        self.llm_client = llm_client
        self.url = url

    async def generate(self, input_ids: Sequence[int], sampling_params: SamplingParams, *, rid: str | None = None,
                       return_logprob: bool = True, timeout: float | None = None,
                       priority: int | None = None) -> GenerateOutput:
        # verl's LLMServerClient.generate takes no request priority: scheduler.server_priority has no effect here
        params = {**sampling_params.to_json(), "logprobs": True}
        rid = rid or "agentloop"
        out = await self.llm_client.generate(rid, prompt_ids=list(input_ids), sampling_params=params)
        ids = list(out.token_ids)
        if out.log_probs is None or len(out.log_probs) != len(ids):
            raise EngineError("/generate", None, f"verl server returned {len(ids)} tokens but "
                              f"{None if out.log_probs is None else len(out.log_probs)} logprobs", url=self.url)
        if out.stop_reason == "aborted":
            finish: dict[str, Any] = {"type": "abort", "message": "aborted by verl's server"}
        elif len(ids) >= sampling_params.max_new_tokens:
            finish = {"type": "length", "length": len(ids)}
        else:
            finish = {"type": "stop", "matched": ids[-1] if ids else None}
        version = str(out.extra_fields.get("global_steps", "")) if out.extra_fields else ""
        return GenerateOutput(ids, [float(x) for x in out.log_probs], finish, version, rid,
                              prompt_tokens=len(input_ids), completion_tokens=len(ids), server_url=self.url)

    async def _not_ours(self, *args: Any, **kwargs: Any) -> Any:
        raise EngineError("lifecycle", None, "verl's CheckpointEngineManager owns its servers' memory and weights",
                          url=self.url)

    release_memory_occupation = resume_memory_occupation = _not_ours
    update_weights_from_disk = update_weights_from_tensor = pause_generation = continue_generation = _not_ours

    async def flush_cache(self) -> bool:
        return True

    async def abort_request(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        return None  # LLMServerClient has no abort; the scheduler cancels the call client-side

    async def health(self) -> bool:
        return True

    async def model_info(self) -> dict[str, Any]:
        return {}

    async def server_info(self) -> dict[str, Any]:
        return {}

    async def close(self) -> None:
        return None


class AgentLoopManager:
    """verl's `AgentLoopManager` interface (`create`, `generate_sequences`) over agentloop's scheduler."""

    def __init__(self, config: Any, llm_client: Any, teacher_client: Any = None,
                 reward_loop_worker_handles: list[Any] | None = None, *, tokenizer: Any = None, tools: Any = None) -> None:
        if teacher_client is not None:
            # A configuration agentloop refuses, not a missing piece: on-policy distillation needs the teacher's
            # logprobs on every rollout token, which this manager's trajectories do not carry.
            raise ValueError("AgentLoopManager(teacher_client=...): agentloop's AgentLoopManager does not support "
                             "verl's on-policy distillation (a teacher model scoring the rollouts); turn distillation "
                             "off in the verl config, or use verl's own AgentLoopManager for that run")
        self.config = config
        rollout = config.actor_rollout_ref.rollout
        self.prompt_length = int(rollout.prompt_length)
        self.response_length = int(rollout.response_length)
        self.reward_workers = list(reward_loop_worker_handles or [])
        self._next_worker = 0
        own = _cfg_get(_cfg_get(rollout, "agent", {}), "agentloop", {})
        own = dict(own) if own else {}
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(config.actor_rollout_ref.model.path))
        self.tokenizer = tokenizer
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        if tools is None:
            from ..tools.registry import ToolRegistry

            path = _cfg_get(_cfg_get(rollout, "multi_turn", {}), "tool_config_path")
            if path:
                tools = ToolRegistry.from_yaml(str(path))
            else:
                from ..tools.builtin import CalculatorTool

                tools = ToolRegistry([CalculatorTool()])
        self.tools = tools
        multi_turn = _cfg_get(rollout, "multi_turn", {})
        base = {
            "max_assistant_turns": int(_cfg_get(multi_turn, "max_assistant_turns", 8)),
            "max_response_tokens": self.response_length,
            "max_new_tokens_per_turn": self.response_length,
            "max_context_tokens": self.prompt_length + self.response_length,
            **dict(own.get("agent", {}) or {}),
        }
        # verl's rollout sampling, under what the agentloop section's agent.sampling sets (merged per key).
        own_sampling = base.get("sampling") or {}
        if isinstance(own_sampling, Mapping):  # anything else: AgentConfig refuses it, naming agent.sampling
            base["sampling"] = {"temperature": float(_cfg_get(rollout, "temperature", 1.0)),
                                "top_p": float(_cfg_get(rollout, "top_p", 1.0)),
                                "top_k": int(_cfg_get(rollout, "top_k", -1)), **dict(own_sampling)}
        val = _cfg_get(rollout, "val_kwargs", {})
        self.settings = {
            False: AgentConfig.model_validate(base),
            True: AgentConfig.model_validate({**base, "sampling": {
                **base["sampling"], "temperature": float(_cfg_get(val, "temperature", 0.0)),
                "top_p": float(_cfg_get(val, "top_p", 1.0)), "top_k": int(_cfg_get(val, "top_k", -1))}}),
        }
        # verl repeats each prompt n times itself: every row is one trajectory (n=1 here).
        scfg = SchedulerConfig.model_validate({"reward": None, **dict(own.get("scheduler", {}) or {}), "n": 1})
        self.lifecycle = Lifecycle([VerlServerEngine(llm_client)], awake=True)  # verl wakes and sleeps its servers
        self.router = Router(self.lifecycle, per_server_limit=None, request_timeout=None)
        reward_fn = self._verl_reward if self.reward_workers else None
        self.schedulers = {
            validate: Scheduler(self.router, tokenizer=tokenizer, agent_config=s, config=scfg,
                                tools=tools, default_agent=s.agent, reward_fn=reward_fn)
            for validate, s in self.settings.items()
        }

    @classmethod
    @auto_await
    async def create(cls, *args: Any, **kwargs: Any) -> "AgentLoopManager":
        return cls(*args, **kwargs)

    @auto_await
    async def generate_sequences(self, prompts: DataProto) -> DataProto:
        """One trajectory per row of `prompts` (verl already repeated each prompt `rollout.n` times;
        rows sharing `uid` form a GRPO group); returns verl's agent-loop output layout."""
        validate = bool(prompts.meta_info.get("validate", False))
        samples = rows_to_samples(prompts)
        t0 = time.monotonic()
        res = await self.schedulers[validate].run(samples)
        by_uid = {t.uid: t for t in res.trajectories}
        missing = [s.uid for s in samples if s.uid not in by_uid]
        if missing:  # nothing stops this run early, so every row must have come back
            raise RuntimeError(f"agentloop: rows {missing[:5]} produced no trajectory")
        trajs = [by_uid[s.uid] for s in samples]
        out = self._to_verl_output(trajs)
        out.meta_info["timing"] = {"agent_loop/agentloop/seconds": time.monotonic() - t0,
                                   **{f"agent_loop/agentloop/{k}": float(v) for k, v in res.metrics.items()
                                      if isinstance(v, (int, float)) and not isinstance(v, bool)}}
        return out

    async def _verl_reward(self, trajectory: Trajectory, sample: Sample) -> float | None:
        """Score through verl's reward loop workers (round robin), as verl's agent loop does."""
        worker = self.reward_workers[self._next_worker % len(self.reward_workers)]
        self._next_worker += 1
        data = single_row_dataproto(trajectory, sample.extra.get("verl_row", {}))
        result = await worker.compute_score.remote(data)
        trajectory.extra["reward_extra_info"] = result.get("reward_extra_info", {})
        return result["reward_score"]

    def _to_verl_output(self, trajs: list[Trajectory]) -> DataProto:
        b = collate(trajs, pad_token_id=self.pad_token_id, pad_to=(self.prompt_length, self.response_length))
        trainable = b["trainable"]
        tensors = {
            "prompts": b["prompts"], "responses": b["responses"], "input_ids": b["input_ids"],
            "attention_mask": b["attention_mask"], "position_ids": compute_position_id_with_mask(b["attention_mask"]),
            "response_mask": b["response_mask"] * trainable.unsqueeze(1),
            "rollout_log_probs": b["rollout_log_probs"] * trainable.unsqueeze(1),
            "token_weight_versions": b["token_weight_versions"],
        }
        meta: dict[str, Any] = {"metrics": [{"generate_sequences": t.metrics.get("generate_seconds", 0.0),
                                             "tool_calls": t.metrics.get("tool_seconds", 0.0),
                                             "compute_score": t.metrics.get("reward_seconds", 0.0),
                                             "num_preempted": -1} for t in trajs]}
        scored = [t.reward is not None for t in trajs if t.status in FINISHED_OK]
        if scored and all(scored):
            scores = group_mean_filled_scores(trajs)
            rm = torch.zeros_like(b["response_mask"], dtype=torch.float32)
            last = (b["attention_mask"][:, self.prompt_length:].sum(-1) - 1).clamp(min=0)
            rm[torch.arange(len(trajs)), last] = torch.tensor(scores, dtype=torch.float32)
            tensors["rm_scores"] = rm
            meta["reward_extra_keys"] = []
        elif any(scored):
            unscored = [t.uid for t in trajs if t.status in FINISHED_OK and t.reward is None]
            raise ValueError(f"agentloop: some finished trajectories have no reward ({unscored[:5]}): "
                             "give every row a ground truth, or none")
        non_tensors = {
            "__num_turns__": np.array(b["num_turns"], dtype=np.int32),
            "agentloop_status": np.array(b["statuses"], dtype=object),
            "agentloop_trainable": trainable.numpy().astype(np.int64),
            "agentloop_tool_calls": np.array(b["tool_calls"], dtype=np.int64),
        }
        return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta)


#: verl's registered agent loops -> agentloop's (a row's `agent_name`); other names are agentloop registry names.
VERL_AGENTS = {"single_turn_agent": "single_turn", "tool_agent": "tool"}


def rows_to_samples(prompts: DataProto) -> list[Sample]:
    """verl rows (`raw_prompt` messages, `uid`, `reward_model.ground_truth`, ...) → agentloop group members."""
    nt = prompts.non_tensor_batch
    if "raw_prompt" not in nt:
        raise ValueError("agentloop's AgentLoopManager needs the chat messages: set data.return_raw_chat=True "
                         "(non_tensor_batch['raw_prompt'] is missing)")
    n = len(prompts)
    uids = nt["uid"] if "uid" in nt else np.array([f"row{i}" for i in range(n)], dtype=object)
    seen: dict[str, int] = {}
    out: list[Sample] = []
    for i in range(n):
        row = {k: v[i] for k, v in nt.items()}
        group = str(uids[i])
        k = seen.get(group, 0)
        seen[group] = k + 1
        messages = row["raw_prompt"]
        messages = list(messages.tolist() if isinstance(messages, np.ndarray) else messages)
        reward_model = row.get("reward_model") or {}
        gt = reward_model.get("ground_truth") if isinstance(reward_model, Mapping) else None
        agent = row.get("agent_name")
        out.append(Sample(uid=f"{group}#{k}", group_id=group, index_in_group=k, messages=messages,
                          agent=VERL_AGENTS.get(str(agent), str(agent)) if agent is not None else None,
                          ground_truth=gt, extra={"verl_row": row}))
    return out


def group_mean_filled_scores(trajs: Sequence[Trajectory]) -> list[float]:
    """Each trajectory's reward; a failed/aborted one gets its group's mean over the scored members (0 if none)."""
    sums: dict[str, list[float]] = {}
    for t in trajs:
        if t.status in FINISHED_OK and t.reward is not None:
            sums.setdefault(t.group_id, []).append(float(t.reward))
    return [float(t.reward) if t.status in FINISHED_OK and t.reward is not None
            else (sum(sums[t.group_id]) / len(sums[t.group_id]) if sums.get(t.group_id) else 0.0) for t in trajs]


def _one_object(value: Any) -> np.ndarray:
    out = np.empty(1, dtype=object)
    out[0] = value  # a list value stays one element (np.array would make it a dimension)
    return out


def single_row_dataproto(t: Trajectory, row: Mapping[str, Any]) -> DataProto:
    """One finished trajectory in the shape verl's reward loop scores (unpadded, as verl's agent loop sends it)."""
    prompts = torch.tensor([t.prompt_ids], dtype=torch.long)
    responses = torch.tensor([t.response_ids], dtype=torch.long)
    input_ids = torch.cat([prompts, responses], 1)
    attention_mask = torch.ones_like(input_ids)
    tensors = {"prompts": prompts, "responses": responses, "input_ids": input_ids, "attention_mask": attention_mask,
               "position_ids": compute_position_id_with_mask(attention_mask)}
    non_tensors = {**{k: _one_object(v) for k, v in row.items()},
                   "__num_turns__": np.array([t.num_turns]), "tool_extra_fields": np.array([{}], dtype=object),
                   "prompt_len": np.array([len(t.prompt_ids)]), "response_len": np.array([len(t.response_ids)])}
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)
