"""The `openai` agent loop end to end: agents written with the official `openai` client, run by
`Runtime.step` against the embedded CPU engine serving the shipped tiny tool model (its chat template
and the hermes parser, as the built-in tool loop uses them), through the scheduler, router and
lifecycle gate, over two or more wake → roll out → sleep steps.

Every engine generate is recorded (the client's `generate` is wrapped), so each trajectory's mask-1
tokens and logprobs are checked against what the engine returned for exactly that input, and every
dispatch against the lifecycle state it happened in.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any, Iterator

import anyio
import openai
import pytest

from agentloop.engine.base import GenerateOutput
from agentloop.engine.lifecycle import EngineState
from agentloop.config.rollout import load_config
from agentloop.runtime import Runtime
from agentloop.tasks.arithmetic import CALCULATOR_TOOL, evaluate_expression, generate_questions
from agentloop.types import Sample, Trajectory

pytestmark = pytest.mark.slow

#: Shared with the agents below (they run in the runtime's event loop; the tests read it after a step).
STATE: dict[str, Any] = {}


def _example() -> Any:
    """examples/openai_calculator.py, the docs' agent, loaded from the checkout."""
    path = Path(__file__).resolve().parents[1] / "examples" / "openai_calculator.py"
    spec = importlib.util.spec_from_file_location("openai_calculator_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: The docs' agent: OpenAI tool calls to the calculator until the model answers (named by CONFIG below).
calculator_agent = _example().calculator_agent


async def summarizing_agent(client: openai.AsyncOpenAI, sample: Sample) -> float:
    """One tool round, then the history is rewritten: the exchange is replaced by a note. Returns its
    own reward (1.0 if the final answer contains the tool's result)."""
    question = sample.messages[-1]["content"]
    r = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": question}],
                                             tools=[CALCULATOR_TOOL], max_tokens=64)
    calls = r.choices[0].message.tool_calls or []
    notes = []
    for call in calls:
        expr = json.loads(call.function.arguments).get("expression", "")
        notes.append(f"{expr} = {evaluate_expression(expr)}")
    summary = [{"role": "system", "content": "You are a helpful assistant. Notes: " + "; ".join(notes)},
               {"role": "user", "content": question}]
    r2 = await client.chat.completions.create(model="policy", messages=summary, tools=[CALCULATOR_TOOL], max_tokens=64)
    STATE.setdefault("segments_seen", []).append((r.agentloop["segment"], r2.agentloop["segment"]))  # type: ignore[attr-defined]
    text = r2.choices[0].message.content or ""
    await client.close()  # harmless: trajectories' clients share one pool that the loop owns
    return 1.0 if notes and notes[0].split(" = ")[-1] in text else 0.0


async def long_agent(client: openai.AsyncOpenAI, sample: Sample) -> str:
    """A long generation (the engine ignores EOS) that a sleep aborts; short once the test says so."""
    n = 8 if STATE.get("short") else 1000
    try:
        r = await client.chat.completions.create(model="policy", messages=sample.messages, max_tokens=n,
                                                 extra_body={"ignore_eos": True})
    except openai.APIStatusError as e:
        STATE["long_error"] = e
        raise
    return r.choices[0].message.content or ""


async def sleeper_agent(client: openai.AsyncOpenAI, sample: Sample) -> str:
    """Puts the runtime to sleep while the long agent generates, then asks for a completion."""
    rt: Runtime = STATE["runtime"]
    if not STATE.get("slept"):
        STATE["slept"] = True
        with anyio.fail_after(60):
            while rt.lifecycle.in_flight() == 0:  # type: ignore[union-attr]
                await anyio.sleep(0.005)
        await anyio.sleep(0.3)  # some tokens sampled (1000 take seconds on any CPU)
        await rt.sleep()
        STATE["state_after_sleep"] = rt.lifecycle.state  # type: ignore[union-attr]
        STATE["generates_at_sleep"] = len(STATE["outputs"])
        try:
            await client.chat.completions.create(model="policy", messages=sample.messages, max_tokens=8)
        except openai.APIStatusError as e:
            STATE["sleeper_error"] = e
            STATE["generates_after_refusal"] = len(STATE["outputs"])
            raise
    r = await client.chat.completions.create(model="policy", messages=sample.messages, max_tokens=8)
    return r.choices[0].message.content or ""


CONFIG = {
    "engine": {"local": {"num_threads": 1}},
    "scheduler": {"n": 2, "concurrency": 8},
    "agent": {"agent": "openai", "function": "test_openai_agent:calculator_agent", "max_new_tokens_per_turn": 1000,
              "max_response_tokens": 1500},
}


