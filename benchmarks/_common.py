"""Shared pieces of the rollout benchmarks (`rollout_throughput`, `lifecycle`, `long_tail`).

Owns what the three have in common and nothing else:

- **the command line**: `--engine cpu|sglang`, `--engine-url` (attach to a running server), `--out`,
  `--smoke`, and how a server is started when no URL is given (a random-weight Qwen2 model on the CPU
  engine, or SGLang with `--load-format dummy` on a config-only folder);
- **the report header**: exact command, date, git commit, versions (agentloop, torch, transformers,
  sglang if installed; extends `cpu_engine_batching`'s helpers) and hardware (CPU and GPU name);
- **the run**: `run_benchmark` is each one's `main` (checkpointed JSON, the plot next to it);
- **the workload**: multi-turn `replay` specs with heavy-tailed turn lengths (a lognormal per-turn
  factor times a lognormal per-trajectory factor, so some trajectories are long as a whole), tool
  latencies from a configurable distribution and tool-result lengths, all from one seed;
- **measuring helpers**: trainer-side weights for the served model, in-flight-interval statistics
  (how much of the wall time the engine had work), and samplers of the engine's CPU time or the GPU's
  utilisation / memory while a benchmark runs.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import importlib.metadata
import itertools
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence

import anyio
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_engine_batching import hardware as _cpu_hardware  # noqa: E402  (shared benchmark helpers)
from cpu_engine_batching import versions as _base_versions  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ report header
def versions() -> dict[str, str | None]:
    v: dict[str, str | None] = dict(_base_versions())
    for dist in ("sglang", "numpy", "matplotlib"):
        try:
            v[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            v[dist] = None
    return v


def hardware() -> dict[str, Any]:
    hw = dict(_cpu_hardware())
    hw["gpu"] = None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            hw["gpu"] = out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return hw


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=REPO, timeout=10).stdout.strip()
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return ""


def header(name: str, script: str, argv: Sequence[str], args: argparse.Namespace) -> dict[str, Any]:
    return {
        "benchmark": name,
        "command": shlex.join(["python", script, *argv]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "versions": versions(),
        "hardware": hardware(),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }


def result_paths(args: argparse.Namespace, name: str) -> tuple[Path, Path]:
    """JSON and PNG paths: `<out>/<name>[_<engine>][_smoke].json|png` (CPU and GPU results side by side);
    a `--smoke` run without its own `--out` writes to a fresh temporary folder."""
    stem = f"{name}_{getattr(args, 'engine', 'cpu')}" + ("_smoke" if args.smoke else "")
    out = Path(args.out)
    if args.smoke and out.resolve() == RESULTS.resolve():
        # A smoke run only proves the benchmark runs: its files go to a temporary folder, never into
        # the checkout's results (where they would sit untracked beside the real ones).
        out = Path(tempfile.mkdtemp(prefix="agentloop-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    return out / f"{stem}.json", out / f"{stem}.png"


def run_benchmark(name: str, argv: list[str] | None, parse_args: Callable[[list[str]], argparse.Namespace],
                  definitions: dict[str, str], measure: Callable[..., Any],
                  plot: Callable[[dict[str, Any], Path], None], *, checkpoints: bool = False,
                  plot_checkpoints: bool = False) -> int:
    """A benchmark's `main`: the report is the header, `definitions` and what `measure` returns, written to
    `result_paths(args, name)` with its plot.

    With `checkpoints`, `measure(args, save)` calls `save(out)` after each finished part, so a run cut short
    (a timeout on a rented GPU) still leaves its results, and the report says whether it is `complete`;
    `plot_checkpoints` redraws the plot each time too. Without, `measure(args)` is written once at the end.
    """
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    sigterm_as_interrupt()
    report = header(name, f"benchmarks/{name}.py", argv, args)
    report["definitions"] = definitions
    json_path, png_path = result_paths(args, name)
    if checkpoints:
        def save(measured: dict[str, Any], complete: bool = False) -> None:
            report.update(measured, complete=complete)
            write_json(report, json_path)
            if complete or plot_checkpoints:
                _plot_safely(plot, report, png_path)

        save(anyio.run(measure, args, save), complete=True)
    else:
        report.update(anyio.run(measure, args))
        write_json(report, json_path)
        _plot_safely(plot, report, png_path)
    print(f"wrote {json_path} and {png_path}")
    return 0


def _plot_safely(plot: Callable[[dict[str, Any], Path], None], report: dict[str, Any], path: Path) -> None:
    """Draw the plot; a plotting failure is reported, never allowed to end a run whose JSON is measured.

    A GPU run costs scarce device minutes: on the H200 image a stub IPython module once made every
    pyplot figure raise, and the benchmarks died after their first point.
    """
    try:
        plot(report, path)
    except Exception as exc:  # noqa: BLE001 - any plotting error; the JSON already holds the data
        print(f"warning: could not draw {path}: {type(exc).__name__}: {exc}", file=sys.stderr)


def write_json(report: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(report, indent=1, default=_jsonable) + "\n")


def _jsonable(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def sigterm_as_interrupt() -> None:
    """Let SIGTERM (e.g. `timeout` in tools/gpu_benchmarks.sh) end a benchmark like Ctrl-C does: the event
    loop cancels its tasks, so `finally` blocks run — the attached server is woken up again for the next
    benchmark and the engine we started is stopped."""
    import signal

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def median(xs: Sequence[float]) -> float:
    return float(np.median(np.asarray(xs, dtype=float))) if len(xs) else float("nan")


def r4(x: float) -> float:
    return round(float(x), 4) if x == x else x  # NaN stays NaN


# ------------------------------------------------------------------ command line and engines
def benchmark_parser(doc: str) -> argparse.ArgumentParser:
    """The parser every rollout benchmark starts from: its docstring's first paragraph (a summary that
    may wrap over several lines; argparse re-flows it) and the engine options."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    g = p.add_argument_group("engine")
    g.add_argument("--engine", choices=["cpu", "sglang"], default="cpu", help="which engine serves the model")
    g.add_argument("--engine-url", default=None, help="attach to a running server (default: start one)")
    g.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and PNG results")
    g.add_argument("--smoke", action="store_true", help="tiny configuration that only proves the benchmark runs")
    g.add_argument("--hidden-size", type=int, default=64, help="CPU engine: random model width")
    g.add_argument("--num-layers", type=int, default=2, help="CPU engine: random model depth")
    g.add_argument("--engine-threads", type=int, default=1, help="CPU engine: torch threads")
    g.add_argument("--model", type=Path, default=None,
                   help="sglang without --engine-url: a model folder (config.json suffices with --load-format dummy)")
    g.add_argument("--load-format", default="dummy", help="sglang launch: --load-format")
    g.add_argument("--mem-fraction", type=float, default=0.5, help="sglang launch: --mem-fraction-static")
    g.add_argument("--cuda-graph", action="store_true", help="sglang launch: decode CUDA graphs on")
    g.add_argument("--server-args", type=shlex.split, default=[], metavar="'FLAGS'",
                   help="flags added to the command of a server this benchmark starts (CPU engine or sglang), e.g. "
                   "'--enable-priority-scheduling --max-running-requests 16'")
    return p


