"""`slot_order: target_first` with preemption: the groups that will meet the step's target take a request
slot from the surplus of over-sampling, whose preempted turn is continued in place by its route session,
so no agent loop sees the preemption and every token and logprob is the one the engine sampled."""

from __future__ import annotations

import anyio
import pytest

from agentloop.agents.base import AgentConfig
from agentloop.config import SchedulerConfig
from agentloop.engine.base import SamplingParams
from agentloop.engine.lifecycle import Lifecycle
from agentloop.engine.router import Router
from agentloop.engine.slots import PrioritySlots
from agentloop.scheduler import Scheduler
from agentloop.scheduler.book import GroupBook, expand_samples
from agentloop.types import Sample

from test_scheduler_support import FakeEngine, length_reward

pytestmark = pytest.mark.anyio

LOW, HIGH = (1, 4, 5), (0, 4, 0)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def fake_tokens(input_len: int, n: int) -> list[int]:
    """What FakeEngine samples for `n` tokens after `input_len` (a function of the position only)."""
    return [(input_len + t) % 500 + 1 for t in range(n)]


def test_slots_preempt_only_a_worse_class_and_each_holder_once() -> None:
    slots = PrioritySlots(3)
    held = [slots.hold(key, (f"u{k}", f"r{k}")) for k, key in enumerate([(0, 1, 0), (1, 2, 7), (1, 4, 3)])]
    assert slots.preempt_for((1, 0, 0)) is None  # same class: waits like any waiter
    assert slots.preempt_for((0, 3, 9)) == ("u2", "r2")  # the worst key of the worse class first
    assert PrioritySlots.was_preempted(held[2]) and not PrioritySlots.was_preempted(held[1])
    assert slots.preempt_for((0, 3, 9)) == ("u1", "r1")
    assert slots.preempt_for((0, 0, 0)) is None  # only class 0 holds now; nobody is chosen twice
    assert slots.preemptions == 2
    for r in held:
        slots.release(r)
    slots.release(held[0])  # a record released twice counts once
    assert slots._live_holders == 0
    for k in range(500):  # released records do not pile up in the heap
        slots.release(slots.hold((0, 0, k), ("u", "r")))
    assert len(slots._holders) <= 64 + 2


async def test_a_forfeited_entry_passes_a_granted_slot_on() -> None:
    slots = PrioritySlots(1)
    assert slots.enqueue() is None
    a, b = slots.enqueue((0,)), slots.enqueue((1,))
    slots.release()  # granted to a, whose waiter is cancelled before it waits
    slots.forfeit(a)
    with anyio.fail_after(5):
        assert await slots.wait(b) is True
    slots.release()
    assert slots.free == 1


def router_one_slot(engine: FakeEngine) -> Router:
    return Router(Lifecycle([engine], awake=True), per_server_limit=1, slot_order="target_first", sole_client=True)


async def test_a_target_turn_takes_the_slot_and_the_preempted_turn_continues_exactly() -> None:
    engine = FakeEngine("http://a", token_delay=0.01)
    router = router_one_slot(engine)
    low = router.session("low", slot_rank=lambda: LOW, preempt=True)
    high = router.session("high", slot_rank=lambda: HIGH, preempt=True)
    prompt = [1, 2, 3, 4, 5]
    done: dict[str, float] = {}
    outs = {}

    async def run(name, session, n) -> None:
        outs[name] = await session(prompt, SamplingParams(max_new_tokens=n))
        done[name] = anyio.current_time()

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "low", low, 40)
            while len(engine.generates) < 1 or not engine.running:
                await anyio.sleep(0.005)
            await anyio.sleep(0.08)  # a few tokens sampled
            tg.start_soon(run, "high", high, 3)
    assert done["high"] < done["low"]
    out = outs["low"]
    # One output for the whole turn: the pieces' tokens in order, exactly an uninterrupted turn's.
    assert out.finish_type == "length" and out.output_ids == fake_tokens(len(prompt), 40)
    assert out.output_logprobs == [-0.25] * 40 and not out.interrupted_for_update
    assert outs["high"].output_ids == fake_tokens(len(prompt), 3)
    low_requests = [(rid, n) for rid, n in engine.generates if rid.startswith("low-")]
    assert len(low_requests) == 2 and low_requests[0][1] == len(prompt) < low_requests[1][1] < len(prompt) + 40
    assert engine.abort_calls == [low_requests[0][0]]  # only the preempted request, not abort_all
    assert low.preempted == 1 and high.preempted == 0 and router.stats.slot_preemptions == 1
    assert router.slots("http://a").free == 1


