"""The scheduler's group book and watchdog on their own: the book is synchronous (no event loop, no
engine) — add jobs, finish trajectories, read the decisions, what is final and what is carried; the
watchdog's deadlines with a short real clock and a stand-in router."""

from __future__ import annotations

import time

import anyio
import pytest

from agentloop.scheduler.book import Decision, GroupBook, expand_samples
from agentloop.group_filters import drop_zero_variance
from agentloop.scheduler.watchdog import Watchdog
from agentloop.types import Sample, Trajectory


def prompts(k: int, prefix: str = "p") -> list[Sample]:
    return [Sample(uid=f"{prefix}{i}", messages=[]) for i in range(k)]


def traj(job: Sample, status: str = "completed", reward: float | None = 1.0, error: str | None = None) -> Trajectory:
    return Trajectory(uid=job.uid, group_id=job.group_id, prompt_ids=[1], status=status, reward=reward,  # type: ignore[arg-type]
                      error=error, index_in_group=job.index_in_group)


def finish_all(book: GroupBook, idx, **kw) -> list[Decision]:
    return [book.finish(i, traj(book.jobs[i], **kw)) for i in idx]


# ------------------------------------------------------------------ ungrouped
def test_ungrouped_each_trajectory_is_emitted_alone_and_unfinished_ones_are_carried() -> None:
    book = GroupBook(n=2)
    assert not book.grouped
    idx = book.add(expand_samples(prompts(3), 2))
    assert list(idx) == [0, 1, 2, 3, 4, 5] and [j.uid for j in book.jobs][:4] == ["p0_0", "p0_1", "p1_0", "p1_1"]
    assert book.finish(2, traj(book.jobs[2])) == Decision("emitted", emit=(2,))  # its group still runs
    assert book.finish(0, traj(book.jobs[0], status="aborted", reward=None)) == Decision("carried")
    d = book.finish(1, traj(book.jobs[1], status="failed", reward=None, error="boom"))
    assert d.emit == (1,) and not d.group  # p0_0 was stopped: group p0 is not decided
    d = book.finish(3, traj(book.jobs[3]))
    assert d.group == (2, 3) and d.group_verdict == "accepted"  # ungrouped runs decide whole groups too
    final, carry, rejected = book.partition(partial_rollout=True)
    assert [t.uid for t in final] == ["p0_1", "p1_0", "p1_1"]  # input order, not finish order
    assert [s.uid for s in carry] == ["p0_0", "p2_0", "p2_1"] and not rejected
    assert carry[0].resume_from is not None and carry[0].resume_from.status == "aborted"  # partial kept
    assert carry[1].resume_from is None  # never started: as it came
    assert book.started() == 4 and book.groups_wanted() == 0 and book.unfinished == 2


def test_a_trajectory_cannot_finish_twice() -> None:
    book = GroupBook()
    book.add(expand_samples(prompts(1), 1))
    book.finish(0, traj(book.jobs[0]))
    with pytest.raises(RuntimeError, match="p0 finished twice"):
        book.finish(0, traj(book.jobs[0]))


# ------------------------------------------------------------------ groups and the target
def test_groups_are_decided_when_their_last_member_finishes_and_the_target_stops_the_run() -> None:
    book = GroupBook(n=2, target_groups=2)
    book.add(expand_samples(prompts(3), 2))  # groups p0 p1 p2, indices (0 1) (2 3) (4 5)
    assert book.grouped and book.num_groups == 3 and book.running_groups == 3
    assert book.finish(1, traj(book.jobs[1])).verdict == "pending"
    d = book.finish(0, traj(book.jobs[0]))
    assert d == Decision("accepted", emit=(0, 1), target_reached=False, refill=True, group=(0, 1), group_verdict="accepted")
    assert book.finish(4, traj(book.jobs[4])).verdict == "pending"
    d = book.finish(3, traj(book.jobs[3]))
    assert d.verdict == "pending"
    d = book.finish(2, traj(book.jobs[2]))
    assert d.verdict == "accepted" and d.emit == (2, 3) and d.target_reached  # the run stops the rest now
    assert book.accepted == 2
    # The stopped member of p2 comes back aborted: p2 is carried whole (its finished member as it is).
    assert book.finish(5, traj(book.jobs[5], status="aborted", reward=None)) == Decision("carried")
    final, carry, _ = book.partition(partial_rollout=True)
    assert [t.uid for t in final] == ["p0_0", "p0_1", "p1_0", "p1_1"]
    assert [(s.uid, s.resume_from.status) for s in carry] == [("p2_0", "completed"), ("p2_1", "aborted")]
    assert book.complete_groups() == 2


def test_a_group_complete_past_the_target_is_carried_not_returned() -> None:
    book = GroupBook(n=1, target_groups=1)
    book.add(expand_samples(prompts(2), 1))
    assert book.finish(0, traj(book.jobs[0])).target_reached
    assert book.finish(1, traj(book.jobs[1])) == Decision("carried")  # finished just after the stop
    final, carry, _ = book.partition(partial_rollout=False)
    assert [t.uid for t in final] == ["p0"]
    assert carry[0].uid == "p1" and carry[0].resume_from.status == "completed"  # nothing left to run


