"""`agentloop.engine.launch`: SGLang's command line, readiness, logs, and stopping the process group.

SGLang itself needs a GPU, so these tests put a stand-in `sglang/launch_server.py` first on
PYTHONPATH: it parses SGLang's flags, forks a long-lived child (as SGLang forks its scheduler and
detokenizer), then serves the real CPU engine (`agentloop serve`) on the given host/port and prints
SGLang's ready line. That exercises everything launch.py owns against real processes and real HTTP.
The real thing runs in tests/gpu (see `benchmarks/results/gpu_*.json`).
"""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
from pathlib import Path

import anyio
import pytest

from agentloop.engine.launch import (
    QWEN2_05B_CONFIG, READY_LINE, LaunchError, SGLangLaunchConfig, SGLangServer, free_port, start_servers,
    write_dummy_model)

FAKE = textwrap.dedent(f'''
    """Stand-in for `python -m sglang.launch_server` (test double of the process, real CPU engine inside)."""
    import argparse, os, subprocess, sys, time, urllib.request
    p = argparse.ArgumentParser()
    p.add_argument("--model-path"); p.add_argument("--host"); p.add_argument("--port", type=int)
    args, rest = p.parse_known_args()
    mode = os.environ.get("FAKE_SGLANG_MODE", "ok")
    print("fake sglang argv:", sys.argv[1:], flush=True)
    if mode == "exit":
        print("RuntimeError: CUDA out of memory (fake)", flush=True)
        sys.exit(3)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("scheduler pid", child.pid, flush=True)
    serve = subprocess.Popen([sys.executable, "-m", "agentloop.cli", "serve", "--model", args.model_path,
                              "--host", args.host, "--port", str(args.port), "--num-threads", "1",
                              "--log-level", "warning"])
    if mode == "ok":
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://{{args.host}}:{{args.port}}/model_info", timeout=1)
                print("{READY_LINE}", flush=True)
                break
            except OSError:
                time.sleep(0.1)
    serve.wait()
''')


