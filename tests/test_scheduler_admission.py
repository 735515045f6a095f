"""Over-admission and staleness in the scheduler (issue 27, part 1), over in-process engine doubles:
the feeder (sync or async) keeps `active` trajectories in flight, a met target stops the rest and
nothing drawn is lost, finished groups are handed over as they are decided, and carried trajectories
past `max_staleness` are restarted or dropped; every step reports its tokens' staleness."""

from __future__ import annotations

import logging

import pytest

from agentloop.agents.base import AgentConfig
from agentloop.config import SchedulerConfig
from agentloop.engine.lifecycle import Lifecycle
from agentloop.engine.router import Router
from agentloop.scheduler import Scheduler
from agentloop.scheduler.staleness import VersionLog, token_staleness
from agentloop.types import Sample, Trajectory

from test_scheduler_support import FakeEngine, length_reward

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make(engine: FakeEngine, **cfg) -> tuple[Scheduler, Lifecycle]:
    lc = Lifecycle([engine], awake=True)
    sched = Scheduler(Router(lc, sole_client=True), tokenizer=None,
                      agent_config=AgentConfig(max_new_tokens_per_turn=1000, max_response_tokens=2000),
                      config=SchedulerConfig(**cfg), reward_fn=length_reward)
    return sched, lc


def replay(uid: str, gens: list[int]) -> Sample:
    turns = [{"gen_tokens": g, "tool_latency_s": 0.0, "tool_result_tokens": 2} for g in gens]
    return Sample(uid=uid, messages=[], agent="replay", extra={"replay": {"prompt_tokens": 4, "turns": turns}})


async def serve(lc: Lifecycle, engine: FakeEngine, version: str) -> None:
    """What a wake-up with new weights does, as far as the scheduler sees it."""
    engine.weight_version = version
    await lc.gate.open(version)


def test_version_log_orders_versions_and_counts_unknown_ones_as_oldest(caplog: pytest.LogCaptureFixture) -> None:
    log = VersionLog()
    assert log.age("x") == 0 and log.current is None
    with caplog.at_level(logging.WARNING, logger="agentloop.scheduler"):
        for v in ("v1", "v1", "v2", "v1", "v3", "v1"):
            log.observe(v)
    # served again after newer ones: said (once), since its tokens are counted from its first place
    assert [r.getMessage()[:33] for r in caplog.records] == ["weight version 'v1' is served aga"]
    assert log.versions == ["v1", "v2", "v3"] and log.current == "v3"
    assert [log.age(v) for v in ("v3", "v2", "v1", "other")] == [0, 1, 2, 3]
    assert log.age("v1", now="v2") == 1
    t = Trajectory(uid="u", group_id="g", prompt_ids=[1])
    assert log.first_token_age(t) is None
    assert token_staleness(log, [t]) == {"token_staleness": {}, "max_token_staleness": 0, "stale_token_fraction": 0.0}


async def test_staleness_bound_restarts_or_drops_carried_trajectories() -> None:
    engine = FakeEngine("http://a", token_delay=0.003)
    sched, lc = make(engine, n=1, target_groups=1, concurrency=16)
    await serve(lc, engine, "v1")
    res1 = await sched.run([replay("quick", [3]), *[replay(f"long{i}", [600]) for i in range(3)]])
    assert [t.uid for t in res1.trajectories] == ["quick"] and len(res1.carry_over) == 3
    partial = {s.uid: s.resume_from for s in res1.carry_over}
    assert all(p is not None and 0 < len(p.response_ids) < 600 for p in partial.values())
    assert res1.metrics["token_staleness"] == {"0": 3} and res1.metrics["max_token_staleness"] == 0

    # Within the bound: resumed; their first tokens are one version old, and reported so.
    await serve(lc, engine, "v2")
    within = sched.config.model_copy(update={"target_groups": None, "max_staleness": 1})
    res2 = await sched.run(res1.carry_over, config=within)
    assert res2.metrics["stale_restarted"] == 0 and len(res2.trajectories) == 3
    old_tokens = sum(len(p.response_ids) for p in partial.values())
    for t in res2.trajectories:
        t.check_invariants()
        p = partial[t.uid]
        assert t.response_ids[: len(p.response_ids)] == p.response_ids
        assert t.response_logprobs[: len(p.response_ids)] == p.response_logprobs
        assert t.weight_versions == ["v1", "v2"]  # the resumed message: its tokens keep their version
    assert res2.metrics["token_staleness"] == {"0": 3 * 600 - old_tokens, "1": old_tokens}
    assert res2.metrics["max_token_staleness"] == 1

    # Past the bound (restart, the default): the same partials run again from their prompts.
    again = await sched.run(res1.carry_over, config=within.model_copy(update={"max_staleness": 0}))
    assert again.metrics["stale_restarted"] == 3 and again.metrics["max_token_staleness"] == 0
    assert all(t.weight_versions == ["v2"] and t.metrics.get("resumed", 0) == 0 for t in again.trajectories)

    # Past the bound with stale_policy drop: the groups leave the step, handed back as they came.
    dropped = await sched.run(res1.carry_over + [replay("fresh", [2])],
                              config=within.model_copy(update={"max_staleness": 0, "stale_policy": "drop"}))
    assert [t.uid for t in dropped.trajectories] == ["fresh"]
    assert [s.uid for s in dropped.dropped] == [s.uid for s in res1.carry_over] and dropped.metrics["stale_dropped"] == 3


