"""The cgroup layer of the kernel sandbox: one memory + pids cgroup per call, where the host delegates one.

rlimits bound a process's address space, not memory as a whole: SysV shared memory, memfd and tmpfs
pages, and the kernel memory of inodes and dentries (an "empty files" bomb in the scratch tmpfs) are
charged to nobody's address space — issue #29 grew host Shmem by 1.7 GiB and slab by 545 MiB from one
call with `memory_mb: 512`. A memory cgroup charges every page the call's processes fault in, whatever
backs it (anonymous, shmem/tmpfs, memfd, kernel slab, page cache), to one counter with one limit, so
`memory.max` (v2) / `memory.limit_in_bytes` (v1) bounds the sandbox as a whole; swap is switched off for
it (`memory.swap.max = 0` / `memory.memsw.limit_in_bytes` = the limit), and `pids.max` bounds its tasks
(threads included) per call instead of per host uid.

Where the cgroup comes from (`find_cgroup_host`, probed once per process):
- cgroup v2: the worker's own cgroup (or `cgroup_parent`) when it offers `memory` and `pids` and either
  already enables them for its children (`cgroup.subtree_control`) or lets us enable them, and we can
  create a child there — a delegated subtree (`systemd-run -p Delegate=yes`, a container with a writable
  cgroupns) or root on the host;
- cgroup v1 (hybrid hosts, like this repository's test machine): the worker's cgroup in the `memory`
  hierarchy (and in `pids` where mounted), when we can create a child there (root, or a delegated dir).
Anything else: no cgroup, and the caller says so and uses the fallback (see policy.py: SysV shm,
memfd and POSIX message queues refused) — never silently.

A call's processes enter their cgroup before bubblewrap starts (`join_argv`: a `sh` that writes its own
pid into `cgroup.procs` then execs bubblewrap), so every process of the sandbox is born inside it.
"""

from __future__ import annotations

import functools
import itertools
import os
import signal
import time
from dataclasses import dataclass

__all__ = ["CallCgroup", "CgroupHost", "find_cgroup_host"]

_NAME = "agentloop-sbx"
# bubblewrap's monitor, its PID 1 (or, with --as-pid-1, none), the interpreter's main thread: the tasks a
# sandbox needs before the code starts threads of its own
BASE_TASKS = 3
_counter = itertools.count()
# `sh` writes its own pid into each cgroup.procs named before "--", then execs the rest
_JOIN = ('while [ "$1" != -- ]; do echo $$ > "$1" || { echo "sandbox-cgroup: cannot join $1" >&2; exit 111; }; '
         'shift; done; shift; exec "$@"')


@dataclass(frozen=True)
class CgroupHost:
    """Where per-call cgroups are made: `version` 2 (one dir for memory and pids) or 1 (a dir per
    hierarchy; `pids_parent` None when the pids controller is not mounted)."""

    version: int
    memory_parent: str
    pids_parent: str | None
    sh: str

    def describe(self) -> str:
        where = self.memory_parent if self.version == 2 else f"memory {self.memory_parent}, pids {self.pids_parent}"
        return f"cgroup v{self.version} ({where})"


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _mounts() -> list[tuple[str, str, list[str], str]]:
    """(mount point, fs type, super options, root within the fs) of every cgroup mount."""
    found = []
    for line in _read("/proc/self/mountinfo").splitlines():
        fields, _, fs = line.partition(" - ")
        f, s = fields.split(), fs.split()
        if s and s[0] in ("cgroup", "cgroup2"):
            found.append((f[4], s[0], s[2].split(",") if len(s) > 2 else [], f[3]))
    return found