def test_a_group_with_a_failed_member_is_final_but_not_counted() -> None:
    book = GroupBook(n=2, target_groups=1)
    book.add(expand_samples(prompts(1), 2))
    book.finish(0, traj(book.jobs[0]))
    d = book.finish(1, traj(book.jobs[1], status="failed", reward=None, error="tool crashed"))
    assert d == Decision("failed", emit=(0, 1), refill=True, group=(0, 1), group_verdict="failed")
    assert book.accepted == 0 and book.groups_wanted() == 1  # the target still needs a group: draw one
    final, carry, _ = book.partition(partial_rollout=True)
    assert len(final) == 2 and not carry and book.complete_groups() == 0


def test_without_partial_rollout_an_aborted_member_restarts_from_its_prompt() -> None:
    book = GroupBook(n=2, target_groups=1)
    book.add(expand_samples(prompts(2), 2))
    finish_all(book, [0, 1])
    book.finish(2, traj(book.jobs[2], status="aborted", reward=None))
    _, carry, _ = book.partition(partial_rollout=False)
    assert [(s.uid, s.resume_from) for s in carry] == [("p1_0", None), ("p1_1", None)]  # p1_1 never started


# ------------------------------------------------------------------ the filter, drawing more
def test_the_filter_rejects_groups_which_leave_the_batch_and_ask_for_more() -> None:
    book = GroupBook(n=2, target_groups=1, group_filter=drop_zero_variance, filter_name="drop_zero_variance")
    book.add(expand_samples(prompts(1), 2))
    assert book.groups_wanted() == 0  # one running group covers the target
    book.finish(0, traj(book.jobs[0], reward=1.0))
    d = book.finish(1, traj(book.jobs[1], reward=1.0))
    assert d == Decision("rejected", refill=True, group=(0, 1), group_verdict="rejected") and book.rejected == 1
    assert book.groups_wanted() == 1
    added = book.add_sample(Sample(uid="fresh", messages=[]))
    assert [book.jobs[i].uid for i in added] == ["fresh_0", "fresh_1"] and book.groups_wanted() == 0
    book.finish(added[0], traj(book.jobs[added[0]], reward=0.0))
    assert book.finish(added[1], traj(book.jobs[added[1]], reward=1.0)).target_reached
    final, carry, rejected = book.partition(partial_rollout=True)
    assert [t.uid for t in final] == ["fresh_0", "fresh_1"] and [t.uid for t in rejected] == ["p0_0", "p0_1"]
    assert not carry


def test_a_filter_that_raises_keeps_the_group_and_is_counted() -> None:
    def broken(group):
        raise ZeroDivisionError("no")

    book = GroupBook(n=1, target_groups=1, group_filter=broken, filter_name="broken")
    book.add(expand_samples(prompts(1), 1))
    assert book.finish(0, traj(book.jobs[0])).verdict == "accepted"
    assert book.filter_errors == 1


def test_drawn_samples_are_checked_and_the_budget_counts_groups() -> None:
    book = GroupBook(n=2, target_groups=3, group_budget=2)
    book.add(expand_samples(prompts(1), 2))
    with pytest.raises(ValueError, match="already in this step"):
        book.add_sample(Sample(uid="p0", messages=[]))
    with pytest.raises(TypeError, match="expected agentloop.types.Sample"):
        book.add_sample({"uid": "x"})  # type: ignore[arg-type]
    assert not book.budget_reached()
    book.add_sample(Sample(uid="q", messages=[]))
    assert book.budget_reached() and book.groups_wanted() == 1


# ------------------------------------------------------------------ the watchdog
class _Router:
    def __init__(self) -> None:
        self.checks: list[float] = []

    async def take_out_stalled(self, after: float) -> list[str]:
        self.checks.append(after)
        return []


@pytest.mark.anyio
async def test_watchdog_expires_running_keys_in_deadline_order_and_skips_finished_ones() -> None:
    running = {"a", "b", "c"}
    expired: list[str] = []
    dog = Watchdog(clock=time.monotonic, is_running=running.__contains__, on_expired=expired.append)
    now = time.monotonic()
    async with anyio.create_task_group() as tg:
        tg.start_soon(dog.run)
        await anyio.sleep(0.01)  # the watcher waits with no deadline
        dog.add_deadline("c", now + 0.30)
        dog.add_deadline("b", now + 0.15)
        dog.add_deadline("a", now + 0.05)  # earlier than the one it sleeps toward: it wakes for it
        await anyio.sleep(0.10)
        assert expired == ["a"]
        running.discard("b")  # finished before its deadline
        await anyio.sleep(0.30)
        tg.cancel_scope.cancel()
    assert expired == ["a", "c"] and dog.timed_out == {"a", "c"} and dog.pending == 0


@pytest.mark.anyio
async def test_watchdog_checks_servers_every_quarter_of_the_hung_timeout() -> None:
    router = _Router()
    dog = Watchdog(clock=time.monotonic, is_running=lambda k: False, on_expired=lambda k: None,
                   router=router, hung_timeout=0.2)
    with anyio.move_on_after(0.27):
        await dog.run()
    assert router.checks == [0.2] * len(router.checks) and 3 <= len(router.checks) <= 5
    with pytest.raises(ValueError, match="needs the router"):
        Watchdog(clock=time.monotonic, is_running=bool, on_expired=print, hung_timeout=1.0)
