"""One job: the streaming mode's bounded queue of batches to the trainer — a `put` that blocks while
the queue is full (backpressure), a `get`, how many batches wait, and at close every batch not taken,
the one whose send a close cancelled included (a cancelled send drops its item), so none is lost."""

from __future__ import annotations

from typing import Generic, TypeVar

import anyio

__all__ = ["BatchQueue"]

T = TypeVar("T")


class BatchQueue(Generic[T]):
    """Up to `max_batches` batches between one producer and the trainer (see the module docstring).
    `get` raises anyio.EndOfStream once the producer closed its side and the queue is empty, and
    anyio.ClosedResourceError after `drain`."""

    def __init__(self, max_batches: int) -> None:
        self._send, self._receive = anyio.create_memory_object_stream[T](max_batches)
        #: the batch being put, until a receiver took it or it is in the queue
        self._unsent: T | None = None

    @property
    def waiting(self) -> int:
        """Batches not yet taken: in the queue, or being put while the queue is full."""
        return self._send.statistics().current_buffer_used + (1 if self._unsent is not None else 0)

    async def put(self, batch: T) -> None:
        self._unsent = batch
        await self._send.send(batch)  # blocks while the queue is full: backpressure
        self._unsent = None

    async def get(self) -> T:
        return self._taken(await self._receive.receive())

    def close_producer(self) -> None:
        """No more puts: a `get` on the empty queue then ends (EndOfStream)."""
        self._send.close()

    def drain(self) -> list[T]:
        """After the producer and the trainer stopped: every batch not taken, in order; the queue closes."""
        left: list[T] = []
        while True:
            try:
                left.append(self._taken(self._receive.receive_nowait()))
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
        if self._unsent is not None:  # its send was cancelled before anyone took it
            left.append(self._unsent)
            self._unsent = None
        self._receive.close()  # an unclosed stream warns when it is collected (at exit: a traceback)
        return left

    def _taken(self, batch: T) -> T:
        if batch is self._unsent:  # taken straight from a waiting put: it is delivered
            self._unsent = None
        return batch
