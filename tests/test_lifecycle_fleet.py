"""`Fleet` on its own: rotation (every gate told), stage fan-out (one failing server taken out, all failing
raises and takes out nobody), records, gate windows, settle over every gate, the liveness probe and
re-admission, against in-memory engines and a recording gate."""

from __future__ import annotations

from typing import Any

import pytest

from agentloop.engine.base import EngineError
from agentloop.engine.lifecycle import Fleet, LifecycleError, LifecycleSettings, MemoryMark, ServerDriver
from agentloop.engine.lifecycle.owner import Owner
from lifecycle_fakes import MemEngine, RecordingGates

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Holder:
    pass


def fleet(*engines: MemEngine, gates: RecordingGates | None = None) -> tuple[Fleet, RecordingGates]:
    holder = Holder()
    owner = Owner(holder, lease_timeout=600.0, takeover=False)
    settings = LifecycleSettings(acquire_settle=0.02, liveness_timeout=1.0)
    drivers = [ServerDriver(e, owner=owner, settings=settings, served=lambda: "v1") for e in engines]
    gates = gates or RecordingGates()
    f = Fleet(drivers, [gates], stage_timeout=5.0, settle_timeout=1.0)
    f._holder = holder  # type: ignore[attr-defined]
    return f, gates


async def test_a_stage_takes_out_the_server_that_fails_and_records_itself() -> None:
    a, b = MemEngine("http://a"), MemEngine("http://b")
    f, gates = fleet(a, b)
    b.fail["flush"] = EngineError("/flush_cache", None, "connection refused", url=b.url)
    mark = len(f.records)
    await f.stage("sleep", "flush_cache", lambda d: d.flush())
    assert f.urls == ["http://a"] and "connection refused" in f.out_of_rotation["http://b"]
    assert ("take_out", "http://b") in gates.calls
    assert [(r.phase, r.stage, r.detail) for r in f.records_since(mark)] == [("sleep", "flush_cache", {"servers": 2})]
    assert f.server_events[-1]["event"] == "out" and f.server_events[-1]["url"] == "http://b"
    # the next stage runs on the server left only
    await f.stage("sleep", "release", lambda d: d.release())
    assert a.released and not b.released


async def test_a_stage_failing_everywhere_raises_naming_each_server_and_takes_out_nobody() -> None:
    a, b = MemEngine("http://a"), MemEngine("http://b")
    f, gates = fleet(a, b)
    for e in (a, b):
        e.fail["pause"] = EngineError("/pause_generation", 500, "boom", url=e.url)
    with pytest.raises(LifecycleError, match=r"stage 'pause' failed: failed on every engine server \(http://a.*http://b"):
        await f.stage("sleep", "pause", lambda d: d.pause("abort"))
    assert f.urls == ["http://a", "http://b"] and not f.records and ("take_out", "http://a") not in gates.calls


async def test_rotation_moves_every_gate_and_admits_back() -> None:
    a, b = MemEngine("http://a"), MemEngine("http://b")
    extra = RecordingGates()
    f, gates = fleet(a, b)
    f.add_gates(extra)
    await f.take_out("http://b", "hung")
    await f.take_out("http://b", "again")  # out already: nothing more
    assert f.out_of_rotation == {"http://b": "hung"} and [d.url for d in f.in_rotation()] == ["http://a"]
    assert gates.calls.count(("take_out", "http://b")) == 1 and ("take_out", "http://b") in extra.calls
    await f.admit(f.drivers["http://b"])
    assert f.urls == ["http://a", "http://b"] and ("admit", "http://b") in extra.calls
    assert [e["event"] for e in f.server_events] == ["out", "in"]


async def test_gate_windows_and_settle_over_every_gate() -> None:
    a = MemEngine("http://a")
    f, gates = fleet(a, gates=RecordingGates(in_flight=2))
    await f.open_gates("v1")
    await f.open_gates("v1")  # open already: one window
    await f.close_gates()
    assert len(f.gate_windows) == 1 and len(f.gate_windows[0]) == 2
    assert [c for c in gates.calls if c[0] in ("open", "close")] == [("open", "v1"), ("open", "v1"), ("close", None)]
    with pytest.raises(LifecycleError, match="2 requests still in flight"):
        await f.settle(f.drivers["http://a"])
    f.drivers["http://a"].released = {"weights"}  # nothing can run there: nothing to wait for
    await f.settle(f.drivers["http://a"])


