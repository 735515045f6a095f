"""A trainer's own reward function (`Runtime(reward_fn=...)` / `Scheduler(reward_fn=...)`): plain sync or
async `f(trajectory, sample)`, run off the event loop under `reward_timeout` by `rewards.call_reward`
(the same helper `rewards.score` uses); `timeout=` only for functions that take it; a grader that
raises or hangs fails its own trajectory, never the step. Rows name a reward or give a spec
`{"name", "ground_truth", **kwargs}`; `SchedulerConfig.reward` scores rows with a ground truth and no name."""

from __future__ import annotations

import asyncio
import threading
import types
from typing import Any

import anyio
import pytest

from agentloop.agents.base import AgentConfig
from agentloop.config import SchedulerConfig
from agentloop.engine.lifecycle import Lifecycle
from agentloop.engine.router import Router
from agentloop.dataset import row_to_sample
from agentloop.rewards import RewardResult, call_reward, register_reward, registered_rewards, score
from agentloop.runtime import Runtime
from agentloop.scheduler import Scheduler
from agentloop.types import Sample, Trajectory

from test_scheduler_support import FakeEngine, samples

TOK = types.SimpleNamespace(pad_token_id=0, eos_token_id=2)


def _traj() -> Trajectory:
    return Trajectory(uid="t", group_id="g", prompt_ids=[1], response_ids=[5, 6], response_mask=[1, 1],
                      response_logprobs=[-0.1, -0.2], messages=[{"role": "assistant", "content": "The answer is 5."}])


async def test_call_reward_sync_async_timeout_keyword_and_return_forms() -> None:
    loop_thread = threading.get_ident()
    seen: dict[str, Any] = {}
    s = Sample(uid="t", messages=[], ground_truth=5)

    def plain(traj: Trajectory, sample: Sample) -> float:
        seen["thread"] = threading.get_ident()
        return len(traj.response_ids) + sample.ground_truth

    async def with_timeout(traj: Trajectory, sample: Sample, *, timeout: float) -> dict[str, Any]:
        seen["timeout"] = timeout
        return {"reward": 0.5, "turn_rewards": [1, 0], "judge": "ok"}

    def kwargs_only(traj: Trajectory, sample: Sample, **kw: Any) -> RewardResult:
        seen["kw"] = kw
        return RewardResult(1.0)

    r = await call_reward(plain, _traj(), s, timeout=2.0)
    assert r is not None and r.reward == 7.0 and seen["thread"] != loop_thread  # ran in a worker thread
    r = await call_reward(with_timeout, _traj(), s, timeout=2.5)
    assert seen["timeout"] == 2.5 and r is not None and r.reward == 0.5
    assert r.turn_rewards == [1.0, 0.0] and r.info == {"judge": "ok"}
    assert (await call_reward(kwargs_only, _traj(), s, timeout=3.0)).reward == 1.0 and seen["kw"] == {"timeout": 3.0}
    assert await call_reward(lambda t, smp: None, _traj(), s, timeout=1.0) is None  # does not score it

    with pytest.raises(TypeError, match="expected a float"):
        await call_reward(lambda t, smp: "1.0", _traj(), s, timeout=1.0)
    with pytest.raises(TypeError, match="expected a number"):
        await call_reward(lambda t, smp: {"reward": "high"}, _traj(), s, timeout=1.0)

    async def hang(traj: Trajectory, sample: Sample) -> float:
        await anyio.sleep_forever()
        return 0.0

    with pytest.raises(TimeoutError, match="'test_call_reward_sync_async_timeout_keyword_and_return_forms.<locals>.hang' "
                                           "timed out after 0.1 s"):
        await call_reward(hang, _traj(), s, timeout=0.1)


async def test_score_with_a_given_function_records_its_dict_result() -> None:
    t = _traj()
    await score(t, Sample(uid="t", messages=[]), fn=lambda tr, s: {"reward": 2, "turn_rewards": [0.25]})
    assert t.reward == 2.0 and t.turn_rewards == [0.25] and "reward_error" not in t.extra


def test_runtime_with_plain_sync_and_async_reward_functions_for_two_steps() -> None:
    on_loop: list[bool] = []

    def _on_event_loop() -> bool:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return False
        return True

    def sync_reward(traj: Trajectory, sample: Sample) -> float:  # no `timeout` keyword
        on_loop.append(_on_event_loop())
        return float(len(traj.response_ids))

    async def async_reward(traj: Trajectory, sample: Sample) -> float:
        await anyio.sleep(0)
        return -float(sum(traj.response_mask))

    for fn in (sync_reward, async_reward):
        with Runtime(clients=[FakeEngine("http://a")], tokenizer=TOK, tools=object(), reward_fn=fn) as rt:
            for _ in range(2):
                res = rt.step_sync(samples(3, turns=2, tokens=3))
                assert [t.status for t in res.trajectories] == ["completed"] * 3, [t.error for t in res.trajectories]
                want = [fn is sync_reward and float(len(t.response_ids)) or -float(sum(t.response_mask))
                        for t in res.trajectories]
                assert [t.reward for t in res.trajectories] == want
                assert res.batch["rewards"].tolist() == want
    assert on_loop == [False] * 6  # the sync grader ran in worker threads, never on the event loop


