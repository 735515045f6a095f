"""The `python` tool as a whole (kernel sandbox + the in-process audit hook on top), each promise shown
by a test: output and tracebacks come back; the network is refused; CPU time, memory, file size and
wall-clock limits kill or stop the code; nothing outside the scratch directory can be written (nor read);
scratch is fresh per call; an infinite loop or a fork bomb does not stall the event loop; cancellation
kills the child; the audit hook is hard to switch off from inside. The kernel layers on their own (hook
off) are shown in test_python_sandbox_kernel.py; the `unsafe_subprocess` opt-in is covered here too."""

from __future__ import annotations

import os
import signal
import textwrap
from pathlib import Path

import anyio
import pytest

from agentloop.tools import ToolContext, ToolError, ToolRegistry
from agentloop.tools.builtin.python import PythonTool
from agentloop.tools.parsers import ToolCall

pytestmark = pytest.mark.timeout(120)


def children() -> set[int]:
    """Live child processes of this test process."""
    me, out = os.getpid(), set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == me and fields[0] != "Z":
                    out.add(int(name))
            except (OSError, IndexError, ValueError):
                pass
    return out


async def run(tool: PythonTool, code: str) -> str:
    return await tool.execute({"code": textwrap.dedent(code)}, ToolContext("t"))


class Ticker:
    """Counts ticks of a coroutine that sleeps `period` each time; a blocked event loop shows as a gap."""

    def __init__(self, period: float = 0.01) -> None:
        self.period, self.ticks, self.max_gap = period, 0, 0.0

    async def __call__(self) -> None:
        last = anyio.current_time()
        while True:
            await anyio.sleep(self.period)
            now = anyio.current_time()
            self.ticks += 1
            self.max_gap = max(self.max_gap, now - last)
            last = now


async def test_output_exit_status_and_traceback_without_sandbox_frames():
    t = PythonTool()
    assert await run(t, "print(6 * 7)") == "42"
    assert await run(t, "x = 1") == "(no output)"
    out = await run(t, """
        import sys
        print("partial")
        def f():
            return 1 / 0
        f()
    """)
    assert out.startswith("partial\nTraceback (most recent call last):")
    assert 'File "<tool code>", line 5, in f' in out and "return 1 / 0" in out and "ZeroDivisionError" in out
    assert "_sandbox_boot" not in out and out.endswith("(exit status 1)")
    assert (await run(t, "import sys; print('bye', file=sys.stderr); sys.exit(3)")).splitlines() == ["bye", "(exit status 3)"]
    out = await run(t, "print(1)\ndef f(:\n    pass")
    assert out.splitlines()[:4] == ['  File "<tool code>", line 2', "    def f(:", "          ^", "SyntaxError: invalid syntax"]
    assert "null bytes" in await run(t, "print(1)\x00")
    assert await run(t, "print('\udcff'.encode('utf-8', 'replace'))") == "b'?'"  # a lone surrogate in the JSON


async def test_refuses_network(tmp_path):
    hits = 0

    async def handle(stream):
        nonlocal hits
        hits += 1
        await stream.aclose()

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    attempts = [
        f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)",
        f"import _socket; s = _socket.socket(); s.connect(('127.0.0.1', {port}))",
        f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}/', timeout=2)",
        f"import http.client; http.client.HTTPConnection('127.0.0.1', {port}).request('GET', '/')",
        f"import asyncio; asyncio.run(asyncio.open_connection('127.0.0.1', {port}))",
    ]
    async with anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handle)
        for kind in ("kernel", "unsafe_subprocess"):  # the audit hook refuses in the unsafe mode too
            t = PythonTool(sandbox=kind, timeout=20)
            for code in attempts:
                out = await run(t, code)
                assert "sandbox: import of" in out and "is not allowed" in out, out
        await anyio.sleep(0.2)
        tg.cancel_scope.cancel()
    assert hits == 0


async def test_network_namespace():
    out = await run(PythonTool(), "print(open('/proc/self/net/dev').read())")
    interfaces = [line.split(":")[0].strip() for line in out.splitlines()[2:] if ":" in line]
    assert interfaces == ["lo"], out  # only a (down) loopback: no route anywhere


