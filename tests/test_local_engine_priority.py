"""Priority scheduling: the CPU engine's (SGLang's flags and rules), and `scheduler.server_priority`
sending SGLang's request `priority` (older trajectories higher) from a Runtime, checked against /server_info."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
import torch

from agentloop.engine.base import SamplingParams
from agentloop.engine.local.priority import PriorityPolicy
from agentloop.engine.local.request import Request
from agentloop.engine.local.sampling import RequestSampling
from agentloop.engine.local.scheduler import Scheduler
from agentloop.engine.sglang import SGLangClient
from agentloop.runtime import Runtime
from agentloop.types import Sample
from agentloop.runtime.concurrency import check_server_priority

PROMPT = [1, 87, 85, 268, 201, 74, 75, 223, 20, 13, 21, 2, 201, 1, 67, 270, 294, 201]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
PRIORITY_ARGS = ["--max-running-requests", "1", "--enable-priority-scheduling"]


@pytest.fixture(scope="module")
def priority_engine(start_local_engine, random_model_dir: Path) -> str:
    """One CPU engine with SGLang's priority scheduling and a batch of one, for every test here."""
    return start_local_engine(random_model_dir, PRIORITY_ARGS)


def req(rid: str, priority: int | None, queued: float = 0.0) -> Request:
    r = Request(rid=rid, input_ids=[1], sampling=RequestSampling.from_json({}, vocab_size=8),
                generator=torch.Generator(), priority=priority)
    r.queued = queued
    return r


def test_policy_orders_by_priority_then_arrival_and_preempts_past_the_threshold() -> None:
    high_first = PriorityPolicy(enabled=True)
    a, b, c, d = req("a", 1, 1), req("b", 5, 2), req("c", None, 3), req("d", 5, 4)
    assert [r.rid for r in high_first.order([a, b, c, d])] == ["b", "d", "a", "c"]  # None: the worst
    low_first = PriorityPolicy(enabled=True, low_values_first=True)
    assert [r.rid for r in low_first.order([a, b, c, d])] == ["a", "b", "d", "c"]

    running = [req("old", 0, 1), req("young", 0, 2), req("mid", 50, 3)]
    # beats both priority-0 requests by more than 10: the most recently queued goes first
    assert [r.rid for r in high_first.victims(req("new", 11, 9), running, 2)] == ["young", "old"]
    assert high_first.victims(req("new", 10, 9), running, 1) == []  # a difference of 10 is not more than 10
    assert high_first.victims(req("new", 100, 9), running, 0) == []
    assert PriorityPolicy(enabled=True, preemption=False).victims(req("new", 100, 9), running, 1) == []
    assert PriorityPolicy().victims(req("new", 100, 9), running, 1) == []
    assert [r.rid for r in low_first.victims(req("new", -20, 9), running, 3)] == ["mid", "young", "old"]


async def wait_running(client: SGLangClient, n: int = 1) -> None:
    for _ in range(1000):
        if (await client.server_info())["internal_states"][0]["num_running"] >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never saw {n} running request(s)")


async def test_a_higher_priority_request_preempts_and_the_preempted_one_resumes_exactly(
        priority_engine: str) -> None:
    url = priority_engine
    long = GREEDY.replace(max_new_tokens=300)  # long enough to still run when the short one has answered
    async with SGLangClient(url) as client:
        info = await client.server_info()
        assert info["enable_priority_scheduling"] is True and info["schedule_low_priority_values_first"] is False
        reference = await client.generate(PROMPT, long, priority=0)
        before = (await client.server_info())["internal_states"][0]["preempted_requests"]
        low = asyncio.create_task(client.generate(PROMPT, long, priority=0))
        try:
            await wait_running(client)
            high = await asyncio.wait_for(client.generate(PROMPT[:6], GREEDY, priority=100), 30)
            assert not low.done(), "the high-priority request waited for the whole low-priority one"
            out = await asyncio.wait_for(low, 60)
        finally:
            low.cancel()
        assert len(high.output_ids) == GREEDY.max_new_tokens
        assert out.raw_meta["num_retractions"] == 1
        # preempted, re-prefilled from its tokens and continued: the same greedy tokens, each with its logprob
        assert out.output_ids == reference.output_ids
        assert out.output_logprobs == pytest.approx(reference.output_logprobs, abs=1e-4)
        assert (await client.server_info())["internal_states"][0]["preempted_requests"] == before + 1


async def test_the_queue_is_served_by_priority_and_a_small_lead_does_not_preempt(
        priority_engine: str) -> None:
    url = priority_engine
    done: list[str] = []
    async with SGLangClient(url) as client:
        async def run(name: str, priority: int, n: int = 12) -> None:
            await client.generate(PROMPT, GREEDY.replace(max_new_tokens=n), priority=priority)
            done.append(name)

        first = asyncio.create_task(run("running", 0, 100))
        await wait_running(client)
        queued = [asyncio.create_task(run(f"p{p}", p)) for p in (1, 3, 2)]  # within 10 of the running one
        await asyncio.sleep(0.2)  # all three queued behind it
        await asyncio.wait_for(asyncio.gather(first, *queued), 60)
    assert done == ["running", "p3", "p2", "p1"]


async def test_priority_must_be_an_integer(priority_engine: str) -> None:
    url = priority_engine
    async with aiohttp.ClientSession() as http:
        for bad in ("high", True, 1.5, [1]):
            async with http.post(f"{url}/generate", json={"input_ids": PROMPT, "priority": bad}) as r:
                assert r.status == 400 and "priority must be an integer" in await r.text()


