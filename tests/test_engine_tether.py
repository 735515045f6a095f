"""Engine processes agentloop launches die with the process that launched them (`agentloop.engine.tether`).

- a Python process stops a `Runtime` with an embedded CPU engine normally (after two steps): the
  engine is gone and its port free; then it runs a `Runtime` with two engines (two steps done, a
  third in flight) and is SIGKILLed: within seconds no engine process of it is left and their ports
  are free;
- an SGLang launch (`SGLangServer`; a stand-in `sglang.launch_server` module whose child sets its own
  death signal first thing, as sglang 0.5.17's scheduler and detokenizer do) is taken down whole
  when its launcher is SIGKILLed, and a normal stop still ends the whole process group;
- the classic pitfall: a server started from a thread that then ends keeps running (the kernel
  watches the forking *thread*; agentloop forks from one thread that lives as long as the process).
Deaths are polled for (a deadline, no fixed sleeps).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Callable

import anyio
import pytest

from agentloop.engine.launch import SGLangLaunchConfig, SGLangServer
from agentloop.engine.tether import TETHER_AVAILABLE, popen_tethered

pytestmark = [pytest.mark.skipif(not TETHER_AVAILABLE, reason="PR_SET_PDEATHSIG is Linux-only"), pytest.mark.anyio]
REPO = Path(__file__).resolve().parents[1]
DEADLINE = 60.0  # generous for a loaded 2-core machine; a pass takes well under a second after the kill


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet is dead: it holds no port and no memory)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def port_free(port: int) -> bool:
    """Nobody listens on 127.0.0.1:port (SO_REUSEADDR: sockets left in TIME_WAIT do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_until(cond: Callable[[], bool], what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > DEADLINE:
            raise AssertionError(f"not within {DEADLINE:.0f}s: {what}")
        time.sleep(0.05)
    return time.monotonic() - t0


def child_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]), **extra}


# ---------------------------------------------------------------------- a runtime with embedded engines
RUNTIME_PROGRAM = textwrap.dedent("""
    import json, sys, anyio
    from agentloop.runtime import Runtime
    from agentloop.types import Sample

    replay = {"prompt_tokens": 10, "turns": [{"gen_tokens": 8, "tool_latency_s": 0.05, "tool_result_tokens": 3}]}

    def samples(prefix, n=4, turns=2):
        return [Sample(uid=f"{prefix}{i}", messages=[{"role": "user", "content": "x"}], agent="replay",
                       extra={"replay": dict(replay, turns=replay["turns"] * turns)}) for i in range(n)]

    async def two_steps(rt):
        for step in range(2):
            res = await rt.step(samples(f"s{step}-"))
            assert [t.status for t in res.trajectories] == ["completed"] * 4, [t.error for t in res.trajectories]
        return [{"pid": p.pid, "port": p.port} for p in rt.processes]

    async def main():
        def cfg(n):
            return {"engine": {"model": sys.argv[1], "num_local_servers": n, "local": {"num_threads": 1}},
                    "agent": {"sampling": {"temperature": 0.0}}}
        async with Runtime(cfg(1)) as rt:  # the normal stop path
            engines = await two_steps(rt)
        print(json.dumps(engines), flush=True)
        rt = Runtime(cfg(2))
        await rt.start()
        print(json.dumps(await two_steps(rt)), flush=True)
        await rt.step(samples("long-", n=8, turns=400))  # killed in the middle of it
        print("NOT KILLED", flush=True)

    anyio.run(main)
""")