async def test_killed_past_cpu_time_limit():
    t = PythonTool(cpu_seconds=1, timeout=60)
    t0 = anyio.current_time()
    res = await t.run_code("while True: pass")
    assert res.returncode == -signal.SIGXCPU and not res.timed_out
    assert anyio.current_time() - t0 < 30  # stopped by CPU time, long before the wall clock
    with pytest.raises(ToolError, match="CPU time limit of 1 seconds exceeded"):
        t.render(res)
    # code that ignores SIGXCPU is killed by the hard limit one second later
    res = await t.run_code("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True: pass")
    assert res.returncode == -signal.SIGKILL and not res.timed_out
    with pytest.raises(ToolError, match="killed by SIGKILL"):
        t.render(res)


async def test_memory_limit():
    t = PythonTool(memory_mb=128)
    assert await run(t, "b = bytearray(32 * 1024 * 1024); print(len(b))") == str(32 * 1024 * 1024)
    out = await run(t, "b = bytearray(512 * 1024 * 1024)")
    assert "MemoryError" in out and "memory limit of 128 MiB exceeded" in out
    out = await run(t, """
        chunks = []
        while True:
            chunks.append(bytearray(8 * 1024 * 1024))
    """)
    assert "MemoryError" in out
    # code that catches MemoryError and keeps trying still never gets past the limit
    # (ru_maxrss is no witness here: Linux carries the forking parent's peak across exec, so under a
    # big pytest process it reports the parent's RSS; the refusals count is what the limit shows.)
    out = await run(t, """
        chunks, refused = [], 0
        for _ in range(200):
            try:
                chunks.append(bytearray(16 * 1024 * 1024))
            except MemoryError:
                refused += 1
        print(len(chunks), refused)
    """)
    held, refused = map(int, out.split())
    assert held * 16 < 128 and refused > 150 and held + refused == 200, out


async def test_scratch_size_limit(tmp_path):
    t = PythonTool(max_scratch_mb=2, max_file_mb=16, scratch_root=str(tmp_path))
    out = await run(t, """
        written = 0
        try:
            for i in range(100):
                with open(f"f{i}", "wb") as f:
                    f.write(b"x" * 512 * 1024)
                written += 1
        except OSError as e:
            print(written, e.strerror)
    """)
    n, _, err = out.partition(" ")
    assert int(n) <= 4 and err == "No space left on device", out  # 2 MiB hold four 512 KiB files
    assert list(tmp_path.iterdir()) == []  # the scratch tmpfs lives in the sandbox, never on the host


async def test_file_size_limit():
    out = await run(PythonTool(max_file_mb=1), "open('big', 'wb').write(b'x' * (2 * 1024 * 1024))")
    assert "File too large" in out


WRITE_ESCAPES = {
    "open_w": "open(OUT + '/new.txt', 'w').write('x')",
    "open_a": "open(VICTIM, 'a').write('x')",
    "os_open": "import os; os.write(os.open(OUT + '/new.txt', os.O_WRONLY | os.O_CREAT), b'x')",
    "os_open_rdwr": "import os; os.write(os.open(VICTIM, os.O_RDWR), b'x')",
    "pathlib": "import pathlib; pathlib.Path(OUT, 'new.txt').write_text('x')",
    "remove": "import os; os.remove(VICTIM)",
    "rename_out": "import os; os.rename(VICTIM, 'stolen')",
    "replace_in": "import os; open('mine', 'w').write('x'); os.replace('mine', VICTIM)",
    "hardlink": "import os; os.link(VICTIM, 'hl'); open('hl', 'w').write('x')",
    "symlink": "import os; os.symlink(VICTIM, 'sl'); open('sl', 'w').write('x')",
    "symlink_dir": "import os; os.symlink(OUT, 'sd'); open('sd/new.txt', 'w').write('x')",
    "symlink_inside": "import os; open('f', 'w'); os.symlink('f', 'l')",
    "mkdir": "import os; os.mkdir(OUT + '/newdir')",
    "chmod": "import os; os.chmod(VICTIM, 0o777)",
    "truncate": "import os; os.truncate(VICTIM, 0)",
    "utime": "import os; os.utime(VICTIM, (0, 0))",
    "chdir": "import os; os.chdir(OUT); open('new.txt', 'w').write('x')",
    "relative": "open('../../../../../../../..' + OUT + '/new.txt', 'w').write('x')",
    # another thread moves the cwd up between the hook's check and the open: ".." is refused outright
    "dotdot_race": "import os; os.makedirs('a/b/c'); os.chdir('a/b/c'); open('../../x', 'w')",
    "shutil": "import shutil; open('mine', 'w').write('x'); shutil.copy('mine', OUT + '/new.txt')",
    "dir_fd": "import os; fd = os.open(OUT, os.O_RDONLY); os.write(os.open('new.txt', os.O_WRONLY | os.O_CREAT, dir_fd=fd), b'x')",
    "mkfifo": "import os; os.mkfifo(OUT + '/fifo')",
    "mknod": "import posix; posix.mknod(OUT + '/node')",
    "fchmod": "import os, sys; fd = os.open(sys.executable, os.O_RDONLY); os.fchmod(fd, 0o777)",
    "futime": "import os, sys; fd = os.open(sys.executable, os.O_RDONLY); os.utime(fd, (0, 0))",
    "sqlite": "import sqlite3; sqlite3.connect(OUT + '/db').execute('create table t(x)')",
    "tempfile_dir": "import tempfile; tempfile.mkstemp(dir=OUT)",
}


