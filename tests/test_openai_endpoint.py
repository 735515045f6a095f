"""The OpenAI-compatible endpoint without an engine process: the real `openai` client against
`EndpointServer` + `TrajectoryRecorder`, whose generate is a scripted stand-in that returns fixed ids
with logprobs (the tiny tool model's tokenizer and chat template). What is checked here is the wire
format and the token bookkeeping: extensions appended as template deltas after the sampled ids,
rewrites split into segments, stop strings, budgets and turn limits, refusals, keys and errors.
(`test_openai_agent.py` runs the same against the real CPU engine through the runtime.)
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

import aiohttp
import openai
import pytest

from agentloop.agents.base import AgentConfig, AgentContext
from agentloop.chat import TokenBuffer, render_ids
from agentloop.endpoint import EndpointServer, TrajectoryRecorder
from agentloop.engine.base import GenerateOutput, SamplingParams
from agentloop.models import tiny_tool_model
from agentloop.tasks.arithmetic import CALCULATOR_TOOL
from agentloop.types import Sample, training_rows

TOK: Any = None


def tokenizer() -> Any:
    global TOK
    if TOK is None:
        from transformers import AutoTokenizer

        TOK = AutoTokenizer.from_pretrained(str(tiny_tool_model()))
    return TOK


CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 + 30"}}\n</tool_call><|im_end|>'
ANSWER = "The answer is 42.<|im_end|>"


class ScriptedEngine:
    """A GenerateFn returning the encoded texts of `script` in turn, logprob -0.01*(i+1) per token;
    records every input and output."""

    def __init__(self, *script: str, aborted: bool = False) -> None:
        self.script = list(script)
        self.inputs: list[list[int]] = []
        self.outputs: list[GenerateOutput] = []
        self.params: list[SamplingParams] = []
        self.aborted = aborted

    async def __call__(self, input_ids: list[int], params: SamplingParams) -> GenerateOutput:
        self.inputs.append(list(input_ids))
        self.params.append(params)
        ids = tokenizer().encode(self.script[len(self.outputs) % len(self.script)], add_special_tokens=False)
        ids = ids[: params.max_new_tokens]
        finish = {"type": "abort", "message": "aborted by test"} if self.aborted else (
            {"type": "stop", "matched": ids[-1]} if len(ids) < params.max_new_tokens else {"type": "length", "length": len(ids)})
        out = GenerateOutput(output_ids=ids, output_logprobs=[-0.01 * (i + 1) for i in range(len(ids))],
                             finish_reason=finish, weight_version="v1", rid=f"r{len(self.outputs)}")
        self.outputs.append(out)
        return out


def recorder(engine: ScriptedEngine, **cfg: Any) -> TrajectoryRecorder:
    config = AgentConfig(**{"max_new_tokens_per_turn": 64, "max_response_tokens": 512, **cfg})
    ctx = AgentContext(generate=engine, tokenizer=tokenizer(), config=config)
    return TrajectoryRecorder(Sample(uid="t0", messages=[{"role": "user", "content": "What is 12 + 30?"}]), ctx)


@pytest.fixture
async def server() -> AsyncIterator[EndpointServer]:
    s = await EndpointServer().start()
    try:
        yield s
    finally:
        await s.close()


def client(route: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=route.base_url, api_key=route.key, max_retries=0)


USER = {"role": "user", "content": "What is 12 + 30?"}


async def test_tool_call_then_answer_appends_only_the_delta(server: EndpointServer) -> None:
    eng = ScriptedEngine(CALL, ANSWER)
    rec = recorder(eng)
    with server.open(rec) as route:
        c = client(route)
        r1 = await c.chat.completions.create(model="any", messages=[USER], tools=[CALCULATOR_TOOL], temperature=0.5, seed=3)
        msg = r1.choices[0].message
        assert r1.choices[0].finish_reason == "tool_calls" and msg.content is None
        (call,) = msg.tool_calls
        assert call.id == "call_t0_0" and call.function.name == "calculator"
        assert json.loads(call.function.arguments) == {"expression": "12 + 30"}
        assert r1.usage.completion_tokens == len(eng.outputs[0].output_ids)
        assert r1.usage.prompt_tokens == len(eng.inputs[0])
        assert eng.params[0].temperature == 0.5 and eng.params[0].sampling_seed == 3
        # The agent sends the assistant message back as the SDK dumps it, plus the tool result.
        history = [USER, msg.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "42"}]
        r2 = await c.chat.completions.create(model="any", messages=history, tools=[CALCULATOR_TOOL])
        assert r2.choices[0].message.content == "The answer is 42." and r2.choices[0].finish_reason == "stop"
        models = await c.models.list()
        assert [m.id for m in models.data] == ["agentloop"]
        await c.close()
    traj = rec.trajectory(value="The answer is 42.")
    traj.check_invariants()
    assert traj.status == "completed" and traj.num_turns == 2 and traj.tool_calls == 1 and not traj.segments
    assert traj.extra["agent_output"] == "The answer is 42."
    # The prompt is what the built-in loops render; the second input is the first plus the sampled ids
    # plus the template delta of the tool message, which is exactly what TokenBuffer appends.
    tok = tokenizer()
    assert traj.prompt_ids == render_ids(tok, [USER], tools=[CALCULATOR_TOOL])
    buf = TokenBuffer(tok, [USER], [CALCULATOR_TOOL])
    buf.append_model_turn(eng.outputs[0])
    buf.append_messages([{"role": "tool", "tool_call_id": call.id, "content": "42"}])
    assert eng.inputs[1] == buf.ids
    buf.append_model_turn(eng.outputs[1])
    assert traj.prompt_ids + traj.response_ids == buf.ids
    sampled = [t for o in eng.outputs for t in o.output_ids]
    assert [t for t, m in zip(traj.response_ids, traj.response_mask) if m] == sampled
    assert [x for x, m in zip(traj.response_logprobs, traj.response_mask) if m] == [x for o in eng.outputs for x in o.output_logprobs]
    assert [c["segment"] for c in traj.extra["openai_calls"]] == [0, 0]


async def test_streamed_answer_rebuilds_the_same_message(server: EndpointServer) -> None:
    eng = ScriptedEngine(CALL, ANSWER)
    rec = recorder(eng)
    with server.open(rec) as route:
        c = client(route)
        stream = await c.chat.completions.create(model="m", messages=[USER], tools=[CALCULATOR_TOOL], stream=True,
                                                 stream_options={"include_usage": True})
        calls: dict[int, dict[str, str]] = {}
        finish, usage = None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                for d in choice.delta.tool_calls or []:
                    slot = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                    slot["id"] += d.id or ""
                    slot["name"] += d.function.name or ""
                    slot["arguments"] += d.function.arguments or ""
        assert finish == "tool_calls" and usage is not None and usage.completion_tokens == len(eng.outputs[0].output_ids)
        assert calls == {0: {"id": "call_t0_0", "name": "calculator", "arguments": '{"expression": "12 + 30"}'}}
        assistant = {"role": "assistant", "tool_calls": [{"id": calls[0]["id"], "type": "function",
                     "function": {"name": "calculator", "arguments": calls[0]["arguments"]}}]}
        stream2 = await c.chat.completions.create(
            model="m", messages=[USER, assistant, {"role": "tool", "tool_call_id": "call_t0_0", "content": "42"}],
            tools=[CALCULATOR_TOOL], stream=True)
        text = "".join([ch.choices[0].delta.content or "" async for ch in stream2 if ch.choices])
        assert text == "The answer is 42."
        await c.close()
    traj = rec.trajectory()
    assert traj.num_turns == 2 and not traj.segments  # the streamed reply was recognised as an extension


async def test_rewritten_history_starts_a_flagged_segment(server: EndpointServer) -> None:
    eng = ScriptedEngine(CALL, ANSWER)
    rec = recorder(eng)
    with server.open(rec) as route:
        c = client(route)
        r1 = await c.chat.completions.create(model="m", messages=[USER], tools=[CALCULATOR_TOOL])
        msg = r1.choices[0].message.model_dump(exclude_none=True)
        # Summarized: the tool exchange is replaced by a note; the sampled turn is not in this context.
        summary = [{"role": "system", "content": "Notes: 12 + 30 = 42."}, USER]
        r2 = await c.chat.completions.create(model="m", messages=summary, tools=[CALCULATOR_TOOL])
        assert r2.agentloop["segment"] == 1  # type: ignore[attr-defined]
        # Back to the first conversation, extended: it continues segment 0 (no third segment).
        r3 = await c.chat.completions.create(
            model="m", messages=[USER, msg, {"role": "tool", "tool_call_id": "call_t0_0", "content": "42"}],
            tools=[CALCULATOR_TOOL])
        assert r3.agentloop["segment"] == 0  # type: ignore[attr-defined]
        # An edited assistant turn is a rewrite too.
        edited = {**msg, "tool_calls": [{**msg["tool_calls"][0], "function": {"name": "calculator",
                                                                                "arguments": '{"expression": "1 + 1"}'}}]}
        r4 = await c.chat.completions.create(
            model="m", messages=[USER, edited, {"role": "tool", "tool_call_id": "call_t0_0", "content": "2"}],
            tools=[CALCULATOR_TOOL])
        assert r4.agentloop["segment"] == 2  # type: ignore[attr-defined]
        await c.close()
    traj = rec.trajectory(value=0.5)
    assert traj.reward == 0.5
    assert traj.uid == "t0" and traj.extra["segment_index"] == 2 and traj.extra["history_rewritten"]
    assert [s.uid for s in traj.segments] == ["t0/segment-0", "t0/segment-1"]
    assert [s.extra["segment_reason"] for s in traj.segments] == ["start", "history_rewritten"]
    assert traj.extra["segment_reason"] == "history_rewritten"
    traj.check_invariants()
    # Each segment is its own exact sequence: its prompt is its first request's rendering; its
    # mask-1 ids are exactly the outputs generated for it.
    tok = tokenizer()
    seg0, seg1 = traj.segments
    assert seg1.prompt_ids == render_ids(tok, summary, tools=[CALCULATOR_TOOL])
    assert seg0.num_turns == 2 and seg1.num_turns == 1 and traj.num_turns == 1
    by_input = {tuple(i): o for i, o in zip(eng.inputs, eng.outputs)}
    for row in (seg0, seg1, traj):
        for turn in row.turns:
            full = row.prompt_ids + row.response_ids
            out = by_input[tuple(full[: len(row.prompt_ids) + turn.start])]
            assert row.response_ids[turn.start: turn.start + turn.length] == out.output_ids
            assert row.response_logprobs[turn.start: turn.start + turn.length] == out.output_logprobs
    rows = training_rows([traj])
    assert [r.uid for r in rows] == ["t0/segment-0", "t0/segment-1", "t0"]
    assert all(r.reward == 0.5 and r.extra["history_rewritten"] and not r.segments for r in rows)


async def test_stop_string_cuts_the_sampled_ids(server: EndpointServer) -> None:
    eng = ScriptedEngine("The answer is 42. Observation: done<|im_end|>")
    rec = recorder(eng)
    with server.open(rec) as route:
        c = client(route)
        r = await c.chat.completions.create(model="m", messages=[USER], stop=["Observation:"], logprobs=True)
        await c.close()
    assert r.choices[0].message.content == "The answer is 42. " and r.choices[0].finish_reason == "stop"
    traj = rec.trajectory()
    sampled = eng.outputs[0].output_ids
    kept = traj.response_ids
    assert kept == sampled[: len(kept)] and len(kept) < len(sampled)
    assert "Observation:" in tokenizer().decode(kept) and "Observation:" not in tokenizer().decode(kept[:-1])
    assert [lp.logprob for lp in r.choices[0].logprobs.content] == traj.response_logprobs
    assert r.usage.completion_tokens == len(kept)


async def test_budget_and_turn_limits_refuse_with_400(server: EndpointServer) -> None:
    eng = ScriptedEngine(CALL)
    rec = recorder(eng, max_assistant_turns=1)
    with server.open(rec) as route:
        c = client(route)
        r1 = await c.chat.completions.create(model="m", messages=[USER], tools=[CALCULATOR_TOOL])
        more = [USER, r1.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": "call_t0_0", "content": "42"}]
        with pytest.raises(openai.BadRequestError, match="max_assistant_turns") as e:
            await c.chat.completions.create(model="m", messages=more, tools=[CALCULATOR_TOOL])
        assert e.value.code == "max_assistant_turns"
        await c.close()
    assert len(eng.outputs) == 1
    traj = rec.trajectory()
    assert (traj.status, traj.finish_reason) == ("truncated", "max_assistant_turns")

    eng = ScriptedEngine(CALL)
    rec = recorder(eng, max_context_tokens=20)
    with server.open(rec) as route:
        c = client(route)
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(model="m", messages=[USER], tools=[CALCULATOR_TOOL])
        assert e.value.code == "context_length_exceeded"
        await c.close()
    assert eng.outputs == []
    assert rec.trajectory().status == "truncated"


async def test_aborted_call_is_an_error_and_later_calls_are_refused(server: EndpointServer) -> None:
    eng = ScriptedEngine(ANSWER, aborted=True)
    rec = recorder(eng)
    with server.open(rec) as route:
        c = client(route)
        with pytest.raises(openai.APIStatusError, match="aborted by test") as e:
            await c.chat.completions.create(model="m", messages=[USER])
        assert e.value.status_code == 503 and e.value.response.headers["x-should-retry"] == "false"
        with pytest.raises(openai.APIStatusError, match="refused, nothing generated") as e:
            await c.chat.completions.create(model="m", messages=[USER])
        assert e.value.status_code == 503
        await c.close()
    assert len(eng.outputs) == 1
    traj = rec.trajectory(error=RuntimeError("the agent gave up"))
    assert traj.status == "aborted" and traj.error is None  # carried over, not failed


async def test_keys_scope_each_trajectory(server: EndpointServer) -> None:
    eng_a, eng_b = ScriptedEngine(ANSWER), ScriptedEngine(ANSWER)
    rec_a, rec_b = recorder(eng_a), recorder(eng_b)
    with server.open(rec_a) as a, server.open(rec_b) as b:
        assert a.key != b.key
        # The key as the API key on the plain /v1 base URL reaches the same trajectory.
        by_key = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=b.key, max_retries=0)
        await by_key.chat.completions.create(model="m", messages=[USER])
        await by_key.close()
        stale = client(a)
    assert len(eng_b.outputs) == 1 and eng_a.outputs == []
    with pytest.raises(openai.NotFoundError, match="no running trajectory"):
        await stale.chat.completions.create(model="m", messages=[USER])
    await stale.close()
    async with aiohttp.ClientSession() as http:  # no key at all: 401, OpenAI-shaped
        async with http.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": [USER]}) as r:
            assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
        async with http.get(f"{server.url}/v2/nothing") as r:
            assert r.status == 404 and "error" in await r.json()


@pytest.mark.parametrize("kwargs, param", [
    ({"n": 2}, "n"),
    ({"tool_choice": "required", "tools": [CALCULATOR_TOOL]}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"temperature": 3.0}, "temperature"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
])
async def test_unsupported_requests_are_refused_naming_the_field(server: EndpointServer, kwargs: dict, param: str) -> None:
    eng = ScriptedEngine(ANSWER)
    with server.open(recorder(eng)) as route:
        c = client(route)
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(model="m", **{"messages": [USER], **kwargs})
        await c.close()
    assert e.value.param == param, e.value.message
    assert eng.outputs == []


async def test_tool_choice_none_and_injected_turns(server: EndpointServer) -> None:
    eng = ScriptedEngine(CALL, ANSWER)
    rec = recorder(eng)
    with server.open(rec) as route:
        c = client(route)
        r1 = await c.chat.completions.create(model="m", messages=[USER], tools=[CALCULATOR_TOOL], tool_choice="none")
        # Not parsed: the call stays text, and the turn is an ordinary answer.
        assert r1.choices[0].finish_reason == "stop" and not r1.choices[0].message.tool_calls
        assert "<tool_call>" in (r1.choices[0].message.content or "")
        # New messages may include an assistant turn the agent wrote itself (a few-shot hint): it was
        # not sampled, so it is part of the mask-0 delta; the conversation still extends segment 0.
        sent = r1.choices[0].message.model_dump(exclude_none=True)
        more = [USER, sent, {"role": "user", "content": "Use the tool."},
                {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "Go on."}]
        r2 = await c.chat.completions.create(model="m", messages=more, tools=[CALCULATOR_TOOL], tool_choice="none")
        assert r2.agentloop["segment"] == 0  # type: ignore[attr-defined]
        await c.close()
    traj = rec.trajectory()
    assert not traj.segments and traj.num_turns == 2 and traj.tool_calls == 0
    buf = TokenBuffer(tokenizer(), [USER], [CALCULATOR_TOOL])
    buf.append_model_turn(eng.outputs[0])
    buf.append_messages(more[2:])
    assert eng.inputs[1] == buf.ids  # the injected assistant turn is in the delta, with mask 0
    first, second = traj.turns
    assert traj.response_mask[first.start + first.length: second.start] == [0] * (second.start - first.start - first.length)
