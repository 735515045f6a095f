"""A step ends at once when its target is met (issue 27, part 0): trajectories waiting on a tool are
stopped without waiting the tool out (they keep their tokens and are carried), the requests in flight
are aborted in one round (one `abort_all` per server when this runtime is the servers' only client),
and a carried trajectory resumed next step runs the cut tool call again and ends exactly as an
uninterrupted run of the same sample."""

from __future__ import annotations

import time

import anyio
import pytest

from agentloop.agents.base import AgentConfig
from agentloop.agents.replay import INTERRUPTED_TOOL
from agentloop.config import SchedulerConfig
from agentloop.engine.lifecycle import Lifecycle
from agentloop.engine.router import Router
from agentloop.scheduler import Scheduler
from agentloop.types import Sample

from test_scheduler_support import FakeEngine, length_reward

pytestmark = pytest.mark.anyio

TOOL_S = 2.0  # every slow trajectory's first tool call; a step that waited it out would take this long


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make(engine: FakeEngine, *, sole_client: bool = True, **cfg) -> Scheduler:
    router = Router(Lifecycle([engine], awake=True), sole_client=sole_client)
    return Scheduler(router, tokenizer=None, agent_config=AgentConfig(max_new_tokens_per_turn=1000),
                     config=SchedulerConfig(**cfg), reward_fn=length_reward)


def replay(uid: str, turns: list[dict]) -> Sample:
    return Sample(uid=uid, messages=[], agent="replay", extra={"replay": {"prompt_tokens": 4, "turns": turns}})


def slow(uid: str) -> Sample:
    """A first turn, then a long tool call, then two more turns (the second tool call is short)."""
    return replay(uid, [{"gen_tokens": 2, "tool_latency_s": TOOL_S, "tool_result_tokens": 3},
                        {"gen_tokens": 3, "tool_latency_s": 0.01, "tool_result_tokens": 2},
                        {"gen_tokens": 2}])