async def test_probe_takes_out_a_dead_server_and_readmits_it_asleep_when_it_answers() -> None:
    a, b = MemEngine("http://a"), MemEngine("http://b")
    f, gates = fleet(a, b)
    await f.attach()
    b.fail["model_info"] = EngineError("/model_info", None, "connection refused", url=b.url)
    await f.probe(readmit=False)
    assert f.urls == ["http://a"] and "liveness probe" in f.out_of_rotation["http://b"]
    b.weight_version = "default"  # it came back (a restart: awake, no mark)
    await f.probe(readmit=True)
    assert f.urls == ["http://a", "http://b"]
    # re-admitted in its real state and put to sleep like the others before it is woken with them
    assert b.released == {"weights", "kv_cache", "cuda_graph"}
    after = b.ops()[len(b.ops()) - b.ops()[::-1].index("pause") - 1:]
    assert [op for op in after if op != "version"] == ["pause", "continue", "flush", "release"]
    assert MemoryMark.decode(b.weight_version).released == b.released


async def test_probe_with_no_server_left_fails_naming_each() -> None:
    a = MemEngine("http://a")
    f, _ = fleet(a)
    a.fail["model_info"] = EngineError("/model_info", None, "connection refused", url=a.url)
    with pytest.raises(LifecycleError, match=r"stage 'liveness' failed: no engine server left \(http://a: failed the liveness probe"):
        await f.probe(readmit=False)


async def test_the_gate_watches_clients_through_the_typed_interface_only() -> None:
    from agentloop.engine.gate import Gate, GateWatched

    class Watched(MemEngine):
        def __init__(self, url: str) -> None:
            super().__init__(url)
            self.sent_outside_awake = 0
            self.is_open = None

        def watch_gate(self, is_open) -> None:  # noqa: ANN001
            self.is_open = is_open

    watched, plain = Watched("http://a"), MemEngine("http://b")
    plain.gate_open = None  # an attribute of that name no longer makes a client watched  # type: ignore[attr-defined]
    gate = Gate([watched, plain], awake=True)
    assert isinstance(watched, GateWatched) and not isinstance(plain, GateWatched)
    assert watched.is_open is not None and watched.is_open() and plain.gate_open is None  # type: ignore[attr-defined]
    await gate.close()
    assert not watched.is_open()
    watched.sent_outside_awake = 2
    assert gate.generations_outside_awake == 2


async def test_records_since_gives_one_calls_stages() -> None:
    from agentloop.engine.lifecycle import Lifecycle

    a = MemEngine("http://a")
    lc = Lifecycle([a], awake=True)
    await lc.sleep()
    mark = lc.record_mark()
    await lc.wake_up()
    woke = lc.records_since(mark)
    assert [(r.phase, r.stage) for r in woke] == [("wake_up", s) for s in ("resume_weights", "update_weights", "resume_kv_cache")]
    woke.clear()  # a copy: the lifecycle's records are untouched
    assert len(lc.records_since(mark)) == 3 and lc.records_since(lc.record_mark()) == []
    lc.close()


async def test_lease_renewal_takes_out_a_server_no_longer_ours_and_never_marks_it_ours() -> None:
    # A restarted server (awake, its own weights, no mark) must not be re-marked as ours by the lease
    # renewal that runs beside a rollout: the mark would name weights it does not serve.
    a, b = MemEngine("http://a"), MemEngine("http://b")
    f, gates = fleet(a, b)
    await f.attach()
    b.weight_version = "default"  # restarted
    await f.renew_leases(1.0)
    assert f.urls == ["http://a"] and "no longer held by this runtime" in f.out_of_rotation["http://b"]
    assert b.weight_version == "default" and ("take_out", "http://b") in gates.calls
    assert MemoryMark.decode(a.weight_version).lease is not None  # ours still carries the lease


