"""Fixtures and result hooks of the GPU tests (helpers and docs in `gpu_helpers.py`).

Lazy by design: without CUDA or sglang the test modules skip themselves at import and no server starts.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from gpu_helpers import DRYRUN, QWEN2_05B, RESULTS, SEED_A, gpu_memory, hf_param_shapes, launch, make_weights, out_dir

# ------------------------------------------------------------------ servers
class ServerHandle:
    """A started server (SGLang, or the CPU engine in a dry run) plus what the tests need to know."""

    def __init__(self, server: Any, model_config: dict[str, Any]) -> None:
        self.server = server
        self.url: str = server.url
        self.model_config = model_config
        self.vocab: int = int(model_config["vocab_size"])
        self.shapes = hf_param_shapes(model_config)
        #: the trainer's "current" weights: loaded by the lifecycle test, restored after each test
        self.weights_a = make_weights(self.shapes, SEED_A)

    def alive(self) -> bool:
        proc = getattr(self.server, "proc", None) or getattr(self.server, "_proc", None)
        return proc is not None and proc.poll() is None


@pytest.fixture(scope="session")
def dummy_server():
    """SGLang serving a Qwen2-0.5B-shaped dummy model with memory saver on (dry run: the CPU engine
    on a random Qwen2 model); shared by the lifecycle/control/error tests, stopped at session end."""
    if DRYRUN:
        from agentloop.models.random_model import make_random_model

        model_dir = make_random_model(out_dir() / "dryrun_qwen2", arch="qwen2")
        config = json.loads((model_dir / "config.json").read_text())
    else:
        from agentloop.engine.launch import write_dummy_model

        model_dir = write_dummy_model(out_dir() / "qwen2_05b_dummy", QWEN2_05B)
        config = QWEN2_05B
    mem_before = gpu_memory()
    t0 = time.monotonic()
    server, command = launch("dummy", model_dir, load_format="dummy",
                             mem_fraction=float(os.environ.get("AGENTLOOP_GPU_MEM_FRACTION", "0.4")))
    RESULTS["servers"]["dummy"] = {"command": command, "startup_seconds": round(time.monotonic() - t0, 1),
                                   "gpu_memory_before_start": mem_before, "gpu_memory_after_start": gpu_memory()}
    handle = ServerHandle(server, config)
    try:
        yield handle
    finally:
        RESULTS["servers"]["dummy"]["alive_at_end"] = handle.alive()
        anyio.run(server.stop)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# ------------------------------------------------------------------ results
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "tests/gpu/" not in report.nodeid:
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        name = report.nodeid.split("::")[-1]
        RESULTS["tests"].setdefault(name, {})["outcome"] = report.outcome
        RESULTS["tests"][name]["seconds"] = round(report.duration, 2)
        if report.outcome == "failed":
            RESULTS["tests"][name]["error"] = str(report.longrepr)[-3000:]


def _environment() -> dict[str, Any]:
    env: dict[str, Any] = {"dryrun_on_cpu_engine": DRYRUN, "python": sys.version.split()[0], "platform": platform.platform(),
                           "command": os.environ.get("AGENTLOOP_GPU_COMMAND", shlex.join(sys.argv))}
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
            env["gpu_total_gib"] = round(torch.cuda.mem_get_info()[1] / 2**30, 1)
    except Exception as e:  # the results file must still be written
        env["torch_error"] = repr(e)
    for mod in ("sglang", "transformers", "triton", "torch_memory_saver"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:
            env[mod] = None
    try:
        env["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:
        pass
    return env


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get("AGENTLOOP_GPU_RESULTS")
    if not path or not RESULTS["tests"]:
        return
    RESULTS["environment"] = _environment()
    RESULTS["exitstatus"] = int(exitstatus)
    RESULTS["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    Path(path).write_text(json.dumps(RESULTS, indent=1, default=str))
