"""`agentloop.allocator.tune_allocator`: glibc's mmap and trim thresholds pinned so that big transient
buffers go back to the system (issue 29's soak: RSS ratcheted 365 -> 651 MB with glibc's defaults).

Every call that changes the allocator runs in a subprocess (mallopt would stay set in this test
process). The effect check frees one 16 MiB buffer first — freed, it raises glibc's *dynamic* mmap
threshold to 16 MiB (a buffer over 32 MiB would not: glibc caps the adjustment there) — then
allocates 200 buffers of 1 MiB and frees every other one: with the defaults they came from the heap
and the freed ones, between live ones, stay resident; tuned, each was its own mapping and is unmapped.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

import agentloop.allocator as allocator

SRC = Path(__file__).resolve().parents[1] / "src"
MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def _is_glibc() -> bool:
    try:
        ctypes.CDLL(None).gnu_get_libc_version  # noqa: B018
    except (OSError, AttributeError, TypeError):
        return False
    return True


glibc_only = pytest.mark.skipif(not (sys.platform.startswith("linux") and _is_glibc()), reason="glibc on Linux only")

PROBE = textwrap.dedent("""
    import json, os, sys
    from agentloop.allocator import tune_allocator

    def rss_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    records = [tune_allocator().__dict__ for _ in range(int(sys.argv[1]))]
    big = b"\\x01" * (16 << 20)  # freed, it raises the dynamic mmap threshold (when not pinned)
    del big
    bufs = [b"\\x02" * (1 << 20) for _ in range(200)]
    peak = rss_mb()
    del bufs[::2]  # 100 MiB freed between 100 MiB still alive
    print(json.dumps({"records": records, "peak_mb": peak, "after_mb": rss_mb()}))