@pytest.mark.parametrize("why", ["same_class", "no_preempt"])
async def test_no_preemption_within_a_class_or_when_off(why: str) -> None:
    engine = FakeEngine("http://a", token_delay=0.005)
    router = router_one_slot(engine)
    low = router.session("low", slot_rank=lambda: LOW, preempt=True)
    other = router.session("other", slot_rank=lambda: (1, 0, 0) if why == "same_class" else HIGH,
                           preempt=why != "no_preempt")
    done: list[str] = []

    async def run(name, session, n) -> None:
        await session([1, 2], SamplingParams(max_new_tokens=n))
        done.append(name)

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "low", low, 30)
            while not engine.running:
                await anyio.sleep(0.005)
            tg.start_soon(run, "other", other, 2)
    assert done == ["low", "other"] and not engine.abort_calls and low.preempted == 0


async def test_a_stop_while_a_preempted_turn_waits_returns_its_tokens_aborted() -> None:
    engine = FakeEngine("http://a", token_delay=0.01)
    router = router_one_slot(engine)
    low = router.session("low", slot_rank=lambda: LOW, preempt=True)
    high = router.session("high", slot_rank=lambda: HIGH, preempt=True)
    outs = {}

    async def run(name, session, n) -> None:
        outs[name] = await session([1, 2, 3], SamplingParams(max_new_tokens=n))

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "low", low, 100)
            while not engine.running:
                await anyio.sleep(0.005)
            await anyio.sleep(0.05)
            tg.start_soon(run, "high", high, 60)  # holds the slot long enough for the stop below
            while low.preempted == 0 or not any(r.startswith("high-") for r in engine.running):
                await anyio.sleep(0.005)
            await router.stop_sessions([low], "step over")
    out = outs["low"]
    assert out.aborted and 0 < len(out.output_ids) < 100 and out.output_ids == fake_tokens(3, len(out.output_ids))
    assert len(out.output_logprobs) == len(out.output_ids)
    assert outs["high"].output_ids == fake_tokens(3, 60)


async def test_weights_changed_between_pieces_return_the_turn_as_interrupted_by_the_update() -> None:
    engine = FakeEngine("http://a", token_delay=0.01, version="v1")
    router = router_one_slot(engine)
    low = router.session("low", slot_rank=lambda: LOW, preempt=True)
    high = router.session("high", slot_rank=lambda: HIGH, preempt=True)
    outs = {}

    async def run(name, session, n) -> None:
        outs[name] = await session([1, 2, 3], SamplingParams(max_new_tokens=n))

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "low", low, 100)
            while not engine.running:
                await anyio.sleep(0.005)
            await anyio.sleep(0.05)
            tg.start_soon(run, "high", high, 20)
            while low.preempted == 0:
                await anyio.sleep(0.002)
            engine.weight_version = "v2"  # served to the continuation, not to the first piece
    out = outs["low"]
    first = [n for rid, n in engine.generates if rid.startswith("low-")]
    assert len(first) == 2
    sampled_before = first[1] - 3
    assert out.aborted and out.interrupted_for_update and out.weight_version == "v1"
    assert out.output_ids == fake_tokens(3, sampled_before) and len(out.output_logprobs) == sampled_before


