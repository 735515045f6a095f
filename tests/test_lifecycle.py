"""Lifecycle state machine and gate, against an instrumented in-process engine.

The engine double below enforces SGLang's memory rules (resume of a tag not released fails, generate
while anything is released fails, released weights are lost until updated) and records every call,
so these tests fail if the lifecycle ever dispatches out of order. Every multi-step test runs >= 2
steps: the bug this project is built on only shows on step 2.
"""

from __future__ import annotations

from typing import Any, Sequence

import anyio
import pytest

from agentloop.engine.base import EngineError, EngineUnavailable, GenerateOutput, SamplingParams
from agentloop.engine.lifecycle import EngineState, Lifecycle, LifecycleError, Weights
from agentloop.engine.lifecycle import MemoryMark, served_version

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True)
def short_lease_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process engines, one lifecycle at a time: the wait that excludes a second runtime attaching
    at the same moment (tests/test_engine_owner.py) only adds time here."""
    monkeypatch.setattr(Lifecycle, "acquire_settle", 0.02)


class RecordingEngine:
    """SGLang memory semantics in memory; `calls` logs (op, args, lifecycle-visible state)."""

    def __init__(self, url: str = "http://engine-a", *, gen_delay: float = 0.0, asleep: bool = False) -> None:
        self.url = url
        self.released: set[str] = {"weights", "kv_cache", "cuda_graph"} if asleep else set()
        self.weights_valid = not asleep
        self.weight_version = "default"
        self.calls: list[tuple[str, Any]] = []
        self.gen_delay = gen_delay
        self.paused = False
        self.aborted: set[str] = set()
        self.abort_all_flag = False
        self.fail_next: dict[str, Exception] = {}
        self.busy_flushes = 0
        self.generates_while_invalid = 0
        self.marks: list[str] = []

    def _maybe_fail(self, op: str) -> None:
        if op in self.fail_next:
            raise self.fail_next.pop(op)

    async def generate(self, input_ids, sampling_params, *, rid=None, return_logprob=True, timeout=None):
        self.calls.append(("generate", rid))
        self._maybe_fail("generate")
        if self.released or not self.weights_valid:
            self.generates_while_invalid += 1
            raise EngineError("/generate", 400, f"memory released {sorted(self.released)}", url=self.url)
        steps = max(1, int(self.gen_delay / 0.01))
        for i in range(steps):
            if rid in self.aborted or self.abort_all_flag:
                return GenerateOutput([1] * i, [-0.5] * i, {"type": "abort", "message": "Aborted"}, self.weight_version, rid or "")
            await anyio.sleep(self.gen_delay / steps if self.gen_delay else 0)
        n = sampling_params.max_new_tokens
        return GenerateOutput([7] * n, [-0.1] * n, {"type": "length", "length": n}, self.weight_version, rid or "")

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        self.calls.append(("release", tuple(tags or ())))
        self._maybe_fail("release")
        for t in tags or ():
            if t in self.released:
                raise EngineError("/release_memory_occupation", 400, f"{t} already released", url=self.url)
        self.released.update(tags or ())
        if "weights" in (tags or ()):
            self.weights_valid = False

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        self.calls.append(("resume", tuple(tags or ())))
        self._maybe_fail("resume")
        for t in tags or ():
            if t not in self.released:
                raise EngineError("/resume_memory_occupation", 400, f"KeyError: {t}", url=self.url)
        self.released.difference_update(tags or ())

    async def update_weights_from_disk(self, model_path, *, load_format=None, weight_version=None, flush_cache=True, abort_all_requests=False):
        self.calls.append(("update_disk", model_path))
        self._maybe_fail("update")
        if "weights" in self.released:
            raise EngineError("/update_weights_from_disk", 400, "weights are released", url=self.url)
        self.weights_valid = True
        self.weight_version = weight_version or self.weight_version
        return {"success": True, "message": "ok"}

    async def update_weights_from_tensor(self, named_tensors, *, load_format=None, weight_version=None, flush_cache=True, abort_all_requests=False):
        self.calls.append(("update_tensor", len(named_tensors)))
        self._maybe_fail("update")
        if "weights" in self.released:
            raise EngineError("/update_weights_from_tensor", 400, "weights are released", url=self.url)
        self.weights_valid = True
        self.weight_version = weight_version or self.weight_version
        return {"success": True, "message": "ok"}

    async def flush_cache(self) -> bool:
        self.calls.append(("flush", None))
        self._maybe_fail("flush")
        if self.busy_flushes:
            self.busy_flushes -= 1
            return False
        return True

    async def pause_generation(self, mode: str = "abort") -> None:
        self.calls.append(("pause", mode))
        self.paused = True
        if mode == "abort":
            self.abort_all_flag = True

    async def continue_generation(self) -> None:
        self.calls.append(("continue", None))
        self.paused = False
        self.abort_all_flag = False

    async def abort_request(self, rid=None, *, abort_all=False) -> None:
        self.calls.append(("abort", rid or "all"))
        if abort_all:
            self.abort_all_flag = True
        elif rid:
            self.aborted.add(rid)

    async def health(self) -> bool:
        self.calls.append(("health", None))
        if self.released:
            raise AssertionError("/health sent to a released engine: real SGLang crashes here")
        return True

    async def model_info(self) -> dict[str, Any]:
        self.calls.append(("model_info", None))
        return {"model_path": "/models/policy", "weight_version": self.weight_version}

    async def update_weight_version(self, new_version: str, *, abort_all_requests: bool = False) -> None:
        """SGLang's: sets the version string only (the lifecycle's memory marks go here)."""
        self.marks.append(new_version)
        self.weight_version = new_version

    async def server_info(self) -> dict[str, Any]:
        return {}

    async def close(self) -> None:
        pass

    def ops(self) -> list[str]:
        """The lifecycle's calls, without the liveness probes (`/model_info`) around them."""
        return [c[0] for c in self.calls if c[0] != "model_info"]


