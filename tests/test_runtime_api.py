"""Runtime.step's trainer-facing arguments over an in-process engine double (the CPU-engine runs are in
test_runtime.py): `pad_to` shapes the batch; samples without an agent run the configured default agent
loop; every test runs >= 2 steps."""

from __future__ import annotations

import types

import pytest

from agentloop.config import RuntimeConfig
from agentloop.runtime import Runtime, StepCollateError
from agentloop.types import Sample

from test_scheduler_support import FakeEngine, length_reward, samples

TOK = types.SimpleNamespace(pad_token_id=0, eos_token_id=2)


def test_pad_to_fixes_the_batch_shapes_and_a_too_short_pad_keeps_the_results() -> None:
    eng = FakeEngine("http://a")
    with Runtime(clients=[eng], tokenizer=TOK, tools=object(), reward_fn=length_reward) as rt:
        # the scripted loop: prompt of 4 tokens; 2 turns of 3 tokens + 3 tool tokens between = 9
        res = rt.step_sync(samples(3, turns=2, tokens=3), pad_to=(8, 32))
        b = res.batch
        assert tuple(b["prompts"].shape) == (3, 8) and tuple(b["responses"].shape) == (3, 32)
        assert tuple(b["input_ids"].shape) == tuple(b["attention_mask"].shape) == (3, 40)
        assert tuple(b["response_mask"].shape) == tuple(b["rollout_log_probs"].shape) == (3, 32)
        assert b["attention_mask"].sum().item() == sum(len(t.prompt_ids) + len(t.response_ids) for t in res.trajectories)
        assert b["response_mask"].sum().item() == res.metrics["sampled_tokens"] == 3 * 6

        res = rt.step_sync(samples(2, turns=1, tokens=5), pad_to=(None, 16))  # None: the batch's longest
        assert tuple(res.batch["prompts"].shape) == (2, 4) and tuple(res.batch["responses"].shape) == (2, 16)

        records = len(rt.lifecycle.records)
        with pytest.raises(ValueError, match="pad_to must be"):
            rt.step_sync(samples(1), pad_to=(8, 0))
        assert len(rt.lifecycle.records) == records  # refused before any engine woke
        with pytest.raises(StepCollateError, match="response of 9 tokens is longer than pad_to response length 5") as ei:
            rt.step_sync(samples(2, turns=2, tokens=3), pad_to=(None, 5))
        assert [t.uid for t in ei.value.trajectories] == ["p0", "p1"]  # the rollout is not lost
        assert all(t.status == "completed" and t.reward == 9.0 for t in ei.value.trajectories)
        assert rt.lifecycle.generations_outside_awake == 0


def _spy_agents(rt: Runtime) -> dict[str, str]:
    """uid → name of the agent loop the scheduler ran it with."""
    ran: dict[str, str] = {}
    orig = rt.scheduler._agent

    def spy(name: str):
        loop = orig(name)

        class Recording:
            async def run(self, sample, ctx):
                ran[sample.uid] = name
                return await loop.run(sample, ctx)

        return Recording()

    rt.scheduler._agent = spy  # type: ignore[method-assign]
    return ran


def test_samples_without_an_agent_run_the_configured_default_agent() -> None:
    assert Sample(uid="x", messages=[]).agent is None
    assert RuntimeConfig().agent.agent == "tool"
    with Runtime({"agent": {"agent": "replay"}}, clients=[FakeEngine("http://a")], tokenizer=TOK, tools=object(),
                 reward_fn=length_reward) as rt:
        ran = _spy_agents(rt)
        for step in range(2):
            plain = Sample(uid=f"plain{step}", messages=[{"role": "user", "content": "q"}],
                           extra={"prompt_ids": [5, 6, 7], "replay": [{"gen_tokens": 4}]})
            res = rt.step_sync([plain, *samples(1, turns=1)])  # samples(): agent="scripted"
            assert [t.status for t in res.trajectories] == ["completed", "completed"], [t.error for t in res.trajectories]
            assert res.trajectories[0].prompt_ids == [5, 6, 7] and len(res.trajectories[0].response_ids) == 4
        assert ran == {"plain0": "replay", "plain1": "replay", "p0": "scripted"}
