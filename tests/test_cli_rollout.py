"""`agentloop rollout` as a real subprocess: the embedded default (tiny tool model, real tool calls),
an unreachable engine URL, running engines given by URL, and Ctrl-C in the middle of a step."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from agentloop.data import arithmetic_prompts
from agentloop.output import message_from_parquet
from agentloop.types import STATUSES, TimelineEvent, Trajectory, TurnRecord

# Short turns; the embedded engine runs one torch thread by default (the CI machine has 2 cores).
FAST = ["--quiet", "--max-new-tokens", "48"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def rollout_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "agentloop", "rollout", *args]


def run_rollout(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(rollout_cmd(*args), capture_output=True, text=True, timeout=timeout, env=env)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    text = path.read_text(encoding="utf-8")
    assert text == "" or text.endswith("\n"), "last line of the JSONL is not whole"
    return [json.loads(line) for line in text.splitlines()]


def as_trajectory(r: dict[str, Any]) -> Trajectory:
    fields = {k: v for k, v in r.items() if k not in ("step", "weight_versions")}
    fields["turns"] = [TurnRecord(**t) for t in r["turns"]]
    fields["timeline"] = [TimelineEvent(**e) for e in r["timeline"]]
    return Trajectory(**fields)


def check_outputs(out: Path, *, steps: int, interrupted: bool = False) -> list[dict[str, Any]]:
    """Files exist and agree with each other; every trajectory's ids/mask/logprobs are consistent."""
    leftovers = [p.name for p in out.iterdir() if p.name.startswith(".") or p.name.endswith((".partial", ".tmp"))]
    assert leftovers == [], f"temporary files left behind: {leftovers}"
    rows = read_jsonl(out / "trajectories.jsonl")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is interrupted
    for r in rows:
        t = as_trajectory(r)
        t.check_invariants()  # lengths agree; mask-1 spans are exactly the recorded model turns
        for m, lp in zip(t.response_mask, t.response_logprobs):
            if m == 1:
                assert lp is not None and math.isfinite(lp) and lp <= 0.0
            else:
                assert lp == 0.0
        assert t.status in STATUSES
        assert r["weight_versions"] == [turn.weight_version for turn in t.turns]
        assert len(t.prompt_ids) > 0 and t.group_id and t.uid.startswith(t.group_id)
    # summary.json counts are the JSONL's counts, per step and in total.
    total = summary["total"]
    assert {k: summary[k] for k in total} == total  # the run totals are at top level too
    assert total["trajectories"] == len(rows)
    assert total["status"] == {s: sum(r["status"] == s for r in rows) for s in STATUSES}
    assert total["tool_calls"] == sum(r["tool_calls"] for r in rows)
    assert total["generated_tokens"] == sum(sum(r["response_mask"]) for r in rows)
    assert len(summary["per_step"]) == steps
    for ps in summary["per_step"]:
        mine = [r for r in rows if r["step"] == ps["step"]]
        assert ps["trajectories"] == len(mine)
        assert ps["status"] == {s: sum(r["status"] == s for r in mine) for s in STATUSES}
        assert {"resume_weights", "update_weights", "resume_kv_cache"} <= set(ps["wake_up_stages"])
        assert {"pause", "flush_cache", "release"} <= set(ps["sleep_stages"])
        if not interrupted:  # every sampled token's staleness, counted (a step cut short reports none)
            assert sum(ps["token_staleness"].values()) == sum(sum(r["response_mask"]) for r in mine)
    # Parquet holds the same trajectories, one row each.
    table = pq.read_table(out / "trajectories.parquet").to_pylist()
    assert [(r["uid"], r["step"]) for r in table] == [(r["uid"], r["step"]) for r in rows]
    for pr, r in zip(table, rows):
        assert pr["response_ids"] == r["response_ids"] and pr["response_mask"] == r["response_mask"]
        assert [message_from_parquet(m) for m in pr["messages"]] == r["messages"]
        assert pr["turn_rewards"] == r["turn_rewards"]
    png = (out / "timeline.png").read_bytes()
    assert png[:8] == PNG_MAGIC and len(png) > 10_000
    return rows


