"""`ServerDriver` on its own: one server's memory calls, the mark written around each, lease checks and
attach-state resolution, against an in-memory engine that fails the way SGLang crashes."""

from __future__ import annotations

import gc

import anyio
import pytest

from agentloop.engine.base import EngineError
from agentloop.engine.lifecycle import LifecycleError, LifecycleSettings, MemoryMark, ServerDriver, Weights
from agentloop.engine.lifecycle.owner import Owner
from agentloop.engine.memory_mark import MARK_SEPARATOR
from lifecycle_fakes import MemEngine

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Holder:
    """Stands for a Lifecycle: the lease of an owner whose holder is alive counts as alive."""


def driver(eng: MemEngine, *, holder: object | None = None, served: str | None = None, **settings) -> ServerDriver:
    holder = holder if holder is not None else Holder()
    owner = Owner(holder, lease_timeout=600.0, takeover=settings.pop("takeover", False))
    d = ServerDriver(eng, owner=owner, settings=LifecycleSettings(acquire_settle=0.02, **settings), served=lambda: served)
    d._holder = holder  # keep the holder alive as long as the driver (its lease is "alive" until then)
    return d


async def test_release_and_resume_write_a_pending_mark_then_the_result() -> None:
    eng = MemEngine("http://a")
    d = driver(eng)
    await d.release()
    versions = [a for op, a in eng.calls if op == "version"]
    pending, done = (MemoryMark.decode(v) for v in versions)
    assert pending.pending == "release:weights,kv_cache,cuda_graph" and not pending.released
    assert done.pending is None and done.released == {"weights", "kv_cache", "cuda_graph"} and done.lease == d.owner.lease
    assert d.released == eng.released
    await d.release()  # everything released already: no call at all (a second release crashes SGLang)
    assert eng.ops().count("release") == 1
    await d.resume(["weights"])
    assert eng.released == {"kv_cache", "cuda_graph"} and MemoryMark.decode(eng.weight_version).released == eng.released
    await d.resume(["weights"])  # resident already: nothing sent
    assert eng.ops().count("resume") == 1


async def test_a_refused_memory_call_clears_pending_an_unanswered_one_keeps_it() -> None:
    eng = MemEngine("http://a")
    d = driver(eng)
    eng.fail["release"] = EngineError("/release_memory_occupation", 500, "refused", url=eng.url)
    with pytest.raises(EngineError):
        await d.release()
    assert MemoryMark.decode(eng.weight_version).pending is None and not d.released
    eng.fail["release"] = EngineError("/release_memory_occupation", None, "connection reset", url=eng.url)
    with pytest.raises(EngineError):
        await d.release()
    assert MemoryMark.decode(eng.weight_version).pending == "release:weights,kv_cache,cuda_graph"


async def test_mark_is_written_only_when_it_changes_and_uses_the_loaded_version() -> None:
    eng = MemEngine("http://a")
    d = driver(eng, served="v7")
    await d.mark()
    await d.mark()
    assert eng.ops().count("version") == 1
    assert MemoryMark.decode(eng.weight_version).version == "v7"
    await d.load(Weights(state_dict={"w": 1}), "v8", flush_cache=False)
    assert ("update_tensor", False) in eng.calls  # flush_cache passed through (in-flight updates)
    assert d.version == "v8" and MemoryMark.decode(eng.weight_version) == MemoryMark("v8", lease=d.owner.lease)
    await d.release()
    assert MemoryMark.decode(eng.weight_version).version == "v8"  # the server's own version, not served()


async def test_a_client_without_update_weight_version_keeps_no_mark() -> None:
    eng = type("NoVersion", (MemEngine,), {"update_weight_version": None})("http://a")
    d = driver(eng)
    await d.release()
    assert not d.marks and eng.released == {"weights", "kv_cache", "cuda_graph"}
    assert "version" not in eng.ops()


async def test_resolve_reads_the_mark_or_the_setting() -> None:
    eng = MemEngine("http://a", version=MemoryMark("v3", frozenset({"kv_cache"})).encode())
    d = driver(eng)
    await d.resolve(await eng.model_info(), initial=True)
    assert d.released == {"kv_cache"} and d.found == MemoryMark("v3", frozenset({"kv_cache"}))
    plain = driver(MemEngine("http://b", version="v1"))
    await plain.resolve({"weight_version": "v1"}, initial=True)
    assert plain.released == set() and plain.model_path is None
    told = driver(MemEngine("http://c"), attach_state="asleep")
    await told.resolve({"weight_version": "v1"}, initial=True)
    assert told.released == {"weights", "kv_cache", "cuda_graph"}


