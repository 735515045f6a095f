"""A second runtime attaching to a server another one drives (`agentloop.engine.lease`), on real CPU servers.

Before owner leases, a runtime B attaching while runtime A was mid-step found the server's plain
weight version ("awake, nobody's"), and its start-up sleep aborted A's requests and released the
memory under it; A's own sleep then released released memory (SGLang: a crash). Now:
- B (a `Runtime`, or `agentloop rollout --engine-url`) is refused while A drives the server, mid-step
  or between steps, naming A and `engine.takeover`; A's steps are untouched; once A stops, B runs;
- a SIGKILLed A (same machine) is taken over at once; a lease from another machine is respected until
  it expires, then taken over; `engine.takeover` takes a live one, and A then stops driving the
  server (it is taken out of A's rotation, never released twice);
- two runtimes attaching at the same moment: exactly one gets the server.
Every case runs 2+ steps.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Iterator

import anyio
import pytest

from agentloop.engine.base import SamplingParams
from agentloop.engine.lease import Lease
from agentloop.engine.lifecycle import Lifecycle, LifecycleError
from agentloop.engine.lifecycle import MARK_SEPARATOR, MemoryMark
from agentloop.engine.sglang import SGLangClient
from agentloop.runtime import Runtime
from agentloop.types import Sample
from engine_pool import EnginePool

pytestmark = pytest.mark.anyio
REPO = Path(__file__).resolve().parents[1]
ALL_TAGS = ["cuda_graph", "kv_cache", "weights"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def pool(random_model_dir: Path) -> Iterator[EnginePool]:
    """CPU servers reused while as good as new (a lease left in a mark disqualifies one)."""
    engines = EnginePool(random_model_dir)
    yield engines
    engines.close_sync()




def samples(n: int, prefix: str, turns: int = 2, latency: float = 0.05) -> list[Sample]:
    replay = {"prompt_tokens": 10, "turns": [{"gen_tokens": 8, "tool_latency_s": latency, "tool_result_tokens": 3}] * turns}
    return [Sample(uid=f"{prefix}{i}", messages=[{"role": "user", "content": "x"}], agent="replay",
                   extra={"replay": replay}) for i in range(n)]


def config(url: str, model: Path, **engine: Any) -> dict[str, Any]:
    return {"engine": {"urls": [url], "tokenizer": str(model), "liveness_timeout": 5.0, "request_timeout": 60, **engine},
            "scheduler": {"concurrency": 8, "trajectory_timeout": 120}, "agent": {"sampling": {"temperature": 0.0}}}


async def server_state(url: str) -> dict[str, Any]:
    async with SGLangClient(url) as c:
        info = await c.server_info()
        return {"released": info["internal_states"][0]["released_tags"], "version": (await c.model_info())["weight_version"]}


async def completed_steps(rt: Runtime, prefix: str, steps: int = 2, **kw: Any) -> None:
    for step in range(steps):
        res = await rt.step(samples(4, f"{prefix}{step}-", **kw))
        assert [t.status for t in res.trajectories] == ["completed"] * 4, [t.error for t in res.trajectories]
        # the lifecycle's mark is in the server's weight version while A holds it, never in a trajectory's
        assert all(MARK_SEPARATOR not in v for t in res.trajectories for v in t.weight_versions)


def refused_for_owner(e: BaseException, owner: Lease) -> None:
    text = str(e)
    assert "another runtime drives this server now" in text and owner.owner.split(":")[2] in text, text
    assert "engine.takeover: true" in text, text


@pytest.mark.slow
async def test_a_second_runtime_is_refused_while_the_first_drives_the_server(
        random_model_dir: Path, pool: EnginePool) -> None:
    async with pool.servers(1) as (proc,):
        url = proc.url
        async with Runtime(config(url, random_model_dir)) as a:
            assert a.lifecycle is not None
            await completed_steps(a, "a")  # between steps: A holds the server asleep
            with pytest.raises(LifecycleError) as between:
                await Runtime(config(url, random_model_dir)).start()
            refused_for_owner(between.value, a.lifecycle.lease)
            refusals: list[BaseException] = []

            async def b_mid_step() -> None:
                await a.lifecycle.gate.wait_awake(60)  # A is mid-step, generating
                with pytest.raises(LifecycleError) as mid:  # (B's tokenizer given: B attaches at once)
                    await Runtime(config(url, random_model_dir), tokenizer=a.tokenizer).start()
                assert a.lifecycle.gate.is_open, "A's step ended before B attached: not a mid-step attach"
                refusals.append(mid.value)

            async with anyio.create_task_group() as tg:
                tg.start_soon(b_mid_step)
                await completed_steps(a, "m", steps=1, turns=20, latency=0.1)  # untouched by B
            refused_for_owner(refusals[0], a.lifecycle.lease)
            assert a.lifecycle.generations_outside_awake == 0
            assert MemoryMark.decode((await server_state(url))["version"]).lease == a.lifecycle.lease
        # A stopped: the server is awake and nobody's again, and B runs
        assert await server_state(url) == {"released": [], "version": "default"}
        async with Runtime(config(url, random_model_dir)) as b:
            await completed_steps(b, "b")
        assert proc.returncode is None


@pytest.mark.slow
async def test_agentloop_rollout_on_a_driven_server_is_refused_naming_the_owner(
        random_model_dir: Path, pool: EnginePool, tmp_path: Path) -> None:
    async with pool.servers(1) as (proc,), Runtime(config(proc.url, random_model_dir)) as a:
        assert a.lifecycle is not None
        await completed_steps(a, "a")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
        done = await anyio.to_thread.run_sync(lambda: subprocess.run(
            [sys.executable, "-m", "agentloop", "rollout", "--quiet", "--engine-url", proc.url, "--steps", "1",
             "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300, env=env))
        assert done.returncode != 0, done.stdout + done.stderr
        refused_for_owner(Exception(done.stderr), a.lifecycle.lease)
        assert "runtime.engine.takeover=true" in done.stderr
        await completed_steps(a, "c")  # A goes on, its server never touched
        assert (await server_state(proc.url))["released"] == ALL_TAGS


# ---------------------------------------------------------------------- dead, remote and taken-over owners
OWNER = textwrap.dedent("""
    import sys, anyio
    from agentloop.runtime import Runtime
    from agentloop.types import Sample

    url, tokenizer = sys.argv[1], sys.argv[2]

    def samples(prefix, turns):
        replay = {"prompt_tokens": 10, "turns": [{"gen_tokens": 8, "tool_latency_s": 0.05, "tool_result_tokens": 3}] * turns}
        return [Sample(uid=f"{prefix}{i}", messages=[{"role": "user", "content": "x"}], agent="replay",
                       extra={"replay": replay}) for i in range(4)]

    async def main():
        async with Runtime({"engine": {"urls": [url], "tokenizer": tokenizer}, "agent": {"sampling": {"temperature": 0.0}}}) as rt:
            await rt.step(samples("s0-", 2))
            async def announce():
                await rt.lifecycle.gate.wait_awake(60)
                print("MID-STEP", flush=True)
            async with anyio.create_task_group() as tg:
                tg.start_soon(announce)
                await rt.step(samples("long-", 500))
        print("NOT KILLED", flush=True)

    anyio.run(main)
