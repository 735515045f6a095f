"""The streaming mode (`agentloop.runtime.stream`) over an in-process engine double: admission keeps
`active` trajectories in flight, the queue to the trainer applies backpressure, the staleness bound
(AReaL's η) holds for every trained token, and no trajectory is lost or duplicated across updates.
The CPU-engine runs (exact per-token versions across 20 in-flight updates) are in test_stream_engine.py."""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import anyio
import pytest

from agentloop.engine.lifecycle import EngineState
from agentloop.group_filters import register_group_filter
from agentloop.runtime import Runtime
from agentloop.runtime.stream import StreamConfig, rollout_stream
from agentloop.runtime.stream_sync import SyncRolloutStream
from agentloop.types import Sample

from test_scheduler_support import FakeEngine, length_reward, samples

pytestmark = pytest.mark.anyio
TOK = types.SimpleNamespace(pad_token_id=0, eos_token_id=2)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def runtime(eng: FakeEngine, **sched: Any) -> Runtime:
    return Runtime({"scheduler": {"n": 2, **sched}}, clients=[eng], tokenizer=TOK, tools=object(), reward_fn=length_reward)


def feed(n: int, **extra: Any) -> list[Sample]:
    return samples(n, turns=3, tokens=4, tool_delay=0.005, **extra)


async def test_stream_keeps_active_in_flight_and_loses_nothing_across_updates() -> None:
    eng = FakeEngine("http://a", token_delay=0.002)
    rt = runtime(eng)
    seen: list[str] = []
    async with rt:
        assert rt.lifecycle.state is EngineState.SLEEPING
        async with rollout_stream(rt, feed(40), StreamConfig(batch_groups=2, active=8)) as s:
            assert rt.lifecycle.state is EngineState.AWAKE  # woken once, in stages
            async for batch in s:
                assert len(batch.groups) == 2 and all(len(g) == 2 for g in batch.groups)
                assert batch.batch["response_mask"].sum().item() == sum(batch.staleness.values())
                seen += [t.uid for t in batch.trajectories]
                assert all(t.status == "completed" and t.num_turns == 3 for t in batch.trajectories)
                if batch.index <= 15:
                    await s.update_weights({"w": batch.index})
            m = s.metrics
        assert rt.lifecycle.state is EngineState.SLEEPING  # slept again on close
        res = await rt.step(feed(1))  # a step after the stream: wakes from SLEEPING as always
        assert res.trajectories[0].status == "completed"
    assert sorted(seen) == sorted(f"p{i}_{k}" for i in range(40) for k in range(2))  # none lost, none twice
    assert m["updates"] == 15 and m["groups_accepted"] == 40 and m["batches"] == 20
    assert m["generations_outside_awake"] == 0
    assert m["trajectories_resumed"] > 0  # updates interrupted running requests, which were resumed
    assert eng.max_in_flight <= 8


async def test_trainer_that_stops_consuming_stops_admission() -> None:
    eng = FakeEngine("http://a", token_delay=0.001)
    rt = runtime(eng)
    async with rt:
        async with rollout_stream(rt, feed(1000), StreamConfig(batch_groups=2, active=8, max_queued_batches=2)) as s:
            first = await s.__anext__()
            assert first.index == 1
            await anyio.sleep(1.0)  # the trainer does not come back for a while
            admitted = s.counts["groups_admitted"]
            await anyio.sleep(0.5)
            assert s.counts["groups_admitted"] == admitted  # admission stopped
            assert s.in_flight == 0
            # bounded: the queue's batches + the groups completing after the bound was reached
            assert s.buffered_groups <= 2 * 2 + 8 // 2
            assert admitted <= 2 + 2 * 2 + 8 // 2 + 1
            with anyio.fail_after(10):  # the trainer consumes again: admission resumes once the queue has room
                while s.counts["groups_admitted"] == admitted:
                    await s.__anext__()
                    await anyio.sleep(0.01)


