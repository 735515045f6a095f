"""Group filtering in the scheduler: a predicate over each complete group (built-in: drop zero-variance
reward groups); with target_groups the step keeps sampling fresh prompts from `more_samples` until that
many groups are accepted or the budget is spent, and its metrics say which."""

from __future__ import annotations

from typing import Iterator

import pydantic
import pytest

from agentloop.agents.base import AgentConfig
from agentloop.config import SchedulerConfig
from agentloop.engine.lifecycle import Lifecycle
from agentloop.engine.router import Router
from agentloop.group_filters import drop_zero_variance, register_group_filter
from agentloop.scheduler import Scheduler
from agentloop.types import Sample, Trajectory

from test_scheduler_support import FakeEngine

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def scripted_reward(trajectory: Trajectory, sample: Sample) -> float:
    """The reward listed for this member in the prompt's `extra["rewards"]`."""
    return float(sample.extra["rewards"][sample.index_in_group])


def prompt(uid: str, rewards: list[float], **extra) -> Sample:
    return Sample(uid=uid, messages=[{"role": "user", "content": uid}], agent="scripted",
                  extra={"rewards": rewards, "turns": 1, "tokens": 3, **extra})


def make(**cfg) -> Scheduler:
    lc = Lifecycle([FakeEngine("http://a")], awake=True)
    return Scheduler(Router(lc), tokenizer=None, agent_config=AgentConfig(), config=SchedulerConfig(**cfg),
                     reward_fn=scripted_reward)


def test_drop_zero_variance_predicate() -> None:
    def group(*rewards):
        return [Trajectory(uid=f"u{i}", group_id="g", prompt_ids=[1], reward=r) for i, r in enumerate(rewards)]

    assert drop_zero_variance(group(0.0, 1.0))
    assert not drop_zero_variance(group(1.0, 1.0, 1.0))
    assert not drop_zero_variance(group(1.0))  # one member: no baseline, no signal
    assert not drop_zero_variance(group(None, 1.0))


def test_unknown_group_filter_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(pydantic.ValidationError, match="unknown group filter 'nope'.*drop_zero_variance"):
        SchedulerConfig(group_filter="nope")


async def test_equal_reward_groups_keep_sampling_until_the_budget_and_report_it() -> None:
    sched = make(n=2, target_groups=2, group_filter="drop_zero_variance", group_budget=5)
    drawn: list[str] = []

    def more() -> Iterator[Sample]:
        for k in range(100):
            drawn.append(f"m{k}")
            yield prompt(f"m{k}", [1.0, 1.0])

    res = await sched.run([prompt("p0", [1.0, 1.0]), prompt("p1", [0.5, 0.5])], more_samples=more())
    m = res.metrics
    assert m["groups_sampled"] == 5 and len(drawn) == 3  # 2 given + 3 drawn: the budget, not one more
    assert m["groups_accepted"] == 0 and m["groups_rejected"] == 5
    assert m["budget_exhausted"] is True and m["groups_budget_exhausted"] == 2
    assert "group_budget" in m["refill_stop"]
    assert res.trajectories == [] and not res.carry_over
    # Nothing is lost: the rejected groups' trajectories come back, scored, beside the (empty) batch.
    assert sorted(t.group_id for t in res.rejected) == sorted(["p0", "p0", "p1", "p1", "m0", "m0", "m1", "m1", "m2", "m2"])
    assert all(t.status == "completed" and t.reward is not None for t in res.rejected)


async def test_keeps_sampling_until_target_informative_groups() -> None:
    sched = make(n=2, target_groups=2, group_filter="drop_zero_variance", concurrency=2)
    pattern = [[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 1.0]]
    source = iter([prompt(f"m{k}", r) for k, r in enumerate(pattern)])
    emitted: list[str] = []
    res = await sched.run([prompt("p0", [1.0, 1.0])], more_samples=source,
                          on_trajectory=lambda t: emitted.append(t.group_id))
    m = res.metrics
    assert m["groups_accepted"] == 2 and m["budget_exhausted"] is False and m["groups_budget_exhausted"] == 0
    assert {t.group_id for t in res.trajectories} == {"m1", "m3"}
    assert len(res.trajectories) == 4
    assert {t.group_id for t in res.rejected} == {"p0", "m0", "m2"} and m["groups_rejected"] == 3
    assert sorted(emitted) == ["m1", "m1", "m3", "m3"]  # rejected groups are not streamed
    assert next(source).uid == "m4"  # drawn only as needed
    for t in res.trajectories:
        assert drop_zero_variance([x for x in res.trajectories if x.group_id == t.group_id])


