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

from gpu_helpers import QWEN2_05B, RESULTS, SEED_A, gpu_memory, hf_param_shapes, make_weights, out_dir

# ------------------------------------------------------------------ servers
class ServerHandle:
    """A started SGLang server plus what the tests need to know about it."""

    def __init__(self, server: Any, model_config: dict[str, Any], weights_a: dict[str, Any] | None) -> None:
        self.server = server
        self.url: str = server.url
        self.model_config = model_config
        self.weights_a = weights_a


def _start(server: Any, timeout: float) -> None:
    anyio.run(lambda: server.start(timeout=timeout))


def _stop(server: Any) -> None:
    anyio.run(server.stop)


@pytest.fixture(scope="session")
def dummy_server():
    """SGLang serving a Qwen2-0.5B-shaped dummy model, memory saver on; stopped at session end."""
    import torch

    from agentloop.engine.launch import SGLangLaunchConfig, SGLangServer

    model_dir = out_dir() / "qwen2_05b_dummy"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(QWEN2_05B, indent=1))
    cfg = SGLangLaunchConfig(model_path=str(model_dir), load_format="dummy",
                             mem_fraction_static=float(os.environ.get("AGENTLOOP_GPU_MEM_FRACTION", "0.4")),
                             cuda_graph=os.environ.get("AGENTLOOP_GPU_CUDA_GRAPH", "0") == "1")
    server = SGLangServer(cfg, log_path=out_dir() / "sglang_dummy_server.log")
    mem_before = gpu_memory()
    t0 = time.monotonic()
    _start(server, float(os.environ.get("AGENTLOOP_GPU_START_TIMEOUT", "420")))
    RESULTS["servers"]["dummy"] = {"command": shlex.join(cfg.argv(int(server.url.rsplit(":", 1)[1]))),
                                   "startup_seconds": round(time.monotonic() - t0, 1),
                                   "gpu_memory_before_start": mem_before, "gpu_memory_after_start": gpu_memory()}
    shapes = hf_param_shapes(QWEN2_05B)
    handle = ServerHandle(server, QWEN2_05B, make_weights(shapes, SEED_A))
    handle.shapes = shapes  # type: ignore[attr-defined]
    try:
        yield handle
    finally:
        RESULTS["servers"]["dummy"]["alive_at_end"] = server.proc is not None and server.proc.poll() is None
        _stop(server)
        del handle
        torch.cuda.empty_cache()


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
    env: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(),
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