def add_turn_args(g: argparse._ArgumentGroup, *, turns: int, prompt_tokens: int, gen_median: float, gen_sigma: float,
                  traj_sigma: float, gen_max: int) -> None:
    """The `WorkloadSpec` shape options; the defaults are each benchmark's own (its workload differs)."""
    g.add_argument("--turns", type=int, default=turns)
    g.add_argument("--prompt-tokens", type=int, default=prompt_tokens)
    g.add_argument("--gen-median", type=float, default=gen_median, help="median generated tokens of a turn")
    g.add_argument("--gen-sigma", type=float, default=gen_sigma, help="lognormal sigma of a turn's length")
    g.add_argument("--traj-sigma", type=float, default=traj_sigma, help="lognormal sigma of a trajectory's length factor")
    g.add_argument("--gen-max", type=int, default=gen_max)


@dataclass
class Engine:
    """A server the benchmark talks to, and what it knows about it."""

    kind: str
    url: str
    model_dir: Path | None  #: the served model's folder if readable here (config.json, maybe weights)
    tokenizer_dir: Path  #: a tokenizer for client-side buffers (the replay loop needs no real one)
    pid: int | None = None  #: server process (CPU engine we started): its CPU time is the busy measure
    launched: bool = False
    description: dict[str, Any] = field(default_factory=dict)


