"""Engine processes that die with the process that launched them, however it dies.

`popen_tethered(argv, **popen_kwargs)` is `subprocess.Popen` for the engine servers agentloop starts
itself (`agentloop serve` CPU engines, `python -m sglang.launch_server`): when the launching process
ends — a normal exit, an exception, SIGKILL, a `timeout`, the OOM killer — the kernel SIGKILLs the
server, so no server outlives it holding its port, its memory or (SGLang) a whole GPU. Servers
attached by URL are never started here, so never killed.

On Linux the child asks for `prctl(PR_SET_PDEATHSIG, SIGKILL)` and then execs the server. Details
that make this hold:

- **The kernel watches the *thread* that forked**, not the process: a child forked from a thread that
  exits is signalled then, with its process alive. So every tethered child is forked from one daemon
  thread (`_Spawner`) that lives as long as the process: a runtime started from a short-lived thread,
  a blocking portal or a Ray actor's worker thread keeps its servers until the *process* dies.
- **No `preexec_fn`** (Python code between fork and exec is not safe in a threaded process): the
  prctl runs in a few lines of `python -I -S -c` (~20 ms, standard library only, so any interpreter
  works) that then `execvp`s the server; the death signal survives the exec.
- **The launcher may die between fork and prctl**: the prologue then finds a parent other than the
  launcher and exits instead of running orphaned.
- **SGLang's own children**: in sglang 0.5.17 the scheduler(s), the detokenizer, the data-parallel
  controller and the multi-tokenizer workers each call `kill_itself_when_parent_died()`
  (`sglang/srt/utils/common.py`: `prctl(PR_SET_PDEATHSIG, SIGKILL)`) first thing, and
  `launch_server` starts them from its main thread; so when the top process is killed the kernel
  takes the whole tree along.
- **A normal stop is unchanged**: children still get their own session (`start_new_session`), and
  the owners (`SGLangServer.stop`, `LocalEngineProcess.stop`) signal the process group as before.

Elsewhere (no `prctl`) this is a plain `Popen`, and servers outlive a parent killed by SIGKILL.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
from typing import Any, Callable, Sequence, TypeVar

__all__ = ["TETHER_AVAILABLE", "popen_tethered"]

T = TypeVar("T")

#: Whether this platform can tie a child's life to its launcher (Linux: PR_SET_PDEATHSIG).
TETHER_AVAILABLE = sys.platform.startswith("linux")

# argv after `-c`: death signal, launcher pid, then the server's argv. PR_SET_PDEATHSIG is 1.
_PROLOGUE = """\
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(1, int(sys.argv[1]), 0, 0, 0) != 0:
    sys.exit("agentloop: prctl(PR_SET_PDEATHSIG) failed: " + os.strerror(ctypes.get_errno()))
if os.getppid() != int(sys.argv[2]):
    sys.exit("agentloop: the process that launched this server died before it started")
os.execvp(sys.argv[3], sys.argv[3:])
"""


class _Spawner:
    """Runs callables on one daemon thread that lives as long as the process (see the module docstring)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def call(self, fn: Callable[[], T]) -> T:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="agentloop-engine-spawner", daemon=True)
                self._thread.start()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((fn, future))
        return future.result()

    def _serve(self) -> None:
        while True:
            fn, future = self._jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # handed to the caller, who re-raises it
                    future.set_exception(e)


_spawner = _Spawner()


def _forked() -> None:
    # A forked child has no spawner thread (only the forking thread survives a fork): start afresh.
    global _spawner
    _spawner = _Spawner()


os.register_at_fork(after_in_child=_forked)


def popen_tethered(argv: Sequence[str], *, death_signal: int = signal.SIGKILL, **popen_kwargs: Any) -> "subprocess.Popen[bytes]":
    """`subprocess.Popen(argv, **popen_kwargs)` whose process gets `death_signal` when this process dies.

    The returned process is the server itself (the prologue execs it: same pid, same process group).
    A missing executable raises FileNotFoundError here, as Popen would.
    """
    argv = [str(a) for a in argv]
    if not TETHER_AVAILABLE or not sys.executable:  # (an embedded interpreter has no python to run the prologue)
        return subprocess.Popen(argv, **popen_kwargs)
    if shutil.which(argv[0]) is None:
        raise FileNotFoundError(2, "No such file or directory", argv[0])
    wrapped = [sys.executable, "-I", "-S", "-c", _PROLOGUE, str(int(death_signal)), str(os.getpid()), *argv]
    return _spawner.call(lambda: subprocess.Popen(wrapped, **popen_kwargs))