""")


def probe(calls: int, **env: str) -> dict:
    """Run PROBE in a fresh interpreter: `calls` calls of tune_allocator (0: glibc's defaults), then the
    allocation pattern; the environment without the operator's malloc settings, plus `env`."""
    clean = {k: v for k, v in os.environ.items() if k not in MALLOC_ENV}
    clean["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", PROBE, str(calls)], env={**clean, **env}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@glibc_only
def test_tuned_process_returns_freed_big_buffers_and_the_defaults_keep_them():
    tuned = probe(1)
    assert tuned["records"][0] == {"applied": True, "set": {"mmap_threshold": 131072, "trim_threshold": 131072},
                                   "left": {}, "reason": "mmap_threshold = 131072 bytes; trim_threshold = 131072 bytes"}
    assert tuned["peak_mb"] - tuned["after_mb"] > 90, tuned  # the 100 MiB freed went back to the system
    default = probe(0)
    assert default["peak_mb"] - default["after_mb"] < 10, default  # glibc's defaults: it stays resident


@glibc_only
def test_idempotent_the_first_record_comes_back():
    out = probe(3)
    assert out["records"][0]["applied"] and out["records"][1:] == out["records"][:1] * 2
    assert out["peak_mb"] - out["after_mb"] > 90, out


@glibc_only
@pytest.mark.parametrize("env", [{"MALLOC_MMAP_THRESHOLD_": str(32 << 20)},
                                 {"GLIBC_TUNABLES": f"glibc.malloc.check=0:glibc.malloc.mmap_threshold={32 << 20}"}])
def test_the_operators_mmap_threshold_is_left_alone(env):
    out = probe(1, **env)
    rec = out["records"][0]
    where = next(iter(env))
    assert rec["applied"] and rec["set"] == {"trim_threshold": 131072} and rec["left"] == {"mmap_threshold": where}, rec
    assert f"mmap_threshold left to {where}" in rec["reason"]
    # The operator's 32 MiB threshold rules: the 1 MiB buffers came from the heap and stay resident.
    assert out["peak_mb"] - out["after_mb"] < 10, out


def test_which_settings_count_as_the_operators():
    seen = allocator._operator_setting
    assert seen("trim_threshold", {"MALLOC_TRIM_THRESHOLD_": "1"}) == "MALLOC_TRIM_THRESHOLD_"
    assert seen("trim_threshold", {"MALLOC_TRIM_THRESHOLD": "1"}) is None  # glibc reads it with the underscore
    assert seen("trim_threshold", {"MALLOC_TRIM_THRESHOLD_": ""}) is None
    assert seen("mmap_threshold", {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}) is None
    assert seen("trim_threshold", {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}) == "GLIBC_TUNABLES"


def test_off_glibc_it_does_nothing(monkeypatch):
    monkeypatch.setattr(allocator, "_glibc", lambda: None)
    rec = allocator._tune({})
    assert not rec.applied and rec.set == {} and "not glibc" in rec.reason


def test_both_knobs_left_to_the_operator_means_nothing_applied():
    if not _is_glibc():
        pytest.skip("glibc only")
    rec = allocator._tune({"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"})  # sets nothing
    assert not rec.applied and rec.set == {}
    assert rec.left == {"mmap_threshold": "MALLOC_MMAP_THRESHOLD_", "trim_threshold": "MALLOC_TRIM_THRESHOLD_"}


# ------------------------------------------------------------------ where it is called
def test_runtime_start_leaves_the_allocator_to_the_process_owner(monkeypatch):
    """A trainer embeds the runtime in its own process: pinned thresholds slowed its CPU torch work."""
    import agentloop.allocator as alloc
    from agentloop.runtime import Runtime

    from test_scheduler_support import FakeEngine

    calls = []  # below tune_allocator, so a call by any import path is seen
    monkeypatch.setattr(alloc, "_done", None)
    monkeypatch.setattr(alloc, "_tune", lambda env: calls.append(1) or alloc.AllocatorTuning(False, "test"))
    tok = types.SimpleNamespace(pad_token_id=0, eos_token_id=2)
    with Runtime(clients=[FakeEngine("http://a")], tokenizer=tok, tools=object()):
        assert calls == []


@pytest.mark.parametrize("command, tuned", [("rollout", True), ("bench", True), ("serve", False), ("config", False)])
def test_the_cli_tunes_the_allocator_for_its_runtime_commands(monkeypatch, command, tuned):
    import agentloop.allocator as alloc
    import agentloop.cli as cli

    calls = []
    monkeypatch.setattr(alloc, "tune_allocator", lambda: calls.append(1))
    module = types.SimpleNamespace(run=lambda args: 0)
    monkeypatch.setattr(cli.importlib, "import_module", lambda name: module)
    monkeypatch.setattr(cli, "build_parser", lambda: _parser_with(command))
    assert cli.main([command]) == 0
    assert calls == ([1] if tuned else [])


def _parser_with(command):
    import argparse

    p = argparse.ArgumentParser()
    p.add_subparsers(dest="command").add_parser(command)
    return p


def test_the_ray_rollout_worker_tunes_the_allocator(monkeypatch):
    import agentloop.distributed.worker as worker

    calls = []
    monkeypatch.setattr(worker, "tune_allocator", lambda: calls.append(1))
    tok = types.SimpleNamespace(pad_token_id=0, eos_token_id=2)
    worker.RolloutWorker(0, {}, ["http://127.0.0.1:9"], out={}, tokenizer=tok, tools=object())
    assert calls == [1]


def test_the_serve_command_does_not_tune_the_allocator():
    """It halved the CPU engine's throughput (the allocator's module docstring)."""
    import agentloop.commands.serve as serve
    import agentloop.engine.local.server as server

    for module in (serve, server):
        code = Path(module.__file__).read_text()
        assert "tune_allocator()" not in code.replace("No `agentloop.allocator.tune_allocator()` here", "")


@glibc_only
async def test_a_tool_worker_process_tuned_its_allocator_before_any_call(tmp_path, monkeypatch):
    from agentloop.tools import ToolCall, ToolContext, ToolRegistry

    (tmp_path / "allocator_probe_tool.py").write_text(textwrap.dedent("""
        import json
        from agentloop import allocator
        from agentloop.tools import Tool

        class AllocatorProbe(Tool):
            name, description = "probe", "Says whether this process tuned its allocator before the call."
            parameters = {"type": "object", "properties": {}}

            async def execute(self, arguments, context):
                before = allocator._done is not None
                return json.dumps({"before": before, "record": allocator.tune_allocator().__dict__})
    """))
    monkeypatch.syspath_prepend(str(tmp_path))  # the worker gets this process's sys.path
    for k in MALLOC_ENV:
        monkeypatch.delenv(k, raising=False)
    reg = ToolRegistry.from_config({"tools": [{"class_name": "allocator_probe_tool.AllocatorProbe"}]})
    assert reg.isolation("probe") == "process"
    try:
        r = await reg.execute_calls([ToolCall("probe", {}, "")], context=ToolContext(trajectory_id="t"), timeout=30,
                                    max_parallel=1)
        assert r[0].ok, r[0]
        seen = json.loads(r[0].content)
        assert seen["before"] and seen["record"]["applied"], seen
    finally:
        reg.close()
