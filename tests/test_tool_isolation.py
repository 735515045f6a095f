"""Tools that are not trusted run in tool worker processes (issue 29, item 3): a tool that exits the
process, holds the GIL, leaves a thread spinning or forks a child ends only its own call — that call's
tool error, on time — and the other calls (and trajectories) go on. The attacks are the issue's, from
`benchmarks/hostile_tools.py`, loaded by module path from a YAML config (the default: process)."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import anyio
import pytest

from agentloop.tools import ToolCall, ToolContext, ToolRegistry
from agentloop.tools.builtin import CalculatorTool
from agentloop.tools.registry import ToolConfigError

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

HOSTILE = ("exit", "gil_hog", "spin_thread", "fork")


def registry(tmp_path: Path, extra: str = "") -> ToolRegistry:
    p = tmp_path / "tools.yaml"
    p.write_text(textwrap.dedent("""
        tools:
          - class_name: hostile_tools.ExitTool
          - class_name: hostile_tools.GilHogTool
          - class_name: hostile_tools.SpinThreadTool
          - class_name: hostile_tools.ForkTool
          - class_name: hostile_tools.EchoTool
          - class_name: hostile_tools.CountingTool
          - class_name: hostile_tools.DaemonHelperTool
          - class_name: agentloop.tools.builtin.calculator.CalculatorTool
    """) + extra)
    return ToolRegistry.from_yaml(p)


def ctx(tid: str = "t0") -> ToolContext:
    return ToolContext(trajectory_id=tid)


def children_alive(pid: int) -> list[int]:
    from agentloop.tools.worker_pool import _descendants

    return sorted(_descendants(pid))


def test_isolation_defaults_and_overrides(tmp_path):
    reg = registry(tmp_path, "  - class_name: hostile_tools.EchoTool\n    isolation: inline\n"
                             "    tool_schema: {type: function, function: {name: echo2}}\n")
    assert [reg.isolation(n) for n in ("exit", "echo", "calculator", "echo2")] == ["process", "process", "inline", "inline"]
    assert ToolRegistry([CalculatorTool()]).isolation("calculator") == "inline"
    with pytest.raises(ToolConfigError, match=r"tools\[0\]\.isolation: must be one of \['process', 'inline'\], got 'thread'"):
        ToolRegistry.from_config({"tools": [{"class_name": "hostile_tools.EchoTool", "isolation": "thread"}]})


@pytest.mark.parametrize("attack", HOSTILE)
async def test_each_attack_ends_only_its_own_call_on_time(tmp_path, attack):
    reg = registry(tmp_path)
    try:
        # Warm a worker first, so the timing below is the attack's, not a worker start.
        first = await reg.execute_calls([ToolCall("echo", {"text": "hi"}, "")], context=ctx(), timeout=30, max_parallel=1)
        assert first[0].ok and first[0].content.startswith("hi pid=")
        worker_pid = int(first[0].content.split("pid=")[1])
        assert worker_pid != os.getpid()

        # The attack and a calculator call in the same turn; another trajectory's call at the same time.
        gaps = [0.0]

        async def heartbeat() -> None:  # the event loop must keep turning during the attack
            while True:
                t = time.monotonic()
                await anyio.sleep(0.05)
                gaps.append(time.monotonic() - t)

        async with anyio.create_task_group() as tg:
            tg.start_soon(heartbeat)
            res = await reg.execute_calls(
                [ToolCall(attack, {}, ""), ToolCall("calculator", {"expression": "6*7"}, "")],
                context=ctx("t1"), timeout=3, max_parallel=2)
            tg.cancel_scope.cancel()
        assert res[1].ok and res[1].content == "42"
        assert not res[0].ok and res[0].error_kind in ("exception", "timeout"), res[0]
        assert max(gaps) < 1.0, max(gaps)  # the loop was never frozen (inline, the GIL hog froze it 36 s)
        expected = {"exit": "ended during the call (exit status 7)", "gil_hog": "timed out after 3 seconds",
                    "spin_thread": "left 1 thread(s) running after its call (spinner)",
                    "fork": "left 1 child process(es) running"}[attack]
        assert expected in res[0].content, res[0].content

        # Nothing the attack started is left, and the next call is served by a fresh worker.
        again = await reg.execute_calls([ToolCall("echo", {"text": "again"}, "")], context=ctx("t2"), timeout=30,
                                        max_parallel=1)
        assert again[0].ok, again[0]
        for pid in reg.pool().started_pids:
            if pid != int(again[0].content.split("pid=")[1]) and pid != worker_pid:
                assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] in "ZX"
                assert children_alive(pid) == []
    finally:
        reg.close()


async def test_workers_are_reused_and_state_is_pinned_per_trajectory(tmp_path):
    reg = registry(tmp_path)
    try:
        pids = set()
        for _ in range(3):
            r = await reg.execute_calls([ToolCall("echo", {"text": "x"}, "")], context=ctx(), timeout=30, max_parallel=1)
            pids.add(r[0].content.split("pid=")[1])
        assert len(pids) == 1  # one worker served the three calls
        for _ in range(2):  # a daemon helper thread (client libraries have them) is not a leftover
            r = await reg.execute_calls([ToolCall("daemon_helper", {}, "")], context=ctx(), timeout=30, max_parallel=1)
            assert r[0].ok and r[0].content.split("pid=")[1] in pids, r[0]
        a, b = ctx("a"), ctx("b")
        async with reg.trajectory(a), reg.trajectory(b):
            out = []
            for c in (a, a, b, a):
                r = await reg.execute_calls([ToolCall("count", {}, "")], context=c, timeout=30, max_parallel=1)
                out.append(r[0].content.split()[0])
            assert out == ["1", "2", "1", "3"]  # each trajectory's own count, kept in its worker
            # The trajectory's worker dies: that call's error, then a fresh worker with the state afresh.
            r = await reg.execute_calls([ToolCall("count", {"text": "exit"}, "")], context=a, timeout=30, max_parallel=1)
            assert not r[0].ok and "exit status 3" in r[0].content
            r = await reg.execute_calls([ToolCall("count", {}, "")], context=a, timeout=30, max_parallel=1)
            assert r[0].ok and r[0].content.startswith("1 ") and "started afresh" in r[0].content
            r = await reg.execute_calls([ToolCall("count", {}, "")], context=b, timeout=30, max_parallel=1)
            assert r[0].content.startswith("2 ")  # the other trajectory's state was not touched
    finally:
        reg.close()


@pytest.mark.slow
def test_cli_rollout_with_hostile_tools_finishes_writes_everything_and_exits(tmp_path):
    """The issue's attacks through `agentloop rollout`: a tool named like the calculator (so the tiny
    model calls it) that, per trajectory, exits the process, hogs the GIL, leaves a spinning thread,
    forks a child holding stdout open, or calculates. Today: exit 7 at the first `os._exit`, nothing
    written. Isolated: every trajectory written, a summary, exit 0 — and `subprocess.run` returning at
    all proves no process (a forked child included) kept the CLI's stdout/stderr open."""
    import json
    import subprocess
    import zlib

    tools = tmp_path / "tools.yaml"
    tools.write_text(textwrap.dedent("""
        tools:
          - class_name: hostile_tools.RouletteTool
            tool_schema:
              type: function
              function:
                name: calculator
                description: Evaluate an arithmetic expression.
                parameters: {type: object, properties: {expression: {type: string}}, required: [expression]}
    """))
    out = tmp_path / "out"
    src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join([str(src), str(BENCH)])}
    r = subprocess.run(
        [sys.executable, "-m", "agentloop", "rollout", "--quiet", "--no-timeline", "--steps", "2", "--prompts-per-step",
         "4", "--n", "2", "--out", str(out), "--set", f"runtime.agent.tools={tools}",
         "--set", "runtime.agent.tool_timeout=3"],
        capture_output=True, text=True, timeout=540, env=env)
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trajectories"] == 16 and summary["steps"] == 2 and summary["error"] is None
    rows = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and all(row["status"] in ("completed", "truncated") for row in rows), \
        [(row["uid"], row["status"]) for row in rows]
    attacks = {row["uid"]: ["exit", "gil_hog", "spin_thread", "fork", "calculate"][zlib.crc32(row["uid"].encode()) % 5]
               for row in rows}
    assert {"exit", "gil_hog", "spin_thread", "fork"} <= set(attacks.values())  # each attack was made
    for needle in ("ended during the call (exit status 7)", "timed out after 3 seconds", "left 1 thread(s) running",
                   "left 1 child process(es) running"):
        assert needle in r.stderr, needle
    for row in rows:  # each call ended within its timeout plus a worker start, never the attack's length
        calls = row["metrics"]["tool_calls"]
        assert row["metrics"]["tool_seconds"] <= calls * (3 + 15), (row["uid"], attacks[row["uid"]], row["metrics"])


