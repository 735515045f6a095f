"""Agent loops end to end over real HTTP: the CPU reference engine in its own process
(`LocalEngineProcess`), the aiohttp `SGLangClient`, and every generate through `Lifecycle.generate`.

- the `tool` loop on a batch of arithmetic prompts with the shipped tiny tool model: real tool calls
  to the calculator, tool results in the buffer, masks and logprobs checked against the engine's
  responses and against a teacher-forced forward pass of the same weights, rewards scored;
- `single_turn` and `replay` on a random-weight model, and an engine abort mid-turn resumed as a
  partial rollout.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable

import anyio
import pytest
import torch

from agentloop.agents import AgentConfig, AgentContext, SamplingConfig, get_agent
from agentloop.engine.base import GenerateOutput, SamplingParams
from agentloop.engine.lifecycle import Lifecycle
from agentloop.engine.sglang import SGLangClient
from agentloop.rewards import score
from agentloop.types import Sample, Trajectory

torch.set_num_threads(1)


def _tiny_model_dir() -> Path | None:
    try:
        from agentloop.models import tiny_tool_model

        return tiny_tool_model()
    except FileNotFoundError:
        return None


@dataclass
class Engine:
    url: str
    model_dir: Path


@pytest.fixture(scope="module")
def random_engine(local_engine: str, random_model_dir: Path) -> Engine:
    return Engine(local_engine, random_model_dir)


@pytest.fixture(scope="module")
def tiny_engine(start_local_engine: Callable[..., str]) -> Engine:
    d = _tiny_model_dir()
    if d is None:
        pytest.skip("the shipped tiny tool model is not built in this checkout")
    return Engine(start_local_engine(d), d)


class Recorder:
    """Binds `ctx.generate` for one trajectory the way the scheduler does (one server, through the
    lifecycle gate, a fresh rid per turn) and records what the engine saw and returned."""

    def __init__(self, lifecycle: Lifecycle, url: str, uid: str) -> None:
        self.lifecycle, self.url, self.uid = lifecycle, url, uid
        self.inputs: list[list[int]] = []
        self.outputs: list[GenerateOutput] = []
        self._n = itertools.count()

    async def __call__(self, ids: list[int], p: SamplingParams) -> GenerateOutput:
        self.inputs.append(list(ids))
        out = await self.lifecycle.generate(self.url, ids, p, rid=f"{self.uid}-{next(self._n)}", timeout=120)
        self.outputs.append(out)
        return out


def assert_matches_engine(traj: Trajectory, rec: Recorder) -> None:
    traj.check_invariants()
    full = traj.prompt_ids + traj.response_ids
    assert full == rec.inputs[-1] + rec.outputs[-1].output_ids
    assert rec.inputs[0] == traj.prompt_ids
    for inp in rec.inputs:
        assert full[: len(inp)] == inp
    sampled = [t for o in rec.outputs for t in o.output_ids]
    lps = [x for o in rec.outputs for x in o.output_logprobs]
    assert [t for t, m in zip(traj.response_ids, traj.response_mask) if m] == sampled
    assert [x for x, m in zip(traj.response_logprobs, traj.response_mask) if m] == lps
    assert [t.weight_version for t in traj.turns] == [o.weight_version for o in rec.outputs]


async def test_tool_loop_on_arithmetic_with_the_tiny_model(tiny_engine: Engine) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentloop.tasks.arithmetic import evaluate_expression, extract_final_answer, generate_questions
    from agentloop.tools import ToolRegistry
    from agentloop.tools.builtin.calculator import CalculatorTool

    tok = AutoTokenizer.from_pretrained(str(tiny_engine.model_dir))
    url = tiny_engine.url
    client = SGLangClient(url)
    lifecycle = Lifecycle([client])
    tools = ToolRegistry([CalculatorTool()])  # built once, shared by every trajectory
    cfg = AgentConfig(
        max_assistant_turns=4, max_response_tokens=384, max_context_tokens=1024, max_new_tokens_per_turn=96,
        sampling=SamplingConfig(temperature=0.0),
    )
    questions = generate_questions(6, seed=7)
    samples = [
        Sample(uid=f"q{i}", messages=[{"role": "user", "content": q.question}], ground_truth=q.answer,
               reward="arithmetic", group_id=f"q{i}")
        for i, q in enumerate(questions)
    ]
    recs = {s.uid: Recorder(lifecycle, url, s.uid) for s in samples}
    results: dict[str, Trajectory] = {}

    async def one(s: Sample) -> None:
        ctx = AgentContext(generate=recs[s.uid], tokenizer=tok, config=cfg, tools=tools, clock=time.monotonic)
        traj = await get_agent("tool").run(s, ctx)
        await score(traj, s)
        results[s.uid] = traj

    try:
        async with anyio.create_task_group() as tg:  # the batch is in flight at once
            for s in samples:
                tg.start_soon(one, s)
    finally:
        await client.close()

    assert sum(results[s.uid].status == "completed" for s in samples) >= len(samples) // 2
    model = AutoModelForCausalLM.from_pretrained(str(tiny_engine.model_dir), dtype=torch.float32).eval()
    for s in samples:
        traj, rec = results[s.uid], recs[s.uid]
        # A small model may keep calling until the turn limit; it never fails or aborts.
        assert traj.status in ("completed", "truncated"), (traj.status, traj.finish_reason, traj.error)
        assert_matches_engine(traj, rec)
        assert traj.tool_calls >= 1, traj.messages
        tool_msgs = [m for m in traj.messages if m["role"] == "tool"]
        assert len(tool_msgs) == traj.tool_calls and all(m["name"] == "calculator" for m in tool_msgs)
        errors = [m for m in tool_msgs if m["content"].startswith("Error")]
        assert traj.metrics["tool_errors"] == len(errors)
        assert [e.kind for e in traj.timeline].count("tool") == len(traj.extra["tool_results"]) >= 1
        assert traj.reward in (0.0, 1.0)
        # Mask 0 holds exactly the template's tool turns: the tool results' text is in them.
        fixed = tok.decode([t for t, m in zip(traj.response_ids, traj.response_mask) if not m])
        for m in tool_msgs:
            assert m["content"] in fixed
        # Teacher forcing the same weights over prompt+response gives the engine's logprobs at
        # every sampled position: the trainer's tokens are the policy's tokens.
        ids = torch.tensor([traj.prompt_ids + traj.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        p = len(traj.prompt_ids)
        for j, (t, m, lp) in enumerate(zip(traj.response_ids, traj.response_mask, traj.response_logprobs)):
            if m:
                row = logp[p + j - 1]
                assert row[t].item() == pytest.approx(lp, abs=1e-3)
                top2 = row.topk(2).values
                if (top2[0] - top2[1]).item() > 1e-3:  # greedy picked the argmax (ties aside)
                    assert row.argmax().item() == t
        # Each tool result is the calculator's value of the call the model made.
        calls = [c for m in traj.messages if m["role"] == "assistant" for c in m.get("tool_calls") or []]
        for c, m in zip(calls, tool_msgs):
            if not m["content"].startswith("Error"):
                assert m["content"] == str(evaluate_expression(json.loads(c["function"]["arguments"])["expression"]))
        # OpenAI format: each tool message answers its call by id.
        assert [m["tool_call_id"] for m in tool_msgs] == [c["id"] for c in calls]
        # The reward is the final answer's correctness (whatever this small model's accuracy).
        assert traj.messages[-1]["role"] == "assistant"
        final = traj.messages[-1]["content"]
        assert traj.reward == float(extract_final_answer(final) == s.ground_truth), final


async def test_tiny_model_continues_after_a_hanging_and_a_raising_tool(tiny_engine: Engine) -> None:
    """The model really calls `calculator`; here the calculator hangs (timed out) or raises: the
    error text is the tool result the model reads, and the trajectory goes on to another turn."""
    from transformers import AutoTokenizer

    from agentloop.tasks.arithmetic import CALCULATOR_TOOL, generate_questions
    from agentloop.tools import Tool, ToolContext, ToolRegistry

    class BrokenCalculator(Tool):
        name = "calculator"
        description = CALCULATOR_TOOL["function"]["description"]
        parameters = CALCULATOR_TOOL["function"]["parameters"]

        def __init__(self, mode: str) -> None:
            self.mode = mode

        async def execute(self, arguments: dict[str, Any], context: ToolContext) -> str:
            if self.mode == "hang":
                await anyio.sleep_forever()
            raise ValueError("calculator is out of batteries")

    tok = AutoTokenizer.from_pretrained(str(tiny_engine.model_dir))
    client = SGLangClient(tiny_engine.url)
    lifecycle = Lifecycle([client])
    q = generate_questions(1, seed=11)[0]
    cfg = AgentConfig(max_assistant_turns=3, max_new_tokens_per_turn=96, tool_timeout=0.5,
                      sampling=SamplingConfig(temperature=0.0))
    try:
        for mode, needle in (("hang", "timed out"), ("raise", "out of batteries")):
            uid = f"broken-{mode}"
            rec = Recorder(lifecycle, tiny_engine.url, uid)
            ctx = AgentContext(generate=rec, tokenizer=tok, config=cfg, tools=ToolRegistry([BrokenCalculator(mode)]))
            s = Sample(uid=uid, messages=[{"role": "user", "content": q.question}], ground_truth=q.answer)
            traj = await get_agent("tool").run(s, ctx)
            assert traj.status in ("completed", "truncated"), (traj.status, traj.error)
            assert_matches_engine(traj, rec)
            assert traj.metrics["tool_errors"] >= 1 and traj.num_turns >= 2
            assert needle in traj.messages[2]["content"]
            assert needle in tok.decode(rec.inputs[1][len(rec.inputs[0]):])  # the model read the error
            if mode == "hang":  # each tool turn ended at the 0.5 s timeout, not later
                spans = [e.end - e.start for e in traj.timeline if e.kind == "tool"]
                assert spans and all(0.45 <= d < 3.0 for d in spans), spans
    finally:
        await client.close()


async def test_simulated_user_asks_a_second_question_to_the_tiny_model(tiny_engine: Engine) -> None:
    from transformers import AutoTokenizer

    from agentloop.agents.interaction import scripted_user
    from agentloop.tasks.arithmetic import generate_questions
    from agentloop.tools import ToolRegistry
    from agentloop.tools.builtin.calculator import CalculatorTool

    tok = AutoTokenizer.from_pretrained(str(tiny_engine.model_dir))
    client = SGLangClient(tiny_engine.url)
    q1, q2 = generate_questions(2, seed=3)
    s = Sample(uid="chat", messages=[{"role": "user", "content": q1.question}], ground_truth=q2.answer,
               reward="arithmetic", extra={"user_turns": [q2.question]})
    rec = Recorder(Lifecycle([client]), tiny_engine.url, "chat")
    cfg = AgentConfig(max_assistant_turns=6, max_response_tokens=600, max_context_tokens=1500,
                      max_new_tokens_per_turn=96, sampling=SamplingConfig(temperature=0.0))
    ctx = AgentContext(generate=rec, tokenizer=tok, config=cfg, tools=ToolRegistry([CalculatorTool()]),
                       interaction=scripted_user)
    try:
        traj = await get_agent("tool").run(s, ctx)
        await score(traj, s)
    finally:
        await client.close()
    assert traj.status == "completed" and traj.extra["user_turns"] == 1, (traj.status, traj.finish_reason)
    assert_matches_engine(traj, rec)
    users = [i for i, m in enumerate(traj.messages) if m["role"] == "user"]
    assert len(users) == 2 and traj.messages[users[1]]["content"] == q2.question
    assert traj.messages[users[1] - 1]["role"] == "assistant"  # asked after the model's first answer
    # The second question is template text (mask 0) between two model turns.
    fixed = tok.decode([t for t, m in zip(traj.response_ids, traj.response_mask) if not m])
    assert f"<|im_start|>user\n{q2.question}<|im_end|>" in fixed
    assert traj.reward is not None


async def test_interaction_loop_from_a_dataset_row_with_the_tiny_model(tiny_engine: Engine) -> None:
    """A row `agent: interaction` naming its simulated user (`interaction: scripted_user`) runs the
    `interaction` loop; the context has no hook: the user comes from the row."""
    from transformers import AutoTokenizer

    from agentloop.agents import registered_agents
    from agentloop.dataset import row_to_sample
    from agentloop.tasks.arithmetic import generate_questions
    from agentloop.tools import ToolRegistry
    from agentloop.tools.builtin.calculator import CalculatorTool

    tok = AutoTokenizer.from_pretrained(str(tiny_engine.model_dir))
    client = SGLangClient(tiny_engine.url)
    q1, q2 = generate_questions(2, seed=5)
    row = {"prompt": q1.question, "agent": "interaction", "interaction": "scripted_user",
           "user_turns": [q2.question], "ground_truth": q2.answer, "reward": "arithmetic"}
    s = row_to_sample(row, default_uid="row0", known_agents=registered_agents())
    rec = Recorder(Lifecycle([client]), tiny_engine.url, s.uid)
    cfg = AgentConfig(max_assistant_turns=6, max_response_tokens=600, max_context_tokens=1500,
                      max_new_tokens_per_turn=96, sampling=SamplingConfig(temperature=0.0))
    ctx = AgentContext(generate=rec, tokenizer=tok, config=cfg, tools=ToolRegistry([CalculatorTool()]))
    try:
        traj = await get_agent(s.agent).run(s, ctx)
        await score(traj, s)
    finally:
        await client.close()
    assert traj.status == "completed" and traj.extra["user_turns"] == 1, (traj.status, traj.finish_reason, traj.error)
    assert_matches_engine(traj, rec)
    users = [i for i, m in enumerate(traj.messages) if m["role"] == "user"]
    assert len(users) == 2 and traj.messages[users[1]]["content"] == q2.question
    fixed = tok.decode([t for t, m in zip(traj.response_ids, traj.response_mask) if not m])
    assert f"<|im_start|>user\n{q2.question}<|im_end|>" in fixed
    assert traj.num_turns >= 2 and traj.reward is not None


def _random_ctx(engine: Engine, lifecycle: Lifecycle, uid: str, **cfg: Any) -> tuple[AgentContext, Recorder]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(engine.model_dir))
    rec = Recorder(lifecycle, engine.url, uid)
    return AgentContext(generate=rec, tokenizer=tok, config=AgentConfig(**cfg)), rec


async def test_single_turn_and_replay_over_http(random_engine: Engine) -> None:
    client = SGLangClient(random_engine.url)
    lifecycle = Lifecycle([client])
    try:
        ctx, rec = _random_ctx(random_engine, lifecycle, "st", max_new_tokens_per_turn=12,
                               sampling=SamplingConfig(temperature=1.0, seed=3))
        traj = await get_agent("single_turn").run(Sample(uid="st", messages=[{"role": "user", "content": "hi"}]), ctx)
        assert traj.status in ("completed", "truncated") and traj.num_turns == 1
        assert_matches_engine(traj, rec)
        assert traj.prompt_ids + traj.response_ids == rec.inputs[-1] + rec.outputs[-1].output_ids

        spec = [
            {"gen_tokens": 9, "tool_latency_s": 0.05, "tool_result_tokens": 5},
            {"gen_tokens": 4, "tool_latency_s": 0.0, "tool_result_tokens": 3},
            {"gen_tokens": 6},
        ]
        ctx, rec = _random_ctx(random_engine, lifecycle, "rp")
        s = Sample(uid="rp", messages=[], agent="replay", extra={"replay": {"prompt_tokens": 20, "turns": spec}})
        traj = await get_agent("replay").run(s, ctx)
        assert traj.status == "completed", traj.error
        assert_matches_engine(traj, rec)
        assert traj.response_mask == [1] * 9 + [0] * 5 + [1] * 4 + [0] * 3 + [1] * 6
        assert all(o.finish_reason["type"] == "length" for o in rec.outputs)  # ignore_eos: exact lengths
    finally:
        await client.close()


async def test_engine_abort_mid_turn_then_resume_is_a_partial_rollout(random_engine: Engine) -> None:
    client = SGLangClient(random_engine.url)
    lifecycle = Lifecycle([client])
    spec = [{"gen_tokens": 3000, "tool_latency_s": 0.0, "tool_result_tokens": 4}, {"gen_tokens": 5}]
    s = Sample(uid="ab", messages=[], agent="replay", extra={"replay": {"prompt_tokens": 16, "turns": spec}})
    try:
        ctx, rec = _random_ctx(random_engine, lifecycle, "ab", max_response_tokens=4000)
        result: list[Trajectory] = []

        async def run() -> None:
            result.append(await get_agent("replay").run(s, ctx))

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            with anyio.fail_after(60):
                while not rec.inputs:
                    await anyio.sleep(0.01)
            await anyio.sleep(0.3)  # let some tokens be sampled
            await lifecycle.abort("ab-0")
        partial = result[0]
        assert (partial.status, partial.finish_reason) == ("aborted", "abort")
        n = len(partial.response_ids)
        assert 0 < n < 3000 and partial.response_mask == [1] * n
        assert_matches_engine(partial, rec)

        ctx2, rec2 = _random_ctx(random_engine, lifecycle, "ab2", max_response_tokens=4000)
        s2 = Sample(uid="ab", messages=[], agent="replay", extra=s.extra, resume_from=partial)
        traj = await get_agent("replay").run(s2, ctx2)
        assert traj.status == "completed", traj.error
        traj.check_invariants()
        assert rec2.inputs[0] == partial.prompt_ids + partial.response_ids  # continued, not restarted
        assert traj.response_mask == [1] * 3000 + [0] * 4 + [1] * 5
        assert traj.response_ids[:n] == partial.response_ids
        assert len(traj.turns) == 3 and traj.num_turns == 2
    finally:
        await client.close()
