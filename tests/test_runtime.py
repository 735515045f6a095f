"""`Runtime.step` over the real CPU engine (`agentloop serve` subprocesses, real HTTP), >= 2 steps each.

- staged wake-up every step, with weights from disk, a state dict and a path; no generate reaches an
  engine outside AWAKE (a wrapping client records the lifecycle state at every call, a probe keeps
  generating across sleeps, and the engine itself refuses generation while asleep);
- sleep while trajectories are in flight aborts and settles them before memory is released, and the
  aborted ones continue next step;
- over-sampling returns exactly the target number of complete groups and carries the rest over;
- killing one of two engine servers mid-step loses no trajectory.
The `replay` agent loop drives a tiny random model (no tool-calling ability needed for these). The
servers come from the module's `EnginePool` (a server is reused only while it is as good as new).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any, Iterator

import anyio
import pytest
from safetensors.torch import load_file

from agentloop.engine.base import EngineError, SamplingParams
from agentloop.engine.lifecycle import EngineState
from agentloop.engine.sglang import SGLangClient
from agentloop.models.random_model import make_random_model
from agentloop.runtime import Runtime
from agentloop.types import Sample
from engine_pool import EnginePool

pytestmark = pytest.mark.anyio

WAKE = ["resume_weights", "update_weights", "resume_kv_cache"]
SLEEP = ["pause", "settle", "continue", "flush_cache", "release"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model(tmp_path_factory.mktemp("rt") / "model", seed=1)


@pytest.fixture(scope="module")
def pool(model_dir: Path) -> Iterator[EnginePool]:
    engines = EnginePool(model_dir)
    yield engines
    engines.close_sync()


def replay_samples(n: int, turns: list[dict[str, Any]], prefix: str = "s") -> list[Sample]:
    return [Sample(uid=f"{prefix}{i}", messages=[{"role": "user", "content": "x"}], agent="replay",
                   extra={"replay": {"prompt_tokens": 12, "turns": turns}}) for i in range(n)]


def short_turns(k: int = 2, gen: int = 6, latency: float = 0.02) -> list[dict[str, Any]]:
    return [{"gen_tokens": gen, "tool_latency_s": latency, "tool_result_tokens": 3} for _ in range(k)]


class StateRecordingClient:
    """Wraps an `EngineClient`; records the runtime's lifecycle state at every call that reaches it."""

    def __init__(self, inner: SGLangClient) -> None:
        self.inner = inner
        self.url = inner.url
        self.runtime: Runtime | None = None
        self.calls: list[tuple[str, EngineState | None, int]] = []

    def _record(self, op: str) -> None:
        lc = self.runtime.lifecycle if self.runtime else None
        self.calls.append((op, lc.state if lc else None, lc.in_flight() if lc else 0))

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr) or name in ("close",):
            return attr

        async def wrapped(*a: Any, **kw: Any) -> Any:
            self._record(name)
            return await attr(*a, **kw)

        return wrapped

    async def close(self) -> None:
        await self.inner.close()


def stage_names(rt: Runtime, first: int, phase: str) -> list[str]:
    return [r.stage for r in rt.lifecycle.records[first:] if r.phase == phase]


