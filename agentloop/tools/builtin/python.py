"""The `python` tool: runs model-written code in a separate, limited interpreter and returns its output.

Each call gets a fresh scratch directory (cwd, HOME and TMPDIR of the child; deleted afterwards) and a
child `python -I -S -B` started without blocking the event loop (anyio subprocess). What is enforced:
- CPU time (RLIMIT_CPU: SIGXCPU, then SIGKILL one second later), memory (RLIMIT_AS), file size
  (RLIMIT_FSIZE), open files, no core dumps; processes (RLIMIT_NPROC) where the kernel applies it
  (not to root, which has CAP_SYS_RESOURCE) — fork/exec/spawn are refused by the audit hook regardless;
- no network: a new network namespace (`unshare -n`, with a user namespace `-r` when not root) when
  `unshare` works on this host, and in every case an audit hook that refuses every socket operation
  and the import of socket/ssl;
- no writes outside the scratch directory: the audit hook refuses opening for writing and path-changing
  os calls outside it (see `_sandbox_boot.py` for the full list); when the worker runs as root and an
  unprivileged uid can run the interpreter, the child also drops to that uid (`nobody`);
- no reads outside the scratch directory and the interpreter's import path (`restrict_reads`), so
  secrets of the worker (environment, /proc, home directory) never reach the model;
- a wall-clock timeout after which the child's whole process group is killed (also on cancellation);
- the scratch directory is a tmpfs of `max_scratch_mb` in a private mount namespace where the host allows
  it (`unshare -m`), so many files cannot fill the disk; otherwise only RLIMIT_FSIZE bounds each file;
- at most `max_concurrent` interpreters of one tool run at once in a worker (further calls queue, and the
  queueing counts against the registry's per-call timeout);
- stdout and stderr are captured up to a byte cap each (the rest is drained and counted, so a chatty
  child cannot block on a full pipe), decoded leniently, and returned with the exit status.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
from anyio.lowlevel import RunVar

from ..base import Tool, ToolContext, ToolError

__all__ = ["PythonTool", "SandboxOutput", "sandbox_capabilities"]

_BOOT = Path(__file__).with_name("_sandbox_boot.py")
# Modules that reach the network, create processes, write files from C (bypassing the "open" audit
# event), touch interpreter memory, or could find the audit hook; `posix`/`_signal` may not be
# re-imported because the bootstrap strips unaudited process functions from them.
BLOCKED_IMPORTS = ("socket", "_socket", "ssl", "_ssl", "ctypes", "_ctypes", "_posixsubprocess", "gc",
                   "_xxsubinterpreters", "_testcapi", "_testinternalcapi", "faulthandler", "_sqlite3", "sqlite3",
                   "_dbm", "_gdbm", "dbm", "_multiprocessing", "_posixshmem", "posix", "_signal", "readline",
                   "_tkinter", "_curses", "_ctypes_test", "_testbuffer", "_testmultiphase", "_testimportmultiple")
NOBODY = 65534


@dataclass
class SandboxOutput:
    stdout: str
    stderr: str
    returncode: int | None
    seconds: float
    timed_out: bool
    stdout_dropped: int = 0
    stderr_dropped: int = 0


@dataclass(frozen=True)
class _Caps:
    unshare_prefix: tuple[str, ...]  # command prefix for a new network namespace, () if unavailable
    drop_uid: int | None  # uid to drop to (root only), None to stay
    tmpfs: bool = False  # the prefix can also take "-m" and mount a size-limited tmpfs on the scratch dir


# Run inside the new mount namespace: a tmpfs of $2 bytes over the scratch dir $1 (owned by uid $3 if
# given), then exec the interpreter. The mount dies with the namespace, so nothing outlives the call.
_MOUNT_SCRIPT = 'mount -t tmpfs -o "size=$2,mode=0700${3:+,uid=$3,gid=$3}" tmpfs "$1" && shift 3 && exec "$@"'


# Probed once per process. No lock: concurrent first probes are idempotent, and an anyio lock kept in
# a module global would outlive the event loop it was first used on.
_caps_cache: dict[tuple[str, bool], _Caps] = {}


async def _works(cmd: list[str], **kw: Any) -> bool:
    try:
        with anyio.fail_after(10):
            r = await anyio.run_process(cmd, check=False, stdin=None, **kw)
        return r.returncode == 0
    except (OSError, TimeoutError):
        return False


async def sandbox_capabilities(python: str = sys.executable, use_namespaces: bool = True) -> _Caps:
    """Probe once per process what this host allows: `unshare` for a network namespace, and (as root)
    whether `nobody` can run the interpreter."""
    key = (python, use_namespaces)
    if key in _caps_cache:
        return _caps_cache[key]
    root = hasattr(os, "geteuid") and os.geteuid() == 0
    drop = None
    if root and await _works([python, "-I", "-S", "-B", "-c", "import json, resource, os"], user=NOBODY, group=NOBODY,
                             extra_groups=[], cwd="/"):
        drop = NOBODY
    prefix: tuple[str, ...] = ()
    unshare = shutil.which("unshare")
    if use_namespaces and unshare:
        # As root and dropping privileges: a plain net namespace (the uid drop happens inside).
        # Otherwise a user namespace lets an unprivileged user create one (and sheds root's capabilities).
        candidates = [(unshare, "-n")] if drop is not None else [(unshare, "-r", "-n"), (unshare, "-n")]
        for c in candidates:
            if await _works([*c, python, "-I", "-S", "-c", "pass"]):
                prefix = c
                break
    tmpfs = False
    if prefix:
        probe_dir = await anyio.to_thread.run_sync(tempfile.mkdtemp)
        try:
            tmpfs = await _works([*prefix, "-m", "/bin/sh", "-c", _MOUNT_SCRIPT, "sh", probe_dir, "1m",
                                  str(drop) if drop is not None else "", "true"])
        finally:
            await anyio.to_thread.run_sync(lambda: shutil.rmtree(probe_dir, ignore_errors=True))
    caps = _Caps(prefix, drop, tmpfs)
    _caps_cache[key] = caps
    return caps


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


class PythonTool(Tool):
    """Run Python code (argument `code`) in a sandboxed subprocess; returns what it printed."""

    name = "python"
    # Its per-loop limiter (max_concurrent) must be shared by all calls, and it never blocks the loop
    # and kills its child on cancellation: it runs on the worker's loop, not a thread of its own.
    runs_on_event_loop = True
    description = (
        "Run a Python 3 program and return what it prints (stdout, then stderr). Only the standard "
        "library is available; no network, no subprocesses; files may be written in the current directory only. "
        "Use print() to show results."
    )
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "The Python source code to run."}},
        "required": ["code"],
    }

    def __init__(
        self,
        *,
        timeout: float = 10.0,
        cpu_seconds: int = 5,
        memory_mb: int = 512,
        max_processes: int | None = 16,
        max_file_mb: int = 16,
        open_files: int = 64,
        max_output_bytes: int = 64 * 1024,
        scratch_root: str | None = None,
        use_namespaces: bool = True,
        python: str | None = None,
        allow_site_packages: bool = False,
        extra_blocked_imports: list[str] | None = None,
        restrict_reads: bool = True,
        readable_paths: list[str] | None = None,
        max_concurrent: int | None = None,
        max_scratch_mb: int | None = 64,
    ) -> None:
        if timeout <= 0 or cpu_seconds <= 0 or memory_mb <= 0:
            raise ValueError("timeout, cpu_seconds and memory_mb must be positive")
        self.timeout = float(timeout)
        self.cpu_seconds = int(cpu_seconds)
        self.memory_mb = int(memory_mb)
        self.max_processes = max_processes
        self.max_file_mb = int(max_file_mb)
        self.open_files = int(open_files)
        self.max_output_bytes = int(max_output_bytes)
        self.scratch_root = scratch_root
        self.use_namespaces = use_namespaces
        self.python = python or sys.executable
        self.allow_site_packages = allow_site_packages
        self.blocked_imports = sorted(set(BLOCKED_IMPORTS) | set(extra_blocked_imports or ()))
        self.restrict_reads = restrict_reads
        # One worker runs thousands of trajectories: cap the interpreters alive at once (per tool, across
        # trajectories). A RunVar holds the limiter so each event loop gets its own.
        self.max_concurrent = int(max_concurrent or max(2, os.cpu_count() or 2))
        if self.max_concurrent < 1:
            raise ValueError("max_concurrent must be >= 1")
        self._limiter: RunVar[anyio.CapacityLimiter] = RunVar(f"python_tool_limiter_{id(self)}")
        self.readable_paths = [str(p) for p in (readable_paths or ())]
        self.max_scratch_mb = max_scratch_mb

    async def execute(self, arguments: dict[str, Any], context: ToolContext) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ToolError("argument 'code' must be a string of Python source")
        out = await self.run_code(code, scratch_parent=context.scratch_dir)
        return self.render(out)

    def render(self, out: SandboxOutput) -> str:
        """The text for the model; raises ToolError when the code was killed (with what it printed)."""
        parts: list[str] = []
        if out.stdout:
            parts.append(out.stdout.rstrip("\n"))
        if out.stdout_dropped:
            parts.append(f"...(stdout truncated: {out.stdout_dropped} more bytes)")
        if out.stderr:
            parts.append(out.stderr.rstrip("\n"))
        if out.stderr_dropped:
            parts.append(f"...(stderr truncated: {out.stderr_dropped} more bytes)")
        text = "\n".join(parts)
        problem = None
        rc = out.returncode
        if out.timed_out:
            problem = f"timed out after {self.timeout:g} seconds (wall clock); the process was killed"
        elif rc is not None and rc < 0:
            sig = -rc
            name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
            if sig == signal.SIGXCPU:
                problem = f"killed: CPU time limit of {self.cpu_seconds} seconds exceeded"
            elif sig == signal.SIGKILL:  # the CPU hard limit (SIGXCPU ignored by the code) or the OOM killer
                problem = f"killed by SIGKILL (CPU time limit of {self.cpu_seconds} seconds or memory exhausted)"
            else:
                problem = f"killed by signal {name}"
        elif rc and not out.stdout and out.stderr.startswith(("unshare:", "mount:", "sh:")):
            # The wrapper failed before Python ran (e.g. the host ran out of namespaces): not the code's fault.
            raise ToolError(f"the sandbox could not start: {out.stderr.strip().splitlines()[0]}")
        elif rc:
            if "MemoryError" in out.stderr:
                text += f"\n(memory limit of {self.memory_mb} MiB exceeded)"
            text += f"\n(exit status {rc})"
        if problem is not None:
            raise ToolError(problem + (":\n" + text if text else ""), kind="timeout" if out.timed_out else "exception")
        return text if text.strip() else "(no output)"

    async def run_code(self, code: str, *, scratch_parent: Path | str | None = None) -> SandboxOutput:
        """Run `code` in a fresh scratch directory and return what happened (never raises for the code's
        own failures; raises OSError if the interpreter cannot be started)."""
        try:
            limiter = self._limiter.get()
        except LookupError:
            limiter = anyio.CapacityLimiter(self.max_concurrent)
            self._limiter.set(limiter)
        async with limiter:
            return await self._run_code(code, scratch_parent)

    async def _run_code(self, code: str, scratch_parent: Path | str | None) -> SandboxOutput:
        caps = await sandbox_capabilities(self.python, self.use_namespaces)
        parent = str(scratch_parent) if scratch_parent is not None else self.scratch_root
        scratch = await anyio.to_thread.run_sync(lambda: tempfile.mkdtemp(prefix="agentloop-py-", dir=parent))
        try:
            if caps.drop_uid is not None:
                os.chown(scratch, caps.drop_uid, caps.drop_uid)
            return await self._run_in(code, scratch, caps)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(lambda: shutil.rmtree(scratch, ignore_errors=True))

    async def _run_in(self, code: str, scratch: str, caps: _Caps) -> SandboxOutput:
        cfg = {
            "scratch": scratch,
            "cpu_seconds": self.cpu_seconds,
            "memory_bytes": self.memory_mb * 1024 * 1024,
            "file_bytes": self.max_file_mb * 1024 * 1024,
            "open_files": self.open_files,
            "max_processes": self.max_processes,
            "uid": caps.drop_uid,
            "gid": caps.drop_uid,
            "blocked_imports": self.blocked_imports,
            "restrict_reads": self.restrict_reads,
            "readable_paths": self.readable_paths,
        }
        # -u: unbuffered, so what was printed before a kill (timeout, CPU limit) still comes back.
        flags = ["-I", "-B", "-u"] + ([] if self.allow_site_packages else ["-S"])
        cmd = [self.python, *flags, str(_BOOT), json.dumps(cfg)]
        if caps.tmpfs and self.max_scratch_mb:
            uid = str(caps.drop_uid) if caps.drop_uid is not None else ""
            cmd = [*caps.unshare_prefix, "-m", "/bin/sh", "-c", _MOUNT_SCRIPT, "sh", scratch, f"{self.max_scratch_mb}m", uid, *cmd]
        else:
            cmd = [*caps.unshare_prefix, *cmd]
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": scratch,
            "TMPDIR": scratch,
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        out_chunks: list[bytes] = []
        err_chunks: list[bytes] = []
        dropped = [0, 0]
        t0 = time.monotonic()
        timed_out = False
        proc = await anyio.open_process(cmd, cwd=scratch, env=env, start_new_session=True)
        try:
            with anyio.move_on_after(self.timeout) as scope:
                async with anyio.create_task_group() as tg:

                    async def feed() -> None:
                        assert proc.stdin is not None
                        try:
                            await proc.stdin.send(code.encode("utf-8", "replace"))  # lone surrogates (valid JSON) become "?"
                        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                            pass  # the child died before reading its code; its stderr says why
                        finally:
                            await proc.stdin.aclose()

                    async def drain(i: int, stream: Any, sink: list[bytes]) -> None:
                        dropped[i] = await _read_capped(stream, self.max_output_bytes, sink)

                    tg.start_soon(feed)
                    tg.start_soon(drain, 0, proc.stdout, out_chunks)
                    tg.start_soon(drain, 1, proc.stderr, err_chunks)
                    await proc.wait()
            timed_out = scope.cancelled_caught
        finally:
            # Whatever happened (done, timed out, cancelled by the caller), nothing of the child survives.
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
