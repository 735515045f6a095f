"""Per-call cost of the python tool's sandbox: spawn + isolation set-up + a trivial program (`pass`).

Runs the same call N times, one after another, through `PythonTool.run_code` in each mode and reports the
median / p10 / p90 wall time per call:

- **bare_interpreter**: `python -I -S -c pass` through the same process runner — no sandbox at all, the
  floor any local mode pays;
- **unsafe_subprocess**: the explicit unsafe opt-in (boot script, rlimits, audit hook; no kernel isolation);
- **kernel**: the default — bubblewrap namespaces + minimal root (+ setpriv/unshare when the worker is root),
  seccomp, rlimits, the isolation self-check, then the audit hook; a fresh sandbox started per call;
- **kernel_no_cgroup**: `kernel` with `memory_cgroup: off` (no per-call cgroup; seccomp refuses the memory
  rlimits do not count) — present where the tool has that setting, to show what the cgroup costs;
- **kernel_warm**: the same with `warm_sandboxes=1`: each call takes a sandbox started ahead (used once,
  never reused) and starts the next; calls are `--gap` seconds apart, as tool calls of a trajectory are
  separated by model turns.

`kernel_overhead_ms` = kernel median - bare_interpreter median. The load average in `hardware` says how
busy the machine was (the figures scale with it on a shared 2-core box). Writes JSON to
`benchmarks/results/sandbox_overhead.json` (`--out DIR` elsewhere; `--smoke`: 3 calls per mode).

    python benchmarks/sandbox_overhead.py          # ~1 minute
"""

from __future__ import annotations

import argparse
import datetime as dt
import inspect
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_engine_batching import hardware, versions  # noqa: E402  (shared benchmark helpers)

from agentloop.tools.builtin.python import PythonTool  # noqa: E402
from agentloop.tools.sandbox.process import run_sandboxed  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent


def stats(samples: list[float]) -> dict[str, Any]:
    ms = sorted(s * 1000 for s in samples)
    pick = lambda q: ms[min(len(ms) - 1, int(q * (len(ms) - 1) + 0.5))]  # noqa: E731
    return {"n": len(ms), "median_ms": round(statistics.median(ms), 1), "p10_ms": round(pick(0.1), 1),
            "p90_ms": round(pick(0.9), 1), "mean_ms": round(statistics.fmean(ms), 1)}


async def timed(call, n: int, gap: float) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await call()
        out.append(time.perf_counter() - t0)
        if gap:
            await anyio.sleep(gap)
    return out


async def measure(n: int, gap: float) -> dict[str, Any]:
    python = sys.executable
    modes: dict[str, Any] = {}

    async def bare() -> None:
        r = await run_sandboxed([python, "-I", "-S", "-c", "pass"], stdin=b"", env={}, cwd="/", timeout=30,
                                max_output_bytes=1024)
        assert r.returncode == 0, r

    def tool_call(tool: PythonTool):
        async def call() -> None:
            r = await tool.run_code("pass")
            assert r.returncode == 0 and not r.stderr, r
        return call

    unsafe, kernel, warm = PythonTool(sandbox="unsafe_subprocess"), PythonTool(), PythonTool(warm_sandboxes=1)
    # an older checkout (a "before" run) has no memory_cgroup setting: that mode is then left out
    no_cgroup = PythonTool(memory_cgroup="off") if "memory_cgroup" in inspect.signature(PythonTool).parameters else None
    for tool in (unsafe, kernel, warm, no_cgroup):  # first calls probe the interpreter and the host: not per-call cost
        if tool is not None:
            await tool.run_code("pass")
    modes["_memory_enforcement"] = getattr(kernel, "memory_enforcement", None) or "rlimits only (before issue #29)"
    try:
        modes["bare_interpreter"] = stats(await timed(bare, n, 0))
        modes["unsafe_subprocess"] = stats(await timed(tool_call(unsafe), n, 0))
        modes["kernel"] = stats(await timed(tool_call(kernel), n, 0))
        if no_cgroup is not None:
            modes["kernel_no_cgroup"] = stats(await timed(tool_call(no_cgroup), n, 0))
        modes["kernel_warm"] = stats(await timed(tool_call(warm), n, gap))
    finally:
        await warm.aclose()
    return modes


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=REPO,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=40, help="calls per mode")
    ap.add_argument("--gap", type=float, default=0.3, help="seconds between calls in kernel_warm")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--smoke", action="store_true", help="3 calls per mode (a check that it runs)")
    args = ap.parse_args()
    n = 3 if args.smoke else args.calls
    modes = anyio.run(measure, n, args.gap)
    report = {
        "benchmark": "sandbox_overhead",
        "command": " ".join(shlex.quote(a) for a in ["python", "benchmarks/sandbox_overhead.py", *sys.argv[1:]]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "versions": versions(),
        "hardware": hardware(),
        "settings": {"calls_per_mode": n, "gap_s": args.gap, "program": "pass", "worker_uid": os.geteuid(),
                     "memory_enforcement": modes.pop("_memory_enforcement"),
                     "agentloop_source": str(Path(inspect.getfile(PythonTool)).resolve().parents[2])},
        "modes": modes,
        "kernel_overhead_ms": round(modes["kernel"]["median_ms"] - modes["bare_interpreter"]["median_ms"], 1),
        "kernel_warm_overhead_ms": round(modes["kernel_warm"]["median_ms"] - modes["bare_interpreter"]["median_ms"], 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out
    if args.smoke and out == RESULTS:  # smoke files go to a temporary folder, never beside the real results
        out = Path(tempfile.mkdtemp(prefix="agentloop-bench-"))
    path = out / ("sandbox_overhead_smoke.json" if args.smoke else "sandbox_overhead.json")
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"modes": modes, "kernel_overhead_ms": report["kernel_overhead_ms"],
                      "load_average": report["hardware"].get("load_average_1_5_15min")}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
