"""Router over in-process engine doubles: stickiness, least-outstanding choice, failover, errors, stop."""

from __future__ import annotations

import anyio
import pytest

from agentloop.agents.base import AgentConfig
from agentloop.config import SchedulerConfig
from agentloop.engine.base import EngineError, EngineUnavailable, MisalignedLogprobs, SamplingParams
from agentloop.engine.lifecycle import Lifecycle
from agentloop.engine.router import Router
from agentloop.scheduler import Scheduler

from test_scheduler_support import FakeEngine, length_reward, samples

pytestmark = pytest.mark.anyio
P = SamplingParams(max_new_tokens=3)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def scheduler(router: Router, **cfg) -> Scheduler:
    return Scheduler(router, tokenizer=None, agent_config=AgentConfig(), config=SchedulerConfig(**cfg), reward_fn=length_reward)


async def test_sticky_and_balanced() -> None:
    a, b = FakeEngine("http://a"), FakeEngine("http://b")
    router = Router(Lifecycle([a, b]))
    res = await scheduler(router, concurrency=8).run(samples(6, turns=3, tokens=2, tool_delay=0.01))
    assert all(t.status == "completed" for t in res.trajectories)
    for t in res.trajectories:
        on_a = [rid for rid, _ in a.generates if rid.startswith(t.uid + "-")]
        on_b = [rid for rid, _ in b.generates if rid.startswith(t.uid + "-")]
        assert sorted([len(on_a), len(on_b)]) == [0, 3]  # every turn on the same server
        assert len(t.extra["servers"]) == 1 and {turn.server_url for turn in t.turns} == set(t.extra["servers"])
    assert len(a.generates) == len(b.generates) == 9  # 3 trajectories each
    assert router.bound() == {"http://a": 0, "http://b": 0}  # released when the trajectories ended
    assert router.outstanding() == {"http://a": 0, "http://b": 0}
    assert len({rid for rid, _ in a.generates + b.generates}) == 18  # a unique rid per request


async def test_new_trajectory_goes_to_least_outstanding_server() -> None:
    a, b = FakeEngine("http://a", token_delay=0.05), FakeEngine("http://b")
    router = Router(Lifecycle([a, b]))
    busy = router.session("busy")
    async with anyio.create_task_group() as tg:
        tg.start_soon(busy, [1, 2], SamplingParams(max_new_tokens=20))
        await anyio.sleep(0.05)
        assert router.outstanding() == {"http://a": 1, "http://b": 0}
        s = router.session("new")
        out = await s([1, 2, 3], P)
        assert out.server_url == "http://b"
        s.close()
        tg.cancel_scope.cancel()


async def test_dead_server_taken_out_and_turns_retried_elsewhere() -> None:
    a, b = FakeEngine("http://a", token_delay=0.005), FakeEngine("http://b", token_delay=0.005)
    lc = Lifecycle([a, b])
    router = Router(lc)
    sched = scheduler(router, concurrency=8)
    box = {}

    async def run() -> None:
        box["res"] = await sched.run(samples(8, turns=4, tokens=5, tool_delay=0.01))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        while len(b.generates) < 6:
            await anyio.sleep(0.005)
        b.dead = True  # connection refused / reset from now on
    res = box["res"]
    assert [t.status for t in res.trajectories] == ["completed"] * 8
    assert lc.urls == ["http://a"] and "http://b" in router.stats.removed
    assert "health probe" in router.stats.removed["http://b"] or "in a row" in router.stats.removed["http://b"]
    moved = [t for t in res.trajectories if t.extra["servers"] == ["http://b", "http://a"]]
    assert moved and all(t.metrics["route_retries"] >= 1 for t in moved)
    for t in res.trajectories:
        t.check_invariants()
        assert len(t.turns) == 4  # the failed attempt appended nothing


async def test_request_errors_are_not_retried() -> None:
    a, b = FakeEngine("http://a"), FakeEngine("http://b")
    lc = Lifecycle([a, b])
    router = Router(lc)
    s = router.session("t")
    a.error_next = EngineError("/generate", 400, "input_ids out of vocabulary", url="http://a")
    with pytest.raises(EngineError, match="out of vocabulary"):
        await s([1], P)
    assert lc.urls == ["http://a", "http://b"] and router.stats.retries == 0