@pytest.mark.slow
def test_engines_stop_with_their_runtime_and_die_with_its_sigkilled_process(random_model_dir: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", RUNTIME_PROGRAM, str(random_model_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env())
    engines: list[dict[str, int]] = []
    try:
        assert proc.stdout is not None and proc.stderr is not None

        def engines_line() -> list[dict[str, int]]:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                proc.wait(30)
                raise AssertionError(f"the runtime program ended early (code {proc.returncode}): {proc.stderr.read()}")  # type: ignore[union-attr]
            return json.loads(line)

        stopped = engines_line()  # after `async with Runtime` returned: stopped, not merely asked to
        engines += stopped
        assert len(stopped) == 1 and not alive(stopped[0]["pid"]) and port_free(stopped[0]["port"])
        running = engines_line()  # two steps done; a third in flight
        engines += running
        assert len(running) == 2 and all(alive(e["pid"]) and not port_free(e["port"]) for e in running), running
        proc.kill()
        assert proc.wait(30) == -signal.SIGKILL
        wait_until(lambda: not any(alive(e["pid"]) for e in running), f"engine processes {running} gone")
        wait_until(lambda: all(port_free(e["port"]) for e in running), f"engine ports {running} free")
    finally:
        for e in engines:  # only if the test failed: leave nothing behind
            if alive(e["pid"]):
                os.kill(e["pid"], signal.SIGKILL)
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------------- an SGLang launch: the whole tree
FAKE_SGLANG = textwrap.dedent('''
    """Stand-in for `python -m sglang.launch_server`: like sglang 0.5.17 it starts a child with the
    spawn method, the child's first act is its own parent-death signal (kill_itself_when_parent_died),
    and the parent waits for the child to report ready (sglang's scheduler pipe)."""
    import ctypes, multiprocessing as mp, os, signal, sys, time

    def scheduler(pipe):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)
        pipe.send("ready")
        time.sleep(600)

    if __name__ == "__main__":
        mp.set_start_method("spawn", force=True)
        reader, writer = mp.Pipe(duplex=False)
        child = mp.Process(target=scheduler, args=(writer,))
        child.start()
        assert reader.recv() == "ready"
        with open(os.environ["FAKE_SGLANG_PIDS"] + ".tmp", "w") as f:
            f.write(f"{os.getpid()} {child.pid}")
        os.rename(os.environ["FAKE_SGLANG_PIDS"] + ".tmp", os.environ["FAKE_SGLANG_PIDS"])
        child.join()
''')

LAUNCHER = textwrap.dedent("""
    import sys, anyio
    from agentloop.engine.launch import SGLangLaunchConfig, SGLangServer

    server = SGLangServer(SGLangLaunchConfig(model_path="unused"), log_path=sys.argv[1],
                          env={"PYTHONPATH": sys.argv[2], "FAKE_SGLANG_PIDS": sys.argv[3]})
    anyio.run(server.start, 600.0)  # never ready: the stand-in serves no HTTP
""")


def fake_sglang(tmp_path: Path) -> tuple[Path, Path]:
    pkg = tmp_path / "fake" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(FAKE_SGLANG)
    return tmp_path / "fake", tmp_path / "pids"


def read_pids(pids: Path) -> list[int]:
    wait_until(pids.exists, f"the stand-in server wrote {pids}")
    return [int(p) for p in pids.read_text().split()]


@pytest.mark.slow
def test_a_sglang_launch_dies_whole_with_its_sigkilled_launcher(tmp_path: Path) -> None:
    fake, pids_file = fake_sglang(tmp_path)
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path / "server.log"), str(fake), str(pids_file)],
                                env=child_env())
    pids: list[int] = []
    try:
        pids = read_pids(pids_file)
        assert all(alive(p) for p in pids)
        launcher.kill()
        launcher.wait(30)
        wait_until(lambda: not any(alive(p) for p in pids), f"the server {pids[0]} and its child {pids[1]} gone")
    finally:
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)
        launcher.kill()
        launcher.wait()


@pytest.mark.slow
async def test_a_cancelled_sglang_launch_stops_its_whole_process_group(tmp_path: Path) -> None:
    fake, pids_file = fake_sglang(tmp_path)
    server = SGLangServer(SGLangLaunchConfig(model_path="unused"), log_path=tmp_path / "server.log",
                          env={"PYTHONPATH": str(fake), "FAKE_SGLANG_PIDS": str(pids_file)})
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.start, 600.0)
        pids = await anyio.to_thread.run_sync(read_pids, pids_file)
        assert all(alive(p) for p in pids)
        tg.cancel_scope.cancel()  # start() stops what it launched, cancelled or not
    assert server.proc is None
    # the group was signalled: the child too, though its parent went first (it exits on its own time
    # after the signal: poll, a loaded machine took longer than the first look in one CI run)
    await anyio.to_thread.run_sync(wait_until, lambda: not any(alive(p) for p in pids), "the launched group is gone")


# ---------------------------------------------------------------------- the forking-thread pitfall
def test_a_server_started_from_a_thread_that_ends_keeps_running() -> None:
    started: list[subprocess.Popen[bytes]] = []
    native: list[int] = []

    def launch() -> None:
        native.append(threading.get_native_id())
        started.append(popen_tethered([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True))

    t = threading.Thread(target=launch)
    t.start()
    t.join()
    proc = started[0]
    try:
        # the OS thread is gone (not only its Python state): a death signal tied to it would have fired
        wait_until(lambda: not Path(f"/proc/self/task/{native[0]}").exists(), "the launching thread exited")
        assert proc.poll() is None and alive(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def test_a_tethered_process_dies_with_its_sigkilled_launcher() -> None:
    program = ("import sys; from agentloop.engine.tether import popen_tethered; "
               "p = popen_tethered([sys.executable, '-c', 'import time; time.sleep(600)']); "
               "print(p.pid, flush=True); p.wait()")
    launcher = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True, env=child_env())
    assert launcher.stdout is not None
    pid = int(launcher.stdout.readline())
    try:
        assert alive(pid)
        launcher.kill()
        launcher.wait(30)
        wait_until(lambda: not alive(pid), f"tethered process {pid} gone")
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_missing_executable_is_refused_like_popen() -> None:
    with pytest.raises(FileNotFoundError):
        popen_tethered(["/nonexistent/agentloop-engine"])