async def test_a_met_target_cuts_tool_waits_at_once_and_the_carried_trajectories_resume_exactly() -> None:
    engine = FakeEngine("http://a", token_delay=0.004)
    sched = make(engine, n=1, target_groups=1, concurrency=64)
    # The quick one finishes (~0.1 s) while the 24 slow ones sit in their 2 s tool call.
    quick = replay("quick", [{"gen_tokens": 25}])
    slows = [slow(f"s{i}") for i in range(24)]
    emitted: list[float] = []
    t0 = time.monotonic()
    res = await sched.run([quick, *slows], on_trajectory=lambda t: emitted.append(time.monotonic()))
    t_end = time.monotonic()
    assert [t.uid for t in res.trajectories] == ["quick"] and len(res.carry_over) == 24
    for s in res.carry_over:
        traj = s.resume_from
        assert traj is not None and traj.status == "aborted" and traj.error is None
        # Stopped inside its first tool call: no tool event was recorded (no tool wait outlived the stop)...
        assert traj.extra[INTERRUPTED_TOOL] == 0 and traj.tool_calls == 0
        assert not [e for e in traj.timeline if e.kind == "tool"] and traj.metrics["tool_seconds"] == 0.0
        assert sum(traj.response_mask) == 2 and traj.response_mask == [1, 1]  # ...and it keeps its first turn
    # ...so the step returned right after the target was met, not after the tool latency.
    assert len(emitted) == 1 and t_end - emitted[0] < TOOL_S / 2, (t_end - t0, t_end - emitted[0])
    assert not engine.abort_calls  # nothing was generating: nothing to abort

    # Next step: each carried trajectory runs the cut tool call again and finishes as if never stopped.
    res2 = await sched.run(res.carry_over, config=sched.config.model_copy(update={"target_groups": None}))
    reference = await make(FakeEngine("http://b", token_delay=0.004), n=1, concurrency=64).run([slow("s0")])
    want = reference.trajectories[0]
    assert want.status == "completed" and want.tool_calls == 2
    assert [t.uid for t in res2.trajectories] == [s.uid for s in slows] and not res2.carry_over
    for t in res2.trajectories:
        t.check_invariants()
        assert t.status == "completed" and t.tool_calls == 2 and INTERRUPTED_TOOL not in t.extra
        assert t.response_mask == want.response_mask == [1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
        # Sampled ids and their logprobs as the engine returned them (the fake's ids depend on the
        # input length, so a tool result lost or appended twice would change them).
        sampled = [(i, lp) for i, lp, m in zip(t.response_ids, t.response_logprobs, t.response_mask) if m]
        assert sampled == [(i, lp) for i, lp, m in zip(want.response_ids, want.response_logprobs, want.response_mask) if m]
        first = res.carry_over[[s.uid for s in res.carry_over].index(t.uid)].resume_from
        assert t.response_ids[:2] == first.response_ids  # the first turn is the one sampled before the stop
    s0 = next(t for t in res2.trajectories if t.uid == "s0")
    assert s0.response_ids == want.response_ids and s0.response_logprobs == want.response_logprobs


@pytest.mark.parametrize("sole_client", [True, False])
async def test_requests_in_flight_are_aborted_in_one_round(sole_client: bool) -> None:
    engine = FakeEngine("http://a", token_delay=0.01)
    sched = make(engine, sole_client=sole_client, n=1, target_groups=1, concurrency=64)
    quick = replay("quick", [{"gen_tokens": 5}])
    long = [replay(f"l{i}", [{"gen_tokens": 600}]) for i in range(30)]  # 6 s each if not aborted
    t0 = time.monotonic()
    res = await sched.run([quick, *long])
    assert time.monotonic() - t0 < 3.0
    assert [t.uid for t in res.trajectories] == ["quick"] and len(res.carry_over) == 30
    assert all(0 < len(s.resume_from.response_ids) < 600 for s in res.carry_over)  # partial, kept
    if sole_client:
        # Every request in flight on the server was one the stop ended: one abort_all, not 30 aborts.
        assert engine.abort_calls[0] is None and len(engine.abort_calls) <= 2, engine.abort_calls
    else:
        # Another client may share the server: each request by its rid, once per round.
        rids = {rid for rid, _ in engine.generates if rid.startswith("l")}
        assert set(engine.abort_calls) == rids and len(engine.abort_calls) <= 2 * len(rids)
    assert sched.router.stats.abort_requests == len(engine.abort_calls)


async def test_a_stop_from_outside_cuts_tool_waits_too() -> None:
    """`Scheduler.stop` (the runtime's sleep in the middle of a step) ends tool waits as the early stop does."""
    engine = FakeEngine("http://a", token_delay=0.002)
    sched = make(engine, n=1, concurrency=8)
    result = {}

    async def run() -> None:
        result["res"] = await sched.run([slow(f"s{i}") for i in range(4)])

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await anyio.sleep(0.3)  # every trajectory is in its 2 s tool call now
        t_stop = time.monotonic()
        sched.stop("runtime sleep requested")
    assert time.monotonic() - t_stop < TOOL_S / 2
    res = result["res"]
    assert not res.trajectories and [s.resume_from.extra[INTERRUPTED_TOOL] for s in res.carry_over] == [0] * 4


async def test_the_tool_loop_ends_at_once_when_stopped_during_its_tool_calls_and_resumes_them() -> None:
    from agentloop.agents import AgentContext, get_agent
    from agentloop.agents.tool import INTERRUPTED
    from agentloop.tools import ToolRegistry
    from test_agents import Calculator, ScriptedEngine, call
    from test_chat_templates import qwen_style_tokenizer

    tok = qwen_style_tokenizer()
    turns = [call("calculator", expression="2 + 3"), "The answer is 5."]
    s = Sample(uid="s0", messages=[{"role": "user", "content": "What is 2 + 3?"}])

    def ctx(engine: ScriptedEngine, tools: ToolRegistry, stop=None) -> AgentContext:
        return AgentContext(generate=engine, tokenizer=tok, config=AgentConfig(), tools=tools, stop=stop)

    reference = await get_agent("tool").run(s, ctx(ScriptedEngine(tok, list(turns)), ToolRegistry([Calculator()])))
    assert reference.status == "completed" and reference.tool_calls == 1

    # The real stop signal: the route session the scheduler gives the trajectory.
    session = Router(Lifecycle([FakeEngine("http://a")], awake=True)).session("s0")
    box = {}

    async def run() -> None:
        box["partial"] = await get_agent("tool").run(
            s, ctx(ScriptedEngine(tok, turns[:1]), ToolRegistry([Calculator(delay=30.0)]), stop=session))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await anyio.sleep(0.3)  # inside the 30 s calculator call
        t_stop = time.monotonic()
        session.stop("early stop: target groups reached")
    assert time.monotonic() - t_stop < 2.0  # the tool call was cut, not waited out
    partial = box["partial"]
    partial.check_invariants()
    assert (partial.status, partial.finish_reason, partial.error) == ("aborted", "abort", None)
    assert partial.extra[INTERRUPTED] is True and partial.tool_calls == 0 and partial.num_turns == 1
    assert [m["role"] for m in partial.messages] == ["user", "assistant"]

    resumed = await get_agent("tool").run(
        Sample(uid="s0", messages=s.messages, resume_from=partial),
        ctx(ScriptedEngine(tok, turns[1:], version="v2"), ToolRegistry([Calculator()])))
    assert resumed.status == "completed" and resumed.tool_calls == 1 and INTERRUPTED not in resumed.extra
    resumed.check_invariants()
    # Exactly the uninterrupted run: same tokens, masks, logprobs, messages (call ids included).
    assert resumed.response_ids == reference.response_ids and resumed.response_mask == reference.response_mask
    assert resumed.response_logprobs == reference.response_logprobs
    assert resumed.messages == reference.messages
    assert resumed.weight_versions == ["v1", "v2"]  # each turn tagged with the version that sampled it


async def test_a_stop_cuts_the_wait_for_the_simulated_user_and_the_resume_asks_again() -> None:
    from agentloop.agents import AgentContext, get_agent
    from agentloop.agents.tool import INTERRUPTED
    from test_agents import ScriptedEngine
    from test_chat_templates import qwen_style_tokenizer

    tok = qwen_style_tokenizer()
    s = Sample(uid="u0", messages=[{"role": "user", "content": "Hi"}])

    def user(delay: float):
        async def reply(messages, sample):  # one follow-up, then done
            await anyio.sleep(delay)
            return "Tell me more." if sum(m["role"] == "user" for m in messages) == 1 else None
        return reply

    def ctx(engine: ScriptedEngine, delay: float, stop=None) -> AgentContext:
        return AgentContext(generate=engine, tokenizer=tok, config=AgentConfig(), interaction=user(delay), stop=stop)

    reference = await get_agent("tool").run(s, ctx(ScriptedEngine(tok, ["Hello.", "More."]), 0.0))
    assert reference.status == "completed" and reference.extra["user_turns"] == 1
    session = Router(Lifecycle([FakeEngine("http://a")], awake=True)).session("u0")
    box = {}

    async def run() -> None:
        box["partial"] = await get_agent("tool").run(s, ctx(ScriptedEngine(tok, ["Hello."]), 30.0, stop=session))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await anyio.sleep(0.3)  # waiting for the 30 s user
        t_stop = time.monotonic()
        session.stop("early stop: target groups reached")
    assert time.monotonic() - t_stop < 2.0
    partial = box["partial"]
    assert (partial.status, partial.extra[INTERRUPTED], partial.extra["user_turns"]) == ("aborted", True, 0)
    resumed = await get_agent("tool").run(Sample(uid="u0", messages=s.messages, resume_from=partial),
                                          ctx(ScriptedEngine(tok, ["More."], version="v2"), 0.0))
    assert resumed.status == "completed" and INTERRUPTED not in resumed.extra
    assert resumed.response_ids == reference.response_ids and resumed.response_mask == reference.response_mask
    assert resumed.messages == reference.messages and resumed.weight_versions == ["v1", "v2"]