@pytest.mark.parametrize("name", sorted(WRITE_ESCAPES))
async def test_cannot_write_outside_scratch(tmp_path, name):
    out_dir = tmp_path / "outside"
    out_dir.mkdir()
    victim = out_dir / "victim.txt"
    victim.write_text("original")
    os.chmod(victim, 0o644)
    before = victim.stat()
    code = f"OUT = {str(out_dir)!r}; VICTIM = {str(victim)!r}\n" + WRITE_ESCAPES[name]
    out = await run(PythonTool(), code)
    # refused by the hook, or by the kernel: the host directory does not exist in the sandbox (its /tmp is a
    # tmpfs of its own, which also hides pytest's tmp_path)
    assert (("sandbox:" in out and ("refused" in out or "not allowed" in out)) or "has no attribute 'mk" in out
            or "FileNotFoundError" in out), out
    assert sorted(p.name for p in out_dir.iterdir()) == ["victim.txt"]
    after = victim.stat()
    assert victim.read_text() == "original" and after.st_mode == before.st_mode and after.st_mtime == before.st_mtime
    assert after.st_nlink == 1


SCRATCH_CODE = """
    import os, tempfile, shutil
    os.makedirs("a/b")
    open("a/b/f.txt", "w").write("hello")
    shutil.copytree("a", "c")
    shutil.rmtree("a")
    print(os.getcwd())
    print(os.environ["HOME"] == os.getcwd() == os.path.dirname(tempfile.mkstemp()[1]))
    print(sorted(os.listdir(".")), open("c/b/f.txt").read())
"""


async def test_scratch_is_cwd_home_and_tmp_and_fresh_per_call(tmp_path):
    t = PythonTool(scratch_root=str(tmp_path))
    lines = (await run(t, SCRATCH_CODE)).splitlines()
    assert lines[0] == "/tmp" and lines[1] == "True"  # a tmpfs of the sandbox, not a host directory
    assert lines[2].startswith("['c', 'tmp") and lines[2].endswith("hello")
    assert list(tmp_path.iterdir()) == []
    assert await run(t, "import os; print(os.listdir('.'))") == "[]"  # nothing of the previous call


async def test_unsafe_subprocess_scratch_is_a_host_dir_and_is_deleted(tmp_path):
    t = PythonTool(sandbox="unsafe_subprocess", scratch_root=str(tmp_path))
    lines = (await run(t, SCRATCH_CODE)).splitlines()
    assert lines[0].startswith(str(tmp_path)) and lines[1] == "True"
    assert lines[2].startswith("['c', 'tmp") and lines[2].endswith("hello")
    assert list(tmp_path.iterdir()) == []  # deleted afterwards
    # the per-trajectory scratch dir of the context is used as the parent when given
    ctx = ToolContext("t", scratch_dir=tmp_path)
    assert (await t.execute({"code": "import os; print(os.getcwd())"}, ctx)).startswith(str(tmp_path))


