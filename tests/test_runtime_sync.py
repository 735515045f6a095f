"""The runtime's sync facade, overrides, callbacks and config errors, over an in-process engine double
(the CPU-engine runs are in test_runtime.py). Every test runs >= 2 steps."""

from __future__ import annotations

import types

import pytest
from pydantic import ValidationError

from agentloop.config import LaunchConfig, RuntimeConfig
from agentloop.engine.lifecycle import EngineState
from agentloop.engine.base import SamplingParams
from agentloop.runtime import Runtime

from test_scheduler_support import FakeEngine, length_reward, samples

TOK = types.SimpleNamespace(pad_token_id=0, eos_token_id=2)


def test_step_sync_runs_the_same_coroutine_for_two_steps() -> None:
    eng = FakeEngine("http://a")
    seen: list[str] = []
    rt = Runtime({"scheduler": {"n": 2}}, clients=[eng], tokenizer=TOK, tools=object(),
                 reward_fn=length_reward, on_trajectory=lambda t: seen.append(t.uid))
    with rt:
        assert rt.lifecycle.state is EngineState.SLEEPING and "release" in eng.calls
        r1 = rt.step_sync(samples(2, turns=2, tokens=3))
        r2 = rt.step_sync(samples(3, turns=1, tokens=2), {"w": 0}, n=1)  # a state dict: a new weight version
        assert rt.lifecycle.state is EngineState.SLEEPING
    assert [t.uid for t in r1.trajectories] == ["p0_0", "p0_1", "p1_0", "p1_1"]
    assert [t.uid for t in r2.trajectories] == ["p0", "p1", "p2"]  # n overridden for one step
    assert r1.weight_version == "default" and r2.weight_version == "auto-v1"
    assert {t.weight_version for t in r2.trajectories} == {"auto-v1"}
    assert r1.step == 1 and r2.step == 2
    assert sorted(seen) == sorted([t.uid for t in r1.trajectories + r2.trajectories])
    for r in (r1, r2):
        assert r.metrics["generations_outside_awake"] == 0
        assert r.metrics["wake_up_seconds"] >= 0 and r.metrics["sleep_seconds"] >= 0
        assert r.metrics["sampled_tokens"] == int(r.batch["response_mask"].sum())
        assert r.batch["rewards"].tolist() == [float(len(t.response_ids)) for t in r.trajectories]
    # the engine saw: release at start, then per step resume → update → resume → ... → release
    assert eng.calls[0] == "release" and eng.calls.count("release") == 3


async def test_bad_override_and_bad_config_name_the_field() -> None:
    rt = Runtime(clients=[FakeEngine("http://a")], tokenizer=TOK, tools=object(), reward_fn=length_reward)
    async with rt:
        with pytest.raises(TypeError, match="concurency"):
            await rt.step(samples(1), concurency=3)
        with pytest.raises(ValidationError, match="n"):
            await rt.step(samples(1), n=0)
        res = await rt.step(samples(1, turns=1))  # still usable
        res = await rt.step(samples(1, turns=1))
        assert res.trajectories[0].status == "completed"
    with pytest.raises(ValidationError, match="concurrency"):
        RuntimeConfig.model_validate({"scheduler": {"concurrency": 0}})
    with pytest.raises(ValidationError, match="bogus"):
        RuntimeConfig.model_validate({"engine": {"bogus": 1}})
    with pytest.raises(ValidationError, match="either `urls`"):
        RuntimeConfig.model_validate({"engine": {"urls": ["http://x"], "launch": {"model_path": "/m"}}})
    # A YAML true/false in a count is a mistake pydantic would read as 1/0; switches still take it.
    for section, key in (("scheduler", "target_groups"), ("scheduler", "max_staleness"),
                         ("scheduler", "oversample_factor"), ("engine", "request_timeout")):
        with pytest.raises(ValidationError, match=f"{key}: expected a number, got True"):
            RuntimeConfig.model_validate({section: {key: True}})
    cfg = RuntimeConfig.model_validate({"scheduler": {"partial_rollout": True, "target_groups": 2}})
    assert cfg.scheduler.partial_rollout is True and cfg.scheduler.target_groups == 2
    with pytest.raises(ValidationError, match="target_groups: expected a number"):
        cfg.scheduler.target_groups = True  # assignments are checked alike