@pytest.mark.slow
async def test_steps_wake_in_stages_and_generation_only_while_awake(model_dir: Path, pool: EnginePool) -> None:
    async with pool.servers(1) as (proc,):
        client = StateRecordingClient(SGLangClient(proc.url))
        rt = Runtime({"engine": {"tokenizer": str(model_dir)}, "scheduler": {"n": 2}}, clients=[client])
        client.runtime = rt
        async with rt:
            assert rt.lifecycle.state is EngineState.SLEEPING  # start() put the engine to sleep
            raw = SGLangClient(proc.url)
            probe_ids: list[str] = []

            async def probe() -> None:
                # Generates across sleeps and wake-ups: each must wait for the gate.
                session = rt.router.session("probe")
                for _ in range(200):
                    out = await session([5, 6, 7], SamplingParams(max_new_tokens=2, temperature=0.0))
                    probe_ids.append(out.weight_version)
                    await anyio.sleep(0.01)
                    if session.stopped:
                        break

            state_dict = load_file(str(model_dir / "model.safetensors"))
            weights = [None, state_dict, str(model_dir)]
            versions = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(probe)
                for step, w in enumerate(weights):
                    first = len(rt.lifecycle.records)
                    res = await rt.step(replay_samples(3, short_turns()), w)
                    versions.append(res.weight_version)
                    assert stage_names(rt, first, "wake_up") == WAKE
                    assert stage_names(rt, first, "sleep") == SLEEP
                    assert rt.lifecycle.state is EngineState.SLEEPING
                    assert len(res.trajectories) == 6 and {t.status for t in res.trajectories} == {"completed"}
                    assert {t.weight_version for t in res.trajectories} == {res.weight_version}
                    assert res.batch["input_ids"].shape[0] == 6
                    assert res.metrics["status_counts"]["completed"] == 6
                    assert set(res.metrics["stage_seconds"]) == {f"wake_up/{s}" for s in WAKE} | {f"sleep/{s}" for s in SLEEP}
                    # The engine itself refuses generation while asleep (a bypass of the gate fails loudly).
                    with pytest.raises(EngineError, match="(?i)releas"):
                        await raw.generate([5, 6, 7], SamplingParams(max_new_tokens=2))
                    await anyio.sleep(0.1)  # the probe is held at the gate meanwhile
                tg.cancel_scope.cancel()
            await raw.close()
        assert versions[1] != versions[2] and versions[1] and versions[2]  # each weight load is a new version
        gens = [c for c in client.calls if c[0] == "generate"]
        assert len(gens) >= 3 * 6 * 2
        assert all(state is EngineState.AWAKE for _, state, _ in gens), gens
        assert rt.lifecycle.generations_outside_awake == 0
        releases = [c for c in client.calls if c[0] == "release_memory_occupation"]
        assert len(releases) == 4 and all(n == 0 for _, _, n in releases)  # nothing in flight at release


@pytest.mark.slow
async def test_sleep_mid_step_aborts_settles_then_resumes(model_dir: Path, pool: EnginePool) -> None:
    # A first turn long enough (1000 tokens) that no machine finishes it in the 0.2 s before the sleep.
    async with pool.servers(1) as (proc,):
        cfg = {"engine": {"urls": [proc.url], "tokenizer": str(model_dir)}, "scheduler": {"concurrency": 4},
               "agent": {"max_new_tokens_per_turn": 1000, "max_response_tokens": 1100}}
        async with Runtime(cfg) as rt:
            in_flight_at_release: list[int] = []
            c = rt.clients[0]
            release = c.release_memory_occupation

            async def recording_release(tags=None):
                in_flight_at_release.append(rt.lifecycle.in_flight())
                return await release(tags)

            c.release_memory_occupation = recording_release  # type: ignore[method-assign]
            long = [{"gen_tokens": 1000, "tool_latency_s": 0.0, "tool_result_tokens": 2}, {"gen_tokens": 4}]
            samples = replay_samples(4, long)
            box: dict[str, Any] = {}

            async def step() -> None:
                box["res"] = await rt.step(samples)

            with anyio.fail_after(120):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(step)
                    while rt.lifecycle.in_flight() < 4:
                        await anyio.sleep(0.01)
                    await anyio.sleep(0.2)
                    await rt.sleep()
            res = box["res"]
            assert in_flight_at_release == [0]  # the mid-step sleep released with nothing in flight (the step's own sleep is a no-op)
            assert res.trajectories == [] and len(res.carry_over) == 4
            partial = [c.resume_from for c in res.carry_over]
            assert all(p is not None and p.status == "aborted" for p in partial)
            assert all(len(p.response_ids) < 1000 for p in partial)
            assert sum(len(p.response_ids) for p in partial) > 0  # the tokens sampled before the abort are kept

            res2 = await rt.step(res.carry_over)  # step 2: the partials continue and finish
            assert [t.status for t in res2.trajectories] == ["completed"] * 4
            for t, p in zip(res2.trajectories, partial):
                t.check_invariants()
                assert t.response_ids[: len(p.response_ids)] == p.response_ids
                assert len(t.response_ids) == 1000 + 2 + 4


