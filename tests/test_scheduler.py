"""Scheduler over in-process engine doubles: groups, order, limits, timeouts, failure isolation,
over-sampling with early stop and carry-over across >= 2 steps."""

from __future__ import annotations

import anyio
import pytest

from agentloop.agents.base import AgentConfig
from agentloop.config import SchedulerConfig
from agentloop.engine.lifecycle import Lifecycle
from agentloop.engine.router import Router
from agentloop.scheduler import Scheduler, expand_samples
from agentloop.types import Sample

from test_scheduler_support import FakeEngine, length_reward, samples

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make(engines: list[FakeEngine], **cfg) -> tuple[Scheduler, Lifecycle]:
    lc = Lifecycle(engines, awake=True)
    router = Router(lc, per_server_limit=cfg.pop("per_server_concurrency", None))
    sched = Scheduler(router, tokenizer=None, agent_config=AgentConfig(), config=SchedulerConfig(**cfg),
                      reward_fn=length_reward)
    return sched, lc


def test_expand_samples_groups_and_uids() -> None:
    jobs = expand_samples(samples(2), 3)
    assert [j.uid for j in jobs] == ["p0_0", "p0_1", "p0_2", "p1_0", "p1_1", "p1_2"]
    assert [j.group_id for j in jobs] == ["p0"] * 3 + ["p1"] * 3
    assert [j.index_in_group for j in jobs] == [0, 1, 2] * 2
    assert [j.uid for j in expand_samples(samples(2), 1)] == ["p0", "p1"]
    member = Sample(uid="x_1", messages=[], group_id="x", index_in_group=1)
    assert expand_samples([member], 4) == [member]  # a group member runs once
    with pytest.raises(ValueError, match="duplicated.*p0"):
        expand_samples(samples(1) + samples(1), 1)


async def test_groups_order_rewards_and_concurrency_limit() -> None:
    eng = FakeEngine("http://a")
    sched, _ = make([eng], n=2, concurrency=3)
    running = 0
    peak = 0
    seen: list[str] = []

    async def on_traj(t) -> None:
        seen.append(t.uid)

    orig = sched.agent("scripted").run

    async def counting_run(sample, ctx):
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        try:
            return await orig(sample, ctx)
        finally:
            running -= 1

    sched.agent("scripted").run = counting_run  # type: ignore[method-assign]
    ss = samples(5, turns=2, tokens=3, tool_delay=0.01)
    ss[1].extra["turns"] = 4  # finishes late: results must still come back in input order
    res = await sched.run(ss, on_trajectory=on_traj)
    uids = [t.uid for t in res.trajectories]
    assert uids == [f"p{i}_{k}" for i in range(5) for k in range(2)]
    assert sorted(seen) == sorted(uids) and seen != uids  # streamed as they finished
    assert peak == 3
    assert not res.carry_over
    for t in res.trajectories:
        t.check_invariants()
        assert t.status == "completed" and t.reward == float(len(t.response_ids))
        assert t.group_id == t.uid.rsplit("_", 1)[0]
        assert {e.kind for e in t.timeline} >= {"queue", "generate", "tool"}
        assert t.metrics["queue_seconds"] >= 0 and t.metrics["generate_seconds"] > 0
    assert res.metrics["status_counts"]["completed"] == 10
    assert res.metrics["sampled_tokens"] == sum(sum(t.response_mask) for t in res.trajectories)


async def test_failure_isolation_and_bad_reward() -> None:
    sched, _ = make([FakeEngine("http://a")])
    ss = samples(4, turns=2)
    ss[1].extra["raise"] = True
    ss[2].extra["bad_reward"] = True
    ss[3].agent = "no-such-loop"
    res = await sched.run(ss)
    by = {t.uid: t for t in res.trajectories}
    assert [t.uid for t in res.trajectories] == ["p0", "p1", "p2", "p3"]
    assert by["p0"].status == "completed"
    assert by["p1"].status == "failed" and "ValueError: scripted failure in p1" in by["p1"].error
    assert by["p2"].status == "failed" and "reward failed" in by["p2"].error and by["p2"].response_ids
    assert by["p3"].status == "failed" and "no-such-loop" in by["p3"].error


async def test_timeout_keeps_partial_and_aborts_request() -> None:
    slow = FakeEngine("http://a", token_delay=0.1)
    # Turn 2 of p1 runs from 0.6 s to 1.2 s: a 0.9 s timeout lands mid-turn, 0.3 s from either boundary,
    # so a request is in flight to abort even on a loaded CI machine (0.6 s fell on the boundary: a race).
    sched, _ = make([slow], trajectory_timeout=0.9, abort_grace=5.0)
    ss = samples(2, turns=1, tokens=2)
    ss[1].extra.update(turns=3, tokens=6)  # 3 x 6 x 0.1 s = 1.8 s > 0.9 s
    with anyio.fail_after(5):
        res = await sched.run(ss)
    fast, late = res.trajectories
    assert fast.status == "completed"
    assert late.status == "failed" and late.finish_reason == "timeout" and "timed out" in late.error
    late.check_invariants()
    assert late.response_mask.count(1) >= 6  # the turns done before the timeout are kept
    assert any(rid in slow.aborted for rid, _ in slow.generates if rid.startswith("p1"))


