"""Two SGLang servers sharing one GPU, driven through Ray (`agentloop.distributed.RayRuntime`), 2+ steps.

    python tools/gpu_ray_two_servers.py OUT_DIR [--steps 3] [--mem-fraction 0.3] [--model DIR]
    python tools/gpu_ray_two_servers.py OUT_DIR --dry-run     # the same on CPU engines, to debug the script
    python tools/gpu_ray_two_servers.py OUT_DIR --num-servers 1 --mem-fraction 0.51  # the one-server baseline

Two servers vs one at the same total memory: run it twice with the same workload, `--num-servers 2
--mem-fraction 0.3` and `--num-servers 1 --mem-fraction 0.51` (OUT_DIR/gpu_ray_<n>_servers.json each), and
compare `sampled_tokens_per_second` per step. The servers on one GPU start one after another and each
one's fraction is SGLang's: of the memory free at its start, so 0.3 then 0.3 hold ~0.30 + ~0.21 of the GPU
(by SGLang's formula; the JSON records the memory actually used).

What it does: starts a local Ray cluster with the GPU, launches two SGLang server actors with
`num_gpus=0.5` each on one placement group (so both land on the same GPU; `--mem-fraction-static`
below 0.5 each), two rollout worker actors, and runs `--steps` steps of the ordinary
`Runtime.step`: staged wake-up fanned out to both servers (new weights every step, sent from this
driver process as CUDA tensors), the replay agent loop (GRPO groups of `--n`), sleep on both.
Default model: a Qwen2.5-0.5B-shaped config served with `--load-format dummy` (no download), the
tokenizer of a tiny random model (the replay agent's ids fit every vocabulary); `--model DIR` serves a
real HF folder (its own tokenizer) and reloads it from disk / loads it as tensors on alternate steps.

Writes OUT_DIR/gpu_ray_two_servers.json: per step the lifecycle stage seconds, rollout numbers,
jobs per worker and per server, GPU memory after wake-up and after sleep, and the checks (both
servers on one GPU, every step completed, no worker dispatch outside the driver's AWAKE window,
memory released at every sleep); plus the servers' log tails. Exit code 0 only if every check holds.
Needs `ray` and (without --dry-run) `sglang` importable and a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import anyio

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO / "src"))


def gpu_used_gib() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return round((total - free) / 2**30, 3)


def _free_cuda_cache() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def replay_samples(step: int, prompts: int, turns: int, gen: int) -> list[Any]:
    from agentloop.types import Sample

    spec = {"prompt_tokens": 32, "turns": [{"gen_tokens": gen, "tool_latency_s": 0.05, "tool_result_tokens": 8}] * turns}
    return [Sample(uid=f"s{step}p{i}", messages=[{"role": "user", "content": f"prompt {i}"}], agent="replay",
                   extra={"replay": spec}) for i in range(prompts)]


def step_weights(args: argparse.Namespace, step: int, model_dir: Path) -> Any:
    """What to wake up with: a fresh state dict every step (a trainer's update), or the real model's files."""
    if args.model and step % 2 == 1:
        return str(model_dir)  # reload from disk
    import torch
    from safetensors.torch import load_file

    # By path, not as `tests.gpu`: some installed packages ship a top-level `tests` package that shadows ours.
    sys.path.insert(0, str(REPO / "tests" / "gpu"))
    from gpu_helpers import hf_param_shapes, make_weights

    if args.model or args.dry_run:
        files = sorted(model_dir.glob("*.safetensors"))
        sd: dict[str, Any] = {}
        for f in files:
            sd.update(load_file(str(f)))
        dev = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
        return {k: v.to(dev) for k, v in sd.items()}
    return make_weights(hf_param_shapes(model_dir), seed=step)


async def run(args: argparse.Namespace, out: dict[str, Any], save: Callable[[dict[str, Any]], None]) -> bool:
    import ray

    from agentloop.distributed import RayRuntime
    from agentloop.engine.launch import write_dummy_model
    from agentloop.models.random_model import make_random_model

    work = Path(tempfile.mkdtemp(prefix="gpu_ray_"))
    if args.dry_run:
        model_dir = make_random_model(work / "model", seed=0)
        engine: dict[str, Any] = {"model": str(model_dir), "num_local_servers": args.num_servers,
                                  "local": {"num_threads": 1, "log_level": "warning"}}
    else:
        if args.model:
            model_dir = Path(args.model)
            flags: list[str] = []
            tokenizer = str(model_dir)
        else:
            model_dir = write_dummy_model(work / "qwen2_05b_dummy")
            flags = ["--load-format", "dummy"]
            tokenizer = str(make_random_model(work / "tok", seed=0))
        engine = {"launch": {"model_path": str(model_dir), "num_servers": args.num_servers, "mem_fraction_static": args.mem_fraction,
                             "flags": flags}, "tokenizer": tokenizer, "start_timeout": args.start_timeout}
    config = {"engine": engine, "scheduler": {"n": args.n, "concurrency": args.prompts * args.n},
              "agent": {"sampling": {"temperature": 1.0, "seed": 0}, "max_response_tokens": 4096}}
    ray_config = {"num_workers": args.workers, "engine_num_gpus": 0.0 if args.dry_run else 1.0 / args.num_servers, "engine_num_cpus": 1}
    ray.init(num_cpus=max(4, os.cpu_count() or 4), include_dashboard=False, log_to_driver=False)
    out["config"] = {"runtime": config, "ray": ray_config, "cluster_resources": ray.cluster_resources()}
    checks: dict[str, bool] = {}
    rt = RayRuntime(config, ray_config=ray_config)
    t0 = time.monotonic()
    try:
        await rt.start()
        out["start_seconds"] = round(time.monotonic() - t0, 2)
        engines = await rt.engine_info()
        out["engines"] = engines
        out["gpu_used_gib_after_start_sleeping"] = gpu_used_gib()
        if not args.dry_run:
            devices = {e["cuda_visible_devices"] for e in engines}
            checks["all_servers_on_one_gpu"] = len(engines) == args.num_servers and len(devices) == 1 and None not in devices
        steps = []
        for step in range(args.steps):
            weights = step_weights(args, step, model_dir)
            first = len(rt.lifecycle.records)
            mem: dict[str, Any] = {}
            orig_open = rt.pool.open

            async def open_and_measure(version: Any) -> None:
                mem["after_wake_up"] = gpu_used_gib()  # all stages done on both servers, before any rollout
                await orig_open(version)

            rt.pool.open = open_and_measure  # type: ignore[method-assign]
            try:
                res = await rt.step(replay_samples(step, args.prompts, args.turns, args.gen_tokens), weights)
            finally:
                rt.pool.open = orig_open  # type: ignore[method-assign]
            del weights
            _free_cuda_cache()  # this driver's copy of the weights must not count as the servers' memory
            mem["after_sleep"] = gpu_used_gib()
            m = res.metrics
            per_server: dict[str, int] = {}
            for t in res.trajectories:
                for u in t.extra.get("servers", []):
                    per_server[u] = per_server.get(u, 0) + 1
            stages = [{"phase": r.phase, "stage": r.stage, "seconds": round(r.seconds, 4), "servers": r.detail.get("servers")}
                      for r in rt.lifecycle.records[first:]]
            steps.append({
                "step": step + 1, "weight_version": res.weight_version,
                "wake_up_seconds": round(m["wake_up_seconds"], 3), "rollout_seconds": round(m["rollout_seconds"], 3),
                "sleep_seconds": round(m["sleep_seconds"], 3), "stages": stages,
                "status_counts": m["status_counts"], "trajectories": len(res.trajectories),
                "sampled_tokens": m["sampled_tokens"], "sampled_tokens_per_second": round(m["sampled_tokens_per_second"], 1),
                "jobs_per_worker": m["ray"]["jobs_per_worker"], "trajectories_per_server": per_server,
                "retried": m["ray"]["retried"], "worker_generations_outside_awake": m["ray"]["worker_generations_outside_awake"],
                "gpu_used_gib": mem,
            })
            print(json.dumps(steps[-1]), flush=True)
            out["steps"] = steps
            save(out)  # a run cut short keeps the steps it finished
        windows = rt.lifecycle.gate_windows
        stats = await rt.worker_stats(times=True)
        dispatches = [t for s in stats for t in s["dispatch_times"]]
        out["worker_dispatches"] = len(dispatches)
        expected = args.prompts * args.n
        checks["all_steps_completed"] = all(s["status_counts"]["completed"] == expected for s in steps)
        checks["at_least_two_steps"] = len(steps) >= 2
        checks["every_stage_on_every_server"] = all(st["servers"] == args.num_servers for s in steps for st in s["stages"])
        checks["every_server_served_every_step"] = all(len(s["trajectories_per_server"]) == args.num_servers for s in steps)
        checks["dispatches_only_inside_awake_windows"] = bool(dispatches) and all(
            any(lo <= t <= hi for lo, hi in windows) for t in dispatches)
        checks["no_generation_outside_awake"] = all(s["worker_generations_outside_awake"] == 0 for s in steps)
        checks["new_weight_version_every_step"] = len({s["weight_version"] for s in steps}) == len(steps)
        if not args.dry_run:
            checks["memory_released_at_every_sleep"] = all(
                s["gpu_used_gib"]["after_sleep"] < s["gpu_used_gib"]["after_wake_up"] - 1.0 for s in steps)
    finally:
        with anyio.CancelScope(shield=True):
            if rt.fleet is not None:
                tails = []
                for a in rt.fleet.actors:
                    try:
                        tails.append(await a.log_tail.remote(60))
                    except Exception as e:  # a dead actor has no log to give; say so
                        tails.append(f"(no log: {e})")
                out["server_log_tails"] = tails
            await rt.stop()
            ray.shutdown()
    out["checks"] = checks
    return bool(checks) and all(checks.values())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--num-servers", type=int, default=2, choices=[1, 2, 3, 4], help="SGLang servers sharing the GPU")
    p.add_argument("--mem-fraction", type=float, default=0.3, help="--mem-fraction-static of each server (sum < 1)")
    p.add_argument("--model", default=None, help="a real HF model folder (default: Qwen2.5-0.5B shape, dummy weights)")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--dry-run", action="store_true", help="CPU engines instead of SGLang (debug the script)")
    args = p.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / ("gpu_ray_two_servers.json" if args.num_servers == 2 else f"gpu_ray_{args.num_servers}_server.json")
    def save(doc: dict[str, Any]) -> None:
        path.write_text(json.dumps(doc, indent=1, default=str))

    def on_term(*_: Any) -> None:  # `timeout` sends SIGTERM: stop the servers and write what was measured
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, on_term)
    out: dict[str, Any] = {"command": " ".join(sys.argv), "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "dry_run": args.dry_run}
    try:
        import ray

        out["versions"] = {"ray": ray.__version__}
        try:
            import sglang  # noqa: F401

            out["versions"]["sglang"] = getattr(sglang, "__version__", "?")
        except ImportError:
            if not args.dry_run:
                raise
        ok = anyio.run(run, args, out, save)
    except BaseException as e:  # the JSON must say what went wrong
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()
        ok = False
    out["ok"] = ok
    save(out)
    print(f"{'OK' if ok else 'FAILED'}: {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