async def test_reads_restricted_to_scratch_and_python_library():
    t = PythonTool()
    for code in ["open('/etc/passwd').read()", f"open('/proc/{os.getpid()}/environ').read()", "import os; os.listdir('/')",
                 f"open({__file__!r}).read()"]:
        out = await run(t, code)
        # a checkout under /tmp sits below the sandbox's own /tmp: the hook lets the path through and
        # the fresh tmpfs has no such file (the kernel layer holds either way)
        hidden = __file__ in code and __file__.startswith("/tmp/") and "FileNotFoundError" in out
        assert ("sandbox:" in out and "refused" in out) or hidden, out
    assert await run(t, "import json, decimal, zoneinfo; print(json.dumps({'a': 1}))") == '{"a": 1}'
    assert await run(t, "import zoneinfo; print(zoneinfo.ZoneInfo('Europe/Paris').utcoffset(__import__('datetime').datetime(2024, 1, 1)))") == "1:00:00"
    assert await run(t, "import os; open(os.devnull, 'w').write('x'); print('ok')") == "ok"
    # restrict_reads=False lifts the hook's read check, but the host's files are still not in the sandbox
    assert "FileNotFoundError" in await run(PythonTool(restrict_reads=False), "print(open('/etc/passwd').read())")
    # readable_paths are mounted read-only and allowed by the hook
    assert "root:" in await run(PythonTool(readable_paths=["/etc/passwd"]), "print(open('/etc/passwd').read())")
    denied = await run(PythonTool(readable_paths=["/etc/passwd"], audit_hook=False), "open('/etc/passwd', 'a').write('x')")
    assert "PermissionError" in denied or "Read-only file system" in denied
    with pytest.raises(ValueError, match="readable_paths do not exist"):
        PythonTool(readable_paths=["/no/such/path"])


@pytest.mark.parametrize("code", [
    "import gc",
    "import ctypes",
    "import resource; resource.setrlimit(resource.RLIMIT_CPU, (1000, 1000))",
    "import os; os.kill(os.getppid(), 9)",
    "import os; os.killpg(0, 9)",
    "import signal; signal.pidfd_send_signal",
    "import sys; del sys.modules['posix']; import posix",
    "import os; os.chroot('.')",
    "import os; os.setpriority(os.PRIO_PROCESS, os.getppid(), 19)",
    "import os; os.sched_setaffinity(os.getppid(), {0})",
    # an extension module's init symbol comes from the last name component: loading _socket as x._socket
    ("import _imp, importlib.machinery, sys, os\nd = [p for p in sys.path if p.endswith('lib-dynload')][0]\n"
     "f = [x for x in os.listdir(d) if x.startswith('_socket.')][0]\n"
     "_imp.create_dynamic(importlib.machinery.ModuleSpec('x._socket', None, origin=os.path.join(d, f)))"),
    "import sys; sys.addaudithook(lambda *a: None); open('/etc/passwd', 'a')",  # a new hook cannot undo ours
    "import __main__; print(sorted(k for k in vars(__main__) if not k.startswith('__')) or 'clean'); raise SystemExit(sorted(vars(__main__)) != sorted(globals()) and 'leak')",
])
async def test_sandbox_cannot_be_switched_off_from_inside(code):
    out = await run(PythonTool(), code)
    assert "sandbox:" in out or "has no attribute" in out or out == "clean", out


