"""The chaos soak (`benchmarks/soak.py`, issue 15) runs in CI in its `--smoke` configuration through
`agentloop bench soak`: faults of every family are injected (issue 29's included: `os._exit`, a GIL
hog, a spinning thread and a forking tool in tool workers; a 60 MiB endpoint request), no sample is
lost, and the command exits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_soak_smoke_injects_faults_and_loses_nothing(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run([sys.executable, "-m", "agentloop", "bench", "soak", "--smoke", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads((tmp_path / "soak_cpu_smoke.json").read_text())
    assert (tmp_path / "soak_cpu_smoke.png").read_bytes().startswith(b"\x89PNG")
    assert r["complete"] and r["steps_completed"] == r["steps_requested"] == 2
    kinds = set(r["faults_injected"])
    assert {"hang", "raise_value_error", "slow_network", "row_empty_messages"} <= kinds, kinds
    # Issue 29: tools that end or freeze their process (in a tool worker) and a 60 MiB endpoint request.
    assert {"process_exit", "gil_hog", "spin_thread", "fork_child", "huge_endpoint_request"} <= kinds, kinds
    for refusal in r["endpoint_refusals"]:
        assert refusal["status"] == 400 and refusal["code"] == "context_length_exceeded"
        assert not refusal["rendered"]
    assert r["tool_workers_at_end"] == 0  # every worker (and every child a tool forked) is gone
    assert r["lost"] == 0
    launched = r["samples_launched"]
    assert launched > 0 and sum(r["accounted"].values()) == launched
    assert all(step["error"] is None for step in r["per_step"])
    assert sum(step["tool_errors"] for step in r["per_step"]) > 0  # the hostile calls were answered as tool errors
    assert r["resources"] and all(k in r["resources"][0] for k in ("rss_mb", "fds", "tasks", "threads"))
