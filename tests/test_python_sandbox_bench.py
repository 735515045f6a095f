"""The sandbox overhead benchmark still runs (`--smoke`: 3 calls per mode) and reports every mode; no
timing thresholds (speed is measured in benchmarks/, not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(300)
def test_sandbox_overhead_smoke(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "benchmarks/sandbox_overhead.py", "--smoke", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "sandbox_overhead_smoke.json").read_text())
    for key in ("benchmark", "command", "date", "git_commit", "versions", "hardware", "settings", "modes"):
        assert key in report
    assert set(report["modes"]) == {"bare_interpreter", "unsafe_subprocess", "kernel", "kernel_no_cgroup", "kernel_warm"}
    assert report["settings"]["memory_enforcement"]  # which layer bounded memory in the run
    for mode in report["modes"].values():
        assert mode["n"] == 3 and 0 < mode["p10_ms"] <= mode["median_ms"] <= mode["p90_ms"]
    assert report["kernel_overhead_ms"] == round(report["modes"]["kernel"]["median_ms"]
                                                 - report["modes"]["bare_interpreter"]["median_ms"], 1)