def test_config_documents_every_field() -> None:
    def walk(model: type) -> None:
        for name, f in model.model_fields.items():
            assert f.description, f"{model.__name__}.{name} has no description"
            ann = f.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                walk(ann)

    walk(RuntimeConfig)
    walk(LaunchConfig)
    cfg = RuntimeConfig.model_validate({"agent": {"sampling": {"temperature": 0.5, "seed": 3}, "max_new_tokens_per_turn": 7}})
    ac = cfg.agent
    sp = ac.turn_sampling()
    assert sp.temperature == 0.5 and sp.max_new_tokens == 7 and sp.sampling_seed == 3
    assert ac.max_new_tokens_per_turn == 7
    assert cfg.scheduler.prompts_per_step(16) == 16
    assert RuntimeConfig.model_validate({"scheduler": {"target_groups": 8, "oversample_factor": 1.5}}).scheduler.prompts_per_step(16) == 12


def test_agent_config_is_one_model_with_typed_knobs() -> None:
    """`RuntimeConfig.agent` is `AgentConfig` itself; interaction_timeout and chat_template_kwargs are
    typed settings. The older spellings (them in `extra`, `sampling=SamplingParams(...)`) are refused,
    naming the setting to use."""
    from agentloop.agents import AgentConfig
    from agentloop.engine.base import SamplingParams

    assert RuntimeConfig.model_fields["agent"].annotation is AgentConfig
    cfg = RuntimeConfig.model_validate({"agent": {"interaction_timeout": 5, "chat_template_kwargs": {"enable_thinking": False}}})
    assert cfg.agent.interaction_timeout == 5.0 and cfg.agent.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(ValidationError, match="interaction_timeout"):
        AgentConfig(interaction_timeout="soon")
    assert AgentConfig(extra={"mine": 2}).extra == {"mine": 2}
    for old in ({"interaction_timeout": 7}, {"chat_template_kwargs": {"x": 1}, "mine": 2}):
        name = next(iter(old))
        with pytest.raises(ValidationError, match=rf"extra.{name}: `{name}` is a setting of its own \(agent.{name}\)"):
            AgentConfig(extra=old)
    with pytest.raises(ValidationError, match=r"sampling\n  Input should be a valid dictionary or instance of SamplingConfig"):
        AgentConfig(sampling=SamplingParams(temperature=0.0))
    ac = AgentConfig(max_new_tokens_per_turn=9, sampling={"temperature": 0.0, "seed": 4, "extra": {"stop_token_ids": [5]}})
    sp = ac.turn_sampling()
    assert (sp.temperature, sp.sampling_seed, sp.stop_token_ids, sp.max_new_tokens) == (0.0, 4, [5], 9)
    assert AgentConfig(sampling={"extra": {"repetition_penalty": 1.1}}).turn_sampling().to_json()["repetition_penalty"] == 1.1


def _old_turn_sampling(max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
                       min_p: float = 0.0, seed: int | None = None, sampling_extra: dict | None = None) -> SamplingParams:
    """What the flat `AgentConfig.sampling` property built before the sub-model (kept here as the reference)."""
    sd = {} if seed is None else {"sampling_seed": seed}
    return SamplingParams.from_mapping({"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
                                        "top_k": top_k, "min_p": min_p, **sd, **(sampling_extra or {})})


def test_sampling_is_a_sub_model_with_todays_defaults_and_turn_params() -> None:
    """`AgentConfig.sampling` is a `SamplingConfig`: the defaults, the validation and a turn's `SamplingParams`
    are those of the flat settings it replaces."""
    from agentloop.agents import AgentConfig, SamplingConfig

    assert AgentConfig.model_fields["sampling"].annotation is SamplingConfig
    default = AgentConfig().sampling
    assert default.model_dump() == {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "seed": None, "extra": {}}
    assert AgentConfig().turn_sampling() == _old_turn_sampling(256)
    assert "sampling_seed" not in AgentConfig().turn_sampling().to_json()
    for flat in ({"temperature": 0.0}, {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 11},
                 {"seed": 0, "sampling_extra": {"repetition_penalty": 1.1, "stop_token_ids": [3, 4], "top_k": 5}}):
        nested = {("extra" if k == "sampling_extra" else k): v for k, v in flat.items()}
        ac = AgentConfig(max_new_tokens_per_turn=33, sampling=nested)
        assert ac.turn_sampling() == _old_turn_sampling(33, **flat)
        assert ac.turn_sampling().to_json() == _old_turn_sampling(33, **flat).to_json()
        assert ac.turn_sampling() is not ac.turn_sampling()  # a new object per call: callers build it once
        assert ac.sampling.params(33) == ac.turn_sampling()
    for bad in ({"temperature": -0.1}, {"top_p": 0}, {"top_p": 1.5}, {"min_p": 2}, {"seed": "x"}, {"typo": 1}):
        with pytest.raises(ValidationError, match=rf"sampling\.{next(iter(bad))}"):
            AgentConfig(sampling=bad)
    with pytest.raises(ValidationError, match="temperature"):
        AgentConfig().sampling.temperature = -1  # validate_assignment, as before
    yaml_cfg = RuntimeConfig.model_validate({"agent": {"sampling": {"temperature": 0.25, "seed": 9}}})
    assert (yaml_cfg.agent.sampling.temperature, yaml_cfg.agent.sampling.seed) == (0.25, 9)
    assert RuntimeConfig.model_validate(yaml_cfg.model_dump(mode="json")) == yaml_cfg  # round-trips (Ray workers)