@contextlib.asynccontextmanager
async def open_engine(args: argparse.Namespace, *, max_running: int = 256) -> AsyncIterator[Engine]:
    """Start (or attach to) the engine named by `args`; stops what it started."""
    from agentloop.engine.sglang import SGLangClient
    from agentloop.models.random_model import make_random_model

    with tempfile.TemporaryDirectory(prefix="agentloop-bench-") as tmp:
        tmpdir = Path(tmp)
        if args.engine_url:
            async with SGLangClient(args.engine_url) as c:
                info = await c.model_info()
                server = await c.server_info()
            path = info.get("model_path")
            model_dir = Path(path) if path and (Path(path) / "config.json").is_file() else None
            tok = model_dir if model_dir is not None and (model_dir / "tokenizer.json").is_file() else None
            if tok is None:
                tok = make_random_model(tmpdir / "tokenizer", hidden_size=16, num_layers=1)
            desc = {"attached": args.engine_url, "model_path": path,
                    "server": {k: server.get(k) for k in ("engine", "version", "vocab_size", "max_running_requests",
                                                          "mem_fraction_static", "load_format", "cuda_graph_max_bs",
                                                          "disable_cuda_graph", "attention_backend", "enable_priority_scheduling",
                                                          "schedule_low_priority_values_first",
                                                          "priority_scheduling_preemption_threshold") if k in server}}
            if model_dir is not None:
                desc["config"] = _config_summary(model_dir)
            yield Engine(args.engine, args.engine_url.rstrip("/"), model_dir, tok, description=desc)
            return
        if args.engine == "cpu":
            from agentloop.engine.local.process import LocalEngineProcess

            model_dir = make_random_model(tmpdir / "model", hidden_size=args.hidden_size, num_layers=args.num_layers)
            proc = LocalEngineProcess(model_dir, extra_args=["--num-threads", str(args.engine_threads),
                                                             "--max-running-requests", str(max_running),
                                                             "--log-level", "warning", *args.server_args])
            url = await proc.start(timeout=180)
            try:
                pid = proc.pid  # to sample the server's CPU time
                yield Engine("cpu", url, model_dir, model_dir, pid=pid, launched=True,
                             description={"kind": "make_random_model (qwen2)", "command": shlex.join(proc.command()),
                                          "config": _config_summary(model_dir)})
            finally:
                await proc.stop()
            return
        from agentloop.engine.launch import SGLangLaunchConfig, SGLangServer

        if args.model is None:
            raise SystemExit("--engine sglang without --engine-url needs --model DIR (a folder with config.json)")
        cfg = SGLangLaunchConfig(model_path=str(args.model), load_format=args.load_format,
                                 mem_fraction_static=args.mem_fraction, cuda_graph=args.cuda_graph,
                                 extra_args=tuple(args.server_args))
        server = SGLangServer(cfg, log_path=tmpdir / "sglang.log")
        url = await server.start(timeout=600)
        try:
            yield Engine("sglang", url, Path(args.model), make_random_model(tmpdir / "tokenizer", hidden_size=16, num_layers=1),
                         launched=True, description={"command": shlex.join(cfg.argv(int(url.rsplit(":", 1)[1]))),
                                                     "startup_seconds": server.startup_seconds,
                                                     "config": _config_summary(Path(args.model))})
        finally:
            await server.stop()


def _config_summary(model_dir: Path) -> dict[str, Any]:
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "vocab_size", "torch_dtype")
    return {k: cfg.get(k) for k in keys if k in cfg}