async def test_repeated_server_errors_take_a_server_out() -> None:
    a, b = FakeEngine("http://a"), FakeEngine("http://b")
    lc = Lifecycle([a, b])
    router = Router(lc, failure_threshold=2)
    s = router.session("t")
    a.error_next = EngineError("/generate", 500, "scheduler crashed", url="http://a")
    out = await s([1], P)  # first failure: retried on the same (still healthy) server
    assert out.server_url == "http://a" and lc.urls == ["http://a", "http://b"]
    # Two consecutive failures (the engine double fails one call per `error_next`): the server goes.
    a.error_next = EngineError("/generate", 500, "scheduler crashed", url="http://a")
    orig = a.generate

    async def fail_twice(*args, **kw):
        if a.error_next is None and not getattr(a, "_second", False):
            a._second = True
            raise EngineError("/generate", 503, "overloaded", url="http://a")
        return await orig(*args, **kw)

    a.generate = fail_twice
    out = await s([1], P)
    assert out.server_url == "http://b" and lc.urls == ["http://b"]
    assert "2 failed requests in a row" in router.stats.removed["http://a"]


async def test_last_server_dead_fails_the_trajectory_without_hanging() -> None:
    a = FakeEngine("http://a")
    router = Router(Lifecycle([a]), max_retries=2)
    a.dead = True
    with anyio.fail_after(10):
        res = await scheduler(router).run(samples(2, turns=2))
    assert [t.status for t in res.trajectories] == ["failed", "failed"]
    assert all("EngineUnavailable" in t.error for t in res.trajectories)


async def test_stop_releases_a_request_held_at_the_gate() -> None:
    a = FakeEngine("http://a")
    lc = Lifecycle([a], awake=False)
    router = Router(lc)
    s = router.session("t")
    box = {}

    async def call() -> None:
        box["out"] = await s([1, 2], P)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            await anyio.sleep(0.1)
            assert "out" not in box  # held by the gate
            s.stop("test")
    out = box["out"]
    assert out.aborted and out.output_ids == [] and "not dispatched" in out.finish_reason["message"]
    assert a.generates == []
    out = await s([1], P)  # later calls return at once too
    assert out.aborted and a.generates == []


async def test_stop_releases_a_request_waiting_for_a_server_slot() -> None:
    a = FakeEngine("http://a", token_delay=0.05)
    router = Router(Lifecycle([a]), per_server_limit=1)
    busy, waiting = router.session("busy"), router.session("waiting")
    box = {}

    async def call() -> None:
        box["out"] = await waiting([1, 2], P)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(busy, [1, 2], SamplingParams(max_new_tokens=20))
            await anyio.sleep(0.05)
            tg.start_soon(call)
            await anyio.sleep(0.05)
            assert "out" not in box and waiting._slot_waits  # held by the full slot
            waiting.stop("test")
            while "out" not in box:
                await anyio.sleep(0.001)
            assert busy.in_flight_rid is not None and not waiting._slot_waits  # released before the busy turn ended
            assert a.generates and all(rid.startswith("busy-") for rid, _ in a.generates)
    out = box["out"]
    assert out.aborted and out.output_ids == [] and "not dispatched" in out.finish_reason["message"]
    assert router.slots("http://a").free == 1  # the cancelled wait took no slot
    out = await router.session("next")([3], P)  # and the slot still serves
    assert not out.aborted and out.output_ids


async def test_unreachable_then_healthy_server_is_kept() -> None:
    a, b = FakeEngine("http://a"), FakeEngine("http://b")
    lc = Lifecycle([a, b])
    router = Router(lc, failure_threshold=3)
    s = router.session("t")
    a.error_next = EngineUnavailable("/generate", None, "timed out after 1s", url="http://a")
    out = await s([1], P)  # the probe says a is alive: it stays, the turn is retried
    assert out.server_url == "http://a" and lc.urls == ["http://a", "http://b"] and router.stats.retries == 1


async def test_priority_slots_admit_lowest_key_then_arrival_and_survive_cancellation() -> None:
    from agentloop.engine.router import PrioritySlots

    slots = PrioritySlots(1)
    await slots.acquire((0,))
    order: list[str] = []

    async def waiter(name: str, key: tuple) -> None:
        await slots.acquire(key)
        order.append(name)
        slots.release()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            for name, key in [("late-b", (0, 2)), ("deep", (-2, 5)), ("late-a", (0, 1)), ("late-a2", (0, 1))]:
                tg.start_soon(waiter, name, key)
                await anyio.sleep(0.01)
            with anyio.CancelScope() as gone:  # a waiter cancelled before its turn takes no slot
                gone.cancel()
                await slots.acquire((-9,))
            assert slots.free == 0
            slots.release()
    assert order == ["deep", "late-a", "late-a2", "late-b"]
    assert slots.free == 1