async def test_source_running_out_ends_the_step_short_and_says_so() -> None:
    sched = make(n=3, target_groups=3, group_filter="drop_zero_variance")
    res = await sched.run([prompt("p0", [0.0, 1.0, 1.0])], more_samples=iter([prompt("m0", [2.0, 2.0, 2.0])]))
    m = res.metrics
    assert m["groups_accepted"] == 1 and m["groups_rejected"] == 1 and m["groups_sampled"] == 2
    assert m["budget_exhausted"] is True and m["groups_budget_exhausted"] == 2
    assert m["refill_stop"] == "more_samples exhausted"
    assert [t.uid for t in res.trajectories] == ["p0_0", "p0_1", "p0_2"]


async def test_filter_without_target_drops_uninformative_groups_and_keeps_failures() -> None:
    sched = make(n=2, group_filter="drop_zero_variance")
    res = await sched.run([prompt("p0", [1.0, 1.0]), prompt("p1", [0.0, 1.0]), prompt("p2", [0.0, 1.0], **{"raise": True})])
    assert [t.uid for t in res.trajectories] == ["p1_0", "p1_1", "p2_0", "p2_1"]
    assert [t.status for t in res.trajectories[2:]] == ["failed", "failed"]  # a failed group is kept (trainable=0)
    assert [t.uid for t in res.rejected] == ["p0_0", "p0_1"]
    assert res.metrics["groups_rejected"] == 1 and res.metrics["budget_exhausted"] is False


async def test_a_filter_that_raises_keeps_the_group_and_is_counted() -> None:
    @register_group_filter("test_broken")
    def broken(group):
        raise RuntimeError("bug in the filter")

    sched = make(n=2, group_filter="test_broken")
    res = await sched.run([prompt("p0", [1.0, 1.0])])
    assert [t.uid for t in res.trajectories] == ["p0_0", "p0_1"]
    assert res.metrics["group_filter_errors"] == 1


def test_runtime_steps_with_equal_rewards_sample_on_and_report_it() -> None:
    """Through `Runtime.step` (2 steps, each a full wake/sleep): a step whose groups all tie keeps drawing
    prompts from `more_samples` until the budget and says so; the next step, with informative prompts in the
    source, stops at target_groups accepted groups. The batch, ragged form and trainable mask hold only
    accepted groups; the rejected trajectories are on the result."""
    import types

    from agentloop.runtime import Runtime

    tok = types.SimpleNamespace(pad_token_id=0, eos_token_id=2)
    cfg = {"scheduler": {"n": 2, "target_groups": 2, "group_filter": "drop_zero_variance", "group_budget": 6}}
    with Runtime(cfg, clients=[FakeEngine("http://a")], tokenizer=tok, tools=object(), reward_fn=scripted_reward) as rt:
        tied = (prompt(f"t{k}", [1.0, 1.0]) for k in range(100))
        res = rt.step_sync([prompt("a", [0.0, 0.0])], more_samples=tied)
        m = res.metrics
        assert (m["groups_sampled"], m["groups_accepted"], m["groups_rejected"]) == (6, 0, 6)
        assert m["budget_exhausted"] is True and m["groups_budget_exhausted"] == 2
        assert res.trajectories == [] and len(res.rejected) == 12 and res.batch["input_ids"].shape[0] == 0
        assert res.ragged["response_ids"] == []

        mixed = iter([prompt("b0", [1.0, 1.0]), prompt("b1", [0.0, 1.0]), prompt("b2", [1.0, 0.0]), prompt("b3", [0.0, 1.0])])
        res = rt.step_sync([prompt("b", [2.0, 2.0])], more_samples=mixed)
        m = res.metrics
        assert m["groups_accepted"] == 2 and m["budget_exhausted"] is False and m["groups_budget_exhausted"] == 0
        assert sorted({t.group_id for t in res.trajectories}) == ["b1", "b2"]
        assert res.batch["trainable"].tolist() == [1, 1, 1, 1]
        assert res.ragged["group_ids"] == [t.group_id for t in res.trajectories]
        assert res.ragged["response_ids"] == [t.response_ids for t in res.trajectories]
        assert rt.steps_done == 2 and rt.lifecycle.generations_outside_awake == 0


async def test_a_bad_sample_from_the_source_stops_drawing_and_keeps_the_step() -> None:
    sched = make(n=2, target_groups=2, group_filter="drop_zero_variance")
    source = iter([prompt("p0", [0.0, 1.0]), prompt("m1", [0.0, 1.0])])  # p0 is already in the step
    res = await sched.run([prompt("p0", [1.0, 0.0])], more_samples=source)
    m = res.metrics
    assert "bad sample" in m["refill_stop"] and "p0" in m["refill_stop"]
    assert [t.uid for t in res.trajectories] == ["p0_0", "p0_1"]
    assert m["groups_accepted"] == 1 and m["budget_exhausted"] is True