def test_the_flat_sampling_spelling_is_refused_naming_the_new_place() -> None:
    from agentloop.agents import AgentConfig

    for old, new in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p"),
                     ("seed", "seed"), ("sampling_extra", "extra")):
        value = {} if old == "sampling_extra" else 1
        with pytest.raises(ValidationError, match=rf"agent\.{old}: write it as agent\.sampling\.{new}"):
            AgentConfig(**{old: value})
        with pytest.raises(ValidationError, match=rf"agent\.{old}: write it as agent\.sampling\.{new}"):
            RuntimeConfig.model_validate({"agent": {old: value}})
        if old != "sampling_extra":
            with pytest.raises(ValidationError, match=rf"extra\.{old}: `{old}` is a setting of its own "
                                                      rf"\(agent\.sampling\.{new}\)"):
                AgentConfig(extra={old: 1})


def test_one_stage_wake_up_for_two_steps() -> None:
    eng = FakeEngine("http://a")
    rt = Runtime({"engine": {"staged": False, "release_tags": ["kv_cache"]}}, clients=[eng], tokenizer=TOK,
                 tools=object(), reward_fn=length_reward)
    with rt:
        for _ in range(2):
            first = len(rt.lifecycle.records)
            res = rt.step_sync(samples(2, turns=1))
            assert [r.stage for r in rt.lifecycle.records[first:] if r.phase == "wake_up"] == ["resume_all"]
            assert [t.status for t in res.trajectories] == ["completed"] * 2
            assert eng.released == {"kv_cache"}  # only the configured tag is released


async def test_stream_yields_trajectories_as_they_finish_then_the_result() -> None:
    eng = FakeEngine("http://a")
    rt = Runtime({"scheduler": {"n": 2}}, clients=[eng], tokenizer=TOK, tools=object(), reward_fn=length_reward)
    async with rt:
        for step in (1, 2):
            ss = samples(3, turns=2, tokens=2)
            ss[0].extra["turns"] = 5  # finishes last
            got = []
            async with rt.stream(ss) as s:
                async for t in s:
                    got.append(t.uid)
            assert s.result is not None and s.result.step == step
            assert sorted(got) == sorted(t.uid for t in s.result.trajectories)
            assert set(got[-2:]) == {"p0_0", "p0_1"}  # in finishing order, not input order
            assert rt.lifecycle.state is EngineState.SLEEPING


def test_embedded_engine_settings_are_typed_fields() -> None:
    """`engine.local` holds the embedded CPU engines' settings as typed fields, passed to each
    `agentloop serve` as its flags (only the ones set); the older string list `local_args` is refused."""
    from agentloop.config import LocalServerConfig

    assert LocalServerConfig().serve_args() == []  # nothing set: serve's own defaults
    cfg = RuntimeConfig.model_validate({"engine": {"local": {"num_threads": 2, "context_length": 64, "log_level": "warning",
                                                             "return_original_logprob": True, "seed": 0}}})
    assert cfg.engine.local.serve_args() == ["--num-threads", "2", "--context-length", "64", "--seed", "0",
                                             "--return-original-logprob", "--log-level", "warning"]
    with pytest.raises(ValidationError, match=r"engine.local.num_threads\n  Input should be greater than or equal to 0"):
        RuntimeConfig.model_validate({"engine": {"local": {"num_threads": -1}}})
    with pytest.raises(ValidationError, match=r"engine.local_args\n  Extra inputs are not permitted"):
        RuntimeConfig.model_validate({"engine": {"local_args": ["--num-threads", "1"]}})
    # Every field is a flag `agentloop serve` takes.
    from agentloop.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    flags = {o for a in serve._actions for o in a.option_strings}
    assert {"--" + n.replace("_", "-") for n in LocalServerConfig.model_fields} <= flags
