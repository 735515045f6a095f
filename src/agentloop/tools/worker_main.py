"""The tool worker process: the child side of `tools.worker_pool`.

Started by the pool as `python -c ...` in a session of its own (so its process group holds every
process a tool forks) with one end of a socket pair. It builds its tools from the specs the parent
sends (a tool config entry, imported by its module path, or a pickled tool object: the parent is
trusted, so parent-to-child messages are pickles), then answers one request at a time:

- `("call", name, arguments, context_fields, bound)`: run the tool on this process's main thread and
  reply with its bounded text, or with the error it raised;
- `("open" | "close", trajectory_id, context_fields)`: run the tool's state hooks for a trajectory
  pinned to this worker (its `ToolContext`, state included, lives here between calls).

Replies go the other way as JSON only (`send_bytes`): the tool is not trusted, and it runs in this
process, so it could write anything to the socket — the parent must never unpickle what comes back.

After every request the worker looks for what the tool left behind (a thread still running, a child
process in its group or below it) and says so: the parent then kills the whole group and starts
another worker. A tool that exits the process, holds the GIL or never returns is ended by the parent
(EOF on the socket, or the call's timeout).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["main", "leftovers"]


def _children_of(pid: int) -> list[int]:
    """Live processes whose parent is `pid` or whose process group is `pid` (Linux /proc)."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit() or int(entry) == pid:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode("ascii", "replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp ...
        if len(fields) < 3 or fields[0] in ("Z", "X"):
            continue
        if int(fields[1]) == pid or int(fields[2]) == pid:
            found.append(int(entry))
    return found


def leftovers(before: set[int] | None = None) -> str | None:
    """What a finished request left running in this process, in words, or None: a non-daemon thread
    started during it (`before`: the threads alive when it began; the one thing that keeps a process
    from exiting, and the issue's spinning-thread attack — idle `ThreadPoolExecutor` workers and daemon
    threads, which libraries use for background work, are left alone), or a child process."""
    while True:  # reap children that already ended (zombies are not leftovers)
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
    threads = [t.name for t in threading.enumerate()
               if t is not threading.main_thread() and t.is_alive() and not t.daemon
               and (before is None or t.ident not in before) and not t.name.startswith("ThreadPoolExecutor")]
    if threads:
        return f"left {len(threads)} thread(s) running after its call ({', '.join(threads[:3])})"
    children = _children_of(os.getpid())
    if children:
        return f"left {len(children)} child process(es) running after its call (pid {', '.join(map(str, children[:3]))})"
    return None


def _describe(e: BaseException) -> str:
    msg = str(e).strip()
    return f"{type(e).__name__}: {msg.splitlines()[0]}" if msg else type(e).__name__


class _Worker:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.tools: dict[str, Any] = {}
        self.hooks: dict[str, tuple[Any, Any]] = {}
        self.contexts: dict[str, Any] = {}  # trajectory id -> ToolContext (pinned trajectories)

    def reply(self, **fields: Any) -> None:
        self.conn.send_bytes(json.dumps(fields, default=str).encode())

    def build(self, specs: list[tuple[str, str, Any]]) -> None:
        from .base import state_hooks
        from .tool_config import build_entry

        for name, kind, spec in specs:
            tool = build_entry(spec, f"tool {name!r}")[0] if kind == "entry" else spec
            self.tools[name] = tool
            self.hooks[name] = state_hooks(tool, name)

    def context(self, fields: dict[str, Any]) -> Any:
        from .base import ToolContext

        pinned = self.contexts.get(fields["trajectory_id"])
        return pinned if pinned is not None else ToolContext(**fields)

    def call(self, name: str, arguments: dict[str, Any], fields: dict[str, Any], bound: tuple[Any, ...]) -> dict[str, Any]:
        from .base import ToolError
        from .tool_output import OutputBound, collect

        tool = self.tools[name]
        sink = OutputBound(*bound).sink()
        context = self.context(fields)

        async def work() -> None:
            out = tool.execute(arguments, context)
            if inspect.isawaitable(out):
                out = await out
            await collect(out, sink, name)

        try:
            asyncio.run(work())
        except ToolError as e:
            return {"ok": False, "kind": e.kind, "message": f"Error: {e}"}
        except BaseException as e:  # noqa: BLE001 - SystemExit & co. are this call's error, never the worker's end
            return {"ok": False, "kind": "exception", "message": f"Error: {_describe(e)}",
                    "traceback": "".join(traceback.format_exception(e))[-4000:]}
        return {"ok": True, "text": sink.text(), "truncated": sink.truncated}

    def state(self, op: str, trajectory_id: str, fields: dict[str, Any]) -> dict[str, Any]:
        from .base import ToolContext

        if op == "open":
            context = self.contexts[trajectory_id] = ToolContext(**fields)
        else:
            context = self.contexts.pop(trajectory_id, None) or ToolContext(**fields)
        index = 0 if op == "open" else 1
        for name, hooks in self.hooks.items():
            hook = hooks[index]
            if hook is None:
                continue
            try:
                asyncio.run(hook(context))
            except BaseException as e:  # noqa: BLE001
                return {"ok": False, "kind": "exception", "tool": name,
                        "message": f"{'create' if op == 'open' else 'release'}_state failed: {_describe(e)}"}
        return {"ok": True}

    def serve(self) -> None:
        while True:
            try:
                request = self.conn.recv()
            except (EOFError, OSError):
                return
            t0 = time.monotonic()
            before = {t.ident for t in threading.enumerate() if t.ident is not None}
            if request[0] == "call":
                answer = self.call(*request[1:])
            elif request[0] in ("open", "close"):
                answer = self.state(*request)
            else:
                answer = {"ok": False, "kind": "exception", "message": f"Error: unknown request {request[0]!r}"}
            answer["seconds"] = time.monotonic() - t0
            answer["leftover"] = leftovers(before)
            self.reply(**answer)
            if answer["leftover"]:
                return  # the parent kills the group; nothing more runs here


def _die_with_parent(parent: int, pdeathsig: bool) -> None:
    """Exit when the parent process goes away (it could not kill this worker then)."""
    if not pdeathsig:
        return
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the pipe's EOF still ends an idle worker
        pass
    if os.getppid() != parent:  # it went away before the prctl
        os._exit(0)


def main(fd: int, parent: int, pdeathsig: bool = True) -> None:
    """Entry point (see the module docstring); `fd` is this side of the socket pair."""
    _die_with_parent(parent, pdeathsig)
    from ..allocator import tune_allocator

    tune_allocator()  # a tool's big outputs go back to the system once sent (`agentloop.allocator`)
    # A tool's prints must not mix into the runtime's stdout (it may be a JSON stream): they go to stderr.
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    conn = Connection(fd)
    worker = _Worker(conn)
    try:
        hello = conn.recv()
        sys.path[:] = hello["sys_path"]
        worker.build(hello["specs"])
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which names the tool
        worker.reply(ready=False, message=_describe(e))
        return
    worker.reply(ready=True)
    worker.serve()
    os._exit(0)  # never wait for threads a tool left