def _own_cgroups() -> dict[str, str]:
    """controller (or "" for v2) -> this process's cgroup path, from /proc/self/cgroup."""
    own = {}
    for line in _read("/proc/self/cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            own[c] = path
    return own


def _join(mount: str, root: str, path: str) -> str:
    rel = path[len(root):] if root != "/" and path.startswith(root) else path
    return os.path.normpath(mount + "/" + rel.lstrip("/"))


def _can_make_children(parent: str) -> str | None:
    """None if a child cgroup can be created (and removed) in `parent`, else why not."""
    probe = os.path.join(parent, f"{_NAME}-probe-{os.getpid()}")
    try:
        os.mkdir(probe)
    except FileExistsError:
        pass
    except OSError as e:
        return f"cannot create a cgroup in {parent}: {e.strerror}"
    try:
        os.rmdir(probe)
    except OSError:
        pass
    return None


def _v2(parent: str, sh: str) -> CgroupHost | str:
    try:
        available = _read(os.path.join(parent, "cgroup.controllers")).split()
        enabled = _read(os.path.join(parent, "cgroup.subtree_control")).split()
    except OSError as e:
        return f"cgroup v2 at {parent} unreadable: {e.strerror}"
    missing = [c for c in ("memory", "pids") if c not in available]
    if missing:
        return f"cgroup v2 at {parent} does not offer {', '.join(missing)}"
    if not {"memory", "pids"} <= set(enabled):
        try:
            _write(os.path.join(parent, "cgroup.subtree_control"), "+memory +pids")
        except OSError as e:  # EBUSY: the cgroup has processes (the worker); EACCES: not delegated to us
            return (f"cannot enable memory and pids for the children of {parent} ({e.strerror}); run the worker "
                    "in a delegated cgroup whose cgroup.subtree_control enables them, e.g. its own leaf under a "
                    "`systemd-run --user -p Delegate=yes` scope, and name the parent with `cgroup_parent`")
    why = _can_make_children(parent)
    return why if why else CgroupHost(2, parent, None, sh)


def _remove_stale(parent: str | None) -> None:
    """Remove the empty call cgroups a worker that died before its calls ended left behind (their names
    carry the worker's pid; a live worker's are left alone)."""
    if parent is None:
        return
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if not name.startswith(_NAME + "-") or len(parts) != 4 or not parts[2].isdigit():
            continue
        pid = int(parts[2])
        if pid != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            try:
                os.rmdir(os.path.join(parent, name))
            except OSError:
                pass


def find_cgroup_host(parent: str | None = None) -> CgroupHost | str:
    """The host's delegated cgroup subtree for sandboxes, or a sentence saying why there is none (probed
    once per process; stale call cgroups of dead workers are removed when one is found)."""
    found = _find_cgroup_host(parent)
    if isinstance(found, CgroupHost) and _cleaned.setdefault(found, False) is False:
        _cleaned[found] = True
        _remove_stale(found.memory_parent)
        _remove_stale(found.pids_parent)
    return found


_cleaned: dict[CgroupHost, bool] = {}


@functools.lru_cache(maxsize=4)
def _find_cgroup_host(parent: str | None = None) -> CgroupHost | str:
    sh = next((p for p in ("/bin/sh", "/usr/bin/sh") if os.access(p, os.X_OK)), None)
    if sh is None:
        return "no /bin/sh to enter the call's cgroup with"
    if parent is not None:
        return _v2(parent, sh)
    try:
        mounts, own = _mounts(), _own_cgroups()
    except OSError as e:
        return f"cannot read this process's cgroups: {e}"
    reasons = []
    for mount, fstype, _, root in mounts:
        if fstype == "cgroup2" and "" in own:
            found = _v2(_join(mount, root, own[""]), sh)
            if isinstance(found, CgroupHost):
                return found
            reasons.append(found)
    v1 = {c: _join(mount, root, own[c]) for mount, fstype, opts, root in mounts if fstype == "cgroup"
          for c in ("memory", "pids") if c in opts and c in own}
    if "memory" in v1:
        why = _can_make_children(v1["memory"])
        if why is None:
            pids = v1.get("pids")
            if pids is not None and _can_make_children(pids) is not None:
                pids = None
            return CgroupHost(1, v1["memory"], pids, sh)
        reasons.append(why)
    return "; ".join(reasons) or "no cgroup v2 with memory and pids, and no cgroup v1 memory hierarchy"


class CallCgroup:
    """The cgroup(s) of one call: created with its limits, joined by the sandbox's first process
    (`join_argv`), killed and removed when the call ends. Blocking (small sysfs writes)."""

    def __init__(self, host: CgroupHost, *, memory_bytes: int, max_tasks: int | None) -> None:
        self.host = host
        name = f"{_NAME}-{os.getpid()}-{next(_counter)}"
        self.memory_dir = os.path.join(host.memory_parent, name)
        self.pids_dir = os.path.join(host.pids_parent, name) if host.pids_parent else None
        self.dirs = [self.memory_dir] + ([self.pids_dir] if self.pids_dir else [])
        made: list[str] = []
        try:
            for d in self.dirs:
                os.mkdir(d)
                made.append(d)
            if host.version == 2:
                _write(os.path.join(self.memory_dir, "memory.max"), str(memory_bytes))
                for knob, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
                    if os.path.exists(os.path.join(self.memory_dir, knob)):
                        _write(os.path.join(self.memory_dir, knob), value)
                if max_tasks is not None:
                    _write(os.path.join(self.memory_dir, "pids.max"), str(max_tasks))
            else:
                _write(os.path.join(self.memory_dir, "memory.limit_in_bytes"), str(memory_bytes))
                memsw = os.path.join(self.memory_dir, "memory.memsw.limit_in_bytes")
                if os.path.exists(memsw):  # swap accounting on: memory + swap together capped at the same
                    _write(memsw, str(memory_bytes))
                if self.pids_dir and max_tasks is not None:
                    _write(os.path.join(self.pids_dir, "pids.max"), str(max_tasks))
        except OSError:
            for d in reversed(made):
                try:
                    os.rmdir(d)
                except OSError:
                    pass
            raise

    def join_argv(self, cmd: list[str]) -> list[str]:
        return [self.host.sh, "-c", _JOIN, "sh", *(os.path.join(d, "cgroup.procs") for d in self.dirs), "--", *cmd]

    def oom_kills(self) -> int:
        """How many processes the kernel killed because the call's memory limit was reached."""
        name = "memory.events" if self.host.version == 2 else "memory.oom_control"
        try:
            for line in _read(os.path.join(self.memory_dir, name)).splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def peak_bytes(self) -> int | None:
        name = "memory.peak" if self.host.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int(_read(os.path.join(self.memory_dir, name)))
        except (OSError, ValueError):
            return None

    def kill(self) -> None:
        """SIGKILL every process in the call's cgroup (the whole sandbox, whatever it became)."""
        kill_file = os.path.join(self.memory_dir, "cgroup.kill")
        if self.host.version == 2 and os.path.exists(kill_file):
            try:
                _write(kill_file, "1")
                return
            except OSError:
                pass
        for _ in range(100):  # v1: kill what is there until nothing is left (a fork could race one pass)
            try:
                pids = [int(p) for p in _read(os.path.join(self.memory_dir, "cgroup.procs")).split()]
            except OSError:
                return
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.002)

    def remove(self, wait: float = 2.0) -> bool:
        """Remove the cgroup(s) once their last task is gone (exiting tasks keep a cgroup busy for a few
        moments). False if one could not be removed in `wait` seconds (left for the host to clean)."""
        deadline = time.monotonic() + wait
        left = list(self.dirs)
        while left:
            for d in list(left):
                try:
                    os.rmdir(d)
                    left.remove(d)
                except FileNotFoundError:
                    left.remove(d)
                except OSError:
                    pass
            if left:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.005)
        return True
