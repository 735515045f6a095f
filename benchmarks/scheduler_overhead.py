"""The runtime's own overhead: the same requests through agentloop vs a bare aiohttp loop, as a ratio.

Starts one CPU engine (`agentloop serve` on a random-weight Qwen2 model, or `--url` of a running
engine) and, for each workload (generated tokens per request x concurrency), issues N identical
single-turn requests (`--prompt-len` fixed prompt ids in, `gen` tokens out with ignore_eos, temperature
1) two ways, alternating, `--repeats` times:

- **bare**: an aiohttp loop, `concurrency` requests in flight at once (a semaphore), POSTing SGLang's
  `/generate` JSON and parsing the reply — the least any client can do;
- **agentloop**: `Runtime.step` with the `replay` agent loop (one turn per sample), i.e. scheduler
  (task group, limits, groups, timeouts) + router (sticky least-loaded, rids) + lifecycle gate +
  SGLangClient + token buffer + collation. Its rollout phase (`rollout_seconds`) is compared with the
  bare loop's wall time; the wake-up and sleep around it are reported separately.

Ratio = agentloop rollout seconds / bare seconds (median over repeats; 1.0 = no overhead). Short
generations make per-request overhead most visible. Writes JSON (command, versions, hardware, date)
to `benchmarks/results/scheduler_overhead.json`.

    python benchmarks/scheduler_overhead.py        # a few minutes on 2 cores
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_engine_batching import hardware, versions  # noqa: E402  (shared benchmark helpers)

from agentloop.engine.base import SamplingParams  # noqa: E402
from agentloop.engine.local.process import LocalEngineProcess  # noqa: E402
from agentloop.models.random_model import make_random_model  # noqa: E402
from agentloop.runtime import Runtime  # noqa: E402
from agentloop.types import Sample  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def prompt_ids(i: int, length: int) -> list[int]:
    return [3 + (i * 31 + k * 7) % 190 for k in range(length)]


async def bare_loop(http: aiohttp.ClientSession, url: str, n: int, concurrency: int, prompt_len: int,
                    gen: int) -> tuple[float, int]:
    """n generates with at most `concurrency` in flight; returns (wall seconds, output tokens).
    `http` is kept across runs (pooled connections), as the runtime's client keeps its own."""
    params = SamplingParams(max_new_tokens=gen, temperature=1.0, ignore_eos=True).to_json()
    limit = anyio.Semaphore(concurrency)
    tokens = 0
    timeout = aiohttp.ClientTimeout(total=600)

    async def one(i: int) -> None:
        nonlocal tokens
        body = {"input_ids": prompt_ids(i, prompt_len), "sampling_params": params, "return_logprob": True,
                "rid": uuid.uuid4().hex}
        async with limit:
            async with http.post(f"{url}/generate", json=body, timeout=timeout) as r:
                r.raise_for_status()
                out = await r.json()
        tokens += len(out["output_ids"])

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
    return time.perf_counter() - t0, tokens


def replay_samples(n: int, prompt_len: int, gen: int, tag: str) -> list[Sample]:
    return [Sample(uid=f"{tag}-{i}", messages=[], agent="replay",
                   extra={"prompt_ids": prompt_ids(i, prompt_len), "replay": {"turns": [{"gen_tokens": gen}]}})
            for i in range(n)]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_random_model(Path(tmp) / "model", hidden_size=args.hidden_size, num_layers=args.num_layers)
        proc = None
        url = args.url
        if url is None:
            proc = LocalEngineProcess(model_dir, extra_args=["--num-threads", str(args.engine_threads)])
            url = await proc.start(timeout=180)
        try:
            return await measure(args, url, model_dir)
        finally:
            if proc is not None:
                await proc.stop()


