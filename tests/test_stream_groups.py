"""`StreamGroups`: the streaming mode's group assembly on its own — members in, complete groups judged
(a failed member drops the group, the filter rejects, a failing filter keeps it), accepted groups out
in order, and at close the ready groups and every partial member handed back."""

from __future__ import annotations

from agentloop.runtime.stream_groups import StreamGroups
from agentloop.scheduler import expand_samples
from agentloop.types import Sample, Trajectory


def members(uid: str, n: int = 2) -> tuple[Sample, list[Sample]]:
    s = Sample(uid=uid, messages=[{"role": "user", "content": uid}])
    return s, expand_samples([s], n)


def traj(m: Sample, status: str = "completed", reward: float = 1.0) -> Trajectory:
    t = Trajectory(uid=m.uid, group_id=m.group_id, prompt_ids=[1])
    t.status, t.reward = status, reward
    return t


def test_groups_are_judged_when_complete_and_taken_in_order() -> None:
    groups = StreamGroups(lambda trajs: len({t.reward for t in trajs}) > 1, "differing")
    outcomes = {}
    for uid, rewards, status in [("a", (1.0, 0.0), "completed"), ("b", (1.0, 1.0), "completed"),
                                 ("c", (1.0, 0.0), "failed"), ("d", (0.0, 1.0), "completed")]:
        s, ms = members(uid)
        g = groups.open(s, ms)
        assert groups.finish(g, 1, traj(ms[1], reward=rewards[1])) is False  # not complete yet
        outcomes[uid] = groups.finish(g, 0, traj(ms[0], status, rewards[0]))
    assert outcomes == {"a": True, "b": False, "c": False, "d": True}
    assert groups.counts == {"groups_accepted": 2, "groups_rejected": 1, "groups_failed": 1}
    assert not groups.running
    first = groups.take(1)
    assert [[t.uid for t in g] for g in first] == [[m.uid for m in members("a")[1]]]  # members in index order
    assert [g[0].group_id for g in groups.take(5)] == ["d"] and groups.take(1) == []


def test_a_failing_filter_keeps_the_group() -> None:
    def broken(trajs: list[Trajectory]) -> bool:
        raise RuntimeError("filter bug")

    groups = StreamGroups(broken, "broken")
    s, ms = members("a", 1)
    assert groups.finish(groups.open(s, ms), 0, traj(ms[0])) is True
    assert groups.counts["groups_accepted"] == 1


def test_close_hands_back_ready_groups_and_partial_members() -> None:
    groups = StreamGroups()
    s, ms = members("a", 1)
    groups.finish(groups.open(s, ms), 0, traj(ms[0]))
    s2, ms2 = members("b", 3)
    g2 = groups.open(s2, ms2)
    done = traj(ms2[2])
    groups.finish(g2, 2, done)
    ready, partials = groups.close()
    assert [g[0].group_id for g in ready] == ["a"]
    assert [(p.uid, p.resume_from) for p in partials] == [(ms2[2].uid, done)]  # the finished member, to rejoin its mates
    assert groups.close() == ([], []) and not groups.running