P = SamplingParams(max_new_tokens=3)


async def test_two_steps_staged_order_and_versions() -> None:
    eng = RecordingEngine()
    lc = Lifecycle([eng], awake=True)
    await lc.sleep()
    assert lc.state is EngineState.SLEEPING and eng.released == {"weights", "kv_cache", "cuda_graph"}
    for step in (1, 2, 3):
        eng.calls.clear()
        v = await lc.wake_up({"w": object()})
        assert v == f"auto-v{step}" and lc.state is EngineState.AWAKE
        assert eng.ops()[:3] == ["resume", "update_tensor", "resume"]
        calls = [c for c in eng.calls if c[0] != "model_info"]
        assert calls[0][1] == ("weights",)
        assert set(calls[2][1]) == {"kv_cache", "cuda_graph"}
        out = await lc.generate(eng.url, [1, 2], P, rid=f"r{step}")
        assert out.weight_version == f"auto-v{step}"
        await lc.sleep()
        assert eng.ops()[-4:] == ["pause", "continue", "flush", "release"]
    assert eng.generates_while_invalid == 0 and lc.generations_outside_awake == 0


async def test_generate_waits_for_gate_then_succeeds() -> None:
    eng = RecordingEngine(asleep=True)
    lc = Lifecycle([eng], awake=False)
    results: list[GenerateOutput] = []

    async def gen() -> None:
        results.append(await lc.generate(eng.url, [1], P, rid="early"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(gen)
        await anyio.sleep(0.05)
        assert results == [] and "generate" not in eng.ops()  # held by the gate
        await lc.wake_up(Weights(path="/new"))
    assert len(results) == 1 and eng.generates_while_invalid == 0
    # the generate went out only after the last wake-up stage
    assert eng.ops().index("generate") > max(i for i, op in enumerate(eng.ops()) if op == "resume")


async def test_none_weights_reload_from_model_path_each_step() -> None:
    eng = RecordingEngine()
    lc = Lifecycle([eng], awake=True)
    for _ in range(2):
        await lc.sleep()
        await lc.wake_up(None)
        assert ("update_disk", "/models/policy") in eng.calls
        await lc.generate(eng.url, [1], P)
    assert eng.generates_while_invalid == 0


async def test_stage_failure_is_named_and_retry_resumes_where_it_stopped() -> None:
    eng = RecordingEngine()
    lc = Lifecycle([eng], awake=True)
    await lc.sleep()
    eng.fail_next["update"] = EngineError("/update_weights_from_tensor", 400, "shape mismatch for lm_head.weight", url=eng.url)
    with pytest.raises(LifecycleError) as ei:
        await lc.wake_up({"lm_head.weight": object()})
    assert ei.value.stage == "update_weights" and "lm_head.weight" in str(ei.value) and eng.url in str(ei.value)
    assert lc.state is EngineState.WEIGHTS_RESUMED  # not AWAKE, not silently half-awake
    eng.calls.clear()
    await lc.wake_up({"w": object()})  # retry continues from the failed stage: no double resume
    assert eng.ops() == ["update_tensor", "resume"] and lc.state is EngineState.AWAKE
    # a failed step can also be put to sleep
    await lc.sleep()
    await lc.wake_up({"w": object()})
    await lc.sleep()
    eng.fail_next["resume"] = EngineError("/resume_memory_occupation", 500, "boom", url=eng.url)
    with pytest.raises(LifecycleError, match="resume_weights"):
        await lc.wake_up({"w": object()})
    await lc.sleep()  # legal from there, releases nothing twice
    assert lc.state is EngineState.SLEEPING


async def test_skipping_a_stage_is_impossible() -> None:
    """The seed bug (verl #2365): an async path that never resumed weights/KV wrote into released
    memory on step 2. Here the only road to generate is the gate, which opens after the last stage,
    and wake-up with released weights and nothing to load fails at once, on step 1."""
    eng = RecordingEngine()

    async def no_model_path() -> dict[str, Any]:
        return {"model_path": None}

    eng.model_info = no_model_path  # type: ignore[method-assign]
    lc = Lifecycle([eng], awake=True)
    await lc.sleep()
    with pytest.raises(LifecycleError, match="update_weights"):
        await lc.wake_up(None)
    assert lc.state is not EngineState.AWAKE
    with pytest.raises(TimeoutError):
        await lc.generate(eng.url, [1], P, gate_timeout=0.1)
    assert "generate" not in eng.ops()


async def test_concurrent_wake_ups_share_one_and_second_is_noop() -> None:
    eng = RecordingEngine(asleep=True)
    lc = Lifecycle([eng], awake=False)
    w = Weights(path="/p", version="s1")
    async with anyio.create_task_group() as tg:
        tg.start_soon(lc.wake_up, w)
        for _ in range(4):
            tg.start_soon(lc.wake_up, None)
            tg.start_soon(lc.wake_up, w)
    assert eng.ops().count("update_disk") == 1 and eng.ops().count("resume") == 2
    await lc.wake_up()
    await lc.wake_up(w)  # the version already served: nothing to do
    assert eng.ops().count("resume") == 2 and eng.ops().count("update_disk") == 1
    await lc.wake_up(Weights(path="/p2", version="s2"))  # new weights while awake: loaded, not dropped
    assert eng.ops().count("update_disk") == 2 and lc.weight_version == "s2"


async def test_same_state_dict_is_one_wake_up_each_step() -> None:
    """`Weights.coerce` wraps each call's dict anew: sameness is the dict object, not the wrapper."""
    eng = RecordingEngine(asleep=True)
    lc = Lifecycle([eng], awake=False)
    for step in (1, 2):
        sd = {"w": object()}  # a trainer builds one state dict per step
        eng.calls.clear()
        async with anyio.create_task_group() as tg:
            tg.start_soon(lc.wake_up, sd)
            tg.start_soon(lc.wake_up, sd)
        assert eng.ops() == ["resume", "update_tensor", "resume"] and lc.weight_version == f"auto-v{step}"
        assert await lc.wake_up(sd) == f"auto-v{step}"  # again while AWAKE: a no-op, version unchanged
        assert await lc.wake_up(Weights(state_dict=sd)) == f"auto-v{step}"
        assert eng.ops().count("update_tensor") == 1 and lc.weight_version == f"auto-v{step}"
        out = await lc.generate(eng.url, [1], P)
        assert out.weight_version == f"auto-v{step}"
        await lc.sleep()
        assert lc.state is EngineState.SLEEPING
    assert eng.generates_while_invalid == 0


async def test_same_path_is_one_wake_up_each_step() -> None:
    from pathlib import Path

    eng = RecordingEngine(asleep=True)
    lc = Lifecycle([eng], awake=False)
    for step in (1, 2):
        eng.calls.clear()
        async with anyio.create_task_group() as tg:
            tg.start_soon(lc.wake_up, "/ckpt/step")
            tg.start_soon(lc.wake_up, Path("/ckpt/step"))
        assert eng.ops() == ["resume", "update_disk", "resume"] and lc.weight_version == f"auto-v{step}"
        assert await lc.wake_up("/ckpt/step/") == f"auto-v{step}"  # the same folder: a no-op
        assert eng.ops().count("update_disk") == 1
        await lc.generate(eng.url, [1], P)
        await lc.sleep()
    # an explicit new version forces a reload of the same path while AWAKE
    eng.calls.clear()
    await lc.wake_up("/ckpt/step")
    assert await lc.wake_up(Weights(path="/ckpt/step", version="hot")) == "hot"
    assert eng.ops().count("update_disk") == 2 and served_version(eng.weight_version) == "hot"
    await lc.sleep()


async def test_different_state_dict_while_awake_is_loaded_in_place() -> None:
    """Not dropped and not an error: a trainer may push weights without a sleep (documented)."""
    eng = RecordingEngine(asleep=True)
    lc = Lifecycle([eng], awake=False)
    for step in (1, 2):
        first, second = {"w": object()}, {"w": object()}
        eng.calls.clear()
        v1 = await lc.wake_up(first)
        v2 = await lc.wake_up(second)
        assert v1 != v2 and lc.weight_version == v2 and served_version(eng.weight_version) == v2
        assert eng.ops() == ["resume", "update_tensor", "resume", "update_tensor"]  # no extra resume
        assert await lc.wake_up(second) == v2  # and that one is now the served one
        assert (await lc.generate(eng.url, [1], P)).weight_version == v2
        await lc.sleep()
        assert lc.state is EngineState.SLEEPING
    assert eng.generates_while_invalid == 0


async def test_sleep_with_requests_in_flight_aborts_and_settles_before_release() -> None:
    for step in range(2):
        eng = RecordingEngine(gen_delay=2.0)
        lc = Lifecycle([eng], awake=True)
        outs: list[GenerateOutput] = []

        async def gen(i: int) -> None:
            outs.append(await lc.generate(eng.url, [1], P, rid=f"s{step}-{i}"))

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(gen, i)
            await anyio.sleep(0.05)
            assert lc.in_flight() == 4
            await lc.sleep()
            # by the time release ran, nothing was in flight
            assert lc.in_flight() == 0
        assert len(outs) == 4 and all(o.aborted for o in outs)
        ops = eng.ops()
        assert ops.index("release") > max(i for i, op in enumerate(ops) if op == "generate")


async def test_flush_retried_while_busy() -> None:
    eng = RecordingEngine()
    eng.busy_flushes = 3
    lc = Lifecycle([eng], awake=True, flush_retry_delay=0.001)
    await lc.sleep()
    assert eng.ops().count("flush") == 4
    eng2 = RecordingEngine()
    eng2.busy_flushes = 100
    lc2 = Lifecycle([eng2], awake=True, flush_retries=3, flush_retry_delay=0.001)
    with pytest.raises(LifecycleError, match="flush_cache"):
        await lc2.sleep()


FULL_SLEEP = ["pause", "settle", "continue", "flush_cache", "release"]


def sleep_stages(lc: Lifecycle) -> list[str]:
    return [r.stage for r in lc.records if r.phase == "sleep"]


@pytest.mark.parametrize("failing, resumed_ops, resumed_stages", [
    ("flush", ["flush", "release"], ["flush_cache", "release"]),
    ("release", ["release"], ["release"]),
])
async def test_failed_sleep_stage_is_resumed_by_the_retry(failing: str, resumed_ops: list[str], resumed_stages: list[str]) -> None:
    eng = RecordingEngine()
    lc = Lifecycle([eng], awake=True)
    eng.fail_next[failing] = EngineUnavailable(f"/{failing}", None, "connection reset", url=eng.url)
    await lc.generate(eng.url, [1], P)
    with pytest.raises(LifecycleError) as ei:
        await lc.sleep()
    assert ei.value.stage == resumed_stages[0] and eng.url in str(ei.value)
    assert lc.state is EngineState.DRAINING and lc.sleep_resume_at == resumed_stages[0]
    # the gate stays closed and a wake-up says what to do
    with pytest.raises(TimeoutError):
        await lc.generate(eng.url, [1], P, gate_timeout=0.05)
    with pytest.raises(LifecycleError, match=f"failed at stage '{resumed_stages[0]}'.*call sleep"):
        await lc.wake_up({"w": object()})
    eng.calls.clear()
    lc.records.clear()
    await lc.sleep()  # the retry: from the failed stage on, nothing before it again
    assert eng.ops() == resumed_ops and sleep_stages(lc) == resumed_stages
    assert lc.state is EngineState.SLEEPING and lc.sleep_resume_at is None
    assert eng.released == {"weights", "kv_cache", "cuda_graph"}
    # then normal steps: full wake-up and full sleep, twice
    for step in (1, 2):
        eng.calls.clear()
        lc.records.clear()
        v = await lc.wake_up({"w": object()})
        assert eng.ops() == ["resume", "update_tensor", "resume"] and v == f"auto-v{step}"
        assert (await lc.generate(eng.url, [1], P)).weight_version == v
        await lc.sleep()
        assert sleep_stages(lc) == FULL_SLEEP
        assert eng.ops()[-4:] == ["pause", "continue", "flush", "release"]
    assert eng.generates_while_invalid == 0 and lc.generations_outside_awake == 0


async def test_sleep_after_a_failed_wake_up_only_releases() -> None:
    eng = RecordingEngine()
    lc = Lifecycle([eng], awake=True)
    for _ in range(2):
        await lc.sleep()
        eng.fail_next["update"] = EngineError("/update_weights_from_tensor", 400, "bad", url=eng.url)
        with pytest.raises(LifecycleError, match="update_weights"):
            await lc.wake_up({"w": object()})
        lc.records.clear()
        await lc.sleep()
        assert sleep_stages(lc) == ["release"] and lc.state is EngineState.SLEEPING
        await lc.wake_up({"w": object()})
        assert lc.state is EngineState.AWAKE


async def test_health_never_reaches_a_released_engine() -> None:
    eng = RecordingEngine()
    lc = Lifecycle([eng], awake=True)
    assert await lc.health(eng.url)
    for _ in range(2):
        await lc.sleep()
        assert await lc.health(eng.url)  # answered by /model_info
        await lc.wake_up(Weights(path="/p"))
        assert await lc.health(eng.url)
        await lc.generate(eng.url, [1], P)
    health_states = [i for i, c in enumerate(eng.calls) if c[0] == "health"]
    assert len(health_states) == 3  # only the AWAKE probes used /health


async def test_fan_out_to_many_engines_and_one_stage_mode() -> None:
    engines = [RecordingEngine(f"http://e{i}") for i in range(3)]
    lc = Lifecycle(engines, awake=True, staged=False)
    for _ in range(2):
        await lc.sleep()
        assert all(e.released == {"weights", "kv_cache", "cuda_graph"} for e in engines)
        await lc.wake_up({"w": object()})
        for e in engines:
            resume = [c for c in e.calls if c[0] == "resume"][-1]
            assert set(resume[1]) == {"weights", "kv_cache", "cuda_graph"}
            await lc.generate(e.url, [1], P)
    assert all(e.generates_while_invalid == 0 for e in engines)


async def test_a_server_failing_a_stage_is_taken_out_and_the_others_go_on() -> None:
    a, b = RecordingEngine("http://a"), RecordingEngine("http://b")
    lc = Lifecycle([a, b], awake=True)
    await lc.sleep()
    b.fail_next["resume"] = EngineUnavailable("/resume_memory_occupation", None, "connection refused", url=b.url)
    await lc.wake_up({"w": 1})  # b is taken out; a wakes
    assert lc.state is EngineState.AWAKE and lc.urls == ["http://a"]
    assert "resume_weights" in lc.out_of_rotation["http://b"] and "connection refused" in lc.out_of_rotation["http://b"]
    assert [e["event"] for e in lc.server_events] == ["out"]
    await lc.generate(a.url, [1], P)
    await lc.sleep()
    # every server failing a stage: nothing is taken out, the error names each server and why
    a.fail_next["resume"] = EngineError("/resume_memory_occupation", 500, "boom", url=a.url)
    with pytest.raises(LifecycleError, match="resume_weights.*boom"):
        await lc.wake_up({"w": 2})
    assert lc.urls == ["http://a"]


def test_bad_arguments_are_clear() -> None:
    with pytest.raises(ValueError, match="unknown memory tags"):
        Lifecycle([RecordingEngine()], release_tags=["weights", "kvcache"])
    with pytest.raises(ValueError, match="at least one"):
        Lifecycle([])
    with pytest.raises(TypeError, match="state dict, a path"):
        Weights.coerce(42)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- attach state (issue #14)
class Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs in the dead runtime."""


class KillableEngine(RecordingEngine):
    """A RecordingEngine that, like SGLang, crashes for good on a double release or a resume of
    resident memory, and whose runtime "dies" at its `kill_at`-th lifecycle call (before or after it)."""

    CALLS = ("release_memory_occupation", "resume_memory_occupation", "update_weights_from_disk",
             "update_weights_from_tensor", "pause_generation", "continue_generation", "flush_cache",
             "update_weight_version")

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.crashed: str | None = None
        self.kill_at: tuple[int, str] | None = None
        self.count = 0
        for name in self.CALLS:
            setattr(self, name, self._killable(getattr(self, name)))

    def _killable(self, inner: Any) -> Any:
        async def call(*a: Any, **kw: Any) -> Any:
            if self.crashed:
                raise EngineUnavailable("/", None, f"server crashed earlier: {self.crashed}", url=self.url)
            self.count += 1
            if self.kill_at == (self.count, "before"):
                raise Killed()
            try:
                out = await inner(*a, **kw)
            except EngineError as e:
                if "already released" in e.message or "KeyError" in e.message:
                    self.crashed = e.message  # what real SGLang does
                raise
            if self.kill_at == (self.count, "after"):
                raise Killed()
            return out
        return call


async def two_lifecycle_steps(lc: Lifecycle, eng: RecordingEngine) -> None:
    for step in range(2):
        await lc.wake_up(None)
        assert (await lc.generate(eng.url, [1], P)).weight_version == "default"
        await lc.sleep()


async def test_attach_reads_the_state_the_last_lifecycle_recorded_in_the_server() -> None:
    eng = KillableEngine()
    lc = Lifecycle([eng])
    await lc.attach()  # a fresh server: awake
    await lc.sleep()
    assert MemoryMark.decode(eng.weight_version) == MemoryMark("default", frozenset(eng.released), lease=lc.lease)
    lc.close()  # its runtime ended without restoring the server
    lc2 = Lifecycle([eng])  # another runtime attaches to the asleep server: releases nothing twice
    await lc2.attach()
    assert lc2.state is EngineState.SLEEPING
    await lc2.sleep()
    await two_lifecycle_steps(lc2, eng)
    await lc2.park()  # left asleep on purpose
    assert MemoryMark.decode(eng.weight_version).parked
    lc2b = Lifecycle([eng])
    await lc2b.attach()
    await two_lifecycle_steps(lc2b, eng)
    await lc2b.restore()  # found parked: stays parked
    assert eng.released == {"weights", "kv_cache", "cuda_graph"} and MemoryMark.decode(eng.weight_version).parked
    assert eng.crashed is None
    lc3 = Lifecycle([eng], attach_state="asleep")  # told the state: believed
    await lc3.attach()
    await two_lifecycle_steps(lc3, eng)
    assert eng.crashed is None


async def test_runtimes_in_sequence_leave_the_server_as_found() -> None:
    eng = KillableEngine()
    for _ in range(3):
        lc = Lifecycle([eng])
        await lc.attach()
        await lc.sleep()
        await two_lifecycle_steps(lc, eng)
        await lc.restore()
        assert eng.released == set() and eng.weights_valid and eng.weight_version == "default"
        assert (await eng.generate([1], P)).output_ids == [7] * 3
    assert eng.crashed is None and eng.generates_while_invalid == 0


def _is_killed(e: BaseException) -> bool:
    return isinstance(e, Killed) or any(_is_killed(x) for x in getattr(e, "exceptions", ()))


def _kill_points() -> list[tuple[int, str]]:
    return [(k, w) for k in range(1, 40) for w in ("before", "after")]


@pytest.mark.parametrize("kill_at", _kill_points(), ids=[f"{k}-{w}" for k, w in _kill_points()])
async def test_a_lifecycle_killed_at_any_call_leaves_a_server_the_next_one_recovers_or_refuses_exactly(
        kill_at: tuple[int, str]) -> None:
    """Every call of start (attach + sleep), two steps and a stop, killed before it is sent or after
    it was answered: the next lifecycle never crashes the server; it recovers, or refuses naming the
    remedy (the killed call's effect cannot be known: this engine, like SGLang, cannot report it)."""
    eng = KillableEngine()
    eng.kill_at = kill_at
    lc = Lifecycle([eng])
    try:
        await lc.attach()
        await lc.sleep()
        await two_lifecycle_steps(lc, eng)
        await lc.restore()
        return  # the run had fewer calls than kill_at
    except BaseException as e:  # Killed, possibly inside a task group's exception group
        if not _is_killed(e):
            raise
    lc.close()  # its process is gone: so is its lease
    eng.kill_at = None
    nxt = Lifecycle([eng])
    try:
        await nxt.attach()
    except LifecycleError as e:
        assert "Restart the server" in str(e) and "engine.attach_state" in str(e)
        # the message names the setting for either outcome; the person who reads it knows which happened
        truth = nxt._as_setting(eng.released)
        assert f"engine.attach_state: {truth} if" in str(e) or f", {truth} if it did not" in str(e), str(e)
        nxt = Lifecycle([eng], attach_state=sorted(eng.released))
        await nxt.attach()
    await nxt.sleep()
    await two_lifecycle_steps(nxt, eng)
    await nxt.restore()  # whatever the dead run left, the server ends awake, as before any run
    assert eng.crashed is None and eng.generates_while_invalid == 0
    assert not eng.released and eng.weights_valid and eng.weight_version == "default"
