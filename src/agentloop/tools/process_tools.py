"""One job: a tool registry's process tools — their worker processes (`worker_pool.WorkerPool`, started
on the first call and rebuilt when the tools change), the worker each trajectory with per-trajectory
state is pinned to (its `Lease`, from `pin` to `unpin`), and one call run in a worker, its reply turned
into a `ToolResult` (a worker that times out, crashes or answers nonsense becomes an error result
written for the model). A pickled copy (a Ray worker's) has the tools and no processes."""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping, Protocol

import anyio

from .base import ToolContext, ToolResult, describe, first_line
from .parsers import ToolCall
from .tool_output import OutputBound
from .worker_pool import Lease, WorkerFailure, WorkerPool

logger = logging.getLogger("agentloop.tools.registry")  # the registry's log, where its calls' failures are said

__all__ = ["ProcessTools"]

#: Longest a trajectory's release of its pinned worker may take (a release hook that hangs costs its
#: worker, not the step).
UNPIN_TIMEOUT = 60.0


class _HasSpec(Protocol):
    spec: tuple[str, Any] | None


class ProcessTools:
    """See the module docstring. `tools` is the registry's own name → registration mapping (read, never
    written): the tools with a `spec` are the ones a worker builds."""

    def __init__(self, tools: Mapping[str, _HasSpec]) -> None:
        self._tools = tools
        self._pool: WorkerPool | None = None
        self._leases: dict[int, Lease] = {}  # id(ToolContext) -> its trajectory's pinned worker

    def __getstate__(self) -> dict[str, Any]:
        return {"_tools": self._tools, "_pool": None, "_leases": {}}

    @property
    def started(self) -> bool:
        """Whether worker processes were started (since the last `reset`)."""
        return self._pool is not None

    def pool(self) -> WorkerPool:
        if self._pool is None:
            self._pool = WorkerPool([(name, *r.spec) for name, r in self._tools.items() if r.spec is not None])
        return self._pool

    def close(self) -> None:
        """Stop the idle workers (busy ones are killed when their call ends)."""
        if self._pool is not None:
            self._pool.close()

    def reset(self) -> None:
        """The tools changed: close the workers, and build new ones with the next call."""
        self.close()
        self._pool = None

    async def pin(self, context: ToolContext) -> None:
        """Pin `context`'s trajectory to one worker (its tools' per-trajectory state lives there)."""
        self._leases[id(context)] = await self.pool().pin(context.trajectory_id, fields(context))

    async def unpin(self, context: ToolContext) -> str | None:
        """Release `context`'s pinned worker, if any (bounded by UNPIN_TIMEOUT); the failure's text, or None."""
        lease = self._leases.pop(id(context), None)
        if lease is None or self._pool is None:
            return None
        try:
            with anyio.fail_after(UNPIN_TIMEOUT):
                await self._pool.unpin(lease)
        except BaseException as e:  # noqa: BLE001 - the caller shields this
            return first_line(e) if not isinstance(e, TimeoutError) else "release_state timed out"
        return None

    async def call(self, index: int, call: ToolCall, context: ToolContext, timeout: float, bound: OutputBound,
                   t0: float) -> ToolResult:
        """Run `call` in a worker (the trajectory's pinned one, if any); its result, never an exception."""
        name = call.name
        try:
            reply = await self.pool().call(name, dict(call.arguments or {}), fields(context),  # type: ignore[arg-type]
                                           (bound.max_bytes, bound.side, bound.marker), timeout=timeout,
                                           lease=self._leases.get(id(context)))
        except WorkerFailure as e:
            seconds = time.monotonic() - t0
            if e.kind == "timeout":
                text = f"Error: tool {name!r} timed out after {timeout:g} seconds (its worker process was replaced)"
            else:
                text = f"Error: tool {name!r}: {e}"
            logger.warning("tool %r in trajectory %s: %s", name, context.trajectory_id, text)
            return ToolResult(index, name, text, ok=False, error_kind=e.kind, seconds=seconds, call_id=call.id)  # type: ignore[arg-type]
        except Exception as e:  # e.g. arguments or context that cannot be sent to the worker
            return ToolResult(index, name, f"Error: tool {name!r} could not be run in its worker: {describe(e)}",
                              ok=False, error_kind="exception", seconds=time.monotonic() - t0, call_id=call.id)
        seconds = time.monotonic() - t0
        note = f"\n({reply['note']})" if reply.get("note") else ""
        if reply.get("traceback"):
            logger.warning("tool %r raised in trajectory %s (in its worker):\n%s", name, context.trajectory_id,
                           reply["traceback"])
        if not reply.get("ok"):
            kind = reply.get("kind") if reply.get("kind") in ("timeout", "exception") else "exception"
            return ToolResult(index, name, f"{reply.get('message')}{note}", ok=False, error_kind=kind, seconds=seconds,
                              call_id=call.id)
        text = reply.get("text")
        if not isinstance(text, str):
            return ToolResult(index, name, f"Error: tool {name!r}: its worker sent no text", ok=False,
                              error_kind="exception", seconds=seconds, call_id=call.id)
        return ToolResult(index, name, text + note, seconds=seconds, call_id=call.id, truncated=bool(reply.get("truncated")))


def fields(context: ToolContext) -> dict[str, Any]:
    """What a worker needs to make the trajectory's `ToolContext` (its `state` stays where the tool runs)."""
    return {"trajectory_id": context.trajectory_id, "scratch_dir": context.scratch_dir, "extra": dict(context.extra)}
