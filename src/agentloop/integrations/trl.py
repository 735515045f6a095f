"""agentloop as TRL's `rollout_func`: multi-turn tool-calling rollouts for `trl.GRPOTrainer` (TRL 1.16).

TRL's contract (`GRPOTrainer(rollout_func=...)`, `_generate` in `trl/trainer/grpo_trainer.py`): the
function gets this process's prompts (each prompt already repeated `num_generations` times in a row
by TRL's sampler) and the trainer, and returns one completion per prompt entry as a dict with
`prompt_ids`, `completion_ids` and `logprobs` (lists of per-row lists); any other key is forwarded to
the reward functions, except `env_mask`, which TRL takes as the tool mask (1 = model token, 0 =
external token): the loss mask is `completion_mask * env_mask`.

`AgentloopRollout` is that function. Each call is one `Runtime.step`: the trainer's current weights
(its model's state dict, version `step-<global_step>`) go through agentloop's staged wake-up (resume
weight memory → load → resume KV cache), every prompt entry runs agentloop's tool loop, and the engine
sleeps again before TRL computes its loss. It returns:

- `prompt_ids`: the chat-templated prompt of each trajectory (with the tool schemas it was rendered with),
- `completion_ids`: the whole multi-turn response (model turns, tool results, template tokens), verbatim,
- `logprobs`: the engine's logprob of each model token, 0.0 on tool/template tokens,
- `env_mask`: agentloop's `response_mask` — tool results and template tokens are 0, out of the loss,
- `agentloop_trajectory`, `agentloop_status`, `agentloop_tool_calls`: for reward functions and logs.

Rows keep TRL's order and grouping (rows `k*G .. k*G+G-1` are one GRPO group). A failed or aborted
trajectory gets `env_mask` all 0 (no gradient) and the reward functions from `reward_func` return None
for it; TRL 1.16 treats a row whose rewards are all None as unscorable: left out of its group's mean and
std, advantage 0. A trajectory that failed before producing any token gets one EOS token (masked 0),
since TRL needs a non-empty completion.

Rewards: TRL hands reward functions the dataset's columns (e.g. `ground_truth`), which a rollout
function never sees; `AgentloopRollout.reward_func("arithmetic")` is a TRL reward function that scores
each trajectory with agentloop's registered reward function and that column.

Limits: one process (no `accelerate` data parallelism: each process would need its own engines); the
rollout sampling temperature (`Runtime` config `agent.sampling.temperature`) must equal `GRPOConfig.temperature`
(TRL scales its logits by it), checked at the first call.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

try:
    import trl  # noqa: F401  (the integration targets trl's GRPOTrainer)
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f"agentloop.integrations.trl needs trl (pip install 'agentloop[trl]'): {e}") from e

from .. import rewards
from ..engine.lifecycle import Weights
from ..runtime.core import Runtime
from ..runtime.types import StepResult
from ..types import FINISHED_OK, Sample, Trajectory

log = logging.getLogger(__name__)

__all__ = ["AgentloopRollout"]


class AgentloopRollout:
    """A `rollout_func` for `trl.GRPOTrainer` that owns (or borrows) an agentloop `Runtime`.

        with AgentloopRollout({"scheduler": {"concurrency": 32}}) as rollout:
            trainer = GRPOTrainer(model=..., args=GRPOConfig(...), train_dataset=ds,
                                  reward_funcs=[rollout.reward_func("arithmetic")], rollout_func=rollout)
            trainer.train()

    `tools` (OpenAI function schemas) are given to every prompt (None: the runtime's agent decides,
    e.g. the calculator for the shipped tiny model); `step_kwargs` go to every `Runtime.step`
    (scheduler overrides such as `trajectory_timeout`). `last_result` is the latest `StepResult`.
    """

    def __init__(self, runtime: Runtime | Mapping[str, Any] | None = None, *, tools: list[dict[str, Any]] | None = None,
                 **step_kwargs: Any) -> None:
        self._own = not isinstance(runtime, Runtime)
        self.runtime = runtime if isinstance(runtime, Runtime) else Runtime(runtime)
        self.tools = tools
        self.step_kwargs = step_kwargs
        self.last_result: StepResult | None = None
        self.calls = 0
        if "target_groups" in step_kwargs or "group_filter" in step_kwargs:
            raise ValueError("AgentloopRollout: TRL needs one completion per prompt entry; target_groups and "
                             "group_filter (which return fewer) cannot be used here")

    # ------------------------------------------------------------------ lifetime
    def start(self) -> "AgentloopRollout":
        self.runtime.start_sync()
        return self

    def close(self) -> None:
        if self._own:
            self.runtime.stop_sync()

    def __enter__(self) -> "AgentloopRollout":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the rollout_func
    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        self._check_temperature(trainer)  # before any engine starts
        if not self.runtime.started:
            self.start()
        group_size = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
        self.calls += 1
        samples = [self._sample(p, i, group_size) for i, p in enumerate(prompts)]
        unwrapped = trainer.accelerator.unwrap_model(trainer.model)
        # A copy: the optimizer changes the trainer's tensors in place while the engine may still read them.
        state = {k: v.detach().to("cpu", copy=True) for k, v in unwrapped.state_dict().items()}
        weights = Weights(state_dict=state, version=f"step-{trainer.state.global_step}")
        result = self.runtime.step_sync(samples, weights, **self.step_kwargs)
        self.last_result = result
        by_uid = {t.uid: t for t in result.trajectories}
        lost = [s.uid for s in samples if s.uid not in by_uid]
        if lost:  # the step ran to its end, so only a mid-step sleep can leave rows without a result
            raise RuntimeError(f"AgentloopRollout: no trajectory for {lost[:5]} (carried over: "
                               f"{[c.uid for c in result.carry_over][:5]}); TRL needs one completion per prompt")
        return self._to_trl([by_uid[s.uid] for s in samples], trainer)

    def _sample(self, prompt: Any, i: int, group_size: int) -> Sample:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        group = f"trl{self.calls}-g{i // group_size}"
        return Sample(uid=f"{group}-{i % group_size}", group_id=group, index_in_group=i % group_size,
                      messages=messages, tools=self.tools)

    def _check_temperature(self, trainer: Any) -> None:
        want = getattr(trainer, "temperature", None)
        have = self.runtime.config.agent.sampling.temperature
        if want is not None and abs(float(want) - have) > 1e-9:
            raise ValueError(f"AgentloopRollout: the runtime samples at agent.sampling.temperature={have} but GRPOConfig.temperature="
                             f"{want}; TRL scales its logprobs by its temperature, so set both to the same value")

    def _to_trl(self, trajs: list[Trajectory], trainer: Any) -> dict[str, list[Any]]:
        eos = trainer.processing_class.eos_token_id if hasattr(trainer.processing_class, "eos_token_id") else None
        eos = eos if isinstance(eos, int) else self.runtime.pad_token_id
        out: dict[str, list[Any]] = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [],
                                     "agentloop_trajectory": [], "agentloop_status": [], "agentloop_tool_calls": []}
        for t in trajs:
            ok = t.status in FINISHED_OK
            ids = list(t.response_ids) or [eos]
            mask = list(t.response_mask) if (ok and t.response_ids) else [0] * len(ids)
            lps = [lp if m else 0.0 for lp, m in zip(t.response_logprobs, t.response_mask)] or [0.0]
            out["prompt_ids"].append(list(t.prompt_ids))
            out["completion_ids"].append(ids)
            out["logprobs"].append(lps)
            out["env_mask"].append(mask)
            out["agentloop_trajectory"].append(t)
            out["agentloop_status"].append(t.status)
            out["agentloop_tool_calls"].append(t.tool_calls)
        return out

    # ------------------------------------------------------------------ rewards
    def reward_func(self, name: str = "arithmetic", *, timeout: float = 30.0) -> Callable[..., list[float | None]]:
        """A TRL reward function running agentloop's registered reward `name` on each trajectory, with the
        dataset's `ground_truth` column (if any); None for failed/aborted trajectories (TRL: unscorable)."""
        fn = rewards.get_reward(name)

        def reward(prompts: list[Any], completions: list[Any], agentloop_trajectory: Sequence[Trajectory],
                   ground_truth: Sequence[Any] | None = None, **_: Any) -> list[float | None]:
            out: list[float | None] = []
            for i, t in enumerate(agentloop_trajectory):
                if t.status not in FINISHED_OK:
                    out.append(None)
                    continue
                sample = Sample(uid=t.uid, messages=t.messages, group_id=t.group_id, index_in_group=t.index_in_group,
                                ground_truth=ground_truth[i] if ground_truth is not None else None, reward=name)
                try:
                    result = self.runtime._blocking_portal().call(
                        lambda: rewards.call_reward(fn, t, sample, timeout=timeout, name=name))
                except Exception as e:  # one bad grade must not stop training: this row becomes unscorable
                    log.warning("reward %r failed on %s: %s: %s", name, t.uid, type(e).__name__, e)
                    result = None
                out.append(None if result is None else float(result.reward))
            return out

        reward.__name__ = f"agentloop_{name}"
        return reward