@pytest.fixture(scope="module")
def rt() -> Iterator[Runtime]:
    with Runtime(CONFIG) as runtime:
        client = runtime.clients[0]
        raw_generate = client.generate
        outputs: list[tuple[list[int], GenerateOutput]] = []
        states: list[EngineState] = []

        async def recording_generate(input_ids: Any, params: Any, **kw: Any) -> GenerateOutput:
            out = await raw_generate(input_ids, params, **kw)
            outputs.append((list(input_ids), out))
            return out

        client.generate = recording_generate  # type: ignore[method-assign]
        assert runtime.lifecycle is not None
        runtime.lifecycle.on_generate = lambda url, state: states.append(state)
        STATE.update(runtime=runtime, outputs=outputs, states=states)
        yield runtime
    STATE.clear()


def assert_exact(traj: Trajectory) -> None:
    """Each model turn holds exactly what the engine sampled for that turn's input, with its logprobs;
    mask 0 everywhere else."""
    traj.check_invariants()
    assert traj.turns, traj.uid
    full = traj.prompt_ids + traj.response_ids
    for turn in traj.turns:
        prefix = full[: len(traj.prompt_ids) + turn.start]
        ids = traj.response_ids[turn.start: turn.start + turn.length]
        lps = traj.response_logprobs[turn.start: turn.start + turn.length]
        assert any(inp == prefix and o.output_ids == ids and o.output_logprobs == lps for inp, o in STATE["outputs"]), (
            f"{traj.uid}: turn at {turn.start} is not an engine output for its input")
    assert sum(traj.response_mask) == sum(t.length for t in traj.turns)


def questions(k: int, seed: int) -> list[Sample]:
    return [Sample(uid=f"s{seed}q{i}", messages=[{"role": "user", "content": q.question}], ground_truth=q.answer)
            for i, q in enumerate(generate_questions(k, seed=seed))]


def test_calculator_agent_over_two_steps_with_exact_tokens(rt: Runtime) -> None:
    assert rt.lifecycle is not None
    for step, seed in enumerate((11, 12), start=1):
        before = len(STATE["outputs"])
        res = rt.step_sync(questions(3, seed))
        assert rt.lifecycle.state is EngineState.SLEEPING and res.step == step
        assert len(res.trajectories) == 6 and res.batch["input_ids"].shape[0] == 6
        assert [t.status for t in res.trajectories] == ["completed"] * 6, [t.error for t in res.trajectories]
        for t in res.trajectories:
            assert_exact(t)
            assert t.weight_version == res.weight_version
            assert t.reward is not None and t.extra["agent_output"]
        called = [t for t in res.trajectories if t.tool_calls]
        assert len(called) >= 4  # the tiny model calls the calculator (99.5% on its evaluation set)
        for t in called:
            assert t.num_turns >= 2
            ids = [c["id"] for m in t.messages if m["role"] == "assistant" for c in m.get("tool_calls", [])]
            assert ids and ids == [m["tool_call_id"] for m in t.messages if m["role"] == "tool"]
        assert sum(t.reward for t in res.trajectories) >= 4  # type: ignore[misc]
        calls = sum(len(t.extra["openai_calls"]) for t in res.trajectories)
        assert len(STATE["outputs"]) - before == calls
    assert rt.lifecycle.generations_outside_awake == 0
    assert set(STATE["states"]) == {EngineState.AWAKE}


def test_rewritten_history_becomes_flagged_rows(rt: Runtime) -> None:
    samples = [Sample(uid=s.uid, messages=s.messages, ground_truth=s.ground_truth, extra={"function": summarizing_agent})
               for s in questions(2, 21)]
    STATE.pop("segments_seen", None)
    res = rt.step_sync(samples, n=1)
    assert STATE["segments_seen"] == [(0, 1), (0, 1)]
    assert len(res.trajectories) == 4 and res.batch["input_ids"].shape[0] == 4
    by_uid = {t.uid: t for t in res.trajectories}
    for s in samples:
        first, last = by_uid[f"{s.uid}/segment-0"], by_uid[s.uid]
        for row, index, reason in ((first, 0, "start"), (last, 1, "history_rewritten")):
            assert_exact(row)
            assert row.extra["history_rewritten"] and row.extra["segment_of"] == s.uid
            assert (row.extra["segment_index"], row.extra["segment_reason"]) == (index, reason)
            assert row.status == "completed" and row.reward == last.reward and row.num_turns == 1
            assert not row.segments
        # The second segment's prompt is the rewritten conversation, rendered afresh (the first
        # segment's sampled turn is not in it, and nothing of it was re-tokenized).
        assert first.prompt_ids != last.prompt_ids[: len(first.prompt_ids)]
    rows = res.batch["uids"]
    assert sorted(rows) == sorted(by_uid)