""")


@pytest.mark.slow
async def test_a_sigkilled_owner_on_this_machine_is_taken_over_at_once(
        random_model_dir: Path, pool: EnginePool, caplog: pytest.LogCaptureFixture) -> None:
    async with pool.servers(1) as (proc,):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
        owner = subprocess.Popen([sys.executable, "-c", OWNER, proc.url, str(random_model_dir)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env)
        try:
            assert owner.stdout is not None
            line = await anyio.to_thread.run_sync(owner.stdout.readline)
            assert line.strip() == "MID-STEP", owner.stderr.read() if owner.stderr else ""
            lease = MemoryMark.decode((await server_state(proc.url))["version"]).lease
            assert lease is not None and lease.pid == owner.pid
        finally:
            owner.kill()
            owner.wait()
        caplog.set_level(logging.WARNING, logger="agentloop")
        t0 = time.monotonic()
        async with Runtime(config(proc.url, random_model_dir)) as b:  # no waiting for the lease to expire
            assert time.monotonic() - t0 < lease.until - time.time()
            await completed_steps(b, "b")
        assert any("its process is gone" in r.getMessage() and str(owner.pid) in r.getMessage() for r in caplog.records)
        assert await server_state(proc.url) == {"released": [], "version": "default"}
        assert proc.returncode is None


async def write_remote_lease(url: str, until: float) -> Lease:
    """What a runtime on another machine leaves in the server's mark (awake, mid-step)."""
    lease = Lease("otherhost:4242:0badcafe", "0123456789ab", 777, int(until))
    async with SGLangClient(url) as c:
        await c.update_weight_version(MemoryMark("default", lease=lease).encode())
    return lease


@pytest.mark.slow
async def test_a_lease_from_another_machine_holds_until_it_expires(random_model_dir: Path, pool: EnginePool) -> None:
    async with pool.servers(1) as (proc,):
        lease = await write_remote_lease(proc.url, time.time() + 600)
        with pytest.raises(LifecycleError) as live:
            await Runtime(config(proc.url, random_model_dir)).start()
        refused_for_owner(live.value, lease)
        assert "on another machine; its lease has not expired" in str(live.value) and "otherhost" in str(live.value)
        assert (await server_state(proc.url))["released"] == []  # refused before any lifecycle call
        await write_remote_lease(proc.url, time.time() - 1)  # its owner stopped renewing it
        async with Runtime(config(proc.url, random_model_dir)) as b:
            await completed_steps(b, "b")
        assert await server_state(proc.url) == {"released": [], "version": "default"}


