"""TRL 1.16's GRPOTrainer trains 2 steps with agentloop as its `rollout_func`: the tiny tool model's
multi-turn calculator rollouts on the embedded CPU engine, the trainer's current weights pushed through
the staged wake-up before each step's rollout, and the tool-call turns masked out of the loss."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("trl", reason="needs trl (pip install 'agentloop[trl]')")

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from agentloop.integrations.trl import AgentloopRollout  # noqa: E402
from agentloop.models import tiny_tool_model  # noqa: E402
from agentloop.tasks.arithmetic import generate_questions  # noqa: E402

pytestmark = pytest.mark.trl


class RecordingGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that records what each loss computation saw (the trainer under test is TRL's own)."""

    seen: list[dict]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        ids = torch.cat([prompt_ids, completion_ids], 1)
        attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        with torch.no_grad():  # the trainer's logprobs of the sampled tokens, with the weights of this step
            logps = self._get_per_token_logps_and_entropies(model, ids, attn, completion_ids.size(1))[0]
        self.seen.append({
            "step": self.state.global_step,
            "completion_ids": completion_ids.clone(), "completion_mask": inputs["completion_mask"].clone(),
            "tool_mask": inputs["tool_mask"].clone(), "sampling_logps": inputs["sampling_per_token_logps"].clone(),
            "trainer_logps": logps.clone(), "advantages": inputs["advantages"].clone(),
        })
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def test_misuse_is_refused_before_any_engine_starts() -> None:
    from types import SimpleNamespace

    rollout = AgentloopRollout({"agent": {"sampling": {"temperature": 1.0}}})
    with pytest.raises(ValueError, match=r"agent.sampling.temperature=1.0 but GRPOConfig.temperature=0.7"):
        rollout([[{"role": "user", "content": "1+1?"}]], SimpleNamespace(temperature=0.7))
    assert not rollout.runtime.started
    with pytest.raises(ValueError, match="one completion per prompt entry"):
        AgentloopRollout(None, target_groups=2)


@pytest.mark.slow
def test_grpo_trainer_two_steps_with_agentloop_rollouts(tmp_path) -> None:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    model_dir = str(tiny_tool_model())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    qs = generate_questions(8, seed=7)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": q.question}], "ground_truth": q.answer} for q in qs])
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, max_steps=2,
                      learning_rate=1e-3, temperature=1.0, logging_steps=1, report_to=[], save_strategy="no",
                      use_cpu=True, bf16=False, seed=0, dataloader_num_workers=0, max_completion_length=160)
    cfg = {"engine": {"local": {"num_threads": 1}},
           "agent": {"sampling": {"temperature": 1.0}, "max_new_tokens_per_turn": 48, "max_response_tokens": 160}}
    stages_per_call: list[list[str]] = []
    with AgentloopRollout(cfg) as rollout:
        lc = rollout.runtime.lifecycle
        trainer = RecordingGRPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                                       reward_funcs=[rollout.reward_func("arithmetic")], rollout_func=rollout)
        trainer.seen = []
        versions: list[str | None] = []
        orig_call = rollout.__call__

        def spy(prompts, tr):
            first = len(lc.records)
            out = orig_call(prompts, tr)
            stages_per_call.append([f"{r.phase}/{r.stage}" for r in lc.records[first:]])
            versions.append(rollout.last_result.weight_version)
            assert len(out["completion_ids"]) == len(prompts) == 8
            return out

        trainer.rollout_func = spy
        trainer.train()
        assert lc.generations_outside_awake == 0

    assert trainer.state.global_step == 2
    assert versions == ["step-0", "step-1"]  # each step rolled out with the trainer's weights of that step
    wake = ["wake_up/resume_weights", "wake_up/update_weights", "wake_up/resume_kv_cache"]
    for stages in stages_per_call:
        assert stages[:3] == wake and stages[-1] == "sleep/release"  # staged wake-up, then sleep, every step
    assert [s["step"] for s in trainer.seen] == [0, 1]
    tool_tokens = 0
    for seen in trainer.seen:
        loss_mask = seen["completion_mask"] * seen["tool_mask"]
        # Every row: the loss mask is exactly agentloop's response_mask (tool results and template tokens 0).
        trajs = {tuple(t.response_ids): t for t in rollout.last_result.trajectories} if seen["step"] == 1 else None
        for row in range(loss_mask.size(0)):
            n = int(seen["completion_mask"][row].sum())
            ids = seen["completion_ids"][row, :n].tolist()
            mask = loss_mask[row, :n].tolist()
            if trajs is not None and tuple(ids) in trajs:
                assert mask == trajs[tuple(ids)].response_mask
            tool_tokens += mask.count(0)
            m = loss_mask[row].bool()
            # the trainer's logprobs of the model tokens match the engine's: the engine ran the trainer's weights
            diff = (seen["trainer_logps"][row][m] - seen["sampling_logps"][row][m]).abs()
            assert diff.numel() == 0 or float(diff.max()) < 2e-3, float(diff.max())
    assert tool_tokens > 0, "the tiny model called the calculator, so some completion tokens must be masked"
    assert sum(t.tool_calls for t in rollout.last_result.trajectories) > 0
    assert any(k.startswith("rewards/agentloop_arithmetic") for h in trainer.state.log_history for k in h)
