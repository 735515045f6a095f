"""The `python` tool: runs model-written code in an isolated interpreter and returns its output.

Model-written code is hostile. Where it runs is chosen with `sandbox` (the tools YAML's `config`):
- `kernel` (default): a fresh child per call isolated by the kernel — new user, mount, PID, network, IPC
  and UTS namespaces; an unprivileged uid that is never host root and has no capabilities; no_new_privs;
  a root that holds only the interpreter, its standard library and their shared objects (read-only) and a
  fresh size-limited tmpfs at /tmp (cwd, HOME, TMPDIR); a seccomp filter (no fork/exec, ptrace, mounts,
  namespaces, bpf, keyrings, modules, io_uring, non-AF_UNIX sockets, ...); rlimits on CPU time, address
  space, processes/threads, file size and open files; a memory + pids cgroup per call where the host
  delegates one (`memory_cgroup`, `cgroup_parent`; without one, seccomp also refuses SysV shm, memfd and
  message queues, and the log says so once); a scratch tmpfs with an inode limit (`max_scratch_files`);
  the interpreter is PID 1 of its PID namespace; an empty environment (HOME/TMPDIR only). The
  whole process tree dies when the call ends, times out or is cancelled. See
  `src/agentloop/tools/sandbox/namespaces.py` for the chain and docs/sandbox.md for the threat model.
  If the host cannot provide this, every call is refused with `SandboxUnavailable` saying what is missing
  and how to enable it — never a silent fallback.
- `sandbox_fusion`: POST the code to a SandboxFusion-compatible service (`sandbox_fusion_url`, the
  `/run_code` endpoint verl's SandboxFusionTool uses); its isolation is the service's.
- `unsafe_subprocess`: a plain child process with rlimits and the in-process audit hook only. The audit
  hook can be switched off by the code itself, so this is NOT a sandbox; it exists for hosts without
  namespaces and trusted code, and is logged as a warning when the tool is built.

In every local mode the child first runs `_sandbox_boot.py` (rlimits, seccomp, the isolation self-check,
then — unless `audit_hook: false`, a switch for tests that prove the kernel layers hold alone — an audit
hook as defence in depth). At most `max_concurrent` interpreters of one tool run at once in a worker.
stdout and stderr come back capped at `max_output_bytes` each, with the exit status.
"""

from __future__ import annotations

import marshal
import logging
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any, Literal

import anyio
from anyio.lowlevel import RunVar

from ..base import Tool, ToolContext, ToolError
from ..sandbox.cgroup import BASE_TASKS, CallCgroup, CgroupHost, find_cgroup_host
from ..sandbox.fusion import run_fusion
from ..sandbox.interpreter import InterpreterFiles, interpreter_files
from ..sandbox.namespaces import (
    BOOT_DIR, SCRATCH, SandboxUnavailable, explain_failure, find_host_tools, sandbox_command,
)
from ..sandbox.policy import compiled_filter
from ..sandbox.process import Sandboxed, SandboxOutput, WarmPool, communicate, kill_process, run_sandboxed, start_sandboxed

__all__ = ["BLOCKED_IMPORTS", "PythonTool", "SandboxOutput", "SandboxUnavailable"]

logger = logging.getLogger(__name__)

_BOOT = Path(__file__).with_name("_sandbox_boot.py")
# Modules that reach the network, create processes, write files from C (bypassing the "open" audit
# event), touch interpreter memory, or could find the audit hook; `posix`/`_signal` may not be
# re-imported because the bootstrap strips unaudited process functions from them.
BLOCKED_IMPORTS = ("socket", "_socket", "ssl", "_ssl", "ctypes", "_ctypes", "_posixsubprocess", "gc",
                   "_xxsubinterpreters", "_testcapi", "_testinternalcapi", "faulthandler", "_sqlite3", "sqlite3",
                   "_dbm", "_gdbm", "dbm", "_multiprocessing", "_posixshmem", "posix", "_signal", "readline",
                   "_tkinter", "_curses", "_ctypes_test", "_testbuffer", "_testmultiphase", "_testimportmultiple",
                   "seccompy")
SandboxKind = Literal["kernel", "sandbox_fusion", "unsafe_subprocess"]
SANDBOXES = ("kernel", "sandbox_fusion", "unsafe_subprocess")
_STAGES = ("bwrap:", "setpriv:", "unshare:", "sandbox-boot:", "sandbox-cgroup:")  # what a failing sandbox stage prints first


def _interpreter(python: str) -> InterpreterFiles:
    try:
        return interpreter_files(python)
    except (OSError, RuntimeError, ValueError) as e:
        raise SandboxUnavailable(f"python tool sandbox: cannot inspect the interpreter {python!r}: {e}") from e


