"""Agent loops driven by a scripted `ctx.generate` (pre-tokenized turns) with the real tool registry:
parallel calls, a hanging tool timed out, a raising tool's error returned to the model, malformed
calls, limits and budgets, engine aborts and partial-rollout resume, failures returned not raised,
the simulated user, and the replay loop. The end-to-end run over HTTP with the CPU engine and the
tiny model is in `test_agents_e2e.py`.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Callable

import anyio
from hypothesis import given, settings
from hypothesis import strategies as st

from agentloop.agents import AgentConfig, AgentContext, get_agent
from agentloop.agents.interaction import scripted_user
from agentloop.engine.base import EngineError, GenerateOutput, SamplingParams
from agentloop.rewards import score
from agentloop.tasks.arithmetic import CALCULATOR_TOOL, evaluate_expression
from agentloop.tools import Tool, ToolContext, ToolRegistry
from agentloop.types import Sample, Trajectory

try:
    from test_chat_templates import qwen_style_tokenizer
except ImportError:  # tests/ imported as a package
    from tests.test_chat_templates import qwen_style_tokenizer


class Calculator(Tool):
    name = "calculator"
    description = CALCULATOR_TOOL["function"]["description"]
    parameters = CALCULATOR_TOOL["function"]["parameters"]

    def __init__(self, delay: float = 0.0, together: int = 0) -> None:
        self.delay = delay
        # `together` > 0: each call waits until that many calls are running at once (a rendezvous):
        # calls run one after another never meet, and time out instead.
        # Calls may each run on their own event loop (tools.call_thread): a counter under a thread
        # lock, polled, works across loops where an anyio.Event would not.
        self.together = together
        self.started = 0
        self.lock = threading.Lock()

    async def execute(self, arguments: dict[str, Any], context: ToolContext) -> str:
        with self.lock:
            self.started += 1
        while self.started < self.together:
            await anyio.sleep(0.01)
        await anyio.sleep(self.delay)
        return str(evaluate_expression(arguments["expression"]))


class Hang(Tool):
    name = "hang"
    parameters = {"type": "object", "properties": {}}

    async def execute(self, arguments: dict[str, Any], context: ToolContext) -> str:
        await anyio.sleep_forever()
        return ""


class Boom(Tool):
    name = "boom"
    parameters = {"type": "object", "properties": {}}

    async def execute(self, arguments: dict[str, Any], context: ToolContext) -> str:
        raise RuntimeError("disk on fire")


def call(name: str, **args: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


Turn = str | list[int] | Callable[[list[int], SamplingParams], GenerateOutput]


class ScriptedEngine:
    """`ctx.generate` stand-in: returns the scripted turns (text is tokenized once, here, standing in
    for what a model samples; the loop under test never re-tokenizes it). Records every request."""

    def __init__(self, tok: Any, turns: list[Turn], *, version: str = "v1") -> None:
        self.tok = tok
        self.turns = list(turns)
        self.inputs: list[list[int]] = []
        self.params: list[SamplingParams] = []
        self.sampled: list[list[int]] = []
        self.version = version

    async def __call__(self, input_ids: list[int], params: SamplingParams) -> GenerateOutput:
        self.inputs.append(list(input_ids))
        self.params.append(params)
        turn = self.turns.pop(0)
        if callable(turn):
            out = turn(list(input_ids), params)
        else:
            ids = self.tok.encode(turn, add_special_tokens=False) if isinstance(turn, str) else list(turn)
            eos = self.tok.eos_token_id
            if len(ids) + 1 <= params.max_new_tokens:
                ids = ids + [eos]
                finish = {"type": "stop", "matched": eos}
            else:
                ids = ids[: params.max_new_tokens]
                finish = {"type": "length", "length": len(ids)}
            out = GenerateOutput(ids, [-0.01 * (i + 1) for i in range(len(ids))], finish, self.version, "rid")
        self.sampled.append(list(out.output_ids))
        return out


def make_ctx(engine: ScriptedEngine, tools: ToolRegistry | None, **cfg: Any) -> AgentContext:
    return AgentContext(generate=engine, tokenizer=engine.tok, config=AgentConfig(**cfg), tools=tools)


def sample(q: str = "What is 2 + 3?", **kw: Any) -> Sample:
    return Sample(uid="s0", messages=[{"role": "user", "content": q}], **kw)


def assert_exact(traj: Trajectory, eng: ScriptedEngine) -> None:
    traj.check_invariants()
    assert traj.prompt_ids == eng.inputs[0]
    # Every loop ends on a model turn: the engine's last input plus what it sampled.
    assert traj.prompt_ids + traj.response_ids == eng.inputs[-1] + eng.sampled[-1]
    for inp in eng.inputs:
        assert (traj.prompt_ids + traj.response_ids)[: len(inp)] == inp
    sampled = [t for s in eng.sampled for t in s]
    assert [t for t, m in zip(traj.response_ids, traj.response_mask) if m] == sampled


async def test_parallel_calls_run_concurrently_and_the_answer_is_rewarded() -> None:
    tok = qwen_style_tokenizer()
    eng = ScriptedEngine(tok, [
        call("calculator", expression="2 + 3") + "\n" + call("calculator", expression="4 * 5"),
        "The answer is 5.",
    ])
    # The two calls only return once both run at the same time; one after the other, the first
    # would time out (tool_timeout) and its result would be an error message.
    reg = ToolRegistry([Calculator(delay=0.1, together=2)])
    ctx = make_ctx(eng, reg, max_parallel_calls=2, tool_timeout=30.0)
    s = sample(ground_truth=5, reward="arithmetic")
    traj = await get_agent("tool").run(s, ctx)
    assert traj.status == "completed" and traj.finish_reason == "stop", traj.error
    assert traj.tool_calls == 2 and traj.num_turns == 2
    assert_exact(traj, eng)
    tool_msgs = [m for m in traj.messages if m["role"] == "tool"]
    assert [m["content"] for m in tool_msgs] == ["5", "20"]  # both met: they ran concurrently
    # The engine's second input carries both results, in the template's form, after the first turn.
    second = tok.decode(eng.inputs[1][len(eng.inputs[0]):])
    assert "<tool_response>\n5\n</tool_response>\n<tool_response>\n20\n</tool_response>" in second
    assert traj.messages[1]["tool_calls"][1]["function"] == {"name": "calculator", "arguments": '{"expression": "4 * 5"}'}
    assert [e.kind for e in traj.timeline] == ["generate", "tool", "generate"]
    assert traj.metrics["tool_seconds"] >= 0.1 and traj.metrics["tool_errors"] == 0
    await score(traj, s)
    assert traj.reward == 1.0


async def test_hanging_tool_times_out_and_raising_tool_error_reaches_the_model() -> None:
    tok = qwen_style_tokenizer()
    eng = ScriptedEngine(tok, [call("hang"), call("boom"), "{not json", "The answer is 5."])
    ctx = make_ctx(eng, ToolRegistry([Hang(), Boom()]), tool_timeout=0.3)
    with anyio.fail_after(60):  # a guard against hanging forever, not a speed check
        traj = await get_agent("tool").run(sample(), ctx)
    assert traj.status == "completed", traj.error
    assert_exact(traj, eng)
    tool_msgs = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert len(tool_msgs) == 2  # the unparsable third turn is plain text: no call, not a tool turn
    assert "timed out" in tool_msgs[0]
    assert "RuntimeError: disk on fire" in tool_msgs[1]
    assert "disk on fire" in tok.decode(eng.inputs[2])  # the model saw the error
    assert traj.metrics["tool_errors"] == 2
    assert [r["error_kinds"] for r in traj.extra["tool_results"]] == [["timeout"], ["exception"]]


async def test_malformed_and_unknown_calls_become_error_results() -> None:
    tok = qwen_style_tokenizer()
    eng = ScriptedEngine(tok, [
        "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {oops}\n</tool_call>",
        call("nope", x=1) + call("calculator", expression=7),
        "The answer is 1.",
    ])
    traj = await get_agent("tool").run(sample(), make_ctx(eng, ToolRegistry([Calculator()])))
    assert traj.status == "completed"
    kinds = [r["error_kinds"] for r in traj.extra["tool_results"]]
    assert kinds == [["parse"], ["unknown_tool", "bad_arguments"]]
    assert traj.metrics["tool_errors"] == 3 and traj.tool_calls == 3
    assert_exact(traj, eng)


async def test_limits_end_the_loop_truncated() -> None:
    tok = qwen_style_tokenizer()
    eng = ScriptedEngine(tok, [call("calculator", expression="1 + 1")] * 3)
    traj = await get_agent("tool").run(sample(), make_ctx(eng, ToolRegistry([Calculator()]), max_assistant_turns=2))
    assert (traj.status, traj.finish_reason, traj.num_turns, traj.tool_calls) == ("truncated", "max_assistant_turns", 2, 1)

    # Response budget: the clamp shrinks max_new_tokens, and no delta ever overflows the budget.
    eng = ScriptedEngine(tok, [call("calculator", expression="1 + 1")] * 10)
    traj = await get_agent("tool").run(sample(), make_ctx(eng, ToolRegistry([Calculator()]), max_response_tokens=90))
    assert traj.status == "truncated" and traj.finish_reason == "max_response_tokens"
    assert len(traj.response_ids) <= 90
    assert all(p.max_new_tokens <= 90 for p in eng.params)
    assert_exact(traj, eng)

    # Context limit.
    eng = ScriptedEngine(tok, ["x " * 100])
    prompt_len = len(tok.encode(tok.apply_chat_template(sample().messages, add_generation_prompt=True, tokenize=False)))
    traj = await get_agent("tool").run(sample(), make_ctx(eng, None, max_context_tokens=prompt_len + 10))
    assert traj.finish_reason == "max_context_tokens" and len(traj.response_ids) == 10
    assert eng.params[0].max_new_tokens == 10

    # A turn cut by the per-turn limit without a call.
    eng = ScriptedEngine(tok, ["x " * 100])
    traj = await get_agent("tool").run(sample(), make_ctx(eng, None, max_new_tokens_per_turn=8))
    assert (traj.status, traj.finish_reason, len(traj.response_ids)) == ("truncated", "length", 8)


async def test_abort_then_resume_continues_the_same_tokens() -> None:
    tok = qwen_style_tokenizer()
    first = tok.encode(call("calculator", expression="2 + 3"), add_special_tokens=False)
    k = len(first) // 2

    def aborted(ids: list[int], p: SamplingParams) -> GenerateOutput:
        return GenerateOutput(first[:k], [-0.5] * k, {"type": "abort", "message": "paused"}, "v1", "r")

    eng1 = ScriptedEngine(tok, [aborted])
    reg = ToolRegistry([Calculator()])
    s = sample(ground_truth=5, reward="arithmetic")
    partial = await get_agent("tool").run(s, make_ctx(eng1, reg))
    assert (partial.status, partial.finish_reason, partial.num_turns) == ("aborted", "abort", 1)
    partial.check_invariants()
    assert [m["role"] for m in partial.messages] == ["user", "assistant"]  # the partial text, readable
    assert partial.messages[1]["content"] == tok.decode(first[:k])

    def rest(ids: list[int], p: SamplingParams) -> GenerateOutput:
        assert ids == partial.prompt_ids + partial.response_ids  # continues exactly where it stopped
        tail = first[k:] + [tok.eos_token_id]
        return GenerateOutput(tail, [-0.25] * len(tail), {"type": "stop", "matched": tok.eos_token_id}, "v2", "r")

    eng2 = ScriptedEngine(tok, [rest, "The answer is 5."], version="v2")
    s2 = sample(ground_truth=5, reward="arithmetic", resume_from=partial)
    traj = await get_agent("tool").run(s2, make_ctx(eng2, reg))
    assert traj.status == "completed", traj.error
    traj.check_invariants()
    assert traj.weight_versions == ["v1", "v2", "v2"]
    assert traj.num_turns == 2 and traj.tool_calls == 1  # the resumed message is one turn
    assert traj.response_ids[: len(partial.response_ids)] == partial.response_ids
    sampled = [t for t, m in zip(traj.response_ids, traj.response_mask) if m]
    assert sampled == first + [tok.eos_token_id] + eng2.sampled[1]
    assert [m["role"] for m in traj.messages] == ["user", "assistant", "tool", "assistant"]
    assert traj.messages[1]["tool_calls"][0]["function"]["arguments"] == '{"expression": "2 + 3"}'
    # The resumed turn keeps its number: the call id is the one an unbroken run would give.
    assert traj.messages[1]["tool_calls"][0]["id"] == traj.messages[2]["tool_call_id"] == f"call_{s2.uid}_1_0"
    assert traj.metrics["resumed"] == 1
    await score(traj, s2)
    assert traj.reward == 1.0


async def test_unexpected_errors_are_returned_as_failed_trajectories() -> None:
    tok = qwen_style_tokenizer()

    def broken(ids: list[int], p: SamplingParams) -> GenerateOutput:
        raise EngineError("/generate", 500, "boom", url="http://x")

    eng = ScriptedEngine(tok, [call("calculator", expression="1 + 1"), broken])
    traj = await get_agent("tool").run(sample(), make_ctx(eng, ToolRegistry([Calculator()])))
    assert traj.status == "failed" and traj.finish_reason == "error"
    assert "EngineError" in traj.error and "boom" in traj.error
    traj.check_invariants()  # the tokens gathered so far are still exact
    assert traj.num_turns == 1

    bad = Sample(uid="bad", messages=[{"role": "user"}])  # no content: the template fails
    traj = await get_agent("tool").run(bad, make_ctx(ScriptedEngine(tok, []), None))
    assert traj.status == "failed" and traj.prompt_ids == [] and traj.error


async def test_simulated_user_continues_the_conversation() -> None:
    tok = qwen_style_tokenizer()
    eng = ScriptedEngine(tok, ["The answer is 5.", call("calculator", expression="5 * 2"), "The answer is 10.", "Bye."])
    s = sample(ground_truth=10, reward="arithmetic", extra={"user_turns": ["Now double it.", "Thanks!"]})
    ctx = make_ctx(eng, ToolRegistry([Calculator()]), max_user_turns=1)
    ctx.interaction = scripted_user
    traj = await get_agent("tool").run(s, ctx)
    assert (traj.status, traj.finish_reason) == ("truncated", "max_user_turns")
    assert [m["role"] for m in traj.messages] == ["user", "assistant", "user", "assistant", "tool", "assistant"]
    assert traj.messages[2]["content"] == "Now double it."
    assert_exact(traj, eng)
    await score(traj, s)
    assert traj.reward == 1.0

    async def judge(messages: list[dict[str, Any]], smp: Sample) -> str | None:
        return None if "10" in messages[-1]["content"] else "Try again."

    eng = ScriptedEngine(tok, ["The answer is 3.", "The answer is 10."])
    ctx = make_ctx(eng, None)
    ctx.interaction = judge
    traj = await get_agent("tool").run(sample(), ctx)
    assert (traj.status, traj.num_turns, traj.extra["user_turns"]) == ("completed", 2, 1)


async def test_single_turn() -> None:
    tok = qwen_style_tokenizer()
    eng = ScriptedEngine(tok, ["The answer is 5."])
    traj = await get_agent("single_turn").run(sample(), make_ctx(eng, None))
    assert (traj.status, traj.num_turns, traj.messages[-1]["content"]) == ("completed", 1, "The answer is 5.")
    assert_exact(traj, eng)
    eng = ScriptedEngine(tok, ["x " * 50])
    traj = await get_agent("single_turn").run(sample(), make_ctx(eng, None, max_new_tokens_per_turn=5))
    assert (traj.status, traj.finish_reason, len(traj.response_ids)) == ("truncated", "length", 5)


class CountingEngine:
    """Returns exactly max_new_tokens tokens (like ignore_eos on a real engine)."""

    def __init__(self) -> None:
        self.params: list[SamplingParams] = []
        self.inputs: list[list[int]] = []

    async def __call__(self, input_ids: list[int], p: SamplingParams) -> GenerateOutput:
        self.params.append(p)
        self.inputs.append(list(input_ids))
        n = p.max_new_tokens
        return GenerateOutput([5] * n, [-1.0] * n, {"type": "length", "length": n}, "v", "r")


async def test_replay_follows_the_spec() -> None:
    spec = [
        {"gen_tokens": 7, "tool_latency_s": 0.2, "tool_result_tokens": 4},
        {"gen_tokens": 3, "tool_latency_s": 0.0, "tool_result_tokens": 2},
        {"gen_tokens": 5},
    ]
    eng = CountingEngine()
    ctx = AgentContext(generate=eng, tokenizer=None, config=AgentConfig())
    s = Sample(uid="r0", messages=[], agent="replay", extra={"replay": {"prompt_tokens": 6, "turns": spec}})
    t0 = time.monotonic()
    traj = await get_agent("replay").run(s, ctx)
    assert time.monotonic() - t0 >= 0.2
    assert traj.status == "completed", traj.error
    traj.check_invariants()
    assert len(traj.prompt_ids) == 6
    assert traj.response_mask == [1] * 7 + [0] * 4 + [1] * 3 + [0] * 2 + [1] * 5
    assert [p.max_new_tokens for p in eng.params] == [7, 3, 5] and all(p.ignore_eos for p in eng.params)
    assert traj.tool_calls == 2 and [e.kind for e in traj.timeline] == ["generate", "tool", "generate", "tool", "generate"]

    bad = Sample(uid="r1", messages=[], extra={"replay": [{"gen_tokens": 0}]})
    traj = await get_agent("replay").run(bad, ctx)
    assert traj.status == "failed" and "gen_tokens" in traj.error


def test_replay_fixed_ids_are_per_seed_streams_in_range() -> None:
    """The replayed prompt and tool results: deterministic per seed, in range, plain ints, and no two
    samples' prompts share a prefix (the engine must not be able to cache across samples)."""
    import random

    from agentloop.agents.replay import _fixed_ids

    rng = random.Random(0)
    for k in range(200):
        n, low = rng.choice([0, 1, 7, 197, 256, 3000]), rng.randint(0, 50)
        high = rng.choice([low + 1, low + 197, 200, 151936, low - 5])
        seed = f"u{k}/tool{k % 3}"
        ids = _fixed_ids(seed, n, low, high)
        assert ids == _fixed_ids(seed, n, low, high) and len(ids) == n
        assert all(type(t) is int and low <= t < max(high, low + 1) for t in ids)
        assert _fixed_ids(seed, n // 2, low, high) == ids[: n // 2]
    heads = {tuple(_fixed_ids(f"agentloop-{i}/prompt", 8, 3, 200)) for i in range(1024)}
    assert len(heads) == 1024


async def test_abort_before_the_first_token_leaves_no_turn_and_resume_starts_it_afresh() -> None:
    tok = qwen_style_tokenizer()

    def not_dispatched(ids: list[int], p: SamplingParams) -> GenerateOutput:
        return GenerateOutput([], [], {"type": "abort", "message": "stopped"}, "", "r")

    eng = ScriptedEngine(tok, [not_dispatched])
    partial = await get_agent("tool").run(sample(), make_ctx(eng, None))
    assert (partial.status, partial.num_turns, partial.turns, partial.response_ids) == ("aborted", 0, [], [])
    eng2 = ScriptedEngine(tok, ["The answer is 5."])
    traj = await get_agent("tool").run(sample(resume_from=partial), make_ctx(eng2, None))
    assert traj.status == "completed" and traj.num_turns == 1
    assert eng2.inputs[0] == partial.prompt_ids
    assert_exact(traj, eng2)


_turn = st.one_of(
    st.builds(lambda a, b: call("calculator", expression=f"{a} + {b}"), st.integers(0, 999), st.integers(0, 999)),
    st.just("<tool_call>\n{broken\n</tool_call>"),
    st.just(call("nope")),
    st.builds(lambda n: f"The answer is {n}.", st.integers(-99, 999)),
    st.text(alphabet="abc xyz<>/{}\n", max_size=30),
)


@settings(max_examples=25, deadline=None)
@given(
    turns=st.lists(_turn, min_size=1, max_size=6),
    max_response=st.integers(20, 400),
    per_turn=st.integers(4, 64),
    max_turns=st.integers(1, 5),
)
def test_any_script_gives_an_exact_trajectory_within_budget(
    turns: list[str], max_response: int, per_turn: int, max_turns: int
) -> None:
    tok = qwen_style_tokenizer()
    # Enough turns that the loop never runs out of script before a limit or a final answer.
    eng = ScriptedEngine(tok, turns + ["The answer is 1."] * 8)
    ctx = make_ctx(eng, ToolRegistry([Calculator()]), max_response_tokens=max_response,
                   max_new_tokens_per_turn=per_turn, max_assistant_turns=max_turns)
    traj = anyio.run(get_agent("tool").run, sample(), ctx)
    assert traj.status in ("completed", "truncated"), (traj.status, traj.error)
    assert_exact(traj, eng)
    assert len(traj.response_ids) <= max_response
    assert all(p.max_new_tokens <= per_turn for p in eng.params)
    assert traj.num_turns == len(eng.sampled) <= max_turns
    assert traj.tool_calls == sum(len(r["ok"]) for r in traj.extra.get("tool_results", []))