async def test_oversampling_returns_exactly_target_groups_and_carries_the_rest() -> None:
    eng = FakeEngine("http://a", token_delay=0.005)
    sched, lc = make([eng], n=2, concurrency=16, target_groups=2)
    ss = samples(5, turns=2, tokens=4)
    for s in ss[2:]:
        s.extra.update(turns=6, tokens=40)  # long: still running when the first two groups are done
    lc.weight_version = "v1"
    eng.weight_version = "v1"
    res = await sched.run(ss)
    assert [t.uid for t in res.trajectories] == ["p0_0", "p0_1", "p1_0", "p1_1"]
    assert all(t.status == "completed" for t in res.trajectories)
    assert res.metrics["complete_groups"] == 2
    carried = res.carry_over
    assert sorted(c.uid for c in carried) == sorted(f"p{i}_{k}" for i in range(2, 5) for k in range(2))
    assert all(c.group_id and c.resume_from is not None for c in carried)
    partial = [c.resume_from for c in carried]
    assert all(p.status == "aborted" for p in partial)
    assert all(set(p.weight_versions) == {"v1"} for p in partial if p.turns)
    assert eng.aborted, "in-flight requests must be aborted on the engine"
    assert eng.in_flight == 0

    # Step 2 (new weights): the carried members continue where they stopped; nothing is lost.
    eng.weight_version = lc.weight_version = "v2"
    res2 = await sched.run(carried, config=sched.config.model_copy(update={"target_groups": None}))
    assert sorted(t.uid for t in res2.trajectories) == sorted(c.uid for c in carried)
    for t, c in zip(res2.trajectories, carried):
        t.check_invariants()
        assert t.status == "completed"
        prev = c.resume_from
        assert t.response_ids[: len(prev.response_ids)] == prev.response_ids  # continued, not restarted
        assert t.weight_versions[: len(prev.turns)] == prev.weight_versions
        assert t.weight_versions[-1] == "v2"


async def test_oversampling_without_partial_rollout_restarts_members() -> None:
    eng = FakeEngine("http://a", token_delay=0.005)
    sched, _ = make([eng], n=2, target_groups=1, partial_rollout=False)
    ss = samples(3, turns=2, tokens=3)
    for s in ss[1:]:
        s.extra.update(turns=5, tokens=40)
    res = await sched.run(ss)
    assert [t.uid for t in res.trajectories] == ["p0_0", "p0_1"]
    assert len(res.carry_over) == 4
    assert all(c.resume_from is None and c.group_id for c in res.carry_over)
    res2 = await sched.run(res.carry_over, config=sched.config.model_copy(update={"target_groups": None}))
    assert [t.status for t in res2.trajectories] == ["completed"] * 4


async def test_per_server_limit() -> None:
    eng = FakeEngine("http://a")
    sched, _ = make([eng], concurrency=16, per_server_concurrency=2)
    res = await sched.run(samples(8, turns=2, tokens=5))
    assert all(t.status == "completed" for t in res.trajectories)
    assert eng.max_in_flight == 2
    assert any(e.kind == "wait" for t in res.trajectories for e in t.timeline)


async def test_stop_mid_step_carries_everything_over() -> None:
    eng = FakeEngine("http://a", token_delay=0.01)
    sched, lc = make([eng], concurrency=2)
    res_box = {}

    async def run() -> None:
        res_box["r"] = await sched.run(samples(4, turns=3, tokens=20))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        while eng.in_flight == 0:
            await anyio.sleep(0.01)
        sched.stop("test")
        await lc.sleep()  # pause(abort) + settle while requests run, then release
    res = res_box["r"]
    assert res.trajectories == [] and len(res.carry_over) == 4
    assert sum(c.resume_from is not None for c in res.carry_over) == 2  # two had started
    assert eng.released and eng.in_flight == 0


def test_per_step_override_of_a_start_time_setting_is_refused() -> None:
    from agentloop.config import SchedulerConfig
    from agentloop.scheduler import with_overrides

    cfg = SchedulerConfig(per_server_concurrency=4)
    assert with_overrides(cfg, {"n": 3, "per_server_concurrency": 4}).n == 3
    with pytest.raises(TypeError, match="per_server_concurrency is fixed when the runtime starts"):
        with_overrides(cfg, {"per_server_concurrency": 2})
    with pytest.raises(TypeError, match="unknown scheduler settings"):
        with_overrides(cfg, {"concurency": 2})


async def test_a_finished_run_is_freed_by_reference_counting_not_left_in_a_cycle() -> None:
    """The streaming mode makes one scheduler run per trajectory: a run kept alive by a reference cycle
    (its watchdog's callbacks, a cancelled watcher's traceback, its task group) was ~110 objects of
    garbage per trajectory for the cycle collector to find (88k per 800 trajectories, with the full
    collections that brings); a finished run must go when its result is dropped."""
    import gc

    from agentloop.scheduler.run import ScheduleRun

    eng = FakeEngine("http://a", token_delay=0.0)
    sched, _ = make([eng], trajectory_timeout=60.0)
    await sched.run(samples(1, turns=2, tokens=2))  # warm: imports, registries
    gc.collect()
    gc.disable()
    try:
        for i in range(20):
            res = await sched.run(samples(1, turns=2, tokens=2))
            assert res.trajectories[0].status == "completed"
        del res
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        leaked = [o for o in gc.garbage if isinstance(o, ScheduleRun)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert leaked == []
