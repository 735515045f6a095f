"""Liveness and re-admission: before each wake-up and sleep every server in rotation is probed
(`/model_info`, never a generate, within `liveness_timeout`). One that fails the probe, or whose mark
lost this lifecycle's lease, is taken out of rotation (one log line, every gate told) while the
others go on; only when no server is left does the probe fail, with a `LifecycleError` naming each
server and why. Before each wake-up the servers out of rotation are probed too: one that answers
(restarted, or no longer hung) is re-admitted in the memory state it really is in
(`lifecycle_attach.py`), put to sleep like the others, and woken with the step's weights.
"""

from __future__ import annotations

from typing import Any, Mapping

import anyio

from .lifecycle_attach import AttachMixin
from .lifecycle_server import PROBE_ERRORS, TrackedServer, log, short_error
from .lifecycle_types import LifecycleError

__all__ = ["LivenessMixin"]


class LivenessMixin(AttachMixin):
    """The liveness probe of the servers in rotation, and re-admission of those out of it."""

    async def _probe(self, *, readmit: bool) -> None:
        """Liveness of every server in rotation (and, with `readmit`, re-admission of those out)."""
        targets = [s for s in self._servers.values() if s.out is None or readmit]
        answers: dict[str, Any] = {}

        async def one(s: TrackedServer) -> None:
            try:
                with anyio.fail_after(self.liveness_timeout):
                    answers[s.url] = await s.client.model_info()
            except PROBE_ERRORS as e:
                answers[s.url] = e

        async with anyio.create_task_group() as tg:
            for s in targets:
                tg.start_soon(one, s)
        for s in targets:
            a = answers[s.url]
            if s.out is None and isinstance(a, BaseException):
                await self.take_out(s.url, f"failed the liveness probe ({short_error(a)})")
            elif s.out is None:
                lost = self._lost(s, a)
                if lost is None:
                    try:
                        await self._mark(s)  # renews the lease when it is half gone
                        continue
                    except PROBE_ERRORS as e:
                        lost = f"cannot renew this runtime's lease in its mark ({short_error(e)})"
                await self.take_out(s.url, lost)
                if readmit:  # held by nobody now (restarted, or let go): ours again, in its real state
                    await self._readmit(s, a)
            elif not isinstance(a, BaseException):
                await self._readmit(s, a)
        if not self._in_rotation():
            raise self._no_server_left("liveness")

    async def _readmit(self, s: TrackedServer, info: Mapping[str, Any]) -> None:
        """A server out of rotation answers again: learn its real state, put it to sleep, admit it."""
        try:
            await self._acquire(s, info, initial=False)
            await self._sleep_one(s)
        except (LifecycleError, *PROBE_ERRORS) as e:
            reason = f"answers again but cannot be re-admitted: {e}"
            if s.out != reason:
                s.out = reason
                log.warning("engine server %s stays out of rotation: %s", s.url, reason)
            return
        await self._admit(s)
