"""The `interaction` agent loop and the interaction registry, with a scripted `ctx.generate`: a row
with `agent: interaction` is a known loop; the simulated user comes from the sample
(`extra["interaction"]`: a registered name or a `module:function` path) or else from the context;
without one the trajectory fails before any generation with an error saying how to give one. The run
over HTTP with the CPU engine and the tiny model is in `test_agents_e2e.py`.
"""

from __future__ import annotations

from typing import Any

import pytest

from agentloop.agents import get_agent, registered_agents
from agentloop.agents.interaction import get_interaction, register_interaction, registered_interactions, scripted_user
from agentloop.dataset import row_to_sample
from agentloop.tools import ToolRegistry
from agentloop.types import Sample

try:
    from test_agents import Calculator, ScriptedEngine, assert_exact, call, make_ctx
    from test_chat_templates import qwen_style_tokenizer
except ImportError:  # tests/ imported as a package
    from tests.test_agents import Calculator, ScriptedEngine, assert_exact, call, make_ctx
    from tests.test_chat_templates import qwen_style_tokenizer


@register_interaction("test_doubter")
def doubter(messages: list[dict[str, Any]], sample: Sample) -> str | None:
    """Asks 'Sure?' once after the first answer, then stops."""
    return "Sure?" if sum(m["role"] == "user" for m in messages) == 1 else None


def test_interaction_is_a_registered_loop_and_a_row_may_name_it() -> None:
    assert "interaction" in registered_agents()
    assert type(get_agent("interaction")).__name__ == "InteractionAgent"
    s = row_to_sample(
        {"prompt": "What is 2 + 3?", "agent": "interaction", "interaction": "scripted_user", "user_turns": ["And 5 * 2?"]},
        default_uid="r0", known_agents=registered_agents(),
    )
    assert s.agent == "interaction" and s.extra["interaction"] == "scripted_user"


def test_get_interaction_resolves_names_paths_and_callables() -> None:
    assert {"scripted_user", "test_doubter"} <= set(registered_interactions())
    assert get_interaction("scripted_user") is scripted_user
    assert get_interaction("agentloop.agents.interaction:scripted_user") is scripted_user
    assert get_interaction(doubter) is doubter
    with pytest.raises(KeyError, match="unknown interaction 'nobody'.*scripted_user"):
        get_interaction("nobody")
    with pytest.raises(ImportError, match="no attribute 'nope'"):
        get_interaction("agentloop.agents.interaction:nope")
    with pytest.raises(ImportError, match="cannot import module 'no_such_module_xyz'"):
        get_interaction("no_such_module_xyz:f")
    with pytest.raises(TypeError, match="not callable"):
        get_interaction("agentloop.agents.interaction:__all__")


async def test_the_samples_named_interaction_drives_the_conversation() -> None:
    tok = qwen_style_tokenizer()
    for spec in ("scripted_user", "agentloop.agents.interaction:scripted_user"):
        eng = ScriptedEngine(tok, ["The answer is 5.", call("calculator", expression="5 * 2"), "The answer is 10."])
        s = Sample(uid="i0", messages=[{"role": "user", "content": "What is 2 + 3?"}], agent="interaction",
                   extra={"interaction": spec, "user_turns": ["Now double it."]})
        ctx = make_ctx(eng, ToolRegistry([Calculator()]))
        assert ctx.interaction is None  # the hook comes from the sample alone
        traj = await get_agent(s.agent).run(s, ctx)
        assert (traj.status, traj.finish_reason, traj.extra["user_turns"]) == ("completed", "stop", 1), traj.error
        assert [m["role"] for m in traj.messages] == ["user", "assistant", "user", "assistant", "tool", "assistant"]
        assert traj.messages[2]["content"] == "Now double it." and traj.messages[4]["content"] == "10"
        assert_exact(traj, eng)


async def test_the_samples_interaction_wins_over_the_contexts_and_the_context_is_the_fallback() -> None:
    tok = qwen_style_tokenizer()

    def never(messages: list[dict[str, Any]], sample: Sample) -> str | None:
        raise AssertionError("the context's hook must not be asked when the sample names one")

    eng = ScriptedEngine(tok, ["5.", "Yes, 5."])
    ctx = make_ctx(eng, None)
    ctx.interaction = never
    s = Sample(uid="i1", messages=[{"role": "user", "content": "2 + 3?"}], extra={"interaction": "test_doubter"})
    traj = await get_agent("interaction").run(s, ctx)
    assert (traj.status, traj.extra["user_turns"], traj.messages[2]["content"]) == ("completed", 1, "Sure?"), traj.error

    eng = ScriptedEngine(tok, ["5.", "Yes, 5."])
    ctx = make_ctx(eng, None)
    ctx.interaction = doubter
    traj = await get_agent("interaction").run(Sample(uid="i2", messages=[{"role": "user", "content": "2 + 3?"}]), ctx)
    assert (traj.status, traj.num_turns, traj.extra["user_turns"]) == ("completed", 2, 1), traj.error


async def test_no_or_a_bad_interaction_fails_the_trajectory_before_generating() -> None:
    tok = qwen_style_tokenizer()
    for extra, needle in (
        ({}, "needs a simulated user: set the sample's extra['interaction']"),
        ({"interaction": "nobody"}, "extra['interaction']: unknown interaction 'nobody'"),
        ({"interaction": "agentloop.agents.interaction:nope"}, "has no attribute 'nope'"),
    ):
        eng = ScriptedEngine(tok, ["never sampled"])
        traj = await get_agent("interaction").run(
            Sample(uid="bad", messages=[{"role": "user", "content": "hi"}], extra=extra), make_ctx(eng, None)
        )
        assert (traj.status, traj.finish_reason) == ("failed", "error")
        assert needle in (traj.error or ""), traj.error
        assert eng.inputs == [] and traj.num_turns == 0  # nothing was generated for a sample that cannot run
        traj.check_invariants()


async def test_the_tool_loop_also_asks_a_user_the_sample_names_and_fails_on_a_bad_name() -> None:
    tok = qwen_style_tokenizer()
    eng = ScriptedEngine(tok, ["5.", "Yes, 5."])
    s = Sample(uid="t0", messages=[{"role": "user", "content": "2 + 3?"}], extra={"interaction": "test_doubter"})
    traj = await get_agent("tool").run(s, make_ctx(eng, None))
    assert (traj.status, traj.num_turns, traj.extra["user_turns"]) == ("completed", 2, 1), traj.error
    eng = ScriptedEngine(tok, ["never sampled"])
    s = Sample(uid="t1", messages=[{"role": "user", "content": "2 + 3?"}], extra={"interaction": "nobody"})
    traj = await get_agent("tool").run(s, make_ctx(eng, None))
    assert traj.status == "failed" and "unknown interaction 'nobody'" in (traj.error or "") and eng.inputs == []
