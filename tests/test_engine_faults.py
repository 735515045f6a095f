"""Engines that sleep, die, restart or hang across steps and processes (issue #14), on real CPU servers.

- three `Runtime`s in sequence against one server: each attaches to the state the last one left, and
  the server is alive, awake and generating the same greedy tokens after each;
- a runtime process SIGKILLed at each lifecycle call (before it is sent / after it was answered),
  then a new run on the same server recovers it (or, for a call whose effect cannot be known, refuses
  with the remedy), never crashing it;
- one of two servers killed, restarted or SIGSTOPped between steps and mid-step: the steps complete
  on the other one, no trajectory is lost, and the restarted server is re-admitted with the step's weights.
Every case runs 2+ steps. The `replay` agent drives a tiny random model. The servers come from the
module's `EnginePool`: a server an earlier test left in any state a fresh one would not be in is
replaced, so each test starts from fresh servers without paying a start for every one.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Iterator

import anyio
import pytest

from agentloop.engine.base import SamplingParams
from agentloop.engine.lifecycle import EngineState, Lifecycle, LifecycleError
from agentloop.engine.lifecycle import MemoryMark
from agentloop.engine.local.process import LocalEngineProcess
from agentloop.engine.sglang import SGLangClient
from agentloop.models.random_model import make_random_model
from agentloop.runtime import Runtime
from agentloop.types import Sample
from engine_pool import EnginePool, greedy_tokens

pytestmark = pytest.mark.anyio
ALL_TAGS = ["cuda_graph", "kv_cache", "weights"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model(tmp_path_factory.mktemp("faults") / "model", seed=3)


@pytest.fixture(scope="module")
def pool(model_dir: Path) -> Iterator[EnginePool]:
    engines = EnginePool(model_dir)
    yield engines
    engines.close_sync()


def samples(n: int, prefix: str, turns: int = 2, gen: int = 8, latency: float = 0.02) -> list[Sample]:
    replay = {"prompt_tokens": 10, "turns": [{"gen_tokens": gen, "tool_latency_s": latency, "tool_result_tokens": 3}] * turns}
    return [Sample(uid=f"{prefix}{i}", messages=[{"role": "user", "content": "x"}], agent="replay",
                   extra={"replay": replay}) for i in range(n)]


def config(urls: list[str], model_dir: Path, **engine: Any) -> dict[str, Any]:
    return {"engine": {"urls": urls, "tokenizer": str(model_dir), "liveness_timeout": 2.0, "request_timeout": 60, **engine},
            "scheduler": {"concurrency": 8, "trajectory_timeout": 120},
            "agent": {"sampling": {"temperature": 0.0}}}


async def server_state(url: str) -> dict[str, Any]:
    """What the server itself says: its released tags (the CPU engine reports them) and weight version."""
    async with SGLangClient(url) as c:
        info = await c.server_info()
        return {"released": info["internal_states"][0]["released_tags"], "version": (await c.model_info())["weight_version"]}


async def two_steps(rt: Runtime, prefix: str) -> list[list[int]]:
    out = []
    for step in range(2):
        res = await rt.step(samples(4, f"{prefix}{step}-"))
        assert [t.status for t in res.trajectories] == ["completed"] * 4, [t.error for t in res.trajectories]
        out.append([tok for t in res.trajectories for tok in t.response_ids])
    return out


@pytest.mark.slow
async def test_three_runtimes_in_sequence_leave_the_server_as_they_found_it(model_dir: Path, pool: EnginePool) -> None:
    async with pool.servers(1) as (proc,):
        fresh = await greedy_tokens(proc.url)
        runs = []
        for _ in range(3):
            async with Runtime(config([proc.url], model_dir)) as rt:
                runs.append(await two_steps(rt, "r"))
                assert (await server_state(proc.url))["released"] == ALL_TAGS  # asleep between steps
            assert await server_state(proc.url) == {"released": [], "version": "default"}
            assert await greedy_tokens(proc.url) == fresh  # alive, awake, base weights
        assert runs[0] == runs[1] == runs[2]
        # restore_on_stop=False leaves it asleep, and the next runtime attaches to that
        async with Runtime(config([proc.url], model_dir, restore_on_stop=False)) as rt:
            await two_steps(rt, "s")
        state = await server_state(proc.url)
        assert state["released"] == ALL_TAGS and MemoryMark.decode(state["version"]).released == set(ALL_TAGS)
        async with Runtime(config([proc.url], model_dir)) as rt:
            assert await two_steps(rt, "r") == runs[0]
        # found asleep: left asleep
        assert (await server_state(proc.url))["released"] == ALL_TAGS
        assert proc.returncode is None


# ---------------------------------------------------------------------- SIGKILL of a runtime process
KILLER = textwrap.dedent("""
    import os, signal, sys, anyio
    from agentloop.config import RuntimeConfig
    from agentloop.runtime import Runtime
    from agentloop.runtime.engines import make_client
    from agentloop.types import Sample

    url, tokenizer, method, nth, when = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    count = 0

    def wrap(client):
        inner = getattr(client, method)

        async def call(*a, **kw):
            global count
            count += 1
            mine = count  # calls run concurrently (generates): this call's own number
            if mine == nth and when == "before":
                os.kill(os.getpid(), signal.SIGKILL)
            out = await inner(*a, **kw)
            if mine == nth and when == "after":
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        setattr(client, method, call)

    async def main():
        cfg = {"engine": {"urls": [url], "tokenizer": tokenizer}, "agent": {"sampling": {"temperature": 0.0}}}
        client = make_client(url, RuntimeConfig.model_validate(cfg).engine)
        wrap(client)
        rt = Runtime(cfg, clients=[client])
        await rt.start()
        replay = {"prompt_tokens": 10, "turns": [{"gen_tokens": 8, "tool_latency_s": 0.02, "tool_result_tokens": 3}] * 2}
        for step in range(3):
            await rt.step([Sample(uid=f"k{step}-{i}", messages=[{"role": "user", "content": "x"}], agent="replay",
                                  extra={"replay": replay}) for i in range(4)])
        await rt.stop()
        print("NOT KILLED")

    anyio.run(main)