async def test_an_answer_says_whether_its_server_is_still_ours() -> None:
    a, b = MemEngine("http://a"), MemEngine("http://b")
    f, _ = fleet(a, b)
    await f.attach()
    assert f.answer_lost("http://a", a.weight_version) is None
    assert f.answer_lost("http://zzz", "anything") is None  # not one of this fleet's
    taken = MemoryMark("v1", frozenset(), lease=MemoryMark.decode(a.weight_version).lease)
    assert f.answer_lost("http://a", taken.encode()) is None  # ours, written again (another text)
    assert "set to 'rogue' by someone else" in (f.answer_lost("http://b", "rogue") or "")


async def test_the_answer_check_for_other_processes_judges_as_the_fleet_does() -> None:
    # A Ray worker's gate gets `Fleet.answer_check()`: plain data that survives pickling, and the same
    # judgement as `answer_lost` without touching the driver's records.
    import pickle

    from agentloop.engine.lease import new_lease

    a, b = MemEngine("http://a"), MemEngine("http://b")
    f, _ = fleet(a, b)
    await f.attach()
    check = pickle.loads(pickle.dumps(f.answer_check()))
    assert check.leased == {"http://a", "http://b"}
    assert check("http://a", a.weight_version) is None
    ours_again = MemoryMark("v1", frozenset({"kv_cache"}), lease=MemoryMark.decode(a.weight_version).lease)
    assert check("http://a", ours_again.encode()) is None  # another text, our lease: still ours
    assert check("http://zzz", "rogue") is None  # not a server the driver holds
    assert "by someone else" in (check("http://b", "rogue") or "")
    theirs = MemoryMark("v9", lease=new_lease(600.0)).encode()
    assert (check("http://a", theirs) or "").startswith("taken over by")
    newer = "v1~agentloop:fmt=99;released="
    assert "newer agentloop" in (check("http://a", newer) or "")
    assert f.drivers["http://a"].leased  # the check changed nothing of the driver's
    await f.take_out("http://a", "hung")
    assert f.answer_check().leased == {"http://b"}  # only servers in rotation
    assert check("http://b", "rogue") == f.answer_lost("http://b", "rogue")  # (which marks b lost)
    assert f.answer_check().leased == frozenset()


class AnsweringEngine(MemEngine):
    """Answers every generate with the weight version it reports; `during` runs before it answers."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.during: Any = None

    async def generate(self, input_ids, sampling_params, *, rid=None, timeout=None):  # noqa: ANN001
        from agentloop.engine.base import GenerateOutput

        if self.during is not None:
            await self.during()
        return GenerateOutput([7, 8], [-0.5, -0.5], {"type": "length", "length": 2}, self.weight_version, rid or "")


async def test_the_gate_drops_an_answer_from_a_server_no_longer_ours() -> None:
    from agentloop.engine.base import EngineUnavailable, SamplingParams
    from agentloop.engine.gate import Gate

    a = AnsweringEngine("http://a")
    gate = Gate([a], awake=True, check_answer=lambda url, v: None if v == "ours" else f"{url} answered {v}")
    a.weight_version = "ours"
    assert (await gate.generate("http://a", [1], SamplingParams(max_new_tokens=2))).output_ids == [7, 8]
    a.weight_version = "restarted"
    with pytest.raises(EngineUnavailable, match="answered restarted.*its answer was dropped"):
        await gate.generate("http://a", [1], SamplingParams(max_new_tokens=2))
    assert gate.urls == [] and gate.in_flight() == 0


async def test_the_gate_drops_an_answer_that_arrives_after_its_server_was_taken_out() -> None:
    # The take-out's cancel lands at the request's next await; an answer already received must not
    # slip through in between.
    from agentloop.engine.base import EngineUnavailable, SamplingParams
    from agentloop.engine.gate import Gate

    a = AnsweringEngine("http://a")
    gate = Gate([a], awake=True)

    async def taken_out_meanwhile() -> None:
        await gate.take_out("http://a", "restarted with other weights")

    a.during = taken_out_meanwhile
    with pytest.raises(EngineUnavailable, match="restarted with other weights.*its answer was dropped"):
        await gate.generate("http://a", [1], SamplingParams(max_new_tokens=2))
