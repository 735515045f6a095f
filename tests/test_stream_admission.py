"""StreamAdmission on its own: the bounds that let a group start, restarts before fresh prompts,
fresh and unique prompts only, and the staleness bound's two policies."""

from __future__ import annotations

import anyio
import pytest

from agentloop.runtime.stream_admission import StreamAdmission
from agentloop.runtime.stream_types import StreamConfig
from agentloop.scheduler.staleness import VersionLog
from agentloop.types import Sample, Trajectory, TurnRecord


def sample(uid: str, **kw) -> Sample:
    return Sample(uid=uid, messages=[{"role": "user", "content": uid}], **kw)


def traj(gid: str, version: str) -> Trajectory:
    t = Trajectory(uid=f"{gid}_0", group_id=gid, prompt_ids=[1], response_ids=[5, 6], response_mask=[1, 1],
                   response_logprobs=[-0.1, -0.2])
    t.turns = [TurnRecord(start=0, length=2, weight_version=version, finish_reason={"type": "length"})]
    return t


def test_bounds_active_backpressure_and_staleness_capacity() -> None:
    adm = StreamAdmission([], StreamConfig(batch_groups=2, active=8, max_queued_batches=2, max_staleness=1),
                          to_sample=lambda r: r)
    assert adm.allows(4, in_flight=4, buffered_groups=0, updates=0)
    assert not adm.allows(4, in_flight=5, buffered_groups=0, updates=0)  # over `active`
    assert adm.allows(16, in_flight=0, buffered_groups=0, updates=0)  # an empty stream takes one regardless
    assert not adm.allows(1, in_flight=0, buffered_groups=4, updates=0)  # 2 batches x 2 groups wait: full
    adm.counts["groups_admitted"] = 4  # (0 updates + eta 1 + 1) x 2 groups
    assert not adm.allows(1, in_flight=0, buffered_groups=0, updates=0)
    assert adm.allows(1, in_flight=0, buffered_groups=0, updates=1)  # an update makes room for 2 more
    # a group that failed or was rejected, or that the bound dropped or restarted, gives its place back
    assert adm.allows(1, in_flight=0, buffered_groups=0, updates=0, groups_discarded=1)
    adm.counts["groups_dropped_stale"] = 1
    assert adm.allows(1, in_flight=0, buffered_groups=0, updates=0)


def test_restarts_come_first_uids_are_unique_and_prompts_fresh() -> None:
    rows = [sample("a"), sample("b"), sample("a")]
    adm = StreamAdmission(rows, StreamConfig(batch_groups=1, active=4), to_sample=lambda r: r)

    async def main() -> None:
        assert (await adm.next()).uid == "a"
        adm.restarts.append(sample("a.r1"))
        assert (await adm.next()).uid == "a.r1"
        assert (await adm.next()).uid == "b"
        with pytest.raises(ValueError, match="'a' twice"):
            await adm.next()
        assert await adm.next() is None and adm.exhausted and adm.drained
        assert adm.counts["groups_admitted"] == 3

    anyio.run(main)
    for bad in (sample("g", group_id="g"), sample("r", resume_from=traj("r", "v0"))):
        adm = StreamAdmission([bad], StreamConfig(batch_groups=1, active=4), to_sample=lambda r: r)
        with pytest.raises(ValueError, match="fresh prompts only"):
            anyio.run(adm.next)


def test_an_async_feeder_and_a_feeder_of_the_wrong_kind() -> None:
    async def rows():
        for u in ("x", "y"):
            yield {"uid": u}

    adm = StreamAdmission(rows(), StreamConfig(batch_groups=1, active=4), to_sample=lambda r: sample(r["uid"]))

    async def main() -> list[str | None]:
        return [getattr(await adm.next(), "uid", None) for _ in range(3)]

    assert anyio.run(main) == ["x", "y", None]
    with pytest.raises(TypeError, match="feeder must be an iterable"):
        StreamAdmission(42, StreamConfig(batch_groups=1, active=4), to_sample=lambda r: r)  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", ["drop", "restart"])
def test_staleness_bound_drops_or_restarts_a_group_too_many_versions_behind(policy: str) -> None:
    log = VersionLog()
    for v in ("v0", "v1", "v2"):
        log.observe(v)
    adm = StreamAdmission([sample("old"), sample("new")], StreamConfig(batch_groups=1, active=4, max_staleness=1,
                                                                       stale_policy=policy), to_sample=lambda r: r)

    async def admit_both() -> None:
        await adm.next()
        await adm.next()
        assert await adm.next() is None and adm.drained  # the feeder ran out: nothing more to admit

    anyio.run(admit_both)
    kept = adm.bound_staleness([[traj("old", "v0")], [traj("new", "v1")]], log)  # 2 and 1 versions behind
    assert [g[0].group_id for g in kept] == ["new"]
    if policy == "restart":
        assert adm.counts["groups_restarted_stale"] == 1 and [s.uid for s in adm.restarts] == ["old.r1"]
        assert adm.restarts[0].messages == [{"role": "user", "content": "old"}]
        assert not adm.drained  # the restart is admitted although the feeder ran out
        assert anyio.run(adm.next).uid == "old.r1" and adm.drained
    else:
        assert adm.counts["groups_dropped_stale"] == 1 and not adm.restarts and adm.drained
    unbounded = StreamAdmission([], StreamConfig(batch_groups=1, active=4), to_sample=lambda r: r)
    groups = [[traj("old", "v0")]]
    assert unbounded.bound_staleness(groups, log) is groups
