"""`EngineWatch` on its own: the liveness probe at most once per interval, the fleet's end told once,
and the hung-server watch asking for a probe only while a server looks stalled."""

from __future__ import annotations

import types

import anyio
import pytest

from agentloop.engine.lifecycle import LifecycleError
from agentloop.runtime.stream_engines import EngineWatch

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class FakeLifecycle:
    def __init__(self) -> None:
        self.probes = 0
        self.dead = False
        self.stalled: list[str] = []
        self.gate = types.SimpleNamespace(stalled=lambda after: self.stalled)

    async def check_liveness(self) -> None:
        self.probes += 1
        if self.dead:
            raise LifecycleError("liveness", "no engine server left (http://a: failed the liveness probe)")


async def test_checks_are_rate_limited_and_the_end_is_told_once() -> None:
    lc, told = FakeLifecycle(), []
    w = EngineWatch(lc, told.append, hung_timeout=None, interval=0.2)  # type: ignore[arg-type]
    await w.check()
    await w.check()  # within the interval: no second probe
    assert lc.probes == 1 and not told
    await anyio.sleep(0.25)
    lc.dead = True
    await w.check()
    assert lc.probes == 2 and len(told) == 1 and w.gone is told[0] and "no engine server left" in str(told[0])
    await anyio.sleep(0.25)
    await w.check()  # gone: nothing more to probe or tell
    assert lc.probes == 2 and len(told) == 1


async def test_watch_probes_only_while_a_server_looks_hung_and_ends_with_the_fleet() -> None:
    lc, told = FakeLifecycle(), []
    w = EngineWatch(lc, told.append, hung_timeout=0.2, interval=0.0)  # type: ignore[arg-type]
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(w.watch)
            await anyio.sleep(0.3)
            assert lc.probes == 0  # nothing stalled: no probe
            lc.stalled, lc.dead = ["http://a"], True
            while not told:
                await anyio.sleep(0.02)
    assert lc.probes == 1 and w.gone is not None  # watch() returned by itself once the fleet was gone
    assert await EngineWatch(lc, told.append, hung_timeout=None).watch() is None  # no hung_timeout: no watch
