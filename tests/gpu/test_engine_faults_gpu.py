"""Issue #14 on real SGLang: `tools/gpu_engine_faults.py` (every stage) as one GPU test.

The script is the single place the stages live (consecutive `agentloop rollout --engine-url` runs,
a runtime SIGKILLed mid-step, two servers with one killed between steps, a second runtime attaching,
a launcher SIGKILLed); this test runs it in its own process (it starts and kills servers and
runtimes as processes) and requires exit 0 and every recorded check true. Its JSON lands in
`AGENTLOOP_GPU_OUT` (default /tmp/agentloop_gpu_out)/engine_faults/gpu_engine_faults.json; the
committed run is benchmarks/results/gpu_engine_faults_sglang.json. With `AGENTLOOP_GPU_DRYRUN=1` the
CPU engine stands in for SGLang (`--dry-run`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_helpers import DRYRUN, enabled, out_dir  # noqa: E402

_ok, _why = enabled()
if not _ok:
    pytest.skip(_why, allow_module_level=True)

pytestmark = [pytest.mark.gpu]

REPO = Path(__file__).resolve().parents[2]


def test_engine_faults_script_on_sglang() -> None:
    out = out_dir() / "engine_faults"
    argv = [sys.executable, str(REPO / "tools" / "gpu_engine_faults.py"), str(out)] + (["--dry-run"] if DRYRUN else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1500)
    doc = json.loads((out / "gpu_engine_faults.json").read_text())
    failed = [name for name, ok in doc["checks"].items() if not ok]
    assert proc.returncode == 0 and not failed, f"failed checks {failed}; exit {proc.returncode}; tail:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    assert doc["checks"], "no check was recorded"