async def test_a_hanging_or_raising_reward_fails_only_its_trajectory() -> None:
    release = threading.Event()

    def grader(traj: Trajectory, sample: Sample) -> float:
        if sample.uid == "p1":
            release.wait(600.0)  # blocks its worker thread, not the event loop
        if sample.uid == "p2":
            raise ZeroDivisionError("grader bug")
        return 1.0

    lc = Lifecycle([FakeEngine("http://a")], awake=True)
    sched = Scheduler(Router(lc), tokenizer=None, agent_config=AgentConfig(),
                      config=SchedulerConfig(reward_timeout=0.3), reward_fn=grader)
    try:
        # The step does not wait for the blocked grader (it would hold it for 600 s): a hang guard.
        with anyio.fail_after(60):
            res = await sched.run(samples(4, turns=1, tokens=2))
    finally:
        release.set()
    by = {t.uid: t for t in res.trajectories}
    assert by["p0"].status == by["p3"].status == "completed" and by["p0"].reward == by["p3"].reward == 1.0
    assert by["p1"].status == "failed" and "timed out after 0.3 s" in by["p1"].error and by["p1"].reward is None
    assert by["p2"].status == "failed" and "ZeroDivisionError: grader bug" in by["p2"].error
    assert by["p1"].response_ids and by["p2"].response_ids  # the rollout itself is kept


# ------------------------------------------------------------------ reward specs in rows, the default reward


@register_reward("test_gt_plus")
def gt_plus(traj: Trajectory, sample: Sample, *, offset: float = 0.0) -> float:
    return float(sample.ground_truth) + offset


@register_reward("test_constant")
def constant(traj: Trajectory, sample: Sample) -> float:
    return 7.0


def test_row_reward_spec_dict_sets_name_ground_truth_and_kwargs() -> None:
    s = row_to_sample({"prompt": "x", "reward": {"name": "arithmetic", "ground_truth": 3}}, default_uid="u",
                      known_rewards=registered_rewards())
    assert s.reward == "arithmetic" and s.ground_truth == 3 and s.reward_kwargs == {}
    s = row_to_sample({"prompt": "x", "ground_truth": 2, "reward": {"name": "test_gt_plus", "offset": 0.5}}, default_uid="u")
    assert s.reward == "test_gt_plus" and s.ground_truth == 2 and s.reward_kwargs == {"offset": 0.5}
    assert row_to_sample({"prompt": "x", "reward": "arithmetic"}, default_uid="u").reward_kwargs == {}
    for row, problem in [
        ({"prompt": "x", "reward": {"ground_truth": 3}}, 'reward: a reward spec needs a "name"'),
        ({"prompt": "x", "reward": {"name": "arithmetic", "ground_truth": 3}, "ground_truth": 4}, "ground_truth given twice"),
        ({"prompt": "x", "reward": {"name": "nope"}}, "unknown reward function 'nope'"),
        ({"prompt": "x", "reward": 3}, "reward"),
    ]:
        with pytest.raises(ValueError, match=problem):
            row_to_sample(row, default_uid="u", known_rewards=registered_rewards())


def test_default_reward_scores_rows_with_a_ground_truth_for_two_steps() -> None:
    rows = [
        Sample(uid="gt", messages=[], agent="scripted", ground_truth=4),  # no name: the config's default
        Sample(uid="none", messages=[], agent="scripted"),  # nothing to grade against: not scored
        Sample(uid="named", messages=[], agent="scripted", reward="test_constant"),  # its own reward wins
        Sample(uid="kw", messages=[], agent="scripted", ground_truth=1, reward="test_gt_plus", reward_kwargs={"offset": 2}),
    ]
    with Runtime({"scheduler": {"reward": "test_gt_plus"}}, clients=[FakeEngine("http://a")], tokenizer=TOK,
                 tools=object()) as rt:
        for _ in range(2):
            res = rt.step_sync(rows)
            assert [t.status for t in res.trajectories] == ["completed"] * 4
            assert [t.reward for t in res.trajectories] == [4.0, None, 7.0, 3.0]
        # per step too; an unknown name is refused before any engine wakes
        assert [t.reward for t in rt.step_sync(rows[:1], reward=None).trajectories] == [None]
        records = len(rt.lifecycle.records)
        with pytest.raises(ValueError, match="scheduler.reward: unknown reward function 'nope'"):
            rt.step_sync(rows, reward="nope")
        assert len(rt.lifecycle.records) == records


async def test_the_shipped_default_reward_is_arithmetic() -> None:
    assert SchedulerConfig().reward == "arithmetic"
    lc = Lifecycle([FakeEngine("http://a")], awake=True)
    sched = Scheduler(Router(lc), tokenizer=None, agent_config=AgentConfig())
    # the docs' row {"prompt": "What is 7 * 6?", "ground_truth": 42}: graded (0.0: the scripted loop says nothing)
    s = row_to_sample({"prompt": "What is 7 * 6?", "ground_truth": 42}, default_uid="d")
    s.agent = "scripted"
    res = await sched.run([s])
    t = res.trajectories[0]
    assert t.status == "completed" and t.reward == 0.0 and t.extra["reward_info"]["expected"] == 42


async def test_a_graders_own_timeout_error_is_reported_as_its_failure_and_numpy_scalars_count() -> None:
    import numpy as np

    def judge(traj: Trajectory, sample: Sample) -> float:
        raise TimeoutError("judge endpoint did not answer")

    t = _traj()
    await score(t, Sample(uid="t", messages=[]), fn=judge, timeout=5.0)
    assert t.reward is None and "failed: TimeoutError: judge endpoint did not answer" in t.extra["reward_error"]
    await score(t, Sample(uid="t", messages=[]), fn=lambda tr, s: np.float32(0.5))
    assert t.reward == 0.5 and "reward_error" not in t.extra