TAMPERING = {
    "patch_realpath": "import os, posixpath; posixpath._joinrealpath = lambda *a: (SCRATCH, True); os.path.realpath = lambda p, **k: SCRATCH",
    "patch_builtins": "import builtins; builtins.isinstance = lambda *a: False; builtins.OSError = ValueError; builtins.PermissionError = ValueError",
    "str_subclass": (
        "class P(str):\n    def split(self, *a): return ['x']\n    def startswith(self, *a): return True\n"
        "TARGET = P(TARGET)"
    ),
    "import_str_subclass": (
        "class S(str):\n    def split(self, *a): return ['harmless']\n"
        "s = __import__(S('_socket')).socket(); TARGET = OUT"
    ),
    "mode_subclass": (
        "class M(str):\n    def __contains__(self, c): return False\n"
        "open(TARGET, M('w')).write('x')"
    ),
    "fspath_flip": (
        "class P:\n    n = 0\n    def __fspath__(self):\n        P.n += 1\n        return SCRATCH + '/ok' if P.n == 1 else OUT\n"
        "import io; io.FileIO(P(), 'w')"
    ),
    "frames": (
        # walk the frames of a refused call's traceback and mutate everything reachable from them
        "import sys\ntry:\n    open(OUT, 'w')\nexcept PermissionError as e:\n    tb = e.__traceback__\n"
        "    while tb is not None:\n        for v in list(tb.tb_frame.f_locals.values()):\n"
        "            for c in getattr(v, '__closure__', None) or ():\n                c.cell_contents = '/'\n"
        "            if isinstance(v, (list, dict, set)):\n                v.clear()\n        tb = tb.tb_next\n"
    ),
}


@pytest.mark.parametrize("name", sorted(TAMPERING))
async def test_hook_cannot_be_fooled(tmp_path, name):
    # a path that exists in the sandbox outside scratch (pytest's tmp_path is under /tmp, the sandbox's scratch)
    out_file = Path("/opt/agentloop/pwned.txt")
    code = (f"import os\nSCRATCH = os.getcwd(); OUT = {str(out_file)!r}; TARGET = OUT\n" + TAMPERING[name]
            + "\nopen(TARGET, 'w').write('x')\nprint('WROTE')")
    out = await run(PythonTool(), code)
    assert "WROTE" not in out and not out_file.exists(), out
    assert "sandbox: writing" in out or "sandbox: open refused: pass paths as str" in out or "sandbox: import of" in out, out


async def test_infinite_loop_does_not_stall_the_event_loop():
    t = PythonTool(timeout=1.5, cpu_seconds=60)
    tick = Ticker()
    before = children()
    async with anyio.create_task_group() as tg:
        tg.start_soon(tick)
        with pytest.raises(ToolError, match="timed out after 1.5 seconds") as e:
            await run(t, "while True: pass")
        assert e.value.kind == "timeout"
        tg.cancel_scope.cancel()
    # Not a speed check: a loop blocked by the child would be held for the whole run (the 1.5 s
    # timeout) and tick at most once; a loaded machine's hiccups are far shorter than that.
    assert tick.ticks >= 2 and tick.max_gap < t.timeout, (tick.ticks, tick.max_gap)
    assert children() <= before  # the process group was killed and reaped


@pytest.mark.parametrize("code", [  # each keeps trying until it is killed
    "import os\nwhile True:\n    try:\n        os.fork()\n    except PermissionError:\n        pass",
    "while True:\n    try:\n        import subprocess\n        subprocess.Popen(['sh', '-c', ':(){ :|:& };:'])\n    except Exception:\n        pass",
    "import os\nwhile True:\n    try:\n        os.system(':(){ :|:& };:')\n    except PermissionError:\n        pass",
    "while True:\n    try:\n        import multiprocessing\n        multiprocessing.Process(target=print).start()\n    except Exception:\n        pass",
    "import os\nwhile True:\n    try:\n        os.posix_spawn('/bin/sh', ['sh'], {})\n    except PermissionError:\n        pass",
    "import threading, time\nwhile True:\n    try:\n        threading.Thread(target=time.sleep, args=(100,)).start()\n    except Exception:\n        pass",
])
async def test_fork_bomb_is_contained_and_does_not_stall_the_event_loop(code):
    t = PythonTool(timeout=1.5)
    tick = Ticker()
    before = children()
    async with anyio.create_task_group() as tg:
        tg.start_soon(tick)
        with pytest.raises(ToolError, match="timed out|CPU time"):
            await run(t, code)
        tg.cancel_scope.cancel()
    # Not a speed check: a loop blocked by the child would be held for the whole run (the 1.5 s
    # timeout) and tick at most once; a loaded machine's hiccups are far shorter than that.
    assert tick.ticks >= 2 and tick.max_gap < t.timeout, (tick.ticks, tick.max_gap)
    assert children() <= before
    out = await run(PythonTool(), "import os; os.fork()")
    assert "sandbox: os.fork refused" in out