def test_sleep_aborts_in_flight_calls_and_refuses_later_ones(rt: Runtime) -> None:
    assert rt.lifecycle is not None
    STATE.update(slept=False, short=False)
    samples = [Sample(uid="long", messages=[{"role": "user", "content": "Count."}], extra={"function": long_agent}),
               Sample(uid="sleeper", messages=[{"role": "user", "content": "Hi."}], extra={"function": sleeper_agent})]
    res = rt.step_sync(samples, n=1)
    # The long call was aborted mid-generation and its client saw it; the call after the sleep was
    # refused without reaching the engine.
    long_err, sleep_err = STATE["long_error"], STATE["sleeper_error"]
    assert long_err.status_code == 503 and "aborted after" in long_err.message
    assert sleep_err.status_code == 503 and "refused, nothing generated" in sleep_err.message
    assert STATE["state_after_sleep"] is EngineState.SLEEPING
    assert STATE["generates_after_refusal"] == STATE["generates_at_sleep"]
    assert res.trajectories == [] and sorted(c.uid for c in res.carry_over) == ["long", "sleeper"]
    assert all(c.resume_from is not None and c.resume_from.status == "aborted" for c in res.carry_over)
    assert rt.lifecycle.generations_outside_awake == 0 and set(STATE["states"]) == {EngineState.AWAKE}
    # The next step wakes the engine again and runs the carried samples from their prompts.
    STATE["short"] = True
    res2 = rt.step_sync(res.carry_over)
    assert sorted(t.uid for t in res2.trajectories) == ["long", "sleeper"]
    by_uid = {t.uid: t for t in res2.trajectories}
    assert (by_uid["long"].status, by_uid["long"].finish_reason) == ("truncated", "length")  # 8 tokens, EOS ignored
    assert by_uid["sleeper"].status in ("completed", "truncated") and by_uid["sleeper"].error is None
    for t in res2.trajectories:
        assert_exact(t)
        assert len(t.turns) == 1
    assert rt.lifecycle.state is EngineState.SLEEPING


async def agents_sdk_agent(client: openai.AsyncOpenAI, sample: Sample) -> Any:
    """The same task written with the OpenAI Agents SDK (`openai-agents`): its Runner drives the loop."""
    from agents import Agent, FunctionTool, OpenAIChatCompletionsModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)  # the SDK would otherwise export traces to OpenAI

    async def run_calculator(ctx: Any, arguments: str) -> str:
        return str(evaluate_expression(json.loads(arguments)["expression"]))

    fn = CALCULATOR_TOOL["function"]
    calculator = FunctionTool(name=fn["name"], description=fn["description"], params_json_schema=fn["parameters"],
                              on_invoke_tool=run_calculator, strict_json_schema=False)
    agent = Agent(name="calculator", model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
                  tools=[calculator])
    result = await Runner.run(agent, sample.messages[-1]["content"], max_turns=4)
    return result.final_output


def test_openai_agents_sdk_runner(rt: Runtime) -> None:
    pytest.importorskip("agents", reason="openai-agents is not installed")
    samples = [Sample(uid=s.uid, messages=s.messages, ground_truth=s.ground_truth, extra={"function": agents_sdk_agent})
               for s in questions(3, 31)]
    res = rt.step_sync(samples, n=1)
    assert len(res.trajectories) == 3, [t.uid for t in res.trajectories]
    for t in res.trajectories:
        assert t.status in ("completed", "truncated") and t.error is None, t.error
        assert_exact(t)
        assert not t.segments  # the SDK sends the history back as it was returned: one sequence
    assert any(t.tool_calls and t.num_turns >= 2 for t in res.trajectories)


def test_yaml_config_names_the_agent_function(tmp_path: Path) -> None:
    path = tmp_path / "rollout.yaml"
    path.write_text("runtime:\n  agent:\n    agent: openai\n    function: test_openai_agent:calculator_agent\n")
    cfg = load_config(path).runtime
    assert cfg.agent.agent == "openai"
    assert cfg.agent.function == "test_openai_agent:calculator_agent"