def _kernel_command(python: str, *, readable: list[str], site_packages: bool, scratch_bytes: int,
                    boot_args: list[str], scratch_by_boot: bool = False) -> list[str]:
    """Blocking (first call probes the interpreter and the host tools; cached afterwards)."""
    root = os.geteuid() == 0
    tools = find_host_tools(root)
    interp = _interpreter(python)
    return sandbox_command(tools, interp, root=root, boot=str(_BOOT),
                           scratch_bytes=scratch_bytes, readable=readable, site_packages=site_packages,
                           python_args=["-I", "-S", "-B", "-u", f"{BOOT_DIR}/_sandbox_boot.py", *boot_args],
                           scratch_by_boot=scratch_by_boot)


def _scratch_by_boot(readable: list[str], site_packages: list[str]) -> bool:
    """The boot mounts scratch (with its inode limit) unless host paths must be bound inside it."""
    return not any(os.path.realpath(p) == SCRATCH or os.path.realpath(p).startswith(SCRATCH + "/")
                   for p in [*readable, *site_packages])


class PythonTool(Tool):
    """Run Python code (argument `code`) in a sandboxed subprocess; returns what it printed."""

    name = "python"
    # Its per-loop limiter (max_concurrent) must be shared by all calls, and it never blocks the loop
    # and kills its child on cancellation: it runs on the worker's loop, not a thread of its own.
    runs_on_event_loop = True
    isolation = "inline"  # ours; the code it runs is sandboxed in its own child process
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
        python: str | None = None,
        allow_site_packages: bool = False,
        extra_blocked_imports: list[str] | None = None,
        restrict_reads: bool = True,
        readable_paths: list[str] | None = None,
        max_concurrent: int | None = None,
        max_scratch_mb: int = 64,
        sandbox: SandboxKind = "kernel",
        sandbox_fusion_url: str | None = None,
        audit_hook: bool = True,
        warm_sandboxes: int = 0,
        warm_idle_seconds: int = 30,
        max_scratch_files: int = 16384,
        memory_cgroup: Literal["auto", "require", "off"] = "auto",
        cgroup_parent: str | None = None,
    ) -> None:
        if timeout <= 0 or cpu_seconds <= 0 or memory_mb <= 0 or max_scratch_mb <= 0:
            raise ValueError("timeout, cpu_seconds, memory_mb and max_scratch_mb must be positive")
        if sandbox not in SANDBOXES:
            raise ValueError(f"sandbox must be one of {SANDBOXES}, got {sandbox!r}")
        if sandbox == "sandbox_fusion" and not sandbox_fusion_url:
            raise ValueError("sandbox: sandbox_fusion needs sandbox_fusion_url (e.g. http://127.0.0.1:8080/run_code)")
        self.sandbox = sandbox
        self.sandbox_fusion_url = sandbox_fusion_url
        self.timeout = float(timeout)
        self.cpu_seconds = int(cpu_seconds)
        self.memory_mb = int(memory_mb)
        self.max_processes = max_processes
        self.max_file_mb = int(max_file_mb)
        self.open_files = int(open_files)
        self.max_output_bytes = int(max_output_bytes)
        self.scratch_root = scratch_root
        self.python = python or sys.executable
        self.allow_site_packages = allow_site_packages
        self.blocked_imports = sorted(set(BLOCKED_IMPORTS) | set(extra_blocked_imports or ()))
        self.restrict_reads = restrict_reads
        self.audit_hook = bool(audit_hook)
        # One worker runs thousands of trajectories: cap the interpreters alive at once (per tool, across
        # trajectories). A RunVar holds the limiter so each event loop gets its own.
        self.max_concurrent = int(max_concurrent or max(2, os.cpu_count() or 2))
        if self.max_concurrent < 1:
            raise ValueError("max_concurrent must be >= 1")
        self._limiter: RunVar[anyio.CapacityLimiter] = RunVar(f"python_tool_limiter_{id(self)}")
        self.readable_paths = [str(p) for p in (readable_paths or ())]
        missing = [p for p in self.readable_paths if not os.path.exists(p)]
        if missing:
            raise ValueError(f"readable_paths do not exist: {missing}")
        self.max_scratch_mb = int(max_scratch_mb)
        if warm_sandboxes < 0 or warm_idle_seconds < 5:
            raise ValueError("warm_sandboxes must be >= 0 and warm_idle_seconds >= 5")
        self.warm_sandboxes = int(warm_sandboxes)
        self.warm_idle_seconds = int(warm_idle_seconds)
        self._pool: RunVar[WarmPool] = RunVar(f"python_tool_pool_{id(self)}")
        self._kernel_argv: list[str] | None = None
        if max_scratch_files < 16:
            raise ValueError("max_scratch_files must be >= 16")
        if memory_cgroup not in ("auto", "require", "off"):
            raise ValueError(f"memory_cgroup must be auto, require or off, got {memory_cgroup!r}")
        self.max_scratch_files = int(max_scratch_files)
        self.memory_cgroup = memory_cgroup
        self.cgroup_parent = cgroup_parent
        self._cgroup_host: CgroupHost | None = None
        # which kernel layer bounds a call's memory as a whole: "cgroup v1/v2 (...)" or the fallback;
        # decided (and logged, once) when the first sandbox is built
        self.memory_enforcement: str | None = None
        if sandbox == "unsafe_subprocess":
            logger.warning(
                "python tool: sandbox=unsafe_subprocess — model-written code runs in a plain subprocess WITHOUT "
                "kernel isolation (no namespaces, no seccomp; only rlimits and an in-process audit hook that the "
                "code can switch off). Use it only for trusted code."
            )

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
        elif out.memory_exceeded:
            problem = f"killed: memory limit of {self.memory_mb} MiB exceeded (the sandbox's memory cgroup)"
        elif rc is not None and rc < 0:
            sig = -rc
            name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
            if sig == signal.SIGXCPU:
                problem = f"killed: CPU time limit of {self.cpu_seconds} seconds exceeded"
            elif sig == signal.SIGKILL:  # the CPU hard limit (SIGXCPU ignored by the code) or the OOM killer
                problem = f"killed by SIGKILL (CPU time limit of {self.cpu_seconds} seconds or memory exhausted)"
            else:
                problem = f"killed by signal {name}"
        elif rc:
            if "MemoryError" in out.stderr:
                text += f"\n(memory limit of {self.memory_mb} MiB exceeded)"
            text += f"\n(exit status {rc})"
        if problem is not None:
            raise ToolError(problem + (":\n" + text if text else ""), kind="timeout" if out.timed_out else "exception")
        return text if text.strip() else "(no output)"

    async def run_code(self, code: str, *, scratch_parent: Path | str | None = None) -> SandboxOutput:
        """Run `code` and return what happened. Never raises for the code's own failures; raises
        SandboxUnavailable when the sandbox cannot be set up, ToolError when the remote sandbox fails,
        OSError when the interpreter cannot be started at all (unsafe_subprocess)."""
        try:
            limiter = self._limiter.get()
        except LookupError:
            limiter = anyio.CapacityLimiter(self.max_concurrent)
            self._limiter.set(limiter)
        async with limiter:
            if self.sandbox == "kernel":
                return await self._run_kernel(code)
            if self.sandbox == "sandbox_fusion":
                assert self.sandbox_fusion_url is not None
                return await run_fusion(self.sandbox_fusion_url, code, timeout=self.timeout, memory_mb=self.memory_mb,
                                        max_output_bytes=self.max_output_bytes)
            return await self._run_unsafe(code, scratch_parent)

    def _boot_config(self, scratch: str, *, kernel: bool) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "scratch": scratch,
            "cpu_seconds": self.cpu_seconds,
            "memory_bytes": self.memory_mb * 1024 * 1024,
            "file_bytes": self.max_file_mb * 1024 * 1024,
            "open_files": self.open_files,
            "max_processes": self.max_processes,
            "audit_hook": self.audit_hook,
            "blocked_imports": self.blocked_imports,
            "restrict_reads": self.restrict_reads,
            "readable_paths": self.readable_paths,
            "extra_paths": list(_interpreter(self.python).site_packages) if self.allow_site_packages else [],
        }
        if kernel:
            try:
                cfg["seccomp"] = compiled_filter(memory_cgroup=self._cgroup_host is not None)
            except Exception as e:  # seccompy missing, or no syscall table for this architecture
                raise SandboxUnavailable(
                    f"python tool sandbox: cannot build the seccomp filter ({type(e).__name__}: {e}); `pip install "
                    "seccompy` (a dependency of agentloop); seccomp needs Linux on x86_64 or aarch64") from e
            cfg["require_isolation"] = True
            cfg["as_pid_1"] = True
            cfg["memory_layer"] = "cgroup" if self._cgroup_host is not None else "seccomp"
            cfg["mount_scratch"] = _scratch_by_boot(
                self.readable_paths, list(_interpreter(self.python).site_packages) if self.allow_site_packages else [])
            cfg["scratch_bytes"] = self.max_scratch_mb * 1024 * 1024
            cfg["scratch_inodes"] = self.max_scratch_files
        return cfg

    def _warm_pool(self) -> WarmPool:
        try:
            return self._pool.get()
        except LookupError:
            pool = WarmPool(self.warm_sandboxes, max_age=self.warm_idle_seconds - 2)
            self._pool.set(pool)
            return pool

    async def aclose(self) -> None:
        """Kill the sandboxes started ahead for this event loop (unused ones also end by themselves)."""
        await self._warm_pool().aclose()

    def _choose_memory_layer(self) -> None:
        """Blocking, once: the delegated cgroup that will bound each call's memory, or the fallback —
        said in the log either way (and refused when `memory_cgroup: require` cannot be met)."""
        found = None if self.memory_cgroup == "off" else find_cgroup_host(self.cgroup_parent)
        if isinstance(found, CgroupHost):
            self._cgroup_host = found
            self.memory_enforcement = found.describe()
            logger.info("python tool: each call's memory (address space, shm, memfd, tmpfs, kernel memory) and tasks "
                        "are bounded by a %s", self.memory_enforcement)
            return
        why = "switched off (memory_cgroup: off)" if found is None else found
        if self.memory_cgroup == "require":
            raise SandboxUnavailable(f"python tool sandbox unavailable: memory_cgroup: require, but no cgroup can be "
                                     f"used: {why}")
        inodes = ("scratch inodes capped by the tmpfs" if _scratch_by_boot(
            self.readable_paths, list(_interpreter(self.python).site_packages) if self.allow_site_packages else [])
            else "scratch inodes NOT capped: host paths are bound inside /tmp, so bubblewrap mounts it")
        self.memory_enforcement = f"rlimits + seccomp (no memory cgroup: SysV shm, memfd and message queues refused, {inodes})"
        logger.warning("python tool: no memory cgroup for the sandbox (%s); memory is bounded by %s", why,
                       self.memory_enforcement)

    async def _start_kernel(self) -> Sandboxed:
        def command() -> list[str]:
            self._choose_memory_layer()
            cfg = self._boot_config(SCRATCH, kernel=True)
            cfg["idle_seconds"] = self.warm_idle_seconds
            return _kernel_command(self.python, readable=self.readable_paths, site_packages=self.allow_site_packages,
                                   scratch_bytes=self.max_scratch_mb * 1024 * 1024, boot_args=[marshal.dumps(cfg).hex()],
                                   scratch_by_boot=cfg["mount_scratch"])

        if self._kernel_argv is None:  # the same for every call of this tool: built (and probed) once
            try:
                self._kernel_argv = await anyio.to_thread.run_sync(command)
            except SandboxUnavailable as e:
                logger.error("%s", e)
                raise
        cgroup = None
        if self._cgroup_host is not None:
            host = self._cgroup_host
            tasks = None if self.max_processes is None else BASE_TASKS + int(self.max_processes)
            try:
                cgroup = await anyio.to_thread.run_sync(
                    lambda: CallCgroup(host, memory_bytes=self.memory_mb * 1024 * 1024, max_tasks=tasks))
            except OSError as e:
                message = f"python tool sandbox unavailable: cannot create the call's cgroup under {host.describe()}: {e}"
                logger.error("%s", message)
                raise SandboxUnavailable(message) from e
        return await start_sandboxed(self._kernel_argv, env={}, cwd="/", cgroup=cgroup)

    async def _run_kernel(self, code: str) -> SandboxOutput:
        pool = self._warm_pool()
        box = await pool.take() or await self._start_kernel()
        try:
            await pool.fill(self._start_kernel)  # replacements boot while this call runs
        except BaseException:
            await kill_process(box)
            raise
        out = await communicate(box, stdin=code.encode("utf-8", "replace"), timeout=self.timeout,
                                max_output_bytes=self.max_output_bytes)
        rc = out.returncode
        if rc is not None and 128 < rc <= 128 + 64:  # bubblewrap reports a child killed by signal N as 128 + N
            out.returncode = -(rc - 128)
        if rc and not out.stdout and not out.timed_out and out.stderr.lstrip().startswith(_STAGES):
            message = explain_failure(out.stderr)
            logger.error("%s", message)
            raise SandboxUnavailable(message)
        return out

    async def _run_unsafe(self, code: str, scratch_parent: Path | str | None) -> SandboxOutput:
        parent = str(scratch_parent) if scratch_parent is not None else self.scratch_root
        scratch = await anyio.to_thread.run_sync(lambda: tempfile.mkdtemp(prefix="agentloop-py-", dir=parent))
        try:
            cfg = await anyio.to_thread.run_sync(lambda: self._boot_config(scratch, kernel=False))
            # -u: unbuffered, so what was printed before a kill (timeout, CPU limit) still comes back.
            cmd = [self.python, "-I", "-S", "-B", "-u", str(_BOOT), marshal.dumps(cfg).hex()]
            return await run_sandboxed(cmd, stdin=code.encode("utf-8", "replace"), env={"HOME": scratch, "TMPDIR": scratch},
                                       cwd=scratch, timeout=self.timeout, max_output_bytes=self.max_output_bytes)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(lambda: shutil.rmtree(scratch, ignore_errors=True))