async def test_over_admission_keeps_active_in_flight_from_an_async_feeder_and_loses_nothing() -> None:
    engine = FakeEngine("http://a", token_delay=0.002)
    sched, lc = make(engine, n=2, target_groups=3, active=8, concurrency=64)
    await serve(lc, engine, "v1")
    produced: list[str] = []

    async def feeder():
        for k in range(40):
            uid = f"f{k}"
            produced.append(uid)
            # Every third prompt is long: the target is met while they still run.
            yield replay(uid, [400] if k % 3 == 0 else [5, 5])

    groups: list[tuple[list[str], str]] = []
    res = await sched.run([], more_samples=feeder(), on_group=lambda ms, v: groups.append(([t.uid for t in ms], v)))
    assert res.metrics["complete_groups"] == 3 and len(res.trajectories) == 6
    assert [v for _, v in groups] == ["accepted"] * 3
    assert sorted(u for ms, _ in groups for u in ms) == sorted(t.uid for t in res.trajectories)
    # The engine was kept full: 8 in flight at once (4 groups of 2), refilled as groups finished.
    assert engine.max_in_flight == 8
    # Nothing drawn was lost: every produced prompt's members are returned or carried over.
    members = {t.uid for t in res.trajectories} | {s.uid for s in res.carry_over}
    assert members == {f"{u}_{i}" for u in produced for i in range(2)}
    assert res.metrics["samples_drawn"] == len(produced) < 40
    assert any(s.resume_from is not None and s.resume_from.status == "aborted" for s in res.carry_over)


async def test_without_a_target_active_bounds_the_trajectories_in_flight_until_the_feeder_runs_out() -> None:
    engine = FakeEngine("http://a", token_delay=0.002)
    sched, lc = make(engine, n=1, active=3, concurrency=64)
    await serve(lc, engine, "v1")
    res = await sched.run([replay("given", [4])], more_samples=iter([replay(f"f{k}", [6, 3]) for k in range(10)]))
    assert len(res.trajectories) == 11 and not res.carry_over
    assert engine.max_in_flight == 3 and res.metrics["refill_stop"] == "more_samples exhausted"
    assert res.metrics["samples_drawn"] == 10


async def test_on_group_hands_over_whole_groups_in_ungrouped_runs_too() -> None:
    """What a streaming consumer needs: no target, no filter, groups handed over as each completes."""
    engine = FakeEngine("http://a", token_delay=0.002)
    sched, lc = make(engine, n=3, concurrency=64)
    await serve(lc, engine, "v1")
    groups: list[tuple[list[str], str]] = []
    res = await sched.run([replay("a", [3]), replay("b", [30])], on_group=lambda ms, v: groups.append(([t.uid for t in ms], v)))
    assert groups == [(["a_0", "a_1", "a_2"], "accepted"), (["b_0", "b_1", "b_2"], "accepted")]
    assert len(res.trajectories) == 6


async def test_a_stop_ends_a_wait_on_an_async_feeder_without_taking_a_sample() -> None:
    """The streaming shape: the feeder is a queue the trainer fills; a stop returns at once."""
    import anyio

    engine = FakeEngine("http://a", token_delay=0.002)
    sched, lc = make(engine, n=1, active=4, concurrency=64)
    await serve(lc, engine, "v1")
    send, receive = anyio.create_memory_object_stream[Sample](10)
    box = {}

    async def run() -> None:
        box["res"] = await sched.run([], more_samples=receive)

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        for k in range(3):
            await send.send(replay(f"f{k}", [3]))
        await anyio.sleep(0.3)  # all three done; the run waits on the queue for more
        assert "res" not in box
        sched.stop("streaming consumer stopped")
    res = box["res"]
    assert [t.uid for t in res.trajectories] == ["f0", "f1", "f2"] and res.metrics["samples_drawn"] == 3
    await send.send(replay("f3", [3]))  # the queue still works: the cancelled wait took nothing
    assert receive.receive_nowait().uid == "f3"