def test_default_embedded_rollout_does_real_tool_calls(tmp_path: Path) -> None:
    """`agentloop rollout` with no engine URL: embedded CPU engine, shipped tiny tool model,
    two steps of wake → roll out → sleep; a bad data row is skipped and reported, not dropped silently."""
    data = tmp_path / "prompts.jsonl"
    lines = arithmetic_prompts().read_text().splitlines()[:8]
    data.write_text("\n".join(lines[:3] + ['{"prompt": 42}'] + lines[3:]) + "\n")
    out = tmp_path / "out"
    t0 = time.monotonic()
    res = run_rollout("--data", str(data), "--out", str(out), "--prompts-per-step", "4", "--n", "2", *FAST)
    wall = time.monotonic() - t0
    assert res.returncode == 0, res.stderr
    assert f"skipped 1 bad row(s) of {data}" in res.stderr and f"{data}:4: prompt:" in res.stderr
    rows = check_outputs(out, steps=2)
    assert len(rows) == 2 * 4 * 2
    assert [r["step"] for r in rows].count(1) == 8 and [r["step"] for r in rows].count(2) == 8
    # Step 2 takes the next prompts; GRPO groups of n=2 share their prompt's group_id.
    groups = {}
    for r in rows:
        groups.setdefault(r["group_id"], []).append(r["index_in_group"])
    assert len(groups) == 8 and all(sorted(v) == [0, 1] for v in groups.values())
    # The tiny model really calls the calculator: at least half the trajectories hold a tool call
    # and a tool result, and the tool results are the calculator's values.
    with_tools = [r for r in rows if r["tool_calls"] > 0
                  and any(m["role"] == "assistant" and m.get("tool_calls") for m in r["messages"])
                  and any(m["role"] == "tool" for m in r["messages"])]
    assert len(with_tools) >= len(rows) / 2, [r["messages"] for r in rows[:3]]
    # Multi-turn: a tool result sits between model turns, as mask-0 tokens.
    assert any(0 in r["response_mask"] and r["num_turns"] >= 2 for r in with_tools)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["bad_rows"] == 1 and summary["total"]["reward_mean"] is not None
    assert summary["total"]["trajectories_with_tool_call"] >= len(rows) / 2
    # concurrency: auto on the CPU engine is its default; every step says how busy that kept the engine.
    assert summary["concurrency"]["setting"] == "auto" and summary["concurrency"]["used"] == 64
    assert summary["concurrency"]["engine_capacity"] == 64  # the CPU engine's max running requests
    for ps in summary["per_step"]:
        use = ps["engine_use"]
        assert use["concurrency"] == 64 and use["engine_capacity"] == 64
        assert 0 < use["engine_busy_fraction"] <= 8 / 64 + 1e-9  # at most 8 trajectories per step
        assert 0 < use["generate_busy_fraction"] <= 1
    assert "concurrency 64, engine busy" in res.stderr
    # `extra` from the data row is carried through to the trajectory.
    assert all("expected_calls" in r["extra"] for r in rows)
    print(f"default rollout: {wall:.1f}s wall, {summary['total']['tokens_per_second']:.0f} tok/s")