@pytest.mark.parametrize("kind", ["kernel", "unsafe_subprocess"])
async def test_cancellation_kills_the_child_and_removes_scratch(tmp_path, kind):
    t = PythonTool(timeout=60, scratch_root=str(tmp_path), sandbox=kind)
    before = children()
    with anyio.move_on_after(1.0) as scope:
        await run(t, "import time\nwhile True: time.sleep(0.05)")
    assert scope.cancelled_caught
    assert children() <= before and list(tmp_path.iterdir()) == []


async def test_output_is_capped_and_drained():
    t = PythonTool(max_output_bytes=1000)
    out = await run(t, "import sys\nprint('x' * 200000)\nprint('e' * 5000, file=sys.stderr)\nprint('done', file=sys.stderr)")
    assert out.startswith("x" * 1000 + "\n...(stdout truncated: 199001 more bytes)\n" + "e" * 1000)
    assert out.endswith("...(stderr truncated: 4006 more bytes)")  # the child was never blocked on a full pipe


async def test_through_the_registry_calls_run_in_parallel_and_time_out():
    reg = ToolRegistry([PythonTool(timeout=30)])
    code = "import time; time.sleep(1); print('ok')"
    before = children()
    res = await reg.execute_calls(
        [ToolCall("python", {"code": code}, ""), ToolCall("python", {"code": code}, ""),
         ToolCall("python", {"code": "import time; time.sleep(100)"}, "")],
        context=ToolContext("t"), timeout=3, max_parallel=3,
    )
    assert [r.content for r in res[:2]] == ["ok", "ok"]
    assert res[2].error_kind == "timeout" and res[2].content == "Error: tool 'python' timed out after 3 seconds"
    assert children() <= before
    bad = await reg.execute_calls([ToolCall("python", {"source": "1"}, "")], context=ToolContext("t"), timeout=3, max_parallel=1)
    assert bad[0].error_kind == "bad_arguments" and "'code' is a required property" in bad[0].content


async def test_max_concurrent_interpreters_across_trajectories():
    tool = PythonTool(max_concurrent=2, timeout=30)
    reg = ToolRegistry([tool])
    code = "import time; a = time.time(); time.sleep(0.4); print(a, time.time())"
    spans: list[tuple[float, float]] = []

    async def trajectory(i: int) -> None:
        res = await reg.execute_calls([ToolCall("python", {"code": code}, "")] * 2, context=ToolContext(f"t{i}"),
                                      timeout=30, max_parallel=2)
        for r in res:
            a, b = map(float, r.content.split())
            spans.append((a, b))

    async with anyio.create_task_group() as tg:
        for i in range(3):
            tg.start_soon(trajectory, i)
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans], key=lambda x: (x[0], x[1]))
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    assert len(spans) == 6 and peak == 2


async def test_sandbox_start_failure_is_reported_as_such(tmp_path):
    from agentloop.tools.sandbox import SandboxUnavailable

    missing = str(tmp_path / "no-such-python")
    with pytest.raises(SandboxUnavailable, match="cannot inspect the interpreter .*no-such-python"):
        await run(PythonTool(python=missing), "print(1)")
    t = PythonTool(python=missing, sandbox="unsafe_subprocess")
    with pytest.raises(FileNotFoundError):  # the worker cannot start the interpreter at all
        await run(t, "print(1)")
    for tool in (PythonTool(python=missing), t):
        res = await ToolRegistry([tool]).execute_calls([ToolCall("python", {"code": "1"}, "")], context=ToolContext("t"),
                                                       timeout=10, max_parallel=1)
        assert not res[0].ok and res[0].error_kind == "exception" and "no-such-python" in res[0].content


def test_config_errors():
    with pytest.raises(ValueError, match="sandbox must be one of"):
        PythonTool(sandbox="none")
    with pytest.raises(ValueError, match="needs sandbox_fusion_url"):
        PythonTool(sandbox="sandbox_fusion")


async def test_site_packages_only_when_allowed():
    assert "ModuleNotFoundError: No module named 'yaml'" in await run(PythonTool(), "import yaml")
    assert await run(PythonTool(allow_site_packages=True), "import yaml; print(yaml.safe_load('a: 1'))") == "{'a': 1}"
