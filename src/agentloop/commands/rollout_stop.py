"""How an `agentloop rollout` run is stopped, and why it failed.

Owns the Ctrl-C / SIGTERM ladder (1st signal: graceful stop through the scheduler, partial
trajectories kept; 2nd: stop the engine processes this run started; 3rd: exit at once) and the
classification of an exception as an engine-side failure (exit 1 with a message naming the
server) versus a bug (re-raised with its traceback).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from typing import Any, Protocol

import anyio
from anyio.abc import TaskGroup

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

from ..engine.base import EngineError, EngineUnavailable
from ..engine.lifecycle import LifecycleError

#: Seconds a first Ctrl-C waits for the running trajectories to return their partial results.
INTERRUPT_GRACE = 30.0


class _Progress(Protocol):
    def message(self, text: str) -> None: ...


class StoppableRun(Protocol):
    """What stopping needs of a run (the command's `CommandRun` state, `rollout_state`)."""

    interrupted: bool
    in_step: bool
    runtime: Any
    progress: _Progress


def exception_leaves(e: BaseException) -> list[BaseException]:
    """The exceptions inside `e`, exception groups flattened at any depth (`[e]` when it is not a group)."""
    if isinstance(e, BaseExceptionGroup):
        return [leaf for sub in e.exceptions for leaf in exception_leaves(sub)]
    return [e]


def engine_failure_message(e: BaseException) -> str | None:
    """A message for an engine-side failure (unreachable server, failed stage, engine that would not
    start), naming the server; None for anything else (a bug: let it raise with its traceback)."""
    from ..runtime.core import AgentloopError

    messages = []
    for leaf in exception_leaves(e):
        if isinstance(leaf, LifecycleError) and isinstance(leaf.__cause__, EngineUnavailable):
            messages.append(f"cannot reach the engine server at {leaf.url}: {leaf.__cause__.message} "
                            f"(during lifecycle stage '{leaf.stage}')")
        elif isinstance(leaf, EngineUnavailable):
            messages.append(f"cannot reach the engine server at {leaf.url}: {leaf.message}")
        elif isinstance(leaf, (EngineError, LifecycleError, AgentloopError, OSError, TimeoutError)):
            messages.append(str(leaf) or type(leaf).__name__)
        else:
            return None
    return "; ".join(dict.fromkeys(messages)) or None


async def _graceful_stop(run: StoppableRun, work: anyio.CancelScope) -> None:
    """First interrupt: stop the step's trajectories through the scheduler (their in-flight requests
    are aborted on the servers, the partial trajectories come back and are written as `aborted`),
    and let the step end its own way (sleep). Outside a step, or past the grace time, cancel."""
    deadline = time.monotonic() + INTERRUPT_GRACE
    while run.in_step and time.monotonic() < deadline:
        scheduler = getattr(run.runtime, "scheduler", None)
        if scheduler is not None:
            # Repeated: a signal during the wake-up lands before the step's scheduler run starts.
            scheduler.stop("interrupted")
        await anyio.sleep(0.2)
    work.cancel()


async def _force_stop(run: StoppableRun) -> None:
    """Second interrupt: stop the engine processes this run started, now. The graceful sleep that
    may be waiting on them then fails fast, and nothing is left running behind us."""
    for p in list(getattr(run.runtime, "processes", None) or []):
        with contextlib.suppress(Exception):
            await p.stop()


async def watch_signals(run: StoppableRun, tg: TaskGroup, work: anyio.CancelScope) -> None:
    """Receives SIGINT/SIGTERM for the whole run, cleanup included: 1st signal = graceful stop
    (cancelling `work` at the end); 2nd = stop the engines we started without waiting; 3rd = exit
    at once (KeyboardInterrupt). Runs in `tg` until that group is cancelled."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        count = 0
        async for signum in signals:
            count += 1
            name = signal.Signals(signum).name
            if count == 1:
                run.interrupted = True
                run.progress.message(f"{name}: stopping (aborting in-flight requests, putting the engines to "
                                     "sleep, writing finished and partial trajectories); again to hurry ...")
                tg.start_soon(_graceful_stop, run, work)
            elif count == 2:
                run.progress.message(f"{name}: stopping the engines this run started now; again to exit at once")
                tg.start_soon(_force_stop, run)
            else:
                raise KeyboardInterrupt