def test_unreachable_engine_url(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    previous = out / "summary.json"
    previous.write_text('{"from": "an earlier run"}\n')
    url = "http://127.0.0.1:9"  # discard port: nothing listens there
    res = run_rollout("--engine-url", url, "--out", str(out), "--quiet", "--overwrite", timeout=120)
    assert res.returncode == 1
    assert f"cannot reach the engine server at {url}" in res.stderr
    assert "Traceback" not in res.stderr
    # Nothing was started, so the folder is untouched: no partial or corrupt files, the old file intact.
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"]
    assert previous.read_text() == '{"from": "an earlier run"}\n'


def _health(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture(scope="module")
def two_engines(start_local_engine: Any, random_model_dir: Path) -> list[str]:
    return [start_local_engine(random_model_dir), start_local_engine(random_model_dir)]


def test_engine_urls_drives_running_servers(tmp_path: Path, two_engines: list[str]) -> None:
    out = tmp_path / "out"
    args = [x for url in two_engines for x in ("--engine-url", url)]
    res = run_rollout(*args, "--out", str(out), "--prompts-per-step", "4", "--n", "2", "--steps", "2", *FAST)
    assert res.returncode == 0, res.stderr
    rows = check_outputs(out, steps=2)
    assert len(rows) == 16
    used = {url for r in rows for url in r["extra"].get("servers", [])}
    assert used == set(two_engines)  # routed across both servers
    # The engines we do not own are left as they were found (awake, serving), not stopped.
    for url in two_engines:
        assert _health(url) == 200


def signal_mid_step(cmd: list[str], sig: int, *, stop_timeout: float = 90) -> tuple[int, str, str, str]:
    """Run a rollout command, send `sig` once trajectories are finishing (mid-step), and return
    (exit code, the stderr seen before the signal, stdout, the rest of stderr)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stderr is not None
    try:
        seen = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            seen.append(line)
            if " done, " in line or not line:
                break
        assert any(" done, " in s for s in seen), "".join(seen)
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=stop_timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, "".join(seen), stdout, stderr


def test_ctrl_c_stops_cleanly(tmp_path: Path, two_engines: list[str]) -> None:
    out = tmp_path / "out"
    url = two_engines[0]
    rc, seen, stdout, stderr = signal_mid_step(
        rollout_cmd("--engine-url", url, "--out", str(out), "--prompts-per-step", "16", "--n", "2", "--steps", "5",
                    "--quiet", "--max-new-tokens", "64", "--concurrency", "8"), signal.SIGINT)
    assert rc == 130, seen + stderr
    assert "SIGINT: stopping" in stderr and "interrupted:" in stdout
    # The run stopped inside a step (signals are handled only while a step awaits the engines).
    steps = len(json.loads((out / "summary.json").read_text())["per_step"])
    assert 1 <= steps < 5
    rows = check_outputs(out, steps=steps, interrupted=True)
    # The finished trajectories, plus the ones in flight, stopped and kept as partial `aborted`
    # trajectories (consistent ids/mask/logprobs, checked above); no later step began.
    last = [r for r in rows if r["step"] == steps]
    assert 1 <= len(last) <= 16 * 2
    assert any(r["status"] == "aborted" for r in last)
    assert len(rows) == 32 * (steps - 1) + len(last)
    # Every prompt of the stopped step is listed with what became of it; one with no row never started.
    prompts = json.loads((out / "summary.json").read_text())["per_step"][-1]["prompts"]
    assert len(prompts) == 16
    for uid, status in prompts.items():
        mine = [r["status"] for r in last if r["group_id"] == uid]
        assert status == ("not_started" if not mine else "aborted" if len(mine) < 2 or "aborted" in mine
                          else max(mine, key=["completed", "truncated", "failed"].index)), (uid, status, mine)
    assert _health(url) == 200  # in-flight requests aborted, then the engine was left awake, as found


def test_one_dead_url_of_two_fails_over_to_the_live_server(tmp_path: Path, two_engines: list[str]) -> None:
    """The advertised failover holds from the start: with one server unreachable the run goes on with
    the other, says which one it left out, and writes every trajectory (from the live server)."""
    dead, live = "http://127.0.0.1:9", two_engines[1]  # discard port: nothing listens there
    out = tmp_path / "out"
    res = run_rollout("--engine-url", dead, live, "--out", str(out), "--prompts-per-step", "2", "--n", "2",
                      "--steps", "2", *FAST, timeout=300)
    assert res.returncode == 0, res.stderr
    assert dead in res.stderr and "Traceback" not in res.stderr
    rows = check_outputs(out, steps=2)
    # finished, none failed (the random model runs out of its 48 tokens: truncated is a finish too)
    assert len(rows) == 2 * 2 * 2 and all(r["status"] in ("completed", "truncated") for r in rows)
    assert {url for r in rows for url in r["extra"].get("servers", [])} == {live}
