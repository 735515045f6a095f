"""Run one sandbox process to completion: start it in a new session (`start_sandboxed`), feed it the code
on stdin, drain stdout/stderr up to a byte cap each (the rest is read and counted, so a chatty child never
blocks on a full pipe), stop it at a wall-clock timeout, and kill its whole process group whatever happens
(done, timed out, cancelled by the caller) (`communicate`). A process may be started ahead of its call
(`WarmPool`): it is used for exactly one call, so no call ever sees another's state.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Mapping, Sequence

import anyio
import anyio.abc
from anyio.abc import Process

from .cgroup import CallCgroup

__all__ = ["SandboxOutput", "Sandboxed", "WarmPool", "communicate", "kill_process", "run_sandboxed", "start_sandboxed"]

# How long a kill waits for the processes of a sandbox to be gone (they are SIGKILLed: moments).
EXIT_WAIT_SECONDS = 10.0


@dataclass
class SandboxOutput:
    """What one run produced. `returncode` < 0: killed by that signal; None: never reaped (not expected).
    `memory_exceeded`: the kernel killed a process of the call at its memory cgroup's limit;
    `memory_peak`: the cgroup's peak usage in bytes (None without a cgroup)."""

    stdout: str
    stderr: str
    returncode: int | None
    seconds: float
    timed_out: bool
    stdout_dropped: int = 0
    stderr_dropped: int = 0
    memory_exceeded: bool = False
    memory_peak: int | None = None


async def _read_capped(stream: anyio.abc.ByteReceiveStream | None, cap: int, sink: list[bytes], dropped: list[int],
                        i: int) -> None:
    """Read all of `stream`, keep the first `cap` bytes in `sink`, count the rest in `dropped[i]` as it goes
    (so the count is right even when the read is cancelled at the timeout)."""
    if stream is None:
        return
    kept = 0
    async for chunk in stream:
        room = cap - kept
        if room > 0:
            sink.append(chunk[:room])
            kept += min(room, len(chunk))
        dropped[i] += max(0, len(chunk) - max(room, 0))


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class Sandboxed:
    """A started sandbox process (bubblewrap, or the interpreter itself in the unsafe mode), and the
    cgroup all its processes were born in (`cgroup.CallCgroup`, or None)."""

    proc: Process
    cgroup: CallCgroup | None = None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode


async def start_sandboxed(cmd: Sequence[str], *, env: Mapping[str, str], cwd: str,
                          cgroup: CallCgroup | None = None) -> Sandboxed:
    """Start `cmd` in a new session (its process group is what gets killed), inside `cgroup` when given
    (which it then owns: removed when the process is killed). Raises OSError if it cannot start."""
    argv = cgroup.join_argv(list(cmd)) if cgroup is not None else list(cmd)
    try:
        return Sandboxed(await anyio.open_process(argv, cwd=cwd, env=dict(env), start_new_session=True), cgroup)
    except BaseException:
        if cgroup is not None:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(cgroup.remove)
        raise


async def _discard(stream: anyio.abc.ByteReceiveStream | None) -> None:
    if stream is None:
        return
    try:
        async for _ in stream:
            pass
    except (anyio.ClosedResourceError, anyio.BrokenResourceError):
        pass


async def kill_process(box: Sandboxed) -> None:
    """SIGKILL the process group, wait until every process that holds the child's stdout/stderr is gone
    (for a bubblewrap sandbox: its PID 1 and everything in the PID namespace, which the kernel kills when
    PID 1 dies — `--die-with-parent`), then reap the child. Shielded: runs even while being cancelled."""
    with anyio.CancelScope(shield=True):
        _kill_group(box.proc.pid)
        if box.cgroup is not None:  # the sandbox's PID 1 is in another session: kill it by its cgroup too
            await anyio.to_thread.run_sync(box.cgroup.kill)
        with anyio.move_on_after(EXIT_WAIT_SECONDS):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_discard, box.proc.stdout)
                tg.start_soon(_discard, box.proc.stderr)
        await box.proc.wait()
        await box.proc.aclose()
        if box.cgroup is not None:
            await anyio.to_thread.run_sync(box.cgroup.remove)


async def communicate(box: Sandboxed, *, stdin: bytes, timeout: float, max_output_bytes: int) -> SandboxOutput:
    """Send `stdin` (then EOF), collect capped output until the process exits or `timeout` seconds pass,
    then kill it (`kill_process`)."""
    proc = box.proc
    out_chunks: list[bytes] = []
    err_chunks: list[bytes] = []
    dropped = [0, 0]
    t0 = time.monotonic()
    timed_out = False
    oom, peak = 0, None
    cgroup = box.cgroup
    try:
        with anyio.move_on_after(timeout) as scope:
            async with anyio.create_task_group() as tg:

                async def feed() -> None:
                    assert proc.stdin is not None
                    try:
                        await proc.stdin.send(stdin)
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                        pass  # the child died before reading its code; its stderr says why
                    finally:
                        await proc.stdin.aclose()

                tg.start_soon(feed)
                tg.start_soon(_read_capped, proc.stdout, max_output_bytes, out_chunks, dropped, 0)
                tg.start_soon(_read_capped, proc.stderr, max_output_bytes, err_chunks, dropped, 1)
                await proc.wait()
        timed_out = scope.cancelled_caught
    finally:
        if cgroup is not None:  # read before the kill: it is the code's OOM, not ours
            with anyio.CancelScope(shield=True):
                oom, peak = await anyio.to_thread.run_sync(lambda: (cgroup.oom_kills(), cgroup.peak_bytes()))
        await kill_process(box)
    return SandboxOutput(
        stdout=b"".join(out_chunks).decode("utf-8", "replace"),
        stderr=b"".join(err_chunks).decode("utf-8", "replace"),
        returncode=proc.returncode,
        seconds=time.monotonic() - t0,
        timed_out=timed_out,
        stdout_dropped=dropped[0],
        stderr_dropped=dropped[1],
        memory_exceeded=oom > 0,
        memory_peak=peak,
    )


async def run_sandboxed(
    cmd: Sequence[str], *, stdin: bytes, env: Mapping[str, str], cwd: str, timeout: float, max_output_bytes: int,
) -> SandboxOutput:
    """start_sandboxed + communicate."""
    box = await start_sandboxed(cmd, env=env, cwd=cwd)
    return await communicate(box, stdin=stdin, timeout=timeout, max_output_bytes=max_output_bytes)


class WarmPool:
    """Sandboxes started ahead of their call, for one event loop. Each is handed out once (`take`), so
    every call still gets a fresh one; one older than `max_age` seconds is discarded (its boot ends itself
    after an idle timeout, so an unused one never lingers)."""

    def __init__(self, size: int, max_age: float) -> None:
        self.size, self.max_age = size, max_age
        self._ready: list[tuple[float, Sandboxed]] = []

    async def take(self) -> Sandboxed | None:
        while self._ready:
            started, box = self._ready.pop(0)
            if time.monotonic() - started < self.max_age and box.returncode is None:
                return box
            await kill_process(box)
        return None

    async def fill(self, start: Callable[[], Awaitable[Sandboxed]]) -> None:
        """Start sandboxes until `size` are ready (starting only spawns; they boot while the caller works)."""
        while len(self._ready) < self.size:
            self._ready.append((time.monotonic(), await start()))

    async def aclose(self) -> None:
        ready, self._ready = self._ready, []
        for _, box in ready:
            await kill_process(box)
