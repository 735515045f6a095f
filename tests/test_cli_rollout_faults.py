"""Issue 15, `agentloop rollout` as a real subprocess: every configuration problem is found before
any engine starts (exit 2, naming the file and line), and a disk that fills during the run stops it
with a clear message and exit code, keeping only whole JSONL lines and saying where the data is.

The configuration cases give an engine URL nobody listens on: had the command started (or tried) an
engine first, it would exit 1 ("cannot reach"); exit 2 with the problem proves the check came first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

DEAD_URL = "http://127.0.0.1:9"  # discard port: nothing answers


def rollout(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "agentloop", "rollout", "--quiet", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def assert_refused_before_start(r: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "cannot reach" not in r.stderr, r.stderr[-2000:]
    for n in needles:
        assert n in r.stderr, (n, r.stderr)


def test_bad_tools_yaml_is_refused_before_any_engine_starts_naming_file_and_line(tmp_path: Path) -> None:
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: agentloop.tools.builtin.calculator.CalculatorTool\n"
                     "  - class_name: no.such.module.Tool\n")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"runtime:\n  agent:\n    tools: {tools}\n")
    out = tmp_path / "out"
    r = rollout("--config", str(cfg), "--engine-url", DEAD_URL, "--out", str(out))
    assert_refused_before_start(r, f"{tools}:3: tools[1].class_name: cannot load 'no.such.module.Tool'")
    assert not out.exists()

    tools.write_text("tools:\n  - class_name: agentloop.tools.builtin.calculator.CalculatorTool\n    config: {}\n"
                     "    config: {max_length: 3}\n")
    r = rollout("--config", str(cfg), "--engine-url", DEAD_URL, "--out", str(out))
    assert_refused_before_start(r, f"{tools}:4:5: not valid YAML: duplicated key 'config' (first given at line 3)")

    tools.write_text("tools: [\n")
    r = rollout("--config", str(cfg), "--engine-url", DEAD_URL, "--out", str(out))
    assert_refused_before_start(r, f"{tools}:2:1: not valid YAML")


def test_a_duplicated_key_in_the_config_file_is_an_error(tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("steps: 2\nruntime:\n  agent:\n    sampling:\n      temperature: 0.5\n      temperature: 0.7\n")
    r = rollout("--config", str(cfg), "--engine-url", DEAD_URL, "--out", str(tmp_path / "out"))
    assert_refused_before_start(r, f"{cfg}:6:7: invalid YAML: duplicated key 'temperature' (first given at line 5)")


@pytest.mark.parametrize("where", ["under_a_file", "proc"])
def test_an_output_folder_that_cannot_be_written_is_refused_before_any_engine_starts(tmp_path: Path, where: str) -> None:
    if where == "under_a_file":
        blocker = tmp_path / "a_file"
        blocker.write_text("x")
        out, says = blocker / "out", f"--out {blocker / 'out'}: {blocker} is not a folder"
    else:  # a folder nobody may create files in, whatever the permissions say (root included)
        out, says = Path("/proc/agentloop-out"), ("--out /proc/agentloop-out: cannot be created: its nearest existing "
                                                  "parent, /proc, does not accept new files or folders (the system says:")
    r = rollout("--engine-url", DEAD_URL, "--out", str(out))
    assert_refused_before_start(r, says)


def test_an_unreadable_dataset_is_refused_before_any_engine_starts(tmp_path: Path) -> None:
    data = tmp_path / "rows.jsonl"
    data.symlink_to("/proc/self/mem")  # a regular file whose first read fails (EIO)
    r = rollout("--data", str(data), "--engine-url", DEAD_URL, "--out", str(tmp_path / "out"))
    assert_refused_before_start(r, f"{data}: cannot read the dataset file")


@pytest.fixture
def tiny_disk(tmp_path: Path):
    """A 100 KB tmpfs: a real full disk. Skipped where mounting is not permitted."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=100k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.slow
def test_disk_full_stops_the_run_clearly_keeping_whole_lines(tiny_disk: Path) -> None:
    out = tiny_disk / "out"
    r = rollout("--out", str(out), "--steps", "2", "--max-new-tokens", "48", timeout=300)
    assert r.returncode == 74, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr and "ExceptionGroup" not in r.stderr, r.stderr[-3000:]
    assert "No space left on device" in r.stderr
    partial = out / "trajectories.jsonl.partial"
    text = partial.read_text(encoding="utf-8")
    assert text and text.endswith("\n"), "the last line was cut"
    rows = [json.loads(line) for line in text.splitlines()]  # every line is a whole trajectory
    assert f"{len(rows)} complete trajectories (whole lines) are in {partial}" in r.stderr
    assert len({row["uid"] for row in rows}) == len(rows)
    summary = out / "summary.json"
    if summary.exists():  # written when it fit; then it says what failed
        s = json.loads(summary.read_text())
        assert any("No space left on device" in e for e in s["write_errors"])
    else:
        assert "summary.json: No space left on device" in r.stderr