async def test_closing_while_the_queue_is_full_loses_no_group() -> None:
    # The batcher waits in its send with a full batch the queue has no room for; the trainer leaves.
    # Four groups in flight finish together: one to the trainer, one to the queue, one in the send.
    # That batch must end on `unconsumed` (a cancelled send drops its item), not vanish.
    eng = FakeEngine("http://a", token_delay=0.001)
    rt = runtime(eng)
    async with rt:
        async with rollout_stream(rt, feed(100), StreamConfig(batch_groups=1, active=8, max_queued_batches=1)) as s:
            consumed = [t.uid for t in (await s.__anext__()).trajectories]
            with anyio.fail_after(10):
                while s.buffered_groups < 2 or s.in_flight:  # the queue's batch + the one waiting to be sent
                    await anyio.sleep(0.01)
            await anyio.sleep(0.05)  # the batcher is in its send
            admitted = s.counts["groups_admitted"]
        unconsumed = [t.uid for g in s.unconsumed for t in g]
        every = consumed + unconsumed + [x.uid for x in s.leftover]
        assert sorted(every) == sorted(f"p{i}_{k}" for i in range(admitted) for k in range(2))  # each exactly once


@pytest.mark.parametrize("eta,policy", [(0, "drop"), (1, "drop"), (1, "restart")])
async def test_staleness_bound_holds_for_every_trained_token(eta: int, policy: str) -> None:
    eng = FakeEngine("http://a", token_delay=0.002)
    rt = runtime(eng)
    async with rt:
        cfg = StreamConfig(batch_groups=2, active=8, max_staleness=eta, stale_policy=policy)  # type: ignore[arg-type]
        prompts = feed(60)
        prompts[0].extra["turns"] = 10  # one long group: it finishes versions after it started
        async with rollout_stream(rt, prompts, cfg) as s:
            hist: dict[int, int] = {}
            consumed = 0
            async for batch in s:
                consumed += len(batch.groups)
                assert max(batch.staleness) <= eta, batch.staleness
                for k, v in batch.staleness.items():
                    hist[k] = hist.get(k, 0) + v
                # AReaL's admission rule, at every point the trainer sees: groups running or accepted (a stale
                # group dropped or restarted gave its place back)
                c, gc = s.counts, s.groups.counts
                counted = (c["groups_admitted"] - c["groups_dropped_stale"] - c["groups_restarted_stale"]
                           - gc["groups_failed"] - gc["groups_rejected"])
                assert counted <= (c["updates"] + eta + 1) * 2
                if batch.index >= 12:
                    break
                await s.update_weights({"w": batch.index})
            m = s.metrics
            # every accepted group was trained, handled by the policy, or still waits for the trainer
            stale = m["groups_dropped_stale"] + m["groups_restarted_stale"]
            assert m["groups_accepted"] == consumed + stale + s.buffered_groups
    assert hist and max(hist) <= eta
    if eta == 1:
        assert hist.get(1, 0) > 0  # tokens one version old were trained, as the bound allows
    if eta == 0:
        assert set(hist) == {0}  # η = 0 admits one batch per version: synchronous, nothing stale
    else:
        assert stale > 0  # the long group was more than η versions old when handed out: the policy took it
        assert m["groups_restarted_stale" if policy == "restart" else "groups_dropped_stale"] == stale


@register_group_filter("test_stream_reject_p2")
def _reject_p2(group: list[Any]) -> bool:
    return group[0].group_id != "p2"


@pytest.mark.parametrize("eta", [0, 1])
async def test_failed_and_rejected_groups_give_back_their_staleness_capacity(eta: int) -> None:
    """AReaL counts accepted rollouts: a group that fails (here p1, p4) or that the filter rejects (p2)
    never reaches the trainer, so it must not hold a place in (updates + eta + 1) x batch_groups, or
    the last batch stays short forever and the trainer waits for it (with eta = 0, at the first failure)."""
    eng = FakeEngine("http://a", token_delay=0.001)
    rt = runtime(eng, group_filter="test_stream_reject_p2")
    prompts = feed(10)
    for k in (1, 4):
        prompts[k].extra["raise"] = True
    async with rt:
        async with rollout_stream(rt, prompts, StreamConfig(batch_groups=2, active=4, max_staleness=eta)) as s:
            with anyio.fail_after(30):
                async for batch in s:
                    await s.update_weights({"w": batch.index})
            m = s.metrics
    assert m["groups_failed"] == 2 and m["groups_rejected"] == 1 and m["groups_accepted"] == 7
    assert m["batches"] == 4 and m["groups_admitted"] == 10  # 3 of 2 groups, then the last one alone at the end


