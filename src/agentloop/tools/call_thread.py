"""Where one tool call runs, so that the step can always abandon it.

`run_in_thread` runs the call on its own event loop in a daemon thread: a tool that blocks (a
synchronous `time.sleep`, a busy loop, a sync `execute`), shields itself from cancellation or raises
`SystemExit`/`KeyboardInterrupt`/`CancelledError` cannot stall the worker's event loop or end the
step. Past its timeout the call's task is cancelled in its own loop (a cooperative tool stops there)
and the thread is left to finish on its own (a daemon thread never holds the process at exit).
`run_on_loop` awaits the call on the worker's loop, for tools that declare `runs_on_event_loop`
(they promise not to block and to honour cancellation, e.g. because they share loop-bound state).

Both return an `Outcome` instead of raising: whatever the call raised (any `BaseException`) is data
for the caller to turn into a tool error. Only the runtime's own cancellation of the waiting task
propagates.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import sys
import threading
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import anyio

__all__ = ["Outcome", "run_in_thread", "run_on_loop", "abandoned_calls"]

Work = Callable[[], Awaitable[Any]]

_abandoned_lock = threading.Lock()
_abandoned: set[threading.Thread] = set()


def abandoned_calls() -> int:
    """Tool calls given up on (timed out or cancelled) whose thread is still running."""
    with _abandoned_lock:
        for t in [t for t in _abandoned if not t.is_alive()]:
            _abandoned.discard(t)
        return len(_abandoned)


@dataclass
class Outcome:
    """How a call ended: returned (`error` None, not `timed_out`), raised `error`, or timed out."""

    error: BaseException | None = None
    timed_out: bool = False


class _ThreadCall:
    """One call on a fresh event loop in a daemon thread; `done` is set on the caller's loop when it ends."""

    def __init__(self, work: Work, name: str) -> None:
        self.work = work
        self.done = anyio.Event()
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._abandoned = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[Any] | None = None
        # The caller's loop, told when the call ends. asyncio-specific on purpose: a thread must never
        # block on a caller that may be gone (anyio's from_thread would wait for a loop that stopped).
        self._caller = asyncio.get_running_loop()
        context = contextvars.copy_context()
        self.thread = threading.Thread(target=context.run, args=(self._main,), name=f"agentloop tool {name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as e:  # noqa: BLE001 - everything the tool raised is the caller's data
            self.error = e
        finally:
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody waits any more
                self._caller.call_soon_threadsafe(self.done.set)

    async def _run(self) -> Any:
        with self._lock:
            self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
            if self._abandoned:
                self._task.cancel()  # type: ignore[union-attr]
        return await self.work()

    @property
    def abandoned(self) -> bool:
        return self._abandoned

    def abandon(self) -> None:
        """Stop waiting: cancel the call's task in its loop (if it cooperates, the thread ends soon)."""
        with self._lock:
            self._abandoned = True
            loop, task = self._loop, self._task
        if loop is not None and task is not None:
            with contextlib.suppress(RuntimeError):  # its loop already closed: the call has ended
                loop.call_soon_threadsafe(task.cancel)
        with _abandoned_lock:
            _abandoned.add(self.thread)


#: Seconds a timed-out call gets, once cancelled in its own loop, to finish its cleanup before it is
#: left behind (a cooperative tool's `finally` then has run when the result is returned).
CANCEL_GRACE = 1.0


async def run_in_thread(work: Work, *, timeout: float, name: str = "",
                        on_abandon: Callable[[], None] | None = None) -> Outcome:
    """Run `await work()` on its own event loop in a daemon thread, waiting at most `timeout` seconds
    (plus `CANCEL_GRACE` for a cancelled call to clean up). `on_abandon` is called when the call is
    given up on (e.g. to make its output sink refuse more pieces)."""
    call = _ThreadCall(work, name)
    call.start()
    try:
        with anyio.move_on_after(timeout):
            await call.done.wait()
    finally:
        if not call.done.is_set():  # timed out, or the runtime cancelled this wait
            if on_abandon is not None:
                on_abandon()
            call.abandon()
    if call.done.is_set() and not call.abandoned:
        return Outcome(error=call.error)
    with anyio.move_on_after(CANCEL_GRACE):
        await call.done.wait()
    return Outcome(timed_out=True)


def _runtime_cancelling() -> bool:
    """Whether the current task is being cancelled from outside (not a CancelledError a tool raised)."""
    if sys.version_info < (3, 11):  # pragma: no cover - no way to tell: treat it as ours
        return True
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def run_on_loop(work: Work, *, timeout: float) -> Outcome:
    """Await `work()` on this loop under `timeout` (for tools that run on the worker's event loop)."""
    cancelled = anyio.get_cancelled_exc_class()
    with anyio.move_on_after(timeout) as scope:
        try:
            await work()
        except BaseException as e:  # noqa: BLE001 - turned into a tool error by the caller
            if isinstance(e, cancelled) and (scope.cancel_called or _runtime_cancelling()):
                raise
            if scope.cancel_called:  # the tool turned our timeout into another exception
                return Outcome(timed_out=True)
            return Outcome(error=e)
    return Outcome(timed_out=scope.cancelled_caught)