def slot_limit(text: str) -> int | str:
    """`--slot-limit`'s type: a positive integer, or "auto" (the servers' decode CUDA graph batch, read from
    /server_info at Runtime start: `scheduler.per_server_concurrency: auto`)."""
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a positive integer or 'auto'")
    return n


SLOT_LIMIT_HELP = ("generate requests in flight per server (the runtime's per_server_concurrency): an integer, or "
                   "'auto' for the servers' decode CUDA graph batch from /server_info; default: no limit")


def runtime_config(engine: Engine, args: argparse.Namespace, *, concurrency: int, **scheduler: Any) -> dict[str, Any]:
    """A `RuntimeConfig` dict attaching to `engine` with the replay loop's needs (ignore_eos, budgets)."""
    max_turn_tokens = args.gen_max
    # Never binds: turn and tool-result lengths are clipped to these maxima when the workload is drawn.
    max_response_tokens = args.turns * (args.gen_max + WorkloadSpec.tool_result_max) + 64
    return {
        "engine": {"urls": [engine.url], "tokenizer": str(engine.tokenizer_dir), "request_timeout": 600.0},
        "scheduler": {"concurrency": concurrency, "trajectory_timeout": 3600.0, **scheduler},
        "agent": {"agent": "replay", "sampling": {"temperature": 1.0}, "max_assistant_turns": 64,
                  "max_new_tokens_per_turn": max_turn_tokens, "max_response_tokens": max_response_tokens,
                  "max_context_tokens": max_response_tokens + 1024},
    }


@contextlib.asynccontextmanager
async def left_awake(rt: Any, weights: Callable[[], Any]) -> AsyncIterator[None]:
    """Wakes the server up again when the block ends, however it ends: it was found awake, and the next
    runtime (or whoever uses an attached server next) expects it so."""
    try:
        yield
    finally:
        with anyio.CancelScope(shield=True):
            await rt.lifecycle.wake_up(weights())