@pytest.fixture(scope="module")
def fake_sglang(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("fake_sglang")
    (root / "sglang").mkdir()
    (root / "sglang" / "__init__.py").write_text("")
    (root / "sglang" / "launch_server.py").write_text(FAKE)
    return {"PYTHONPATH": os.pathsep.join([str(root), *sys.path])}


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return not re.search(r"^State:\s+Z", state, re.M)


def test_argv_has_the_flags_the_runtime_needs(tmp_path: Path) -> None:
    cfg = SGLangLaunchConfig(model_path=str(tmp_path), load_format="dummy", mem_fraction_static=0.3, tp_size=2,
                             extra_args=("--context-length", "4096"))
    a = cfg.argv(31000)
    assert a[1:3] == ["-m", "sglang.launch_server"]
    joined = " ".join(a)
    for flag in ("--enable-memory-saver", "--skip-tokenizer-init", "--host 127.0.0.1", "--port 31000",
                 "--mem-fraction-static 0.3", "--attention-backend triton", "--sampling-backend pytorch",
                 "--load-format dummy", "--tp-size 2", "--cuda-graph-backend-decode disabled",
                 "--cuda-graph-backend-prefill disabled"):
        assert flag in joined, flag
    assert a[-2:] == ["--context-length", "4096"]
    graphs = " ".join(SGLangLaunchConfig(model_path="m", cuda_graph=True, cuda_graph_max_bs=32).argv(1))
    assert "--cuda-graph-max-bs-decode 32" in graphs and "--cuda-graph-backend-decode" not in graphs
    with pytest.raises(ValueError):
        SGLangServer()
    with pytest.raises(ValueError):
        SGLangServer(cfg, url="http://127.0.0.1:1")


def test_write_dummy_model(tmp_path: Path) -> None:
    d = write_dummy_model(tmp_path / "m")
    assert json.loads((d / "config.json").read_text()) == QWEN2_05B_CONFIG
    assert sorted(p.name for p in d.iterdir()) == ["config.json"]


async def test_start_waits_for_ready_then_stop_ends_the_whole_group(fake_sglang, random_model_dir, tmp_path) -> None:
    log = tmp_path / "sglang.log"
    server = SGLangServer(SGLangLaunchConfig(model_path=str(random_model_dir)), log_path=log, env=fake_sglang)
    url = await server.start(timeout=120)
    assert url == server.url and url.startswith("http://127.0.0.1:")
    text = log.read_text()
    assert READY_LINE in text and "--enable-memory-saver" in text.splitlines()[0]  # the command heads the log
    scheduler = int(re.search(r"scheduler pid (\d+)", text).group(1))
    async with server.client() as c:
        assert (await c.model_info())["model_path"] == str(random_model_dir)
    assert running(scheduler)
    await server.stop(timeout=10)
    assert server.proc is None
    with anyio.fail_after(10):
        while running(scheduler):  # the forked child went with its group
            await anyio.sleep(0.1)
    await server.stop()  # idempotent


async def test_exit_during_startup_is_a_launch_error_with_the_log(fake_sglang, random_model_dir, tmp_path) -> None:
    server = SGLangServer(SGLangLaunchConfig(model_path=str(random_model_dir)), log_path=tmp_path / "x.log",
                          env={**fake_sglang, "FAKE_SGLANG_MODE": "exit"})
    with pytest.raises(LaunchError, match=r"(?s)exited with code 3.*CUDA out of memory \(fake\)"):
        await server.start(timeout=60)
    assert server.proc is None


async def test_not_ready_in_time_stops_the_server(fake_sglang, random_model_dir, tmp_path) -> None:
    # serves /model_info but never logs the ready line (SGLang still warming up)
    server = SGLangServer(SGLangLaunchConfig(model_path=str(random_model_dir)), log_path=tmp_path / "y.log",
                          env={**fake_sglang, "FAKE_SGLANG_MODE": "noready"})
    with pytest.raises(LaunchError, match="not ready after"):
        await server.start(timeout=12)
    assert server.proc is None


@pytest.mark.slow
async def test_attach_to_a_running_server_and_start_servers(fake_sglang, random_model_dir, tmp_path) -> None:
    port = free_port()
    launched = SGLangServer(SGLangLaunchConfig(model_path=str(random_model_dir), port=port),
                            log_path=tmp_path / "z.log", env=fake_sglang)
    (url,) = await start_servers([launched], timeout=120)
    try:
        assert url == f"http://127.0.0.1:{port}"
        attached = SGLangServer.attach(url + "/")
        assert await attached.start(timeout=10) == url and not attached.launched
        await attached.stop()  # not ours: nothing happens
        async with attached.client() as c:
            assert (await c.model_info())["weight_version"]
    finally:
        await launched.stop()
    # one failure stops the others (different GPUs: concurrent starts)
    ok = SGLangServer(SGLangLaunchConfig(model_path=str(random_model_dir), gpu_ids=[0]), log_path=tmp_path / "a.log",
                      env=fake_sglang)
    bad = SGLangServer(SGLangLaunchConfig(model_path=str(random_model_dir), gpu_ids=[1]), log_path=tmp_path / "b.log",
                       env={**fake_sglang, "FAKE_SGLANG_MODE": "exit"})
    with pytest.raises(LaunchError):
        await start_servers([ok, bad], timeout=120)
    assert ok.proc is None and bad.proc is None
    # on one GPU: one after another, and a failure stops the rest before they start
    bad2 = SGLangServer(SGLangLaunchConfig(model_path=str(random_model_dir)), log_path=tmp_path / "c.log",
                        env={**fake_sglang, "FAKE_SGLANG_MODE": "exit"})
    never = SGLangServer(SGLangLaunchConfig(model_path=str(random_model_dir)), log_path=tmp_path / "d.log",
                         env=fake_sglang)
    with pytest.raises(LaunchError):
        await start_servers([bad2, never], timeout=120)
    assert not (tmp_path / "d.log").exists()


async def test_command_line_serves_until_sigterm(fake_sglang, random_model_dir, tmp_path) -> None:
    import signal
    import subprocess

    ready, log = tmp_path / "url", tmp_path / "server.log"
    cli = subprocess.Popen([sys.executable, "-m", "agentloop.engine.launch", "--model-path", str(random_model_dir),
                            "--log", str(log), "--ready-file", str(ready), "--", "--context-length", "2048"],
                           env={**os.environ, **fake_sglang}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        with anyio.fail_after(120):
            while not ready.exists():
                assert cli.poll() is None, cli.stdout.read().decode()
                await anyio.sleep(0.2)
        url = ready.read_text().strip()
        from agentloop.engine.sglang import SGLangClient

        async with SGLangClient(url) as c:
            assert (await c.model_info())["model_path"] == str(random_model_dir)
        text = log.read_text()
        assert "--context-length 2048" in text.splitlines()[0]
        scheduler = int(re.search(r"scheduler pid (\d+)", text).group(1))
        cli.send_signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(lambda: cli.wait(60)) == 0
        assert "READY http://127.0.0.1:" in cli.stdout.read().decode()
        with anyio.fail_after(10):
            while running(scheduler):
                await anyio.sleep(0.1)
    finally:
        if cli.poll() is None:
            cli.kill()
