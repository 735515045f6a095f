"""Runtime.step's trainer-facing arguments over an in-process engine double (the CPU-engine runs are in
test_runtime.py): `pad_to` shapes the batch; samples without an agent run the configured default agent
loop; every test runs >= 2 steps."""

from __future__ import annotations

import types

import pytest

from agentloop.config import RuntimeConfig
from agentloop.rewards import register_reward
from agentloop.engine.base import EngineError
from agentloop.engine.lifecycle import EngineState
from agentloop.runtime import Runtime, StepCollateError, StepSleepError
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
    orig = rt.scheduler.agent

    def spy(name: str):
        loop = orig(name)

        class Recording:
            async def run(self, sample, ctx):
                ran[sample.uid] = name
                return await loop.run(sample, ctx)

        return Recording()

    rt.scheduler.agent = spy  # type: ignore[method-assign]
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


class ReportingEngine(FakeEngine):
    """An engine double whose /server_info reports a context limit as the CPU engine or SGLang does."""

    def __init__(self, url: str, info: dict) -> None:
        super().__init__(url)
        self.info = info

    async def server_info(self) -> dict:
        return dict(self.info)


def test_context_budget_is_lowered_to_the_engines_smallest_context_length() -> None:
    engines = [ReportingEngine("http://a", {"context_length": 64}),  # the CPU engine's key
               ReportingEngine("http://b", {"context_length": None, "max_req_input_len": 23})]  # SGLang's
    cfg = RuntimeConfig.model_validate({"agent": {"agent": "replay", "max_response_tokens": 200}})
    with Runtime(cfg, clients=engines, tokenizer=TOK, tools=object(), reward_fn=length_reward) as rt:
        assert rt.engine_context_length == 23  # min(64 - 2, SGLang's max_req_input_len 23)
        assert rt.config.agent.max_context_tokens == 23 and rt.scheduler.agent_config.max_context_tokens == 23
        assert cfg.agent.max_context_tokens == 4096  # the caller's config object is left as given
        for step in range(2):
            s = Sample(uid=f"s{step}", messages=[], extra={"prompt_ids": [5, 6, 7, 8], "replay": [{"gen_tokens": 50}]})
            t = rt.step_sync([s]).trajectories[0]
            assert len(t.prompt_ids) + len(t.response_ids) == 23  # stopped at the engines' context, not 4 + 50
            assert t.status == "truncated" and t.finish_reason == "max_context_tokens"

    # only lowers; engines that report nothing (or fail to answer) keep the configured value
    with Runtime({"agent": {"max_context_tokens": 16}}, clients=[ReportingEngine("http://a", {"context_length": 64})],
                 tokenizer=TOK, tools=object()) as rt:
        assert rt.engine_context_length == 62 and rt.scheduler.agent_config.max_context_tokens == 16
    with Runtime(clients=[FakeEngine("http://a")], tokenizer=TOK, tools=object()) as rt:
        assert rt.engine_context_length is None and rt.scheduler.agent_config.max_context_tokens == 4096


def test_dict_rows_are_converted_like_dataset_rows() -> None:
    with Runtime(clients=[FakeEngine("http://a")], tokenizer=TOK, tools=object()) as rt:
        ran = _spy_agents(rt)
        for step in range(2):
            rows = [{"prompt": "q", "agent": "scripted", "ground_truth": 3, "reward": "test_gt_plus_one", "turns": 1},
                    {"uid": f"mine{step}", "prompt": "q", "agent": "scripted"},
                    *samples(1, turns=1)]  # Sample objects mix with rows unchanged
            res = rt.step_sync(rows)
            assert [t.uid for t in res.trajectories] == [f"row-{2 * step + 1}", f"mine{step}", "p0"]
            assert [t.status for t in res.trajectories] == ["completed"] * 3
            assert res.trajectories[0].reward == 4.0 and res.trajectories[0].num_turns == 1  # free keys → extra
            assert res.trajectories[1].reward is None and res.trajectories[1].num_turns == 2
        assert set(ran.values()) == {"scripted"}
        records = len(rt.lifecycle.records)
        with pytest.raises(ValueError, match=r"samples\[1\] is not a usable row: a row needs exactly one of 'messages'"):
            rt.step_sync([{"prompt": "ok", "agent": "scripted"}, {"ground_truth": 1}])
        with pytest.raises(ValueError, match=r"samples\[0\].*unknown agent loop 'nope'"):
            rt.step_sync([{"prompt": "ok", "agent": "nope"}])
        with pytest.raises(ValueError, match=r"samples\[0\].*unknown reward function 'nope'"):
            rt.step_sync([{"prompt": "ok", "reward": "nope"}])
        assert len(rt.lifecycle.records) == records  # refused before any engine woke


@register_reward("test_gt_plus_one")
def _gt_plus_one(traj, sample) -> float:
    return float(sample.ground_truth) + 1.0


