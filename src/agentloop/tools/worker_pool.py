"""Tool worker processes: where tools that are not trusted run, so that a tool can end only its own call.

A `WorkerPool` keeps reusable worker processes (`worker_main`), each running one request at a time.
A call takes an idle worker (or starts one), sends the call and waits for the reply under the call's
timeout, off the event loop. The worker is killed — its whole process group, and any process it forked
that left the group — and never reused when:

- the call outlives its timeout (a tool that sleeps, spins, or holds the GIL: only the worker stalls),
- the worker ends during the call (`os._exit`, a crash: EOF on the socket),
- the call leaves a thread or a child process running (the worker reports it), or
- the reply is malformed or larger than the output bound allows.

Each of these is that call's tool error; the next call gets a fresh worker. Starting a worker is not
charged to the call's timeout (it has its own bound, `start_timeout`). Replies are JSON read with a
size bound (a hostile tool controls the worker, so nothing it sends is unpickled here).

Trajectories of tools with per-trajectory state are pinned to one worker from `open` to `close`
(`Lease`): their `ToolContext` lives in that worker, calls of one trajectory run there one at a time.
If the worker has to be killed, the trajectory's next call gets a fresh worker whose state hooks are
run again (the state starts afresh) and is told so.

Workers are started in their own session, die with the parent (PR_SET_PDEATHSIG and EOF on their
socket), and every worker still alive at interpreter exit is killed, so the runtime always exits.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import anyio

__all__ = ["WorkerPool", "WorkerFailure", "Lease", "kill_tree"]

logger = logging.getLogger(__name__)

#: Seconds a worker may take to start and build its tools.
START_TIMEOUT = 60.0
#: Reply bytes allowed beyond the output bound (JSON quoting of the text can double it; error metadata).
_REPLY_SLACK = 1 << 20

_live: "weakref.WeakSet[_Worker]" = weakref.WeakSet()
_live_lock = threading.Lock()


class WorkerFailure(Exception):
    """A worker could not run the request; the message is for the model (the call's tool error)."""

    def __init__(self, message: str, kind: str = "exception") -> None:
        super().__init__(message)
        self.kind = kind


def _descendants(pid: int) -> set[int]:
    """`pid`'s descendants (any depth, whatever their session) and its process group's members."""
    parents: dict[int, int] = {}
    groups: dict[int, int] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return set()
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode("ascii", "replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) >= 3:
            parents[int(entry)], groups[int(entry)] = int(fields[1]), int(fields[2])
    found = {p for p, g in groups.items() if g == pid}
    frontier = [pid, *found]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in found and child != pid:
                found.add(child)
                frontier.append(child)
    found.discard(pid)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL a worker, its process group and every process below it (found before the kill: once
    the worker is gone its orphans are re-parented and could no longer be told apart)."""
    others = _descendants(pid)
    for target in (pid, *others):
        try:
            os.kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class _Worker:
    """One worker process and our end of its socket."""

    def __init__(self, specs: list[tuple[str, str, Any]]) -> None:
        ours, theirs = socket.socketpair()
        self.conn = Connection(os.dup(ours.fileno()))
        ours.close()
        child_fd = theirs.fileno()
        # PR_SET_PDEATHSIG fires when the forking *thread* ends: only a worker started from the main
        # thread may use it (one started from a tool's call thread relies on EOF and the atexit kill).
        pdeathsig = threading.current_thread() is threading.main_thread()
        boot = ("import sys; sys.path[:0] = %r; from agentloop.tools.worker_main import main; main(%d, %d, %r)"
                % (list(sys.path), child_fd, os.getpid(), pdeathsig))
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", boot], pass_fds=(child_fd,), stdin=subprocess.DEVNULL,
                start_new_session=True, close_fds=True)
        finally:
            theirs.close()
        self.pid = self.proc.pid
        self.dead = False
        self.busy = False  # a thread is using `conn`: it closes it (closing under it could hand its fd to another file)
        self._conn_lock = threading.Lock()
        self.specs = specs
        with _live_lock:
            _live.add(self)

    def hello(self) -> None:
        """Send the tools to build; wait (in a thread) for the worker to say it is ready."""
        try:
            reply = self.request({"sys_path": list(sys.path), "specs": self.specs}, START_TIMEOUT, 1 << 16)
        except WorkerFailure as e:  # not the call's timeout: the worker never got to the call
            raise WorkerFailure(f"the tool worker did not start: {'no answer in %g s' % START_TIMEOUT if e.kind == 'timeout' else e}") from None
        if not reply.get("ready"):
            raise WorkerFailure(f"the tool worker could not build its tools: {reply.get('message')}")

    def receive(self, timeout: float, max_bytes: int) -> dict[str, Any]:
        """One JSON reply (blocking; call it off the event loop). Raises WorkerFailure."""
        if not self.conn.poll(timeout):
            raise WorkerFailure("timeout", "timeout")
        try:
            data = self.conn.recv_bytes(max_bytes)
        except EOFError:
            code = self.proc.poll()
            if code is None:
                with _suppress():
                    code = self.proc.wait(timeout=1.0)
            raise WorkerFailure(f"the tool's worker process ended during the call (exit status {code})") from None
        except OSError as e:
            raise WorkerFailure(f"the tool's worker sent an unreadable reply ({e})") from None
        try:
            reply = json.loads(data)
        except ValueError:
            raise WorkerFailure("the tool's worker sent a malformed reply") from None
        if not isinstance(reply, dict):
            raise WorkerFailure("the tool's worker sent a malformed reply")
        return reply

    def request(self, message: Any, timeout: float, max_bytes: int) -> dict[str, Any]:
        """Send one request and wait for its reply (blocking, off the event loop)."""
        with self._conn_lock:
            if self.dead:
                raise WorkerFailure("the tool's worker process is gone")
            self.busy = True
        try:
            try:
                self.conn.send(message)
            except OSError:
                raise WorkerFailure("the tool's worker process is gone") from None
            return self.receive(timeout, max_bytes)
        finally:
            with self._conn_lock:
                self.busy = False
                if self.dead:
                    self._close_conn()

    def _close_conn(self) -> None:
        with _suppress():
            self.conn.close()

    def kill(self) -> None:
        """SIGKILL the worker's tree (its socket then reads EOF, which ends any thread waiting on it)."""
        with self._conn_lock:
            if self.dead:
                return
            self.dead = True
            if not self.busy:
                self._close_conn()
        kill_tree(self.pid)
        with _suppress():
            self.proc.wait(timeout=1.0)
        with _live_lock:
            _live.discard(self)

    def alive(self) -> bool:
        return not self.dead and self.proc.poll() is None


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        return exc[0] is not None and issubclass(exc[0], Exception)


@atexit.register
def _kill_all() -> None:
    """At interpreter exit no worker (nor anything a tool forked) may keep the process waiting."""
    with _live_lock:
        workers = list(_live)
    for w in workers:
        w.kill()


@dataclass
class Lease:
    """A trajectory pinned to a worker (tools with per-trajectory state): calls run there one at a time."""

    trajectory_id: str
    fields: dict[str, Any]
    worker: _Worker | None = None
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    restarted: bool = False


class WorkerPool:
    """Reusable worker processes for one registry's process-isolated tools (see the module docstring).

    `specs`: (registered name, "entry" | "object", a tool config entry or a tool object) per tool.
    `max_idle`: idle workers kept for reuse (more are stopped when they come back)."""

    def __init__(self, specs: list[tuple[str, str, Any]], *, max_idle: int = 8) -> None:
        self.specs = specs
        self.max_idle = max_idle
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self.started = 0
        self.killed = 0
        self.started_pids: list[int] = []

    def __getstate__(self) -> dict[str, Any]:  # a pickled registry gets a fresh pool, no processes
        return {"specs": self.specs, "max_idle": self.max_idle}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["specs"], max_idle=state["max_idle"])

    # ---- workers --------------------------------------------------------------------------------
    def _threads(self) -> anyio.CapacityLimiter:
        # A limiter of its own per request: a thread waits on each running call, and the default limiter
        # (40) is shared with the rest of the runtime, which must not queue behind slow tools. (Not kept:
        # a limiter belongs to the event loop it was made in, and a registry may serve several.)
        return anyio.CapacityLimiter(1)

    async def _acquire(self) -> _Worker:
        with self._lock:
            while self._idle:
                w = self._idle.pop()
                if w.alive():
                    return w
                w.kill()
        w = _Worker(self.specs)
        self.started += 1
        self.started_pids.append(w.pid)
        try:
            await anyio.to_thread.run_sync(w.hello, limiter=self._threads(), abandon_on_cancel=True)
        except BaseException:
            self._retire(w)
            raise
        return w

    def _release(self, w: _Worker) -> None:
        with self._lock:
            if w.alive() and len(self._idle) < self.max_idle:
                self._idle.append(w)
                return
        self._retire(w)

    def _retire(self, w: _Worker) -> None:
        if not w.dead:
            self.killed += 1
        w.kill()

    def close(self) -> None:
        """Stop every idle worker (busy ones are killed by their callers or at exit)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for w in idle:
            w.kill()

    def workers(self) -> int:
        """Idle workers kept (for tests and metrics)."""
        with self._lock:
            return len(self._idle)

    # ---- requests -------------------------------------------------------------------------------
    async def _request(self, w: _Worker, message: tuple[Any, ...], timeout: float, max_bytes: int) -> dict[str, Any]:
        """Send a request and wait for its reply; on any failure the worker is killed (in the finally,
        so even the runtime's cancellation of this wait leaves no worker running a call)."""
        ok = False
        try:
            with anyio.fail_after(timeout + 5.0):  # the thread's own poll() bound is `timeout`
                reply = await anyio.to_thread.run_sync(
                    w.request, message, timeout, max_bytes, limiter=self._threads(), abandon_on_cancel=True)
            if reply.get("leftover"):
                raise WorkerFailure(f"{reply['leftover']}; its worker process was replaced")
            ok = True
            return reply
        except TimeoutError:
            raise WorkerFailure("timeout", "timeout") from None
        finally:
            if not ok:
                self._retire(w)

    async def call(self, name: str, arguments: dict[str, Any], fields: dict[str, Any], bound: tuple[Any, ...],
                   *, timeout: float, lease: Lease | None = None) -> dict[str, Any]:
        """Run one call in a worker: the reply dict (`ok`, `text`/`message`, `kind`, `truncated`).
        Raises WorkerFailure when the worker failed the call (timeout, exit, leftovers)."""
        max_bytes = (bound[0] or 0) * 6 + _REPLY_SLACK if bound[0] is not None else 1 << 30
        message = ("call", name, arguments, fields, bound)
        if lease is None:
            w = await self._acquire()
            reply = await self._request(w, message, timeout, max_bytes)
            self._release(w)
            return reply
        async with lease.lock:
            note = ""
            if lease.worker is None or not lease.worker.alive():
                note = await self._repin(lease)
            assert lease.worker is not None
            try:
                reply = await self._request(lease.worker, message, timeout, max_bytes)
            except WorkerFailure:
                lease.worker, lease.restarted = None, True  # its state died with the worker
                raise
            reply["note"] = note
            return reply

    async def _repin(self, lease: Lease) -> str:
        lease.worker = await self._acquire()
        await self._state(lease, "open")
        if lease.restarted:
            return "the tool's worker was replaced; its state for this trajectory started afresh"
        return ""

    async def _state(self, lease: Lease, op: str) -> None:
        assert lease.worker is not None
        w = lease.worker
        try:
            reply = await self._request(w, (op, lease.trajectory_id, lease.fields), START_TIMEOUT, 1 << 16)
        except WorkerFailure as e:
            lease.worker = None
            raise RuntimeError(f"tool worker: {op} of trajectory {lease.trajectory_id} failed: {e}") from None
        if not reply.get("ok"):
            if op == "open":
                lease.worker = None
                self._retire(w)
            raise RuntimeError(f"tool {reply.get('tool')!r}: {reply.get('message')} for trajectory {lease.trajectory_id}")

    async def pin(self, trajectory_id: str, fields: dict[str, Any]) -> Lease:
        """Pin a trajectory to a worker and run its tools' `create_state` there."""
        lease = Lease(trajectory_id, fields)
        async with lease.lock:
            await self._repin(lease)
        return lease

    async def unpin(self, lease: Lease) -> None:
        """Run the trajectory's `release_state` in its worker and give the worker back."""
        async with lease.lock:
            w = lease.worker
            if w is None or not w.alive():
                return
            try:
                await self._state(lease, "close")
            finally:
                lease.worker = None
                if not w.dead:
                    self._release(w)