""")

#: (method, which call, before/after): one point per kind of state a kill can leave (tests/test_lifecycle.py
#: kills an in-process lifecycle at every one of its calls; here a real process dies at a few).
KILL_POINTS = [
    ("pause_generation", 1, "after"),            # start-up sleep: paused, not continued
    ("release_memory_occupation", 1, "after"),   # released, the mark still says "pending" (the report settles it)
    ("resume_memory_occupation", 1, "after"),    # step 1: weights resumed (zeros), KV released
    ("generate", 3, "after"),                    # mid-step, awake with requests running
    ("release_memory_occupation", 2, "before"),  # step 1's sleep: the mark says "pending", nothing released
]


@pytest.mark.slow
@pytest.mark.parametrize("method, nth, when", KILL_POINTS, ids=[f"{m}-{n}-{w}" for m, n, w in KILL_POINTS])
async def test_a_runtime_sigkilled_at_any_lifecycle_call_leaves_a_server_the_next_run_recovers(
        model_dir: Path, pool: EnginePool, method: str, nth: int, when: str) -> None:
    async with pool.servers(1) as (proc,):
        fresh = await greedy_tokens(proc.url)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"), os.environ.get("PYTHONPATH", "")])}
        done = await anyio.to_thread.run_sync(lambda: subprocess.run(
            [sys.executable, "-c", KILLER, proc.url, str(model_dir), method, str(nth), when],
            capture_output=True, text=True, timeout=300, env=env))
        assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr
        assert proc.returncode is None  # the server survived the runtime's death
        async with Runtime(config([proc.url], model_dir)) as rt:  # the next run attaches and recovers
            await two_steps(rt, "n")
            assert rt.lifecycle.generations_outside_awake == 0
        assert await server_state(proc.url) == {"released": [], "version": "default"}
        assert await greedy_tokens(proc.url) == fresh
        assert proc.returncode is None


class NoReportClient(SGLangClient):
    """A client of a server that, like SGLang 0.5.17, does not report its released tags."""

    async def server_info(self) -> dict[str, Any]:
        info = await super().server_info()
        info["internal_states"] = [{k: v for k, v in s.items() if k != "released_tags"} for s in info["internal_states"]]
        return info


async def test_a_call_whose_effect_cannot_be_known_is_refused_with_the_remedy(model_dir: Path, pool: EnginePool) -> None:
    """A runtime killed while its release was on the wire leaves "pending" in the server's mark; a
    server that cannot report its tags (SGLang) is refused, naming the setting; told, the run works."""
    async with pool.servers(1) as (proc,):
        async with SGLangClient(proc.url) as c:
            await c.release_memory_occupation(None)
            await c.update_weight_version(MemoryMark("default", frozenset(), "release:" + ",".join(ALL_TAGS)).encode())
        async with NoReportClient(proc.url) as client:
            with pytest.raises(LifecycleError, match=r"Restart the server.*engine\.attach_state: asleep if the call "
                               r"took effect, awake if it did not"):
                await Lifecycle([client]).attach()
            lc = Lifecycle([client], attach_state="asleep")  # the remedy, for what really happened
            await lc.attach()
            await lc.sleep()
            for step in range(2):
                await lc.wake_up(None)
                assert (await lc.generate(proc.url, [1, 2, 3], SamplingParams(max_new_tokens=3))).weight_version == "default"
                await lc.sleep()
        assert proc.returncode is None and (await server_state(proc.url))["released"] == ALL_TAGS


# ---------------------------------------------------------------------- one of two servers fails
def servers_of(res: Any) -> set[str]:
    return {u for t in res.trajectories for u in t.extra.get("servers", [])}


@pytest.mark.slow
async def test_stopped_between_steps_is_taken_out_and_readmitted_when_it_continues(model_dir: Path, pool: EnginePool) -> None:
    async with pool.servers(2) as procs, Runtime(config([p.url for p in procs], model_dir)) as rt:
        a, b = procs
        await rt.step(samples(4, "a"))
        os.kill(b._proc.pid, signal.SIGSTOP)
        try:
            with anyio.fail_after(60):  # not the old 60 s per stage: one 2 s probe
                res2 = await rt.step(samples(6, "b"))
        finally:
            os.kill(b._proc.pid, signal.SIGCONT)
        assert [t.status for t in res2.trajectories] == ["completed"] * 6 and servers_of(res2) == {a.url}
        assert "liveness probe" in res2.metrics["servers_removed"][b.url]
        res3 = await rt.step(samples(6, "c"))  # b answers again: re-admitted asleep, as it was left
        assert res3.metrics["servers_readmitted"] == [b.url] and servers_of(res3) == {a.url, b.url}
        assert [t.status for t in res3.trajectories] == ["completed"] * 6


@pytest.mark.slow
async def test_hung_mid_step_fails_over_within_the_watchdog_not_the_timeouts(model_dir: Path, pool: EnginePool) -> None:
    async with pool.servers(2) as procs, \
            Runtime(config([p.url for p in procs], model_dir, hung_timeout=6.0)) as rt:
        a, b = procs
        box: dict[str, Any] = {}

        async def step() -> None:
            box["res"] = await rt.step(samples(8, "m", turns=4, gen=8, latency=0.05))

        with anyio.fail_after(200):
            async with anyio.create_task_group() as tg:
                tg.start_soon(step)
                while rt.lifecycle.in_flight(b.url) == 0 or rt.lifecycle.in_flight(a.url) == 0:
                    await anyio.sleep(0.01)
                os.kill(b._proc.pid, signal.SIGSTOP)
        res = box["res"]
        assert len(res.trajectories) == 8 and not res.carry_over  # nothing lost, nothing silently dropped
        assert [t.status for t in res.trajectories] == ["completed"] * 8, [t.error for t in res.trajectories]
        assert "hung" in res.metrics["servers_removed"][b.url]
        assert any(t.extra["servers"] == [b.url, a.url] for t in res.trajectories)
        for t in res.trajectories:
            t.check_invariants()
        os.kill(b._proc.pid, signal.SIGCONT)
        res2 = await rt.step(samples(8, "n"))  # b is back: re-admitted (its stale requests aborted)
        assert res2.metrics["servers_readmitted"] == [b.url] and servers_of(res2) == {a.url, b.url}
        assert [t.status for t in res2.trajectories] == ["completed"] * 8


@pytest.mark.slow
async def test_killed_then_restarted_between_steps_is_taken_out_then_readmitted(
        model_dir: Path, pool: EnginePool, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="agentloop")
    async with pool.servers(2) as procs, Runtime(config([p.url for p in procs], model_dir)) as rt:
        a, b = procs
        res1 = await rt.step(samples(8, "a"))
        assert servers_of(res1) == {a.url, b.url}
        caplog.clear()
        os.kill(b._proc.pid, signal.SIGKILL)
        await anyio.to_thread.run_sync(b._proc.wait)
        res2 = await rt.step(samples(8, "b"))  # the probe takes b out; the step runs on a
        assert [t.status for t in res2.trajectories] == ["completed"] * 8
        assert servers_of(res2) == {a.url} and "liveness probe" in res2.metrics["servers_removed"][b.url]
        assert list(res2.metrics["servers_out_of_rotation"]) == [b.url]
        await rt.step(samples(8, "b2"))  # still dead: still out, and said once, not per step or request
        lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO and b.url in r.getMessage()]
        # the lifecycle's "out of rotation" and the client's "unreachable": each once, whatever the requests
        assert len([m for m in lines if "out of rotation" in m]) == 1 and len(lines) <= 2, lines
        restarted = LocalEngineProcess(model_dir, port=b.port)
        procs.append(restarted)  # the pool stops it with the others
        await restarted.start()  # fresh: awake with its base weights
        res3 = await rt.step(samples(8, "c"), weights=str(model_dir))  # re-admitted, gets the step's weights
        assert res3.metrics["servers_readmitted"] == [b.url] and res3.metrics["servers_out_of_rotation"] == {}
        assert [t.status for t in res3.trajectories] == ["completed"] * 8 and servers_of(res3) == {a.url, b.url}
        assert {t.weight_version for t in res3.trajectories} == {res3.weight_version}
        assert rt.lifecycle.generations_outside_awake == 0


@pytest.mark.slow
async def test_every_server_gone_fails_the_step_naming_each_and_why(model_dir: Path, pool: EnginePool) -> None:
    async with pool.servers(2) as procs, Runtime(config([p.url for p in procs], model_dir)) as rt:
        await rt.step(samples(2, "a"))
        for p in procs:
            await p.stop()
        with pytest.raises(LifecycleError) as ei:
            await rt.step(samples(2, "b"))
        for p in procs:
            assert p.url in str(ei.value)
        assert "liveness probe" in str(ei.value)
        assert rt.lifecycle.state is EngineState.SLEEPING