@pytest.mark.slow
def test_real_engine_rows_default_agent_default_reward_and_context_for_two_steps() -> None:
    """The shipped tiny tool model on the embedded CPU engine (a real `agentloop serve` subprocess): dict
    rows scored by the default reward, the configured default agent for rows that name none, and the
    agent's context budget taken from the engine's reported context length."""
    cfg = {
        "engine": {"local": {"num_threads": 1, "log_level": "warning", "context_length": 1024}},
        "agent": {"agent": "single_turn", "sampling": {"temperature": 0.0}, "max_new_tokens_per_turn": 48,
                  "max_assistant_turns": 3, "max_response_tokens": 200},
    }
    with Runtime(cfg) as rt:
        assert rt.engine_context_length == 1022  # the engine's --context-length less SGLang's 2, below the configured 4096
        assert rt.scheduler.agent_config.max_context_tokens == 1022
        ran = _spy_agents(rt)
        for step in range(2):
            res = rt.step_sync([{"prompt": "What is 2 + 3?", "ground_truth": 5},
                                {"prompt": "What is 7 * 6?", "ground_truth": 42, "agent": "tool"}])
            plain, tool = res.trajectories
            assert plain.status in ("completed", "truncated") and tool.status in ("completed", "truncated"), \
                [t.error for t in res.trajectories]
            assert ran[plain.uid] == "single_turn" and ran[tool.uid] == "tool"
            assert plain.num_turns == 1 and plain.tool_calls == 0
            # scored by the default reward (arithmetic) though the rows name none
            assert plain.reward in (0.0, 1.0) and tool.reward in (0.0, 1.0)
            assert plain.extra["reward_info"]["expected"] == 5 and tool.extra["reward_info"]["expected"] == 42
            assert res.metrics["generations_outside_awake"] == 0


@pytest.mark.slow
def test_a_trajectory_runs_up_to_the_real_engines_context_and_every_turn_gets_what_it_asked(tmp_path) -> None:
    """On the CPU engine (which caps max_new_tokens like SGLang's scheduler, at context - 2 - input),
    a replay trajectory longer than the context stops exactly at the usable context: the turn that
    reaches it is granted every token the agent asked for (no engine cut, no 400), two steps."""
    from agentloop.models.random_model import make_random_model

    model = make_random_model(tmp_path / "model", seed=3)
    cfg = {"engine": {"model": str(model),
                      "local": {"num_threads": 1, "log_level": "warning", "context_length": 64}},
           "agent": {"agent": "replay", "max_response_tokens": 500, "max_new_tokens_per_turn": 30}}
    turns = [{"gen_tokens": 30, "tool_result_tokens": 3}, {"gen_tokens": 30, "tool_result_tokens": 3}, {"gen_tokens": 30}]
    with Runtime(cfg) as rt:
        assert rt.engine_context_length == 62
        for step in range(2):
            s = Sample(uid=f"c{step}", messages=[], extra={"prompt_ids": [5, 6, 7, 8], "replay": turns})
            t = rt.step_sync([s]).trajectories[0]
            assert t.status == "truncated" and t.finish_reason == "max_context_tokens", t.error
            assert len(t.prompt_ids) + len(t.response_ids) == 62
            # 4 prompt + 30 + 3 tool + 25 asked of the last turn (62 - 37) and all 25 sampled
            assert [turn.length for turn in t.turns] == [30, 25]


class ReleaseFailsOnce(FakeEngine):
    """Release fails once, on the sleep that ends step `fail_on_step`."""

    def __init__(self, url: str, fail_on_release: int) -> None:
        super().__init__(url)
        self.releases = 0
        self.fail_on_release = fail_on_release

    async def release_memory_occupation(self, tags=None) -> None:
        self.releases += 1
        if self.releases == self.fail_on_release:
            self.calls.append("release-failed")
            raise EngineError("/release_memory_occupation", 500, "out of luck", url=self.url)
        await super().release_memory_occupation(tags)


def test_a_failed_sleep_hands_back_the_trajectories_and_the_next_step_finishes_it() -> None:
    # release #1 is the runtime's initial sleep at start; #2 ends step 1 and fails.
    eng = ReleaseFailsOnce("http://a", fail_on_release=2)
    with Runtime(clients=[eng], tokenizer=TOK, tools=object(), reward_fn=length_reward) as rt:
        with pytest.raises(StepSleepError, match="sleep failed.*release_memory_occupation") as ei:
            rt.step_sync(samples(3, turns=2, tokens=3))
        assert len(ei.value.trajectories) == 3 and all(t.status == "completed" for t in ei.value.trajectories)
        assert rt.lifecycle.state is EngineState.DRAINING and rt.lifecycle.sleep_resume_at == "release"
        eng.calls.clear()
        for step in (2, 3):
            res = rt.step_sync(samples(2, turns=1, tokens=4))
            assert [t.status for t in res.trajectories] == ["completed"] * 2
            assert rt.lifecycle.state is EngineState.SLEEPING
        # step 2 first finished step 1's sleep (the release alone), then woke as usual
        assert eng.calls[0] == "release" and eng.calls.count("release") == 3


def test_a_ray_config_is_refused_by_the_in_process_runtime() -> None:
    with pytest.raises(ValueError, match="ray.enabled is true.*RayRuntime"):
        Runtime({"ray": {"enabled": True}}, clients=[FakeEngine("http://a")], tokenizer=TOK, tools=object())
