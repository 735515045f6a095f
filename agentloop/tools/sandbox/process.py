"""Run one sandbox process to completion: feed it the code on stdin, drain stdout/stderr up to a byte cap
each (the rest is read and counted, so a chatty child never blocks on a full pipe), stop it at a wall-clock
timeout, and kill its whole process group whatever happens (done, timed out, cancelled by the caller).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import anyio
import anyio.abc

__all__ = ["SandboxOutput", "run_sandboxed"]


@dataclass
class SandboxOutput:
    """What one run produced. `returncode` < 0: killed by that signal; None: never reaped (not expected)."""

    stdout: str
    stderr: str
    returncode: int | None
    seconds: float
    timed_out: bool
    stdout_dropped: int = 0
    stderr_dropped: int = 0


async def _read_capped(stream: anyio.abc.ByteReceiveStream | None, cap: int, sink: list[bytes]) -> int:
    """Read all of `stream`, keep the first `cap` bytes in `sink`, return how many bytes were dropped."""
    if stream is None:
        return 0
    kept = dropped = 0
    async for chunk in stream:
        room = cap - kept
        if room > 0:
            sink.append(chunk[:room])
            kept += min(room, len(chunk))
        dropped += max(0, len(chunk) - max(room, 0))
    return dropped


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def run_sandboxed(
    cmd: Sequence[str], *, stdin: bytes, env: Mapping[str, str], cwd: str, timeout: float, max_output_bytes: int,
) -> SandboxOutput:
    """Start `cmd` in a new session, send `stdin`, wait at most `timeout` seconds. Raises OSError when the
    command cannot be started at all."""
    out_chunks: list[bytes] = []
    err_chunks: list[bytes] = []
    dropped = [0, 0]
    t0 = time.monotonic()
    timed_out = False
    proc = await anyio.open_process(list(cmd), cwd=cwd, env=dict(env), start_new_session=True)
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

                async def drain(i: int, stream: Any, sink: list[bytes]) -> None:
                    dropped[i] = await _read_capped(stream, max_output_bytes, sink)

                tg.start_soon(feed)
                tg.start_soon(drain, 0, proc.stdout, out_chunks)
                tg.start_soon(drain, 1, proc.stderr, err_chunks)
                await proc.wait()
        timed_out = scope.cancelled_caught
    finally:
        with anyio.CancelScope(shield=True):
            _kill_group(proc.pid)
            await proc.wait()
            await proc.aclose()
    return SandboxOutput(
        stdout=b"".join(out_chunks).decode("utf-8", "replace"),
        stderr=b"".join(err_chunks).decode("utf-8", "replace"),
        returncode=proc.returncode,
        seconds=time.monotonic() - t0,
        timed_out=timed_out,
        stdout_dropped=dropped[0],
        stderr_dropped=dropped[1],
    )