async def test_a_stream_held_back_only_by_the_staleness_bound_says_so(monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    import agentloop.runtime.stream as stream_mod

    monkeypatch.setattr(stream_mod, "STALL_WARNING_S", 0.2)
    eng = FakeEngine("http://a", token_delay=0.001)
    rt = runtime(eng)
    async with rt:
        async with rollout_stream(rt, feed(6), StreamConfig(batch_groups=2, active=8, max_staleness=0)) as s:
            first = await s.__anext__()
            with caplog.at_level("WARNING", logger="agentloop.runtime.stream"):
                await anyio.sleep(0.6)  # training on it: nothing to say
                assert "admits no more groups" not in caplog.text
                second: Any = None

                async def next_batch() -> None:
                    nonlocal second
                    second = await s.__anext__()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(next_batch)  # asks for the next batch before updating: would wait forever
                    await anyio.sleep(0.6)
                    assert "admits no more groups until the next update_weights" in caplog.text
                    with anyio.fail_after(10):
                        await s.update_weights({"w": 1})  # another task updates: the next batch comes
    assert (first.index, second.index) == (1, 2)


async def test_closing_early_keeps_every_trajectory_somewhere() -> None:
    eng = FakeEngine("http://a", token_delay=0.002)
    rt = runtime(eng)
    async with rt:
        consumed: list[str] = []
        async with rollout_stream(rt, feed(50), StreamConfig(batch_groups=2, active=8)) as s:
            async for batch in s:
                consumed += [t.uid for t in batch.trajectories]
                await s.update_weights({"w": batch.index})
                if batch.index == 3:
                    break  # the trainer stops with trajectories in flight and groups queued
        assert rt.lifecycle.state is EngineState.SLEEPING
        unconsumed = [t.uid for g in s.unconsumed for t in g]
        leftover = [x.uid for x in s.leftover]
        admitted = s.counts["groups_admitted"]
        every = consumed + unconsumed + leftover
        assert sorted(every) == sorted(f"p{i}_{k}" for i in range(admitted) for k in range(2))  # each exactly once
        assert leftover and any(x.resume_from is not None and x.resume_from.status == "aborted" for x in s.leftover)
        res = await rt.step(s.leftover)  # the partials go on in a later step, which completes their groups
        assert all(t.status == "completed" for t in res.trajectories)
        # the queue to the trainer is closed with the block (an open one warns when collected), and a
        # trainer that iterates again is told the stream ended
        with pytest.raises(StopAsyncIteration):
            await s.__anext__()


async def test_a_trainer_that_raises_loses_no_finished_group() -> None:
    # The trainer's own error ends the block: it propagates, and what was finished or in flight is
    # still on the stream (unconsumed / leftover) for whoever catches it.
    eng = FakeEngine("http://a", token_delay=0.001)
    rt = runtime(eng)
    async with rt:
        consumed: list[str] = []
        with pytest.raises(ZeroDivisionError):
            async with rollout_stream(rt, feed(100), StreamConfig(batch_groups=1, active=8, max_queued_batches=1)) as s:
                async for batch in s:
                    consumed += [t.uid for t in batch.trajectories]
                    with anyio.fail_after(10):
                        while s.buffered_groups < 2 or s.in_flight:
                            await anyio.sleep(0.01)
                    1 / 0
        assert rt.lifecycle.state is EngineState.SLEEPING
        assert s.unconsumed  # the queue's batch and the one waiting to be sent
        every = consumed + [t.uid for g in s.unconsumed for t in g] + [x.uid for x in s.leftover]
        admitted = s.counts["groups_admitted"]
        assert sorted(every) == sorted(f"p{i}_{k}" for i in range(admitted) for k in range(2))


class FailingUpdateEngine(FakeEngine):
    """Refuses one weight update (after the requests in flight were ended for it)."""

    fail_next_update = False

    async def update_weights_from_tensor(self, named_tensors, **kw):  # type: ignore[no-untyped-def]
        if self.fail_next_update:
            self.fail_next_update = False
            from agentloop.engine.base import EngineError

            raise EngineError("/update_weights_from_tensor", 400, "bad tensor", url=self.url)
        return await super().update_weights_from_tensor(named_tensors, **kw)


async def test_a_failed_update_leaves_the_engine_generating() -> None:
    eng = FailingUpdateEngine("http://a", token_delay=0.002)
    rt = runtime(eng)
    async with rt:
        async with rollout_stream(rt, feed(12), StreamConfig(batch_groups=2, active=8)) as s:
            async for batch in s:
                if batch.index == 1:
                    eng.fail_next_update = True
                    with pytest.raises(Exception, match="bad tensor"):
                        await s.update_weights({"w": 1}, version="bad")
                    assert rt.lifecycle.gate.is_open  # the gates reopened on the old weights although the load failed
                    assert s.weight_version != "bad"
                else:
                    await s.update_weights({"w": batch.index})
            m = s.metrics
    assert m["batches"] == 6 and m["groups_accepted"] == 12  # the stream went on to the end
    assert m["updates"] == 5


async def test_an_update_under_a_version_already_served_is_refused_and_the_stream_goes_on() -> None:
    eng = FakeEngine("http://a", token_delay=0.002)
    rt = runtime(eng)
    async with rt:
        async with rollout_stream(rt, feed(8), StreamConfig(batch_groups=2, active=8)) as s:
            async for batch in s:
                if batch.index == 1:
                    assert await s.update_weights({"w": 1}, version="u1") == "u1"
                elif batch.index == 2:
                    before = eng.calls.count("update")
                    with pytest.raises(ValueError, match="'u1' is the one served now"):
                        await s.update_weights({"w": 2}, version="u1")  # would skip the load: stale weights
                    assert await s.update_weights({"w": 2}, version="u2") == "u2"
                    with pytest.raises(ValueError, match="'u1' was served before"):
                        await s.update_weights({"w": 3}, version="u1")  # would mislabel new tokens as old
                    assert eng.calls.count("update") == before + 1  # only u2 was loaded (no drain for the refusals)
                    assert rt.lifecycle.gate.is_open
            m = s.metrics
    assert m["updates"] == 2 and m["batches"] == 4 and m["groups_accepted"] == 8


def test_sync_stream_and_errors() -> None:
    eng = FakeEngine("http://a")
    rt = runtime(eng)
    with rt:
        with SyncRolloutStream(rt, feed(6), StreamConfig(batch_groups=3, active=4)) as s:
            batches = list(s)
            assert s.metrics["batches"] == 2
        assert [len(b.groups) for b in batches] == [3, 3]
        assert rt.lifecycle.state is EngineState.SLEEPING
        with pytest.raises(ValueError, match="twice"):
            with SyncRolloutStream(rt, feed(2) + feed(1), StreamConfig(batch_groups=1, active=4)) as s:
                list(s)
        assert rt.lifecycle.state is EngineState.SLEEPING
    with pytest.raises(ValueError, match="active"):
        StreamConfig(batch_groups=1, active=0)
    with pytest.raises(ValueError, match="stale_policy"):
        StreamConfig(batch_groups=1, active=1, stale_policy="keep")  # type: ignore[arg-type]
    for bad in ({"active": True}, {"max_staleness": True}, {"max_queued_batches": 1.5}, {"batch_groups": "2"}):
        name = next(iter(bad))
        with pytest.raises(ValueError, match=f"StreamConfig.{name} must be"):
            StreamConfig(**{"batch_groups": 1, "active": 1, **bad})  # a bool is no count


async def test_a_feeder_that_raises_ends_the_stream_with_its_error_and_keeps_what_ran() -> None:
    # A dataset iterator that fails (a shard it cannot read): the trainer gets that error, as itself,
    # and what the stream had admitted is consumed, unconsumed or leftover, not torn down.
    def shards():
        for i, sample in enumerate(feed(100)):
            if i == 6:
                raise OSError("shard 3 unreadable")
            yield sample

    eng = FakeEngine("http://a", token_delay=0.001)
    rt = runtime(eng)
    async with rt:
        consumed: list[str] = []
        with pytest.raises(OSError, match="shard 3 unreadable"):
            async with rollout_stream(rt, shards(), StreamConfig(batch_groups=1, active=4)) as s:
                async for batch in s:
                    consumed += [t.uid for t in batch.trajectories]
        assert rt.lifecycle.state is EngineState.SLEEPING
    every = consumed + [t.uid for g in s.unconsumed for t in g] + [x.uid for x in s.leftover]
    assert s.counts["groups_admitted"] == 6
    assert sorted(every) == sorted(f"p{i}_{k}" for i in range(6) for k in range(2))


@pytest.mark.parametrize("flag", [False, True])
async def test_gc_freeze_holds_for_the_stream_and_is_undone_at_close(flag: bool) -> None:
    """`scheduler.gc_freeze` freezes the heap once for the stream's life (not per trajectory) and unfreezes at
    close; the update breakdown names the load's share of every update."""
    import gc

    assert gc.get_freeze_count() == 0
    eng = FakeEngine("http://a", token_delay=0.001)
    rt = runtime(eng, gc_freeze=flag)
    counts = []
    async with rt:
        async with rollout_stream(rt, feed(6), StreamConfig(batch_groups=2, active=4)) as s:
            async for batch in s:
                counts.append(gc.get_freeze_count())
                await s.update_weights({"w": batch.index})
            m = s.metrics
    assert gc.get_freeze_count() == 0
    assert len(counts) == 3 and all((c > 0) == flag for c in counts)
    assert len(m["update_load_seconds"]) == len(m["update_seconds"]) == 3
    assert all(0 <= load <= total for load, total in zip(m["update_load_seconds"], m["update_seconds"]))


async def test_second_stream_on_a_runtime_does_not_reuse_version_names() -> None:
    """Weights without a version get a name the lifecycle never gave: a second stream's updates of an
    in-place-updated dict must not reuse the first stream's names (the version log keeps a name's first
    place, so a reused one made the second stream's fresh tokens count 30+ versions old on the H200)."""
    eng = FakeEngine("http://a", token_delay=0.001)
    rt = runtime(eng)
    live: dict[str, Any] = {"w": 0}
    hists, served = [], []
    async with rt:
        for run in range(2):
            prompts = [dataclasses.replace(x, uid=f"r{run}-{x.uid}") for x in feed(8)]
            async with rollout_stream(rt, prompts, StreamConfig(batch_groups=2, active=4, max_staleness=1), weights=live) as s:
                async for batch in s:
                    hists.append(batch.staleness)
                    live["w"] += 1
                    served.append(await s.update_weights(live))
    assert len(served) == len(set(served)) == 8
    assert all(max(h) <= 1 for h in hists), hists


async def test_runtime_stream_with_a_stream_config_is_the_streaming_mode() -> None:
    """`rt.stream(feeder, StreamConfig(...))` (the issue's form) is `rollout_stream`; `rt.stream(samples,
    weights)` stays one step's trajectories; iterating either without its block says how to use it."""
    eng = FakeEngine("http://a", token_delay=0.002)
    rt = runtime(eng)
    seen: list[str] = []
    versions: list[str | None] = []
    async with rt:
        async with rt.stream(feed(8), StreamConfig(batch_groups=2, active=6), weights={"w": 0}) as s:
            assert rt.lifecycle.state is EngineState.AWAKE
            async for batch in s:
                seen += [t.uid for t in batch.trajectories]
                versions.append(await s.update_weights({"w": batch.index}, f"v{batch.index}"))
        assert rt.lifecycle.state is EngineState.SLEEPING
        assert s.metrics["updates"] == 4 and versions == ["v1", "v2", "v3", "v4"]
        with pytest.raises(RuntimeError, match="closed"):
            await s.update_weights({"w": 9})
        assert rt.lifecycle.state is EngineState.SLEEPING and rt.lifecycle.weight_version == "v4"
        async with rt.stream(feed(2), config=StreamConfig(batch_groups=2, active=4)) as s2:
            assert [len(b.groups) async for b in s2] == [2]
        async with rt.stream(feed(2)) as step:  # no StreamConfig: one step, trajectory by trajectory
            assert sorted([t.uid async for t in step]) == ["p0_0", "p0_1", "p1_0", "p1_1"]
        assert step.result is not None and len(step.result.trajectories) == 4
        with pytest.raises(TypeError, match=r"async with rt.stream\(feeder, config\) as s"):
            async for _ in rt.stream(feed(2), StreamConfig(batch_groups=1, active=2)):  # type: ignore[attr-defined]
                pass
        with pytest.raises(TypeError, match="weights=..."):
            rt.stream(feed(2), StreamConfig(batch_groups=1, active=2), {"w": 1})
        assert rt.lifecycle.state is EngineState.SLEEPING  # nothing woke for a refused call
    assert sorted(seen) == sorted(f"p{i}_{k}" for i in range(8) for k in range(2))


def test_runtime_stream_sync() -> None:
    eng = FakeEngine("http://a")
    rt = runtime(eng)
    with rt:
        with rt.stream_sync(feed(4), StreamConfig(batch_groups=2, active=4)) as s:
            for batch in s:
                assert s.update_weights({"w": batch.index}) == rt.lifecycle.weight_version
            assert s.metrics["batches"] == 2 and s.metrics["updates"] == 2
        assert rt.lifecycle.state is EngineState.SLEEPING


class HungEngine(FakeEngine):
    """Accepts generates and answers nothing, /model_info included (a wedged server)."""

    hung = False

    async def generate(self, input_ids, sampling_params, **kw):  # type: ignore[override]
        if self.hung:
            await anyio.sleep_forever()
        return await super().generate(input_ids, sampling_params, **kw)

    async def model_info(self):  # type: ignore[override]
        if self.hung:
            await anyio.sleep_forever()
        return await super().model_info()


async def test_one_server_watch_for_the_stream_takes_a_hung_server_out() -> None:
    """The stream's trajectories do not each watch the servers (one watch task per trajectory in flight
    made the collector's garbage and the client's CPU grow with `active`); the stream's single watch
    still takes a hung server out, and its trajectories go on on the other."""
    from agentloop.scheduler.run import ScheduleRun

    good, bad = FakeEngine("http://good", token_delay=0.002), HungEngine("http://bad", token_delay=0.002)
    rt = Runtime({"scheduler": {"n": 2}, "engine": {"hung_timeout": 0.4}}, clients=[good, bad],
                 tokenizer=TOK, tools=object(), reward_fn=length_reward)
    watched: list[float | None] = []
    orig_init = ScheduleRun.__init__

    def spy(self, *a, **kw):
        watched.append(kw.get("hung_timeout"))
        orig_init(self, *a, **kw)

    ScheduleRun.__init__ = spy  # type: ignore[method-assign]
    try:
        async with rt:
            rt.router.health_timeout = 0.2  # the /model_info probe of a silent server
            with anyio.fail_after(30):
                async with rt.stream(feed(12), StreamConfig(batch_groups=2, active=8)) as s:
                    bad.hung = True  # wedged once the stream is awake: requests dispatched to it never answer
                    seen = [t.uid async for batch in s for t in batch.trajectories]
            why = rt.lifecycle.out_of_rotation["http://bad"]
            assert "hung: requests in flight" in str(why), why  # the router's watch, not only a liveness probe
    finally:
        ScheduleRun.__init__ = orig_init  # type: ignore[method-assign]
    assert sorted(seen) == sorted(f"p{i}_{k}" for i in range(12) for k in range(2))
    assert watched and all(h is None for h in watched)  # no member run watched servers itself