@pytest.mark.slow
async def test_oversampling_exact_target_and_carry_over(model_dir: Path, pool: EnginePool) -> None:
    async with pool.servers(1) as (proc,):
        cfg = {"engine": {"urls": [proc.url], "tokenizer": str(model_dir)},
               "scheduler": {"n": 2, "target_groups": 2, "concurrency": 8}}
        async with Runtime(cfg) as rt:
            quick = replay_samples(2, short_turns(2, 4), prefix="q")
            slow = replay_samples(2, short_turns(2, 30), prefix="z")
            res = await rt.step(quick + slow)
            assert sorted({t.group_id for t in res.trajectories}) == ["q0", "q1"]
            assert len(res.trajectories) == 4 and all(t.status == "completed" for t in res.trajectories)
            assert res.batch["input_ids"].shape[0] == 4
            assert sorted(c.uid for c in res.carry_over) == ["z0_0", "z0_1", "z1_0", "z1_1"]
            v1 = res.weight_version
            for c in res.carry_over:
                assert c.resume_from is not None and c.resume_from.status == "aborted"
                assert set(c.resume_from.weight_versions) <= {v1}
            state_dict = load_file(str(model_dir / "model.safetensors"))
            res2 = await rt.step(res.carry_over, state_dict, target_groups=None)
            v2 = res2.weight_version
            assert v2 != v1
            assert sorted(t.uid for t in res2.trajectories) == ["z0_0", "z0_1", "z1_0", "z1_1"]
            by = {c.uid: c.resume_from for c in res.carry_over}
            for t in res2.trajectories:
                t.check_invariants()
                assert t.status == "completed" and len(t.response_ids) == 2 * 30 + 3
                prev = by[t.uid]
                assert t.weight_versions[: len(prev.turns)] == prev.weight_versions  # old turns keep their version
                assert t.weight_versions[-1] == v2 and t.weight_version == v2


@pytest.mark.slow
async def test_killing_one_of_two_servers_loses_no_trajectory(model_dir: Path, pool: EnginePool) -> None:
    async with pool.servers(2) as procs:
        cfg = {"engine": {"urls": [p.url for p in procs], "tokenizer": str(model_dir)},
               "scheduler": {"concurrency": 8, "trajectory_timeout": 120}}
        async with Runtime(cfg) as rt:
            turns = [{"gen_tokens": 30, "tool_latency_s": 0.05, "tool_result_tokens": 3} for _ in range(4)]
            box: dict[str, Any] = {}

            async def step() -> None:
                box["res"] = await rt.step(replay_samples(8, turns))

            with anyio.fail_after(150):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(step)
                    victim = procs[1].url
                    while rt.lifecycle.in_flight(victim) == 0 or rt.lifecycle.in_flight(procs[0].url) == 0:
                        await anyio.sleep(0.01)
                    os.kill(procs[1]._proc.pid, signal.SIGKILL)
            res = box["res"]
            assert len(res.trajectories) == 8 and not res.carry_over
            assert [t.status for t in res.trajectories] == ["completed"] * 8, [t.error for t in res.trajectories]
            assert victim in res.metrics["servers_removed"]
            moved = [t for t in res.trajectories if t.extra.get("servers") == [victim, procs[0].url]]
            assert moved, "some trajectories must have moved from the killed server"
            assert rt.lifecycle.urls == [procs[0].url]
            res2 = await rt.step(replay_samples(4, short_turns()))  # step 2 on the survivor
            assert [t.status for t in res2.trajectories] == ["completed"] * 4