# ------------------------------------------------------------------ trainer-side weights
def trainer_weights(engine: Engine, *, seed: int = 0) -> dict[str, Any]:
    """A state dict the served model accepts, as a trainer would send it.

    The CPU engine's random model ships its weights: they are loaded (CPU tensors, safetensors transport).
    Otherwise the HF parameter names and shapes of the served config (built on the meta device, tied
    weights once) are filled on the GPU — norms 1, the rest N(0, 0.02), seeded — for SGLang's CUDA-IPC
    transport.
    """
    import torch

    if engine.model_dir is None:
        raise SystemExit(f"the served model's folder is not readable here (server {engine.url}): cannot build weights")
    st = engine.model_dir / "model.safetensors"
    if engine.kind == "cpu" and st.is_file():
        from safetensors.torch import load_file

        return dict(load_file(str(st)))
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(engine.model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    out: dict[str, Any] = {}
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(tuple(p.shape), dtype=dtype, device=dev)
        else:
            out[name] = (torch.randn(tuple(p.shape), generator=g, device=dev) * 0.02).to(dtype)
    return out


def versioned_weights(engine: Engine) -> Callable[[], Any]:
    """`trainer_weights(engine)` built once; each call wraps them in a `Weights` with a new version (w1, w2, ...),
    so every wake-up loads them as a trainer's new weights would be."""
    from agentloop.engine.lifecycle import Weights

    state_dict = trainer_weights(engine)
    counter = itertools.count(1)
    return lambda: Weights(state_dict=state_dict, version=f"w{next(counter)}")


def weights_bytes(state_dict: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state_dict.values())


# ------------------------------------------------------------------ workload
@dataclass
class WorkloadSpec:
    """N trajectories x K turns with heavy-tailed turn lengths and random tool latencies."""

    trajectories: int
    turns: int
    prompt_tokens: int = 64
    gen_median: float = 32.0  #: median tokens of one turn (before the per-trajectory factor)
    gen_sigma: float = 0.6  #: lognormal sigma of a turn's length
    traj_sigma: float = 0.6  #: lognormal sigma of a trajectory's length factor (some whole trajectories are long)
    gen_max: int = 512
    tool_latency_dist: str = "lognormal"  #: lognormal (sigma 1) | exponential | constant
    tool_latency_mean: float = 0.1  #: seconds
    tool_result_median: float = 24.0  #: tokens appended after each tool call (lognormal, sigma 0.5)
    tool_result_max: int = 256
    seed: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def workload_spec(args: argparse.Namespace, *, trajectories: int, **spec: Any) -> WorkloadSpec:
    """The workload described by the `add_turn_args` options (and `--tool-result-median`, `--seed`)."""
    return WorkloadSpec(trajectories=trajectories, turns=args.turns, prompt_tokens=args.prompt_tokens,
                        gen_median=args.gen_median, gen_sigma=args.gen_sigma, traj_sigma=args.traj_sigma,
                        gen_max=args.gen_max, tool_result_median=args.tool_result_median, seed=args.seed, **spec)


def warm_up_spec() -> WorkloadSpec:
    """A few short trajectories for the connections, the engine's first forward passes and the client's
    lookups, so that none of them is timed in the first measured run."""
    return WorkloadSpec(trajectories=4, turns=2, prompt_tokens=8, gen_median=4, traj_sigma=0, gen_sigma=0,
                        tool_latency_mean=0.0, tool_result_median=4)


def tool_latency(rng: np.random.Generator, dist: str, mean: float, size: int) -> np.ndarray:
    """Seconds of `size` tool calls with the given mean. Draws the same numbers whatever `mean` is (a
    unit-mean draw, scaled), so a sweep over means keeps the turn lengths drawn after it unchanged."""
    if dist == "constant":
        unit = np.ones(size)
    elif dist == "exponential":
        unit = rng.exponential(1.0, size)
    elif dist == "lognormal":  # sigma 1: heavy right tail; mu = -1/2 makes the mean 1
        unit = rng.lognormal(-0.5, 1.0, size)
    else:
        raise ValueError(f"tool latency distribution must be lognormal|exponential|constant, not {dist!r}")
    return unit * max(mean, 0.0)


def make_workload(spec: WorkloadSpec) -> list[list[dict[str, Any]]]:
    """Per trajectory, its turns as `replay` turn dicts (the last turn has no tool after it)."""
    rng = np.random.default_rng(spec.seed)
    out = []
    for _ in range(spec.trajectories):
        scale = rng.lognormal(0.0, spec.traj_sigma)
        gens = np.clip(np.rint(spec.gen_median * scale * rng.lognormal(0.0, spec.gen_sigma, spec.turns)), 1, spec.gen_max)
        lats = tool_latency(rng, spec.tool_latency_dist, spec.tool_latency_mean, spec.turns)
        res = np.clip(np.rint(rng.lognormal(math.log(max(spec.tool_result_median, 1.0)), 0.5, spec.turns)), 0,
                      spec.tool_result_max)
        turns = []
        for k in range(spec.turns):
            last = k == spec.turns - 1
            turns.append({"gen_tokens": int(gens[k]), "tool_latency_s": 0.0 if last else round(float(lats[k]), 4),
                          "tool_result_tokens": 0 if last else int(res[k])})
        out.append(turns)
    return out


def workload_stats(work: list[list[dict[str, Any]]]) -> dict[str, Any]:
    gens = np.array([t["gen_tokens"] for tr in work for t in tr], dtype=float)
    per_traj = np.array([sum(t["gen_tokens"] for t in tr) for tr in work], dtype=float)
    lats = np.array([t["tool_latency_s"] for tr in work for t in tr[:-1]], dtype=float)
    return {
        "generated_tokens": int(gens.sum()),
        "turn_tokens_mean": r4(gens.mean()), "turn_tokens_p50": r4(np.median(gens)),
        "turn_tokens_p99": r4(np.percentile(gens, 99)), "turn_tokens_max": int(gens.max()),
        "trajectory_tokens_p50": r4(np.median(per_traj)), "trajectory_tokens_max": int(per_traj.max()),
        "tool_latency_mean_s": r4(lats.mean()) if lats.size else 0.0,
        "tool_latency_p99_s": r4(np.percentile(lats, 99)) if lats.size else 0.0,
    }


def filler_ids(n: int, salt: int = 0, low: int = 3, high: int = 200) -> list[int]:
    """`n` deterministic token ids in [low, high) (valid in every test vocabulary): a numpy PCG64 stream
    seeded by `salt`, so each salt has its own sequence (no prefix shared across salts for the engine to
    cache) and `filler_ids(m, s)` is a prefix of `filler_ids(n, s)` for m <= n (the ceiling's turns
    extend their trajectory's context)."""
    rng = np.random.default_rng(abs(int(salt)))
    return (low + rng.integers(0, high - low, size=max(n, 0), dtype=np.int64)).tolist()


# ------------------------------------------------------------------ what the engine was doing
def interval_stats(intervals: Sequence[tuple[float, float]], t0: float, t1: float) -> dict[str, float]:
    """Over [t0, t1]: the fraction of time with >= 1 request in flight, and the mean number in flight."""
    wall = max(t1 - t0, 1e-9)
    if not intervals:
        return {"engine_has_work_fraction": 0.0, "mean_requests_in_flight": 0.0}
    ev = sorted([(max(a, t0), 1) for a, b in intervals] + [(min(b, t1), -1) for a, b in intervals])
    busy = area = 0.0
    depth = 0
    last = t0
    for t, d in ev:
        if depth > 0:
            busy += t - last
        area += depth * (t - last)
        depth += d
        last = t
    return {"engine_has_work_fraction": r4(busy / wall), "mean_requests_in_flight": r4(area / wall)}


class GcTimer:
    """CPU seconds the garbage collector ran between `__enter__` and `__exit__` (part of the process's
    CPU time), collections per generation, and the unreachable objects they freed (`collected`: garbage
    that only the cycle collector could free). With a trainer's heap a full collection is a visible share."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self.collected = 0
        self._t0 = 0.0

    def _cb(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.process_time()
        else:
            self.seconds += time.process_time() - self._t0
            self.collections[info["generation"]] += 1
            self.collected += info.get("collected", 0)

    def __enter__(self) -> "GcTimer":
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._cb in gc.callbacks:
            gc.callbacks.remove(self._cb)


def add_client_args(p: argparse.ArgumentParser, *, gc_freeze: bool = True) -> None:
    """The client-process options of the client-CPU measurements (`--gc-freeze` where no mode says it)."""
    g = p.add_argument_group("client process")
    g.add_argument("--trainer-heap", action="store_true",
                   help="hold what a trainer's process holds: transformers imported and a Qwen2-0.5B-shaped model "
                        "built on the meta device (~360k objects the garbage collector walks on a full collection; "
                        "the GPU runs' client holds this and more: sglang's serializer)")
    if gc_freeze:
        g.add_argument("--gc-freeze", action="store_true",
                       help="agentloop runs with scheduler.gc_freeze (the step's collections skip the older heap)")


def trainer_heap(enabled: bool) -> dict[str, Any]:
    """With `enabled`, build the `--trainer-heap` objects (kept alive by the returned dict); the number
    of objects the garbage collector tracks, either way."""
    out: dict[str, Any] = {}
    if enabled:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.for_model("qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, vocab_size=151936)
        with torch.device("meta"):
            out["model"] = AutoModelForCausalLM.from_config(cfg)
    gc.collect()
    out["gc_tracked_objects"] = len(gc.get_objects())
    return out


class BusySampler:
    """Samples how busy the engine is while a run goes on.

    CPU engine we started: its process's CPU seconds (utime+stime from /proc) per wall second (its
    model runs on `--num-threads` threads, so 1.0 = one thread always computing). GPU: the mean
    `utilization.gpu` of `nvidia-smi` (the fraction of time a kernel ran) sampled every 100 ms.
    Also this (client) process's CPU seconds per wall second.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._gc = GcTimer()
        self._proc: subprocess.Popen[str] | None = None
        self._samples: list[float] = []
        self._thread: threading.Thread | None = None
        self._cpu0 = self._t0 = self._own0 = 0.0
        self._result: dict[str, float] = {}

    def _cpu_seconds(self) -> float | None:
        if self.engine.pid is None:
            return None
        try:
            fields = Path(f"/proc/{self.engine.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return None

    def __enter__(self) -> "BusySampler":
        self._gc.__enter__()
        self._t0 = time.perf_counter()
        self._own0 = time.process_time()
        cpu = self._cpu_seconds()
        self._cpu0 = cpu if cpu is not None else -1.0
        if self.engine.kind == "sglang":
            try:
                self._proc = subprocess.Popen(
                    ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-lms", "100"],
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            except OSError:
                self._proc = None
            if self._proc is not None:
                self._thread = threading.Thread(target=self._read, daemon=True)
                self._thread.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            with contextlib.suppress(ValueError):
                self._samples.append(float(line.split(",")[0]) / 100.0)

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._t0
        # This process's own CPU time: on a small shared machine the client competes with the engine.
        own = time.process_time() - self._own0
        self._gc.__exit__()
        self._result["client_cpu_seconds"] = r4(own)
        self._result["client_gc_seconds"] = r4(self._gc.seconds)
        self._result["client_gc_full_collections"] = self._gc.collections[2]
        self._result["client_gc_collected_objects"] = self._gc.collected
        self._result["client_cpu_busy_fraction"] = r4(own / max(wall, 1e-9))
        cpu = self._cpu_seconds()
        if cpu is not None and self._cpu0 >= 0:
            self._result["engine_cpu_busy_fraction"] = r4((cpu - self._cpu0) / max(wall, 1e-9))
        if self._proc is not None:
            self._proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(5)
            if self._thread is not None:
                self._thread.join(5)
            if self._samples:
                self._result["gpu_utilization_mean"] = r4(sum(self._samples) / len(self._samples))

    def result(self) -> dict[str, float]:
        return dict(self._result)


class PeakSampler:
    """Polls `read()` (bytes in use) in a thread every `period` seconds between `start()` and `stop()`;
    keeps the peak. Used for GPU memory (`torch.cuda.mem_get_info`, device-wide, so the server's
    allocations count) and the CPU engine's resident set size."""

    def __init__(self, read: Callable[[], int | None], period: float = 0.001) -> None:
        self.read = read
        self.period = period
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.peak = self.read() or 0
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            v = self.read()
            if v is not None and v > self.peak:
                self.peak = v
            time.sleep(self.period)

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        v = self.read()
        if v is not None and v > self.peak:
            self.peak = v
        return self.peak


def memory_reader(engine: Engine) -> tuple[str, Callable[[], int | None]] | None:
    """What "memory in use" means for this engine and how to read it, or None when it cannot be read."""
    if engine.kind == "sglang":
        try:
            import torch

            if torch.cuda.is_available():
                def gpu_used() -> int:
                    free, total = torch.cuda.mem_get_info()
                    return int(total - free)

                return "gpu_used_bytes (device-wide, torch.cuda.mem_get_info)", gpu_used
        except ImportError:
            pass
        return None
    if engine.pid is None:
        return None
    status = Path(f"/proc/{engine.pid}/status")

    def rss() -> int | None:
        try:
            for line in status.read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            return None
        return None

    return "engine_rss_bytes (CPU engine process, /proc VmRSS)", rss


# ------------------------------------------------------------------ plotting
def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> None:
    """Closed once written: a benchmark that redraws at every checkpoint would otherwise keep them all."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def title_suffix(report: dict[str, Any]) -> str:
    hw = report["hardware"]
    eng = report.get("engine", {})
    cfg = eng.get("config", {})
    where = hw.get("gpu") or hw.get("cpu", "")
    shape = f"h={cfg.get('hidden_size')} L={cfg.get('num_hidden_layers')}" if cfg else ""
    return f"{report['settings'].get('engine')} engine {shape}, {str(where)[:40]}"