async def test_priority_slots_withdrawn_wait_takes_no_slot_and_a_granted_one_keeps_it() -> None:
    from agentloop.engine.router import PrioritySlots

    slots = PrioritySlots(1)
    assert slots.enqueue() is None  # the free slot, taken at once
    gone, kept = slots.enqueue((0,)), slots.enqueue((1,))
    assert gone is not None and kept is not None
    slots.withdraw(gone)
    with anyio.fail_after(5):
        assert await slots.wait(gone) is False  # woken without the slot
        slots.release()  # the freed slot skips the withdrawn entry
        slots.withdraw(kept)  # too late: already granted
        assert await slots.wait(kept) is True
    assert slots.free == 0
    slots.release()
    assert slots.free == 1


async def served_after_busy(order: str, names: tuple[str, str, str], deep: str, asks_first: str) -> list[str]:
    """Three sessions made in the order of `names` (the first is the oldest) on a server with one slot;
    `deep` gets two model turns behind it, a third session holds the slot, then `asks_first` queues for
    it before the other one: the order the two were served in once the slot came free."""
    a = FakeEngine("http://a", token_delay=0.02)
    router = Router(Lifecycle([a]), per_server_limit=1, slot_order=order)
    sessions = {name: router.session(name) for name in names}
    await sessions[deep]([1], P)
    await sessions[deep]([1, 2, 3], P)
    second = next(n for n in names if n not in (asks_first, "busy"))
    slot = router.slots("http://a")
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(sessions["busy"], [1], SamplingParams(max_new_tokens=10))
            while slot.free:
                await anyio.sleep(0.001)
            for queued, name in enumerate((asks_first, second), start=1):
                tg.start_soon(sessions[name], [1, 2, 3, 4] if name == deep else [7], P)
                while len(slot._heap) < queued:
                    await anyio.sleep(0.001)
    return [rid.split("-")[0] for rid, _ in a.generates][3:]


@pytest.mark.parametrize("order", ["depth_first", "fifo"])
async def test_slot_order_gives_a_freed_slot_to_the_deeper_trajectory(order: str) -> None:
    served = await served_after_busy(order, ("deep", "fresh", "busy"), deep="deep", asks_first="fresh")
    assert served == (["deep", "fresh"] if order == "depth_first" else ["fresh", "deep"])


@pytest.mark.parametrize("order", ["oldest_first", "depth_first", "fifo"])
async def test_oldest_first_gives_a_freed_slot_to_the_older_session(order: str) -> None:
    """The older session wins over a younger one that is deeper (depth_first's pick) and that asked first
    (fifo's pick): with over-sampling the carried groups, started first, are not slowed by the surplus."""
    served = await served_after_busy(order, ("old", "young", "busy"), deep="young", asks_first="young")
    assert served == (["old", "young"] if order == "oldest_first" else ["young", "old"])


def test_slot_order_is_validated() -> None:
    with pytest.raises(ValueError, match="slot_order"):
        Router(Lifecycle([FakeEngine("http://a")]), slot_order="lifo")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        SchedulerConfig(slot_order="random")


async def test_an_answer_with_misaligned_logprobs_is_dropped_and_its_turn_asked_again() -> None:
    a = FakeEngine("http://a")
    a.error_next = MisalignedLogprobs("rid x: 2 output_token_logprobs ... disagree with 3 output_ids ...",
                                      url="http://a", retract_off_by_one=True)
    router = Router(Lifecycle([a]))
    res = await scheduler(router, concurrency=4).run(samples(2, turns=2, tokens=3, tool_delay=0.01))
    assert all(t.status == "completed" for t in res.trajectories)
    assert res.metrics["misaligned_answers"] == 1 and router.stats.misaligned_answers == 1
    assert router.urls == ["http://a"] and router.stats.retries == 0  # the server is not blamed
    reference = await scheduler(Router(Lifecycle([FakeEngine("http://b")])), concurrency=4).run(
        samples(2, turns=2, tokens=3, tool_delay=0.01))
    got = {t.uid: (t.response_ids, t.response_mask, t.response_logprobs) for t in res.trajectories}
    assert got == {t.uid: (t.response_ids, t.response_mask, t.response_logprobs) for t in reference.trajectories}
    again = await scheduler(router, concurrency=4).run(samples(1, turns=1, tokens=2))
    assert again.metrics["misaligned_answers"] == 0  # counted per run