async def test_a_pickled_registry_starts_its_own_workers_and_objects_can_ask_for_a_process(tmp_path):
    import hostile_tools

    cloudpickle = pytest.importorskip("cloudpickle")  # what Ray sends a registry with

    class Isolated(hostile_tools.EchoTool):
        isolation = "process"

    with pytest.raises(ToolConfigError, match=r"tools\[0\]: tool 'echo' has isolation 'process' but cannot be sent"):
        ToolRegistry([Isolated()])  # a local class cannot be rebuilt in a worker: said at registration
    reg = ToolRegistry([hostile_tools.IsolatedEcho()])
    assert reg.isolation("echo") == "process"
    try:
        r = await reg.execute_calls([ToolCall("echo", {"text": "obj"}, "")], context=ctx(), timeout=30, max_parallel=1)
        assert r[0].ok and int(r[0].content.split("pid=")[1]) != os.getpid()
        copy = cloudpickle.loads(cloudpickle.dumps(reg))  # what a Ray worker gets: the tools, no processes
        assert not copy._workers.started
        r2 = await copy.execute_calls([ToolCall("echo", {"text": "copy"}, "")], context=ctx(), timeout=30, max_parallel=1)
        assert r2[0].ok and r2[0].content.split("pid=")[1] != r[0].content.split("pid=")[1]
        copy.close()
    finally:
        reg.close()
