"""Reward functions: by name, sync (off the event loop) or async, under a timeout; a grader that
raises, hangs or returns garbage leaves reward None with the error recorded, never an exception."""

from __future__ import annotations

import threading

import anyio
import pytest

from agentloop.rewards import RewardResult, get_reward, register_reward, registered_rewards, score
from agentloop.types import Sample, Trajectory


def traj(*assistant: str, num_turns: int | None = None, **extra: object) -> Trajectory:
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    for a in assistant:
        msgs.append({"role": "assistant", "content": a})
    return Trajectory(uid="t", group_id="g", prompt_ids=[1], messages=msgs,
                      num_turns=len(assistant) if num_turns is None else num_turns, extra=dict(extra))


def smp(reward: str | None = "arithmetic", gt: object = 5) -> Sample:
    return Sample(uid="t", messages=[], ground_truth=gt, reward=reward)


@pytest.mark.parametrize(
    "text,gt,want",
    [
        ("The answer is 5.", 5, 1.0),
        ("The answer is 5.", "5", 1.0),
        ("I think The answer is 4. No wait. The answer is 5.", 5, 1.0),
        ("The answer is 6.", 5, 0.0),
        ("5", 5, 0.0),
        ("The answer is -12.", -12, 1.0),
        ("", 5, 0.0),
    ],
)
async def test_arithmetic(text: str, gt: object, want: float) -> None:
    t = traj("<tool_call>...</tool_call>", text)
    await score(t, smp(gt=gt))
    assert t.reward == want
    assert "reward_error" not in t.extra


async def test_arithmetic_uses_the_last_assistant_message_only() -> None:
    t = traj("The answer is 5.", "Hmm, let me check.")
    await score(t, smp())
    assert t.reward == 0.0


async def test_no_reward_name_scores_nothing_and_default_applies() -> None:
    t = traj("The answer is 5.")
    await score(t, smp(reward=None))
    assert t.reward is None and "reward_error" not in t.metrics
    await score(t, smp(reward=None), default="arithmetic")
    assert t.reward == 1.0


async def test_bad_ground_truth_unknown_name_and_raising_grader_are_recorded() -> None:
    t = traj("The answer is 5.")
    await score(t, smp(gt=None))
    assert t.reward is None and "integer ground_truth" in t.extra["reward_error"] and t.metrics["reward_error"] == 1.0
    await score(t, smp(reward="no_such_reward"))
    assert t.reward is None and "unknown reward" in t.extra["reward_error"]

    @register_reward("test_raises")
    def raises(tr: Trajectory, s: Sample) -> float:
        raise ZeroDivisionError("grader bug")

    await score(t, smp(reward="test_raises"))
    assert t.reward is None and "ZeroDivisionError: grader bug" in t.extra["reward_error"]

    @register_reward("test_garbage")
    def garbage(tr: Trajectory, s: Sample) -> object:
        return "1.0"

    await score(t, smp(reward="test_garbage"))
    assert t.reward is None and "expected a float" in t.extra["reward_error"]

    @register_reward("test_nan")
    def nan(tr: Trajectory, s: Sample) -> float:
        return float("nan")

    await score(t, smp(reward="test_nan"))
    assert t.reward is None and "non-finite" in t.extra["reward_error"]


async def test_sync_graders_run_off_the_event_loop_and_time_out() -> None:
    loop_thread = threading.get_ident()
    seen: list[int] = []
    release = threading.Event()
    entered = threading.Event()

    @register_reward("test_slow_sync")
    def slow(tr: Trajectory, s: Sample) -> float:
        seen.append(threading.get_ident())
        entered.set()
        release.wait(60.0)  # blocks its thread, not the loop
        return 1.0

    loop_ran_while_blocked = False

    async def watcher() -> None:
        # Runs on the event loop: if it sees the grader inside its blocking wait, the loop was free.
        nonlocal loop_ran_while_blocked
        while not entered.is_set():
            await anyio.sleep(0.01)
        loop_ran_while_blocked = not release.is_set()

    t = traj("x")
    try:
        with anyio.fail_after(30):  # a guard against a hang, not a speed check
            async with anyio.create_task_group() as tg:
                tg.start_soon(watcher)
                await score(t, smp(reward="test_slow_sync"), timeout=0.3)
    finally:
        release.set()
    assert seen and seen[0] != loop_thread
    assert loop_ran_while_blocked  # the event loop kept running while the grader blocked
    assert t.reward is None and "timed out" in t.extra["reward_error"]


async def test_async_graders_and_turn_rewards() -> None:
    @register_reward("test_async")
    async def judge(tr: Trajectory, s: Sample) -> RewardResult:
        await anyio.sleep(0.01)
        return RewardResult(0.5, turn_rewards=[0.0, 1.0], info={"why": "half"})

    t = traj("a", "b")
    t.extra["reward_error"] = "stale"
    await score(t, smp(reward="test_async"))
    assert t.reward == 0.5 and t.turn_rewards == [0.0, 1.0] and t.extra["reward_info"] == {"why": "half"}
    assert "reward_error" not in t.extra  # a later success clears an earlier error

    @register_reward("test_async_hang")
    async def hang(tr: Trajectory, s: Sample) -> float:
        await anyio.sleep_forever()
        return 0.0

    await score(t, smp(reward="test_async_hang"), timeout=0.1)
    assert t.reward is None and "timed out" in t.extra["reward_error"]


async def test_tool_success_turn_rewards() -> None:
    t = traj("call", "call", "The answer is 5.",
             tool_results=[{"turn": 1, "ok": [True, False]}, {"turn": 2, "ok": [True]}])
    await score(t, smp(reward="tool_success"))
    assert t.reward == 1.0 and t.turn_rewards == [0.5, 1.0, 1.0]


def test_registry() -> None:
    assert {"arithmetic", "tool_success"} <= set(registered_rewards())
    with pytest.raises(KeyError, match="registered"):
        get_reward("nope")