@pytest.mark.slow
async def test_a_taken_over_runtime_stops_driving_the_server(random_model_dir: Path, pool: EnginePool) -> None:
    async with pool.servers(1) as (proc,):
        url = proc.url
        a = Runtime(config(url, random_model_dir))
        await a.start()
        try:
            assert a.lifecycle is not None
            await completed_steps(a, "a")
            async with Runtime(config(url, random_model_dir, takeover=True)) as b:  # the override: A is alive
                assert b.lifecycle is not None
                await completed_steps(b, "b")
                with pytest.raises(LifecycleError, match=r"no engine server left .*agentloop runtime "
                                   + b.lifecycle.lease.nonce):
                    await a.step(samples(4, "a2-"))  # A's probe finds B's lease: A sends the server nothing
                assert a.lifecycle.out_of_rotation and url in a.lifecycle.out_of_rotation
                await completed_steps(b, "b2")  # the server never saw a double release
            await a.stop()  # leaves the server alone: not A's any more
            assert await server_state(url) == {"released": [], "version": "default"}  # as B left it
        finally:
            await a.stop()
        assert proc.returncode is None


async def test_two_lifecycles_attaching_at_the_same_moment_one_gets_the_server(
        random_model_dir: Path, pool: EnginePool) -> None:
    async with pool.servers(1) as (proc,):
        async with SGLangClient(proc.url) as c1, SGLangClient(proc.url) as c2:
            lcs = [Lifecycle([c1]), Lifecycle([c2])]
            results: list[BaseException | None] = [None, None]

            async def attach(i: int) -> None:
                try:
                    await lcs[i].attach()
                except LifecycleError as e:
                    results[i] = e

            async with anyio.create_task_group() as tg:
                for i in range(2):
                    tg.start_soon(attach, i)
            assert sum(r is None for r in results) == 1, results
            loser = next(r for r in results if r is not None)
            assert "at the same moment" in str(loser) or "another runtime drives this server now" in str(loser)
            winner = lcs[results.index(None)]
            await winner.sleep()
            for _ in range(2):
                await winner.wake_up(None)
                out = await winner.generate(proc.url, [1, 2, 3], SamplingParams(max_new_tokens=3))
                assert out.weight_version == "default"
                await winner.sleep()
            await winner.restore()
            for lc in lcs:
                lc.close()
        assert await server_state(proc.url) == {"released": [], "version": "default"}


@pytest.mark.slow
async def test_a_rollout_longer_than_the_lease_keeps_it(random_model_dir: Path, pool: EnginePool) -> None:
    """A runtime on another machine trusts the lease's expiry: it must never lapse while the owner
    works. Wake-up and sleep renew it; `keep_lease` renews it during a rollout longer than that."""
    async with pool.servers(1) as (proc,), Runtime(config(proc.url, random_model_dir, lease_timeout=2.0)) as a:
        assert a.lifecycle is not None
        seen: list[int] = []

        async def watch() -> None:
            await a.lifecycle.gate.wait_awake(60)
            while a.lifecycle.gate.is_open:
                lease = MemoryMark.decode((await server_state(proc.url))["version"]).lease
                assert lease is not None and lease.owner == a.lifecycle.lease.owner
                assert lease.until > time.time(), "the lease lapsed mid-step"
                if not seen or lease.until != seen[-1]:
                    seen.append(lease.until)
                await anyio.sleep(0.1)

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            await completed_steps(a, "long", steps=1, turns=50, latency=0.1)  # >= 5 s of tool waits
        assert len(seen) >= 2, f"never renewed during the step: {seen}"  # (the rollout outlasted the lease)
        await completed_steps(a, "c", steps=1)


# ---------------------------------------------------------------------- who is alive (no server needed)
def test_owner_status_tells_live_dead_reused_and_remote_owners() -> None:
    from dataclasses import replace

    from agentloop.engine.lease import new_lease, owner_status

    mine = new_lease(60)
    lc = Lifecycle([SGLangClient("http://127.0.0.1:9")])  # another holder in this very process
    assert owner_status(mine, mine) == "ours"
    assert owner_status(lc.lease, mine) == "alive"
    lc.close()
    assert owner_status(lc.lease, mine) == "dead"  # closed (or collected): its lease is a dead owner's
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        from agentloop.engine.lease import _proc_start_ticks

        theirs = replace(mine, owner=f"host:{child.pid}:feedbeef", started=_proc_start_ticks(child.pid) or -1)
        assert owner_status(theirs, mine) == "alive"
        assert owner_status(replace(theirs, started=theirs.started - 1), mine) == "dead"  # the pid was reused
    finally:
        child.kill()
        child.wait()
    assert owner_status(theirs, mine) == "dead"
    remote = replace(theirs, node="elsewhere", until=int(time.time()) + 60)
    assert owner_status(remote, mine) == "unknown" and owner_status(replace(remote, until=1), mine) == "expired"
    mark = MemoryMark("v3", frozenset({"kv_cache"}), lease=remote)
    assert MemoryMark.decode(mark.encode()) == mark and MemoryMark.decode("v3") == MemoryMark("v3")