async def test_without_priority_scheduling_a_priority_is_ignored_or_refused(local_engine: str) -> None:
    async with SGLangClient(local_engine) as client:
        info = await client.server_info()
        assert info["enable_priority_scheduling"] is False and info["abort_on_priority_when_disabled"] is False
        out = await client.generate(PROMPT, GREEDY.replace(max_new_tokens=2), priority=3)  # ignored
        assert len(out.output_ids) == 2
    with pytest.raises(ValueError, match="abort every request"):
        check_server_priority("oldest_first", [{**info, "abort_on_priority_when_disabled": True}], [local_engine])

    class Unblocked:  # the scheduler's memory manager, as far as `submit` asks it
        def generation_block_reason(self) -> None:
            return None

    # the refusal itself (agentloop serve --abort-on-priority-when-disabled): SGLang's status and message;
    # `submit` runs on the caller's thread here (the worker is never started)
    sched = Scheduler(None, Unblocked(), context_length=64,  # type: ignore[arg-type]
                      priority=PriorityPolicy(abort_when_disabled=True))
    refused, plain = req("r", 3), req("p", None)
    sched.submit(refused)
    sched.submit(plain)
    assert refused.error == (503, "Using priority is disabled for this server. Please send a new request without a priority.")
    assert list(sched.waiting) == [plain] and plain.error is None


def test_server_priority_is_checked_against_each_servers_args() -> None:
    on = {"enable_priority_scheduling": True, "schedule_low_priority_values_first": False}
    assert check_server_priority("none", [{"schedule_low_priority_values_first": True}], ["u"])["server_priority"] == "none"
    ok = check_server_priority("oldest_first", [on, None, {}], ["a", "b", "c"])  # b unreachable, c reports nothing
    assert ok["server_priority"] == "oldest_first" and "ignore" not in ok["server_priority_rule"]
    warned = check_server_priority("oldest_first", [on, {"enable_priority_scheduling": False}], ["a", "b"])
    assert "b run without --enable-priority-scheduling and ignore it" in warned["server_priority_rule"]
    preempting = check_server_priority("oldest_first", [{**on, "disable_priority_preemption": False}], ["a"])
    assert "a preempt running requests" in preempting["server_priority_rule"]
    cpu = {**on, "disable_priority_preemption": False, "engine": "agentloop-cpu"}  # its preemption keeps ids and logprobs aligned
    assert "preempt" not in check_server_priority("oldest_first", [cpu], ["a"])["server_priority_rule"]
    with pytest.raises(ValueError, match=r"http://x:1 runs with --schedule-low-priority-values-first"):
        check_server_priority("oldest_first", [{**on, "schedule_low_priority_values_first": True}], ["http://x:1"])


class PriorityRecordingClient(SGLangClient):
    """The real client, recording the priority each generate carried, by request id."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.sent: list[tuple[str, int | None]] = []

    async def generate(self, *a: Any, **kw: Any) -> Any:
        self.sent.append((kw.get("rid") or "", kw.get("priority")))
        return await super().generate(*a, **kw)


def test_a_runtime_sends_older_trajectories_higher_priorities_over_two_steps(
        priority_engine: str, random_model_dir: Path) -> None:
    client = PriorityRecordingClient(priority_engine)
    turns = [{"gen_tokens": 6, "tool_latency_s": 0.0, "tool_result_tokens": 2} for _ in range(2)]

    async def main() -> list[Any]:
        rt = Runtime({"engine": {"tokenizer": str(random_model_dir)}, "scheduler": {"server_priority": "oldest_first"}},
                     clients=[client])
        results = []
        async with rt:
            assert rt.concurrency is not None and rt.concurrency.server_priority == "oldest_first"
            assert "ignore" not in rt.concurrency.server_priority_rule
            for step in range(2):  # the lifecycle's bugs show on step 2
                samples = [Sample(uid=f"s{step}-{i}", messages=[], agent="replay",
                                  extra={"replay": {"prompt_tokens": 8, "turns": turns}}) for i in range(6)]
                results.append(await rt.step(samples))
        return results

    results = anyio.run(main)
    trajs = [t for r in results for t in r.trajectories]
    assert len(trajs) == 12 and all(t.status == "completed" for t in trajs)
    by_traj: dict[str, set[int | None]] = {}
    for rid, priority in client.sent:
        by_traj.setdefault(rid.rsplit("-", 1)[0], set()).add(priority)
    assert len(by_traj) == 12 and all(len(p) == 1 and None not in p for p in by_traj.values())
    priorities = sorted((p for ps in by_traj.values() for p in ps), reverse=True)
    assert len(set(priorities)) == 12 and all(p <= 0 for p in priorities)  # minus each trajectory's age
    step2 = {next(iter(p)) for k, p in by_traj.items() if any(t.uid.startswith("s1-") and k.startswith(t.uid)
                                                              for t in results[1].trajectories)}
    assert step2 and max(step2) < min(set(priorities) - step2)  # step 2's trajectories are younger


def test_server_priority_none_sends_no_priority(local_engine: str, random_model_dir: Path) -> None:
    client = PriorityRecordingClient(local_engine)

    async def main() -> None:
        async with Runtime({"engine": {"tokenizer": str(random_model_dir)}}, clients=[client]) as rt:
            for step in range(2):
                await rt.step([Sample(uid=f"n{step}", messages=[], agent="replay",
                                      extra={"replay": {"prompt_tokens": 8, "turns": [{"gen_tokens": 4}]}})])

    anyio.run(main)
    assert client.sent and all(p is None for _, p in client.sent)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
