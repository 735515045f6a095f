"""`ModelUpdateLock`: SGLang's `model_update_lock` for the CPU engine, so no request ever mixes two
weight versions (generates share it; a weight update takes it alone, after the generates in flight).
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import AsyncIterator

__all__ = ["ModelUpdateLock"]


class ModelUpdateLock:
    """SGLang's `model_update_lock` (an asyncio readers-writer lock). Every generate holds a reader
    share for its whole life; a weight update takes the writer side, so it waits until the generates
    in flight have finished, and generates arriving while an update waits queue behind it (writer
    preference, like sglang's `utils/aio_rwlock.RWLock`): no request ever mixes two weight versions.
    As in SGLang's tokenizer manager, an update sent while generation is paused skips the lock (the
    caller paused on purpose) and `abort_all_requests` aborts the generates first."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writer_active = False
        self._waiting_writers = 0

    @property
    def readers(self) -> int:
        return self._readers

    @asynccontextmanager
    async def reader(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer_active and self._waiting_writers == 0)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    @asynccontextmanager
    async def writer(self) -> AsyncIterator[None]:
        async with self._cond:
            self._waiting_writers += 1
            try:
                await self._cond.wait_for(lambda: not self._writer_active and self._readers == 0)
            except BaseException:  # cancelled while waiting: readers queued behind us may go now
                self._waiting_writers -= 1
                self._cond.notify_all()
                raise
            self._waiting_writers -= 1
            self._writer_active = True
        try:
            yield
        finally:
            async with self._cond:
                self._writer_active = False
                self._cond.notify_all()
