"""BatchQueue on its own: backpressure, what waits, the end of the producer, and nothing lost at close
(a put cancelled while the queue is full keeps its batch)."""

from __future__ import annotations

import anyio
import pytest

from agentloop.runtime.stream_queue import BatchQueue


def test_put_blocks_when_full_and_a_cancelled_put_loses_nothing() -> None:
    async def main() -> None:
        q: BatchQueue[str] = BatchQueue(2)
        await q.put("a")
        await q.put("b")
        assert q.waiting == 2
        with anyio.move_on_after(0.1) as scope:  # full: the third put waits (backpressure)
            await q.put("c")
        assert scope.cancelled_caught and q.waiting == 3  # "c" still counts as waiting for the trainer
        assert await q.get() == "a"
        assert q.drain() == ["b", "c"] and q.waiting == 0
        with pytest.raises(anyio.ClosedResourceError):
            await q.get()

    anyio.run(main)


def test_a_put_taken_straight_by_a_waiting_get_is_delivered_once() -> None:
    async def main() -> None:
        q: BatchQueue[str] = BatchQueue(0)  # no buffer: every put hands over to a get
        got: list[str] = []

        async def trainer() -> None:
            got.append(await q.get())

        async with anyio.create_task_group() as tg:
            tg.start_soon(trainer)
            await anyio.sleep(0.01)
            await q.put("x")
        assert got == ["x"] and q.waiting == 0 and q.drain() == []  # not handed back a second time

    anyio.run(main)


def test_get_ends_once_the_producer_closed_and_the_queue_is_empty() -> None:
    async def main() -> None:
        q: BatchQueue[int] = BatchQueue(4)
        await q.put(1)
        q.close_producer()
        assert await q.get() == 1
        with pytest.raises(anyio.EndOfStream):
            await q.get()

    anyio.run(main)