async def test_a_pending_mark_is_refused_with_the_remedy_unless_the_server_reports_its_tags() -> None:
    text = MemoryMark("default", frozenset(), "release:weights,kv_cache,cuda_graph").encode()
    eng = MemEngine("http://a", version=text)
    d = driver(eng)
    with pytest.raises(LifecycleError, match=r"Restart the server.*engine\.attach_state: asleep if the call took effect, awake"):
        await d.resolve(await eng.model_info(), initial=True)
    eng.report_released, eng.released = True, {"weights"}
    await d.resolve(await eng.model_info(), initial=True)
    assert d.released == {"weights"}


async def test_a_mark_of_a_newer_format_is_refused_not_guessed() -> None:
    eng = MemEngine("http://a", version=f"v1{MARK_SEPARATOR}fmt=9;released=")
    d = driver(eng)
    with pytest.raises(LifecycleError, match="format '9'"):
        await d.resolve(await eng.model_info(), initial=True)


async def test_acquire_refuses_a_live_owner_and_takes_a_dead_ones_server() -> None:
    eng = MemEngine("http://a")
    first = driver(eng)
    await first.acquire(await eng.model_info(), initial=True)
    assert MemoryMark.decode(eng.weight_version).lease == first.owner.lease and first.leased
    second = driver(eng)
    with pytest.raises(LifecycleError, match="another runtime drives this server now"):
        await second.acquire(await eng.model_info(), initial=True)
    first.owner.close()  # the first owner is done with it: its lease is a dead owner's
    await second.acquire(await eng.model_info(), initial=True)
    assert MemoryMark.decode(eng.weight_version).lease == second.owner.lease
    assert first.lost(await eng.model_info()) == f"taken over by {second.owner.lease.describe()}"
    assert second.lost(await eng.model_info()) is None
    gc.collect()


async def test_lost_notices_a_restart() -> None:
    eng = MemEngine("http://a")
    d = driver(eng)
    await d.acquire(await eng.model_info(), initial=True)
    eng.weight_version = "default"  # a restarted server: plain version, no lease
    assert "no longer held by this runtime" in (d.lost(await eng.model_info()) or "")
    assert not d.leased


async def test_restore_as_found_reloads_under_the_version_found() -> None:
    eng = MemEngine("http://a", version="base-7")
    d = driver(eng, served="v2")
    await d.acquire(await eng.model_info(), initial=True)
    await d.release()
    with anyio.fail_after(5):
        await d.restore_as_found()
    assert not eng.released and ("update_disk", "/models/m") in eng.calls
    assert MemoryMark.decode(eng.weight_version).version == "base-7"


def test_owner_renews_its_lease_when_half_gone_and_holds_nothing_once_closed() -> None:
    from agentloop.engine.lease import owner_status

    holder = Holder()
    owner = Owner(holder, lease_timeout=100.0, takeover=False)
    first = owner.held_lease()
    assert first is not None and owner.held_lease() == first  # not due yet: the same lease
    owner.lease = first.renewed(-60.0)  # as if 80% of it were gone
    renewed = owner.held_lease()
    assert renewed is not None and renewed.owner == first.owner and renewed.until > first.until - 60
    other = Owner(Holder(), lease_timeout=100.0, takeover=False)
    assert owner_status(owner.lease, other.lease) == "alive"
    owner.close()
    assert owner.held_lease() is None and owner_status(owner.lease, other.lease) == "dead"
    other.close()


def test_owner_check_names_the_remedy_and_takeover_takes() -> None:
    keeper = Holder()
    live = Owner(keeper, lease_timeout=100.0, takeover=False)
    polite = Owner(Holder(), lease_timeout=100.0, takeover=False)
    with pytest.raises(LifecycleError, match=r"another runtime drives this server now.*engine\.takeover: true"):
        polite.check(live.lease, "http://a")
    Owner(Holder(), lease_timeout=100.0, takeover=True).check(live.lease, "http://a")  # taken, with a warning
    polite.check(None, "http://a")  # nobody holds it
    assert polite.is_ours(polite.lease) and not polite.is_ours(live.lease) and not polite.is_ours(None)
