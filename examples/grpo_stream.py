"""GRPO that learns asynchronously: the streaming mode (trainer beside a never-sleeping engine, weights
applied in flight) and the over-admitted colocated step against the synchronous per-step mode, same
task, same steps, same trainer.

The task is `examples/grpo_gpu.py`'s tiny mode: the shipped tiny tool model made weak (seeded weight
noise), trained on arithmetic prompts with the calculator tool; the held-out reward (fresh questions)
is measured before and after each run. Each of `--runs` repeats (seed r) runs every mode from the same
weak checkpoint on one runtime (one engine), in the order of `--modes` (reversed every other repeat):

- **sync**: `rt.step(prompts, weights)` per step (staged wake-up → rollout → sleep), then the GRPO
  update (`grpo_gpu.grpo_train_step`: group advantages, PPO-clipped ratio to the rollout logprobs);
- **over**: the colocated step with over-admission: `rt.step(carry, weights, target_groups=prompts,
  active=--active, more_samples=feeder)` keeps `--active` trajectories in flight, returns once the batch's
  groups are complete and carries the rest (partial rollouts, restarted past η) into the next step;
- **stream**: `rollout_stream(rt, feeder, StreamConfig(batch_groups=prompts, active=...,
  max_staleness=η))`: the engine stays awake with `--active` trajectories in flight; each batch of
  complete groups is trained on as it comes and the new weights are applied in flight
  (`update_weights`: the requests in flight end, the weights load, generation goes on). The PPO ratio is taken to the logprobs of the weights
  that sampled each token (the rollout logprobs), so stale tokens are clipped like any off-policy one.

Recorded per step and mode: the batch's mean reward, wall-clock seconds since the run started (rollout
and training together), the staleness histogram of trained tokens; per run: held-out reward before and
after, total seconds. JSON (rewritten after every run) and a PNG (reward and wall-clock per step, every mode).

    python examples/grpo_stream.py --engine sglang --out DIR      # one H200: 30 steps, 2 runs per mode
    python examples/grpo_stream.py --engine cpu --out DIR         # the same code path at tiny sizes
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_gpu import (  # noqa: E402  (the tiny task, trainer and GRPO update of the GPU example)
    EVAL_SEED,
    grpo_train_step,
    live_state_dict,
    resolve_engine,
    reward_of,
    runtime_config,
    tiny_samples,
    trainer_model,
    weak_checkpoint,
)

from agentloop.runtime import Runtime  # noqa: E402
from agentloop.runtime.stream import StreamConfig, rollout_stream  # noqa: E402
from agentloop.types import Sample  # noqa: E402

SIZES = {  # what a GPU run uses, and what the CPU check can do in seconds
    "sglang": dict(steps=30, prompts=16, n=8, max_new_tokens=48, lr=5e-4, mem_fraction=0.3, eval_prompts=256,
                   active=512, runs=2),
    "cpu": dict(steps=3, prompts=2, n=2, max_new_tokens=40, lr=5e-4, mem_fraction=0.3, eval_prompts=4, active=8, runs=1),
}


def feeder(seed: int, per_step: int) -> Iterator[Sample]:
    """The training prompts in order: step k's are grpo_gpu's `tiny_samples` of seed 1000*seed + k."""
    step = 0
    while True:
        step += 1
        yield from tiny_samples(f"r{seed}-s{step}", per_step, seed=seed * 1000 + step)


def _args_for_gpu_example(args: argparse.Namespace) -> argparse.Namespace:
    """The fields `grpo_gpu.runtime_config` / `trainer_model` read."""
    return argparse.Namespace(mode="tiny", engine=args.engine, max_new_tokens=args.max_new_tokens, no_sleep=False,
                              mem_fraction=args.mem_fraction, threads=args.threads, n=args.n, prompts=args.prompts,
                              seed=0)


async def evaluate(rt: Runtime, weights: dict[str, Any], args: argparse.Namespace, tag: str) -> float:
    ev = await rt.step(tiny_samples(f"eval-{tag}", args.eval_prompts, seed=EVAL_SEED), weights, n=1)
    return reward_of(ev.trajectories)


async def one_run(rt: Runtime, mode: str, seed: int, args: argparse.Namespace, model_dir: Path,
                  device: torch.device) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = trainer_model(_args_for_gpu_example(args), model_dir, {}, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.99))
    weights = live_state_dict(model)
    run: dict[str, Any] = {"mode": mode, "seed": seed, "steps": []}
    if args.eval_prompts:
        run["eval_before"] = await evaluate(rt, weights, args, f"{mode}{seed}-before")
    t0 = time.monotonic()

    def record(step: int, batch: Any, trajs: list[Any], staleness: dict[int, int], train: dict[str, Any]) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()
        run["steps"].append({"step": step, "reward_mean": reward_of(trajs), "wall_s": round(time.monotonic() - t0, 3),
                             "staleness": {str(k): v for k, v in staleness.items()},
                             **{k: train.get(k) for k in ("loss", "trained_tokens", "clipped_fraction", "grad_norm",
                                                       "logprob_abs_diff_max", "skipped_nonfinite_update",
                                                       "nonfinite_rollout_logprobs")}})
        s = run["steps"][-1]
        print(f"{mode:6s} run {seed} step {step:3d}: reward {s['reward_mean']:.3f} at {s['wall_s']:7.2f}s "
              f"staleness {s['staleness']}", flush=True)

    if mode == "sync":
        prompts = feeder(seed, args.prompts)
        for step in range(1, args.steps + 1):
            res = await rt.step([next(prompts) for _ in range(args.prompts)], weights)
            train = grpo_train_step(model, opt, res.batch, device)
            record(step, res.batch, res.trajectories, {0: int(res.batch["response_mask"].sum())}, train)
    elif mode == "over":
        prompts, carry = feeder(seed, args.prompts), []
        for step in range(1, args.steps + 1):
            res = await rt.step(carry, weights, target_groups=args.prompts, active=args.active, more_samples=prompts,
                                partial_rollout=True, max_staleness=args.max_staleness, stale_policy="restart")
            train = grpo_train_step(model, opt, res.batch, device)
            record(step, res.batch, res.trajectories, {int(k): v for k, v in res.metrics["token_staleness"].items()}, train)
            carry = res.carry_over  # partial rollouts: resumed next step under the new weights
    else:
        cfg = StreamConfig(batch_groups=args.prompts, active=args.active, max_staleness=args.max_staleness)
        async with rollout_stream(rt, feeder(seed, args.prompts), cfg, weights=weights) as s:
            async for batch in s:
                train = grpo_train_step(model, opt, batch.batch, device)
                record(batch.index, batch.batch, batch.trajectories, batch.staleness, train)
                if batch.index >= args.steps:
                    break
                await s.update_weights(weights)  # the live parameters, under a new version
            run["stream_metrics"] = {k: v for k, v in s.metrics.items() if k != "update_seconds"}
            run["update_seconds_mean"] = round(sum(s.update_seconds) / max(1, len(s.update_seconds)), 4)
    run["train_wall_s"] = round(time.monotonic() - t0, 3)
    if args.eval_prompts:
        run["eval_after"] = await evaluate(rt, weights, args, f"{mode}{seed}-after")
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return run


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("sync", "over", "stream"):
        rs = [r for r in runs if r["mode"] == mode]
        if not rs:
            continue
        gains = [r["eval_after"] - r["eval_before"] for r in rs if "eval_after" in r]
        walls = [r["train_wall_s"] for r in rs]
        out[mode] = {"runs": len(rs), "held_out_gain": gains, "held_out_gain_mean": sum(gains) / len(gains) if gains else None,
                     "held_out_gain_spread": (max(gains) - min(gains)) if gains else None,
                     "train_wall_s": walls, "train_wall_s_mean": sum(walls) / len(walls),
                     "seconds_per_step_mean": sum(walls) / sum(len(r["steps"]) for r in rs)}
    for mode in ("stream", "over"):
        if "sync" in out and mode in out:
            out[f"{mode}_over_sync_wall"] = out[mode]["train_wall_s_mean"] / out["sync"]["train_wall_s_mean"]
    return out


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    colors = {"sync": "tab:gray", "over": "tab:orange", "stream": "tab:blue"}
    for r in report["runs"]:
        xs = [s["step"] for s in r["steps"]]
        a.plot(xs, [s["reward_mean"] for s in r["steps"]], color=colors[r["mode"]], alpha=0.8,
               label=f"{r['mode']} run {r['seed']}")
        b.plot(xs, [s["wall_s"] for s in r["steps"]], color=colors[r["mode"]], alpha=0.8, label=f"{r['mode']} run {r['seed']}")
    a.set_xlabel("step")
    a.set_ylabel("batch reward (mean)")
    b.set_xlabel("step")
    b.set_ylabel("wall-clock seconds (rollout + training)")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    s = report.get("summary", {})
    gains = {m: s.get(m, {}).get("held_out_gain_mean") for m in ("sync", "over", "stream")}
    fig.suptitle(f"GRPO, {report['engine']} engine: mean held-out gain " +
                 ", ".join(f"{m} {g:+.3f}" for m, g in gains.items() if g is not None), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / f"grpo_stream_{args.engine}.json"
    device = torch.device("cuda" if args.engine == "sglang" else "cpu")
    torch.set_num_threads(args.threads)
    model_dir = weak_checkpoint(Path(args.work or out / "work_stream") / "weak_tiny_tool", args.noise, 0)
    report: dict[str, Any] = {"command": " ".join(["python", "examples/grpo_stream.py", *sys.argv[1:]]),
                              "engine": args.engine, "args": vars(args), "runs": []}
    cfg = runtime_config(_args_for_gpu_example(args), model_dir)
    cfg["scheduler"]["concurrency"] = max(args.active, args.prompts * args.n)
    async with Runtime(cfg) as rt:
        for seed in range(args.runs):
            for mode in (args.modes if seed % 2 == 0 else args.modes[::-1]):  # alternate who goes first
                report["runs"].append(await one_run(rt, mode, seed, args, model_dir, device))
                report["summary"] = summarize(report["runs"])
                json_path.write_text(json.dumps(report, indent=1, default=str))
        report["generations_outside_awake"] = rt.lifecycle.generations_outside_awake
    report["summary"] = summarize(report["runs"])
    json_path.write_text(json.dumps(report, indent=1, default=str))
    try:
        plot(report, json_path.with_suffix(".png"))
    except Exception as e:  # the JSON is the record
        print(f"plot failed: {type(e).__name__}: {e}", flush=True)
    print("summary: " + json.dumps(report["summary"]), flush=True)
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=["auto", "sglang", "cpu"], default="auto")
    for name in ("steps", "prompts", "n", "max_new_tokens", "eval_prompts", "active", "runs"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--mem-fraction", type=float, default=None)
    p.add_argument("--max-staleness", type=int, default=1, help="η of the streaming mode and of over-admission's carry")
    p.add_argument("--modes", nargs="+", choices=["sync", "over", "stream"], default=["sync", "over", "stream"])
    p.add_argument("--noise", type=float, default=0.3, help="weight noise of the weak checkpoint (x std)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="grpo_stream_out")
    p.add_argument("--work", default=None)
    args = p.parse_args(argv)
    args.engine = resolve_engine(args.engine)
    for k, v in SIZES[args.engine].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def main(argv: list[str] | None = None) -> int:
    report = anyio.run(main_async, parse_args(argv))
    return 1 if report.get("generations_outside_awake") else 0


if __name__ == "__main__":
    sys.exit(main())