async def measure(args: argparse.Namespace, url: str, model_dir: Path) -> dict[str, Any]:
    workloads = [(g, c) for g in args.gen_tokens for c in args.concurrency]
    results = []
    cfg = {"engine": {"urls": [url], "tokenizer": str(model_dir)},
           "scheduler": {"n": 1, "concurrency": max(args.concurrency)},
           "agent": {"sampling": {"temperature": 1.0}, "max_new_tokens_per_turn": max(args.gen_tokens),
                     "max_response_tokens": max(args.gen_tokens) + 8, "max_context_tokens": 4096}}
    async with Runtime(cfg) as rt, aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        bare_cpu: list[float] = []

        async def bare(n: int, conc: int, gen: int) -> tuple[float, int]:
            # The runtime keeps the engine asleep between steps: wake it (as a step would) for the bare
            # loop and put it back to sleep, so both paths start from a freshly woken engine.
            # CPU is counted over wake-up + loop + sleep, as for the runtime's step (which adds collation).
            c0 = time.process_time()
            await rt.lifecycle.wake_up()
            try:
                return await bare_loop(http, url, n, conc, args.prompt_len, gen)
            finally:
                await rt.lifecycle.sleep()
                bare_cpu.append(time.process_time() - c0)

        # Warm-up both paths once (connections, engine kernels).
        await bare(8, 8, 4)
        await rt.step(replay_samples(8, args.prompt_len, 4, "warm"))
        for gen, conc in workloads:
            bare_s, rt_roll, rt_step, rt_wake, rt_sleep, rt_cpu = [], [], [], [], [], []
            bare_cpu.clear()
            for r in range(args.repeats):
                wall, tok = await bare(args.requests, conc, gen)
                assert tok == args.requests * gen, (tok, args.requests * gen)
                bare_s.append(wall)
                samples = replay_samples(args.requests, args.prompt_len, gen, f"g{gen}c{conc}r{r}")
                c0 = time.process_time()
                res = await rt.step(samples, concurrency=conc)
                rt_cpu.append(time.process_time() - c0)
                bad = [t for t in res.trajectories if t.status != "completed"]
                assert not bad, [(t.uid, t.status, t.error) for t in bad[:3]]
                assert res.metrics["sampled_tokens"] == args.requests * gen
                rt_roll.append(res.metrics["rollout_seconds"])
                rt_step.append(res.metrics["step_seconds"])
                rt_wake.append(res.metrics["wake_up_seconds"])
                rt_sleep.append(res.metrics["sleep_seconds"])
            med_bare, med_roll = statistics.median(bare_s), statistics.median(rt_roll)
            entry = {
                "gen_tokens": gen, "concurrency": conc, "requests": args.requests,
                "bare_seconds": round(med_bare, 4), "agentloop_rollout_seconds": round(med_roll, 4),
                "ratio_agentloop_over_bare": round(med_roll / med_bare, 4),
                "bare_tokens_per_s": round(args.requests * gen / med_bare, 1),
                "agentloop_tokens_per_s": round(args.requests * gen / med_roll, 1),
                "per_request_overhead_ms": round(1000 * (med_roll - med_bare) * conc / args.requests, 3),
                # This process's CPU time (the engine is another process): the client-side cost per request.
                "bare_client_cpu_ms_per_request": round(1000 * statistics.median(bare_cpu) / args.requests, 3),
                "agentloop_client_cpu_ms_per_request": round(1000 * statistics.median(rt_cpu) / args.requests, 3),
                "agentloop_step_seconds": round(statistics.median(rt_step), 4),
                "wake_up_seconds": round(statistics.median(rt_wake), 4),
                "sleep_seconds": round(statistics.median(rt_sleep), 4),
                "all_bare_seconds": [round(x, 4) for x in bare_s],
                "all_agentloop_rollout_seconds": [round(x, 4) for x in rt_roll],
            }
            results.append(entry)
            print(f"gen={gen:4d} c={conc:3d}: bare {med_bare:.3f}s  agentloop {med_roll:.3f}s  "
                  f"ratio {entry['ratio_agentloop_over_bare']:.3f}  (step incl. wake/sleep {entry['agentloop_step_seconds']:.3f}s)  "
                  f"client cpu/request {entry['bare_client_cpu_ms_per_request']:.2f} vs {entry['agentloop_client_cpu_ms_per_request']:.2f} ms",
                  flush=True)
    return {"workloads": results}


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # --engine-url as in the other benchmarks; --url is kept as an alias.
    p.add_argument("--engine-url", "--url", dest="url", default=None,
                   help="a running engine (default: start one on a random model)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--gen-tokens", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--engine-threads", type=int, default=1)
    p.add_argument("--out", default=None,
                   help="JSON file (default: benchmarks/results/scheduler_overhead.json; --smoke: a temporary folder)")
    p.add_argument("--smoke", action="store_true", help="tiny configuration that only proves the benchmark runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.requests, args.gen_tokens, args.concurrency, args.repeats = 8, [1, 4], [4], 1
    if args.out is None:
        # A smoke run writes outside the checkout: it must not leave files in benchmarks/results/.
        args.out = str(Path(tempfile.mkdtemp(prefix="agentloop-bench-")) / "scheduler_overhead_smoke.json"
                       if args.smoke else RESULTS / "scheduler_overhead.json")
    load_before = os.getloadavg()
    measured = anyio.run(run, args)
    report = {
        "benchmark": "scheduler_overhead",
        "command": " ".join(["python", "benchmarks/scheduler_overhead.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "versions": versions(),
        "hardware": hardware(),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        # The engine is another process on the same cores: client CPU time is taken from the engine,
        # and other work on the machine adds noise (hence medians of alternating repeats).
        "load_average_1_5_15_before": [round(x, 2) for x in load_before],
        "ratio_definition": "agentloop rollout seconds (scheduler+router+gate+client+buffer) / bare aiohttp loop seconds, "
                            "median over repeats, same server, same requests",
        **measured,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
