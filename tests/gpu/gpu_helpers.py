"""Helpers of the GPU tests (used by conftest.py and the test modules).

- `QWEN2_05B`: a Qwen2-0.5B-shaped config; the session's SGLang server serves it with
  `--load-format dummy` (random weights from config.json alone).
- `hf_param_shapes` / `make_weights`: a trainer's state dict with the model's HF parameter names
  and shapes, made on the GPU (norms 1, the rest N(0, 0.02), seeded) for `update_weights_from_tensor`.
- `InstrumentedClient`: wraps `SGLangClient`, timing every memory/weight call and reading GPU memory
  after it, and listing every `/generate` or `/health` that went out while the lifecycle was not
  AWAKE (must stay empty: real SGLang crashes on a generate while released).
- `launch`: start SGLang through `agentloop.engine.launch` (dry run: `agentloop serve`); returns
  (server, command line).
- `RESULTS` / `record`: what the tests measure; conftest writes it to `$AGENTLOOP_GPU_RESULTS`.
- `DRYRUN` (`AGENTLOOP_GPU_DRYRUN=1`): the same tests against the CPU engine (`agentloop serve` on a
  random Qwen2 model, CPU tensors, no memory readings), to debug the test code itself without
  spending GPU time. Results of a dry run are not GPU results.
"""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path
from typing import Any

import anyio

from agentloop.engine.launch import QWEN2_05B_CONFIG


DRYRUN = os.environ.get("AGENTLOOP_GPU_DRYRUN") == "1"


def enabled() -> tuple[bool, str]:
    """Whether the GPU tests can run here (a CUDA GPU and sglang, or a dry run)."""
    if DRYRUN:
        return True, ""
    try:
        import torch
    except ImportError:
        return False, "needs torch"
    if not torch.cuda.is_available():
        return False, "needs a CUDA GPU"
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        return False, "needs sglang"
    return True, ""


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


RESULTS: dict[str, Any] = {"tests": {}, "servers": {}, "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

QWEN2_05B: dict[str, Any] = QWEN2_05B_CONFIG
SEED_A, SEED_B = 0, 1


def out_dir() -> Path:
    p = Path(os.environ.get("AGENTLOOP_GPU_OUT") or "/tmp/agentloop_gpu_out")
    p.mkdir(parents=True, exist_ok=True)
    return p


# ------------------------------------------------------------------ GPU memory
def gpu_memory() -> dict[str, float]:
    """Device-wide used/free GiB (every process on the GPU, the servers' schedulers included)."""
    import torch

    if not torch.cuda.is_available():  # dry run
        return {"used_gib": 0.0, "free_gib": 0.0}
    free, total = torch.cuda.mem_get_info()
    return {"used_gib": round((total - free) / 2**30, 3), "free_gib": round(free / 2**30, 3)}


# ------------------------------------------------------------------ trainer-side weights
def hf_param_shapes(config: dict[str, Any] | str | Path) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of the HF model for `config` (a dict or a model folder),
    built on the meta device: the names a trainer's state dict has (tied weights once)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(config, dict):
        cfg = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})
    else:
        cfg = AutoConfig.from_pretrained(str(config))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def make_weights(shapes: list[tuple[str, tuple[int, ...]]], seed: int, *, dtype: Any = None) -> dict[str, Any]:
    """A trainer's state dict on the GPU: norms 1, everything else N(0, 0.02), seeded."""
    import torch

    dtype = dtype or torch.bfloat16
    dev = device()
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    out = {}
    for name, shape in shapes:
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape, dtype=dtype, device=dev)
        else:
            out[name] = (torch.randn(shape, generator=g, device=dev) * 0.02).to(dtype)
    return out


# ------------------------------------------------------------------ instrumentation
_MEMORY_CALLS = {"release_memory_occupation", "resume_memory_occupation", "update_weights_from_tensor",
                 "update_weights_from_disk", "flush_cache", "pause_generation", "continue_generation"}


class InstrumentedClient:
    """Delegates to an `EngineClient`; logs each call (seconds, lifecycle state, GPU memory after)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.url = inner.url
        self.lifecycle: Any = None
        self.events: list[dict[str, Any]] = []
        self.sent: dict[str, int] = {}
        self.sent_outside_awake: list[tuple[str, str]] = []

    def _state(self) -> str:
        return self.lifecycle.state.value if self.lifecycle is not None else "?"

    def watch_gate(self, is_open: Any) -> None:
        """`GateWatched` (sync, unlike the delegated calls below): the wrapped client counts too."""
        watch = getattr(self.inner, "watch_gate", None)
        if watch is not None:
            watch(is_open)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr) or name.startswith("_"):
            return attr

        async def call(*args: Any, **kwargs: Any) -> Any:
            state = self._state()
            if name in ("generate", "health"):
                self.sent[name] = self.sent.get(name, 0) + 1
                if state != "AWAKE":
                    self.sent_outside_awake.append((name, state))
            t0 = time.perf_counter()
            try:
                return await attr(*args, **kwargs)
            finally:
                if name in _MEMORY_CALLS:
                    ev = {"call": name, "args": _short(args), "state": state,
                          "seconds": round(time.perf_counter() - t0, 4), **gpu_memory()}
                    self.events.append(ev)

        return call


def _short(args: tuple[Any, ...]) -> Any:
    out = []
    for a in args:
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], tuple):
            out.append(f"<{len(a)} tensors>")
        elif isinstance(a, (str, int, float, list)) or a is None:
            out.append(a)
        else:
            out.append(type(a).__name__)
    return out


# ------------------------------------------------------------------ servers
def launch(name: str, model_dir: Path, *, load_format: str | None = None, mem_fraction: float = 0.4,
           extra_args: tuple[str, ...] = ()) -> tuple[Any, str]:
    """Start SGLang on `model_dir` (or, in a dry run, `agentloop serve`); returns (server, command)."""
    if DRYRUN:
        from agentloop.engine.local.process import LocalEngineProcess

        proc = LocalEngineProcess(model_dir, extra_args=["--num-threads", "1", "--log-level", "warning"],
                                  log_path=out_dir() / f"dryrun_{name}.log")
        anyio.run(lambda: proc.start(timeout=180))
        return proc, shlex.join(proc.command())
    from agentloop.engine.launch import SGLangLaunchConfig, SGLangServer

    cfg = SGLangLaunchConfig(model_path=str(model_dir), load_format=load_format, mem_fraction_static=mem_fraction,
                             cuda_graph=os.environ.get("AGENTLOOP_GPU_CUDA_GRAPH", "0") == "1", extra_args=extra_args)
    server = SGLangServer(cfg, log_path=out_dir() / f"sglang_{name}_server.log")
    anyio.run(lambda: server.start(timeout=float(os.environ.get("AGENTLOOP_GPU_START_TIMEOUT", "420"))))
    return server, shlex.join(cfg.argv(int(server.url.rsplit(":", 1)[1])))



# ------------------------------------------------------------------ results
def record(test: str, **values: Any) -> None:
    RESULTS["tests"].setdefault(test, {}).update(values)


