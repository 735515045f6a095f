"""`scheduler.gc_freeze` (`agentloop.gc_scope.frozen_heap`): the step's objects-before are frozen for the
step only, a freeze made by someone else is never undone, and the step's results do not change."""

from __future__ import annotations

import gc
import weakref

import pytest

from agentloop.scheduler.gc_scope import frozen_heap
from agentloop.types import Trajectory

from test_scheduler import make
from test_scheduler_support import FakeEngine, samples


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


@pytest.fixture(autouse=True)
def _clean_gc():
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    yield
    gc.unfreeze()
    gc.enable()


def test_off_changes_nothing() -> None:
    with frozen_heap(False) as frozen:
        assert not frozen and gc.get_freeze_count() == 0


def test_freezes_for_the_block_and_restores_even_on_error() -> None:
    before = _Node()
    with pytest.raises(RuntimeError), frozen_heap(True) as frozen:
        assert frozen and gc.get_freeze_count() > 0
        assert not any(o is before for o in gc.get_objects())  # frozen: in no generation the collector walks
        raise RuntimeError("boom")
    assert gc.get_freeze_count() == 0


def test_a_cycle_older_than_the_block_is_collected_after_it() -> None:
    node = _Node()
    ref = weakref.ref(node)
    with frozen_heap(True):
        del node
        gc.collect()
        assert ref() is not None  # frozen: no collection looks at it while the block runs
    gc.collect()
    assert ref() is None


def test_someone_elses_freeze_and_a_disabled_collector_are_left_alone() -> None:
    gc.freeze()
    try:
        with frozen_heap(True) as frozen:
            assert not frozen
        # Their freeze survives our block. (Not `== the count before`: frozen objects that other
        # threads of this test process free meanwhile leave the permanent generation.)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    gc.disable()
    try:
        with frozen_heap(True) as frozen:
            assert not frozen and gc.get_freeze_count() == 0
        assert not gc.isenabled()
    finally:
        gc.enable()  # the rest of this worker's tests run with the collector on


@pytest.mark.anyio
async def test_scheduler_steps_with_gc_freeze_give_the_same_trajectories() -> None:
    results = {}
    for flag in (False, True):
        sched, _ = make([FakeEngine("http://a")], n=2, concurrency=3, gc_freeze=flag)
        seen: list[int] = []

        def on_traj(t: Trajectory) -> None:
            seen.append(gc.get_freeze_count())

        steps = []
        for _ in range(2):  # two steps: the freeze is made and undone per step
            res = await sched.run(samples(3), on_trajectory=on_traj)
            assert gc.get_freeze_count() == 0
            steps.append([(t.uid, t.status, t.prompt_ids, t.response_ids, t.response_mask, t.response_logprobs, t.reward)
                          for t in res.trajectories])
        assert len(seen) == 12 and (all(c > 0 for c in seen) if flag else seen == [0] * 12)
        results[flag] = steps
    assert results[True] == results[False]


@pytest.mark.anyio
async def test_a_steps_trajectories_are_not_left_in_a_reference_cycle() -> None:
    """The run's cancelled watchers leave it in a reference cycle; its trajectories must not be in it (they
    would wait for a full collection, which must walk them too, instead of going with the result)."""
    sched, _ = make([FakeEngine("http://a")], n=2, concurrency=3)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds unreachable stays in gc.garbage
    try:
        for _ in range(3):
            res = await sched.run(samples(3))
            assert len(res.trajectories) == 6
            del res
        gc.collect()
        cyclic = [o for o in gc.garbage if isinstance(o, Trajectory)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert cyclic == []


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_collector_paused_turns_collection_off_for_the_block_only() -> None:
    from agentloop.scheduler.gc_scope import collector_paused

    assert gc.isenabled()
    with collector_paused(True) as paused:
        assert paused and not gc.isenabled()
    assert gc.isenabled()
    with collector_paused(False) as paused:  # not opted in: nothing changes
        assert not paused and gc.isenabled()
    gc.disable()
    try:
        with collector_paused(True) as paused:  # someone else turned it off: left off, not turned on after
            assert not paused
        assert not gc.isenabled()
    finally:
        gc.enable()
    try:
        with collector_paused(True):
            raise KeyError("x")
    except KeyError:
        pass
    assert gc.isenabled()