def test_slot_rank_puts_the_groups_nearest_the_target_first() -> None:
    jobs = expand_samples([Sample(uid=f"g{k}", messages=[]) for k in range(4)], 2)
    book = GroupBook(n=2, target_groups=2)
    book.add(jobs)
    from agentloop.types import Trajectory

    def done(i: int) -> None:
        book.finish(i, Trajectory(uid=jobs[i].uid, group_id=jobs[i].group_id, prompt_ids=[1], status="completed"))

    assert [book.slot_rank(i)[0] for i in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]  # in the order given
    done(6)  # g3 has one member left: it is nearer the target than g1
    assert [book.slot_rank(i)[0] for i in (0, 2, 7)] == [0, 1, 0] and book.slot_rank(7) == (0, 1, 3)
    done(7)  # g3 accepted: one group still wanted, g0 (the oldest of those with two left)
    assert [book.slot_rank(i)[0] for i in (0, 2, 4)] == [0, 1, 1]
    free = GroupBook(n=2)
    free.add(jobs)
    assert {free.slot_rank(i)[0] for i in range(8)} == {0}  # no target: no surplus to preempt


def mixed(turn_tokens: dict[int, int]) -> list[Sample]:
    """Groups of 2 whose model turns have `turn_tokens[group]` tokens (3 turns, a short tool between)."""
    def turns(n: int) -> list[dict]:
        tool = {"gen_tokens": n, "tool_latency_s": 0.05, "tool_result_tokens": 3}
        return [tool, tool, {"gen_tokens": n}]

    return [Sample(uid=f"g{k}", messages=[], agent="replay", extra={"replay": {"prompt_tokens": 4, "turns": turns(n)}})
            for k, n in turn_tokens.items()]


async def test_over_sampling_with_target_first_preempts_the_surplus_and_keeps_every_token_exact() -> None:
    # Two short target groups first, then four surplus groups with long turns that fill both slots while
    # the target groups are in their tool calls.
    tokens = {0: 5, 1: 5, 2: 150, 3: 150, 4: 150, 5: 150}
    engine = FakeEngine("http://a", token_delay=0.002)
    router = Router(Lifecycle([engine], awake=True), per_server_limit=2, sole_client=True)
    cfg = SchedulerConfig(n=2, target_groups=2, concurrency=64, slot_order="target_first", slot_preemption=True,
                          partial_rollout=True)
    sched = Scheduler(router, tokenizer=None, agent_config=AgentConfig(max_new_tokens_per_turn=1000), config=cfg,
                      reward_fn=length_reward)
    with anyio.fail_after(60):
        res = await sched.run(mixed(tokens))
        assert {t.group_id for t in res.trajectories} == {"g0", "g1"} and len(res.carry_over) == 8
        assert res.metrics["slot_preemptions"] >= 1 and engine.abort_calls
        rest = await sched.run(res.carry_over, config=cfg.model_copy(update={"target_groups": None}))
    reference = await Scheduler(Router(Lifecycle([FakeEngine("http://b", token_delay=0.001)], awake=True)),
                                tokenizer=None, agent_config=AgentConfig(max_new_tokens_per_turn=1000),
                                config=SchedulerConfig(n=2, concurrency=64), reward_fn=length_reward).run(mixed(tokens))
    want = {t.uid: t for t in reference.trajectories}
    got = [*res.trajectories, *rest.trajectories]
    assert sorted(t.uid for t in got) == sorted(want) and not rest.carry_over
    for t in got:  # a preempted turn's pieces are one turn: the same ids, logprobs and mask as uninterrupted
        t.check_invariants()
        w = want[t.uid]
        assert (t.response_ids, t.response_mask, t.response_logprobs) == (w.response_ids, w.response_mask,
                                                                          w.response_logprobs), t.uid
        assert t.num_turns == w.num_turns == 3
    assert router.slots("http://a").free == 2


async def test_target_first_without_slot_preemption_never_aborts() -> None:
    tokens = {0: 5, 1: 5, 2: 150, 3: 150}
    engine = FakeEngine("http://a", token_delay=0.002)
    router = Router(Lifecycle([engine], awake=True), per_server_limit=2, sole_client=True)
    cfg = SchedulerConfig(n=2, target_groups=2, concurrency=64, slot_order="target_first", slot_preemption=False)
    sched = Scheduler(router, tokenizer=None, agent_config=AgentConfig(max_new_tokens_per_turn=1000), config=cfg,
                      reward_fn=length_reward)
    with anyio.fail_after(60):
        res = await sched.run(mixed(tokens))
    assert res.metrics["slot_preemptions"] == 0
    assert all(c is None for c in engine.abort_calls)  # only the early stop's abort_all, no preemption
