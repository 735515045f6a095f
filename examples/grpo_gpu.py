"""GRPO on one GPU: the trainer and SGLang share the device, SGLang sleeps while the trainer trains.

`Runtime` launches SGLang itself (memory saver on). Every step:
1. `rt.step(samples, weights=<the trainer's live GPU state dict>)`: staged wake-up (resume weights →
   `update_weights_from_tensor` by CUDA IPC, straight from the trainer's parameters: no copy to the
   CPU, no checkpoint on disk → resume KV cache and CUDA graphs), multi-turn rollout, collate, sleep
   (weights, KV cache and CUDA graphs released);
2. the GRPO loss on the collated batch with the rollout logprobs (group-normalised advantages, PPO
   clipped ratio; `examples/grpo_cpu.py` holds that math, this script runs it on the GPU under bf16
   autocast) → optimizer step, in the memory SGLang gave back.

Two modes:
- `--mode tiny` (learning signal): the shipped tiny tool model made deliberately weak (seeded
  Gaussian noise of `--noise` x each tensor's std added to every weight; at 0.3, `evaluate_model` of
  tools/train_tiny_model.py gave 49 right final answers out of 100 greedy, the shipped model ~97%), trained on arithmetic prompts with the calculator tool;
  a held-out evaluation (fresh questions, the same sampling) before the first and after the last step.
- `--mode real` (memory realism): a Qwen2.5-0.5B-shaped policy (random init, SGLang `--load-format
  dummy`; the trainer's fp32 parameters, gradients and AdamW state are ~8 GB) with the engine's
  `--mem-fraction` and the training batch chosen so the training step does not fit while the KV
  cache is resident. `--probe-no-sleep` then wakes the engine and runs the training step with it
  awake (what a trainer without sleep does): it runs out of memory, which is recorded. `--no-sleep`
  runs the whole loop with nothing released (`engine.release_tags: []`).

Per step it records wake / rollout / sleep / train seconds, GPU memory (device-wide, SGLang's
processes included, and the trainer's own) after every stage plus a sampled timeline, the trainer's
recomputed logprobs of the sampled tokens vs the engine's (mean and max |delta|), reward and loss.
The JSON report is rewritten after every step (a run cut short keeps what it measured); the PNG
(reward vs step, memory timeline, step-time breakdown) is drawn at the end.

`--engine cpu` (the default without a CUDA GPU or without sglang) runs the same code path with the
embedded CPU engine standing in for SGLang (tensors by safetensors instead of CUDA IPC, no GPU
memory figures) at tiny sizes: `tests/test_example_grpo_gpu.py` runs it for 2 steps.

Run (GPU): `python examples/grpo_gpu.py --mode tiny --steps 30 --out DIR`,
           `python examples/grpo_gpu.py --mode real --steps 6 --out DIR`; `tools/gpu_grpo.sh` runs both.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import platform
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_cpu import group_advantages  # noqa: E402  (the same GRPO math as the CPU example)

from agentloop.batch import RolloutBatch  # noqa: E402
from agentloop.runtime import Runtime  # noqa: E402
from agentloop.tasks.arithmetic import CALCULATOR_TOOL, generate_questions  # noqa: E402
from agentloop.types import Sample, Trajectory  # noqa: E402

GIB = 2**30
EVAL_SEED = 987_654  # held-out questions: neither the training prompts (seeds 1000*seed + step) nor the shipped model's


# ------------------------------------------------------------------ engine choice
def sglang_available() -> bool:
    import importlib.util

    return torch.cuda.is_available() and importlib.util.find_spec("sglang") is not None


def resolve_engine(engine: str) -> str:
    if engine == "auto":
        return "sglang" if sglang_available() else "cpu"
    if engine == "sglang" and not sglang_available():
        raise SystemExit("--engine sglang needs a CUDA GPU and sglang installed (source tools/gpu/install_on_device.sh; docs/gpu.md)")
    return engine


# ------------------------------------------------------------------ models
def weak_checkpoint(folder: Path, noise: float, seed: int) -> Path:
    """The shipped tiny tool model with seeded Gaussian noise (`noise` x each tensor's std) added to
    every weight: a deterministic, deliberately weak starting point (tokenizer and config unchanged).
    The same checkpoint as `agentloop.models.weak_tiny_tool_model` (the CPU demos use it too)."""
    from agentloop.models import weak_tiny_tool_model

    return weak_tiny_tool_model(noise, seed, folder=folder)


def real_model_folder(folder: Path, engine: str, *, vocab_size: int) -> tuple[Path, dict[str, Any]]:
    """A Qwen2.5-0.5B-shaped model folder (the CPU dry run: a small Qwen2) with the small byte-level
    tokenizer of `make_random_model` and the vocabulary padded to `vocab_size` (as Qwen's is).
    SGLang serves it with `--load-format dummy`; the trainer pushes its own weights at step 1."""
    from agentloop.engine.launch import QWEN2_05B_CONFIG
    from agentloop.models.random_model import make_random_model

    make_random_model(folder, arch="qwen2", vocab_size=vocab_size, hidden_size=64, num_layers=2, seed=0)
    config = json.loads((folder / "config.json").read_text())
    if engine == "sglang":
        keep = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        config = {**QWEN2_05B_CONFIG, **keep, "vocab_size": vocab_size}
        (folder / "config.json").write_text(json.dumps(config, indent=1))
        (folder / "model.safetensors").unlink()  # dummy weights: nothing to read
    return folder, config


def trainer_model(args: argparse.Namespace, model_dir: Path, config: dict[str, Any], device: torch.device) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.mode == "real" and args.engine == "sglang":
        torch.manual_seed(args.seed)
        cfg = AutoConfig.from_pretrained(str(model_dir))
        with device:
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device)
    model.config.use_cache = False
    return model


def live_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainer's parameters as they are (no copy): tied tensors once, under their first name."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out[name] = t
    return out


# ------------------------------------------------------------------ prompts
def tiny_samples(tag: str, num: int, seed: int) -> list[Sample]:
    return [Sample(uid=f"{tag}-q{i}", messages=[{"role": "user", "content": q.question}], tools=[CALCULATOR_TOOL],
                   agent="tool", reward="arithmetic", ground_truth=q.answer)
            for i, q in enumerate(generate_questions(num, seed=seed))]


REAL_PROMPTS = ["Write a long story about a lighthouse keeper.", "Explain how a compiler works, step by step.",
                "List every prime number you know and say something about each.", "Describe the water cycle in detail."]


def real_samples(tag: str, num: int) -> list[Sample]:
    return [Sample(uid=f"{tag}-p{i}", messages=[{"role": "user", "content": REAL_PROMPTS[i % len(REAL_PROMPTS)]}],
                   agent="single_turn") for i in range(num)]


def lower_half_reward(vocab_size: int):
    """A learnable reward for a random-weight policy (real mode): the share of its sampled tokens in
    the lower half of the vocabulary, so advantages and gradients are not all zero."""

    def reward(traj: Trajectory, sample: Sample) -> float:
        ids = [t for t, m in zip(traj.response_ids, traj.response_mask) if m]
        return sum(t < vocab_size // 2 for t in ids) / max(1, len(ids))

    return reward


# ------------------------------------------------------------------ memory
def gpu_used_gib() -> float | None:
    """Device-wide used memory (every process: SGLang's scheduler included); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return round((total - free) / GIB, 3)


def trainer_gib() -> float | None:
    return round(torch.cuda.memory_allocated() / GIB, 3) if torch.cuda.is_available() else None


class MemoryTimeline:
    """A thread sampling device-wide used memory every `period` s, tagged with the loop's phase."""

    def __init__(self, t0: float, period: float = 0.05) -> None:
        self.t0, self.period = t0, period
        self.phase = "start"
        self.samples: list[tuple[float, float, float, str]] = []  # (t, device used GiB, trainer GiB, phase)
        self.peak: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-timeline", daemon=True)

    def start(self) -> "MemoryTimeline":
        if torch.cuda.is_available():
            self._thread.start()
        return self

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self.peak[phase] = 0.0

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            used, mine, phase = gpu_used_gib(), trainer_gib(), self.phase
            assert used is not None and mine is not None
            self.samples.append((round(time.monotonic() - self.t0, 3), used, mine, phase))
            self.peak[phase] = max(self.peak.get(phase, 0.0), used)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)


# ------------------------------------------------------------------ the GRPO update
def sampled_logprobs(model: torch.nn.Module, batch: RolloutBatch, rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """log p(sampled token | prefix) under `model` for `rows` of the batch, [rows, R] float32."""
    p_len = batch["prompts"].shape[1]
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        out = model(input_ids=batch["input_ids"][rows].to(device), attention_mask=batch["attention_mask"][rows].to(device),
                    position_ids=batch["position_ids"][rows].to(device))
        logits = out.logits[:, p_len - 1: -1].float()  # position t predicts token t+1
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, batch["responses"][rows].to(device).unsqueeze(-1)).squeeze(-1)


#: Dual-clip bound for negative advantages (Ye et al. 2020; verl's `clip_ratio_c`): an off-policy token
#: (a stale one of the streaming mode) whose ratio is huge would otherwise make the loss, and the
#: gradient norm, infinite; `clip_grad_norm_` then scales by 1/inf and writes NaN into every weight.
CLIP_RATIO_C = 3.0


def grpo_train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: RolloutBatch, device: torch.device,
                    *, clip: float = 0.2) -> dict[str, Any]:
    """One GRPO update on the whole batch (one micro-batch: its activations are what needs the GPU
    memory SGLang released). Returns loss, grad norm and the trainer-vs-engine logprob agreement.
    Tokens whose rollout logprob is not finite are left out (counted); an update whose gradient
    norm is not finite is skipped (counted), so the weights the engine loads next stay finite."""
    rows = torch.tensor([i for i, s in enumerate(batch["statuses"]) if s in ("completed", "truncated")], dtype=torch.long)
    if len(rows) == 0:
        return {"loss": 0.0, "trained_rows": 0}
    adv = group_advantages(batch["rewards"][rows], [batch["group_ids"][i] for i in rows.tolist()]).to(device)
    old = batch["rollout_log_probs"][rows].to(device)
    sampled = batch["response_mask"][rows].to(device).bool()
    mask = sampled & torch.isfinite(old)
    model.train()
    new = sampled_logprobs(model, batch, rows, device)
    diff = (new.detach() - old).abs()[mask]
    # clamped before exp: e^20 is already far outside the clip range, and exp must not overflow
    log_ratio = torch.where(mask, (new - old).clamp(-20.0, 20.0), torch.zeros_like(new))
    ratio = torch.exp(log_ratio)
    a = adv.unsqueeze(1)
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a)
    surrogate = torch.where(a < 0, torch.maximum(surrogate, CLIP_RATIO_C * a), surrogate)
    loss = -torch.where(mask, surrogate, torch.zeros_like(surrogate)).sum() / mask.sum().clamp(min=1)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    finite_update = bool(torch.isfinite(grad_norm))
    if finite_update:
        opt.step()
    opt.zero_grad(set_to_none=True)  # gradients are not kept through the next rollout
    return {
        "loss": float(loss.detach()),
        "grad_norm": float(grad_norm),
        "skipped_nonfinite_update": not finite_update,
        "nonfinite_rollout_logprobs": int((sampled & ~torch.isfinite(old)).sum()),
        "trained_rows": int(len(rows)),
        "trained_tokens": int(mask.sum()),
        "batch_shape": list(batch["input_ids"].shape),
        "nonzero_advantages": int((adv != 0).sum()),
        "clipped_fraction": float(((ratio - 1).abs() > clip)[mask].float().mean()) if mask.any() else 0.0,
        # the importance-ratio health: same weights, same tokens, the trainer's bf16 vs the engine's logprobs
        "logprob_abs_diff_mean": float(diff.mean()) if diff.numel() else 0.0,
        "logprob_abs_diff_max": float(diff.max()) if diff.numel() else 0.0,
    }


# ------------------------------------------------------------------ report
def versions() -> dict[str, Any]:
    out: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
                           "cuda": torch.version.cuda}
    for pkg in ("sglang", "transformers", "torch_memory_saver", "agentloop"):
        try:
            out[pkg] = importlib.metadata.version(pkg.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpu_total_gib"] = round(torch.cuda.mem_get_info()[1] / GIB, 1)
    return out


def write_json(path: Path, report: dict[str, Any]) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(path)  # a reader (or a cut-short run) never sees half a file


def reward_of(trajs: list[Trajectory]) -> float:
    return sum((t.reward or 0.0) for t in trajs) / len(trajs) if trajs else math.nan


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """The run in a few figures (medians over the steps, peaks, first vs last steps), for the README."""
    import statistics

    steps = [s for s in report["steps"] if s.get("train_outcome") != "out_of_memory"]
    if not steps:
        return {"steps": 0}

    def med(key: str) -> float | None:
        xs = [s[key] for s in steps if s.get(key) is not None]
        return round(statistics.median(xs), 4) if xs else None

    def mem(key: str, agg: Any = statistics.median) -> float | None:
        xs = [s["memory_gib"][key] for s in steps if s["memory_gib"].get(key) is not None]
        return round(agg(xs), 3) if xs else None

    k = max(1, min(5, len(steps) // 3))
    out: dict[str, Any] = {
        "steps": len(steps),
        "seconds_median": {x: med(f"{x}_seconds") for x in ("wake_up", "rollout", "sleep", "train")},
        "reward_first_steps_mean": round(statistics.fmean(s["reward_mean"] for s in steps[:k]), 4),
        "reward_last_steps_mean": round(statistics.fmean(s["reward_mean"] for s in steps[-k:]), 4),
        "reward_window_steps": k,
        "logprob_abs_diff_mean_median": med("logprob_abs_diff_mean"),
        "logprob_abs_diff_max_max": max((s.get("logprob_abs_diff_max") or 0.0) for s in steps),
        "gpu_used_gib_awake_median": mem("after_wake_first_generate"),
        "gpu_used_gib_asleep_median": mem("after_sleep"),
        "gpu_used_gib_train_peak_max": mem("train_peak", max),
        "trainer_peak_allocated_gib_max": mem("trainer_peak_allocated", max),
        "generations_outside_awake": report.get("generations_outside_awake"),
    }
    for key in ("eval_before", "eval_after"):
        if report.get(key):
            out[f"{key}_reward"] = report[key]["reward_mean"]
    probe = report.get("no_sleep_probe")
    if probe:
        out["no_sleep_probe"] = {k: probe.get(k) for k in ("outcome", "free_gib_for_the_trainer", "memory_engine_awake_gib",
                                                           "trainer_peak_allocated_gib")}
    return out


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = report["steps"]
    fig, ax = plt.subplots(1, 3, figsize=(18, 4.8))
    title = f"{report['mode']} mode on {report['engine']} ({report['versions'].get('gpu') or 'CPU'})"
    fig.suptitle(f"GRPO with agentloop + {title}")
    xs = [s["step"] for s in steps]
    ax[0].plot(xs, [s["reward_mean"] for s in steps], "o-", label="training rollout reward (mean)")
    for key, x, style in (("eval_before", 0, "s"), ("eval_after", max(xs, default=0), "D")):
        if report.get(key):
            ax[0].plot([x], [report[key]["reward_mean"]], style, ms=9, label=f"held-out {key.split('_')[1]}")
    ax[0].set(xlabel="step", ylabel="reward", title="reward vs step")
    ax[0].legend(fontsize=8)
    tl = report.get("memory_timeline") or []
    if tl:
        colors = {"rollout": "tab:blue", "train": "tab:red", "eval": "tab:green", "no_sleep_probe": "tab:purple"}
        t = [s[0] for s in tl]
        ax[1].plot(t, [s[1] for s in tl], color="black", lw=1, label="device used (SGLang + trainer)")
        ax[1].plot(t, [s[2] for s in tl], color="tab:orange", lw=1, label="trainer allocated")
        for phase, c in colors.items():
            pts = [(s[0], s[1]) for s in tl if s[3].startswith(phase)]
            if pts:
                ax[1].scatter(*zip(*pts), s=2, color=c, label=phase)
        total = report["versions"].get("gpu_total_gib")
        if total:
            ax[1].axhline(total, ls="--", color="gray", lw=0.8, label=f"GPU total {total} GiB")
        ax[1].legend(fontsize=7, markerscale=4)
    else:
        ax[1].text(0.5, 0.5, "no GPU memory readings (CPU engine)", ha="center", transform=ax[1].transAxes)
    ax[1].set(xlabel="seconds", ylabel="GiB", title="GPU memory timeline")
    bottom = [0.0] * len(steps)
    for key in ("wake_up_seconds", "rollout_seconds", "sleep_seconds", "train_seconds"):
        vals = [s.get(key) or 0.0 for s in steps]
        ax[2].bar(xs, vals, bottom=bottom, label=key.replace("_seconds", ""))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax[2].set(xlabel="step", ylabel="seconds", title="step time breakdown")
    ax[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ the loop
def runtime_config(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    if args.mode == "tiny":
        agent = {"agent": "tool", "max_assistant_turns": 3, "max_new_tokens_per_turn": args.max_new_tokens,
                 "max_response_tokens": 3 * args.max_new_tokens + 96, "sampling": {"temperature": 1.0}}
    else:
        agent = {"agent": "single_turn", "max_assistant_turns": 1, "max_new_tokens_per_turn": args.max_new_tokens,
                 "max_response_tokens": args.max_new_tokens, "sampling": {"temperature": 1.0}}
    # request_timeout well under trajectory_timeout (300 s): a stuck request leaves time to retry it elsewhere.
    engine: dict[str, Any] = {"request_timeout": 120, "start_timeout": 600}
    if args.no_sleep:
        engine["release_tags"] = []  # sleep disabled: weights, KV cache and CUDA graphs stay resident
    if args.engine == "sglang":
        flags = ["--dtype", "bfloat16"] + (["--load-format", "dummy"] if args.mode == "real" else [])
        engine["launch"] = {"model_path": str(model_dir), "mem_fraction_static": args.mem_fraction, "flags": flags}
    else:
        engine.update(model=str(model_dir), local={"num_threads": args.threads})
    return {"engine": engine,
            "scheduler": {"n": args.n, "concurrency": args.prompts * args.n, "trajectory_timeout": 300,
                          "reward": "arithmetic" if args.mode == "tiny" else None},
            "agent": agent}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / f"grpo_gpu_{args.mode}.json", out / f"grpo_gpu_{args.mode}.png"
    work = Path(args.work or out / f"work_{args.mode}")
    device = torch.device("cuda" if args.engine == "sglang" else "cpu")
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    if args.mode == "tiny":
        model_dir = weak_checkpoint(work / "weak_tiny_tool", args.noise, args.seed)
        config = json.loads((model_dir / "config.json").read_text())
        reward_fn = None
    else:
        model_dir, config = real_model_folder(work / "qwen2_05b_shape", args.engine, vocab_size=args.vocab_size)
        reward_fn = lower_half_reward(int(config["vocab_size"]))
    report: dict[str, Any] = {
        "command": " ".join(["python", "examples/grpo_gpu.py", *sys.argv[1:]]), "mode": args.mode, "engine": args.engine,
        "dryrun_on_cpu_engine": args.engine == "cpu", "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": versions(), "args": vars(args), "model": {"folder": str(model_dir), "config": config},
        "runtime_config": runtime_config(args, model_dir), "memory": {"at_start": gpu_used_gib()}, "steps": [],
    }
    if args.mode == "tiny":
        report["model"]["weak_checkpoint"] = (f"the shipped tiny tool model + N(0, ({args.noise} x tensor std)^2) "
                                              f"noise on every weight, seed {args.seed}")
    timeline = MemoryTimeline(t_start).start()
    first_generate: dict[str, Any] = {}

    def on_generate(url: str, state: Any) -> None:  # the first dispatch of a step: the engine just woke
        if "memory" not in first_generate:
            first_generate["memory"] = gpu_used_gib()

    def save() -> None:
        report["memory_timeline"] = timeline.samples
        report["elapsed_seconds"] = round(time.monotonic() - t_start, 1)
        write_json(json_path, report)

    def samples_for(step: int) -> list[Sample]:
        if args.mode == "tiny":
            return tiny_samples(f"step{step}", args.prompts, seed=args.seed * 1000 + step)
        return real_samples(f"step{step}", args.prompts)

    try:
        t0 = time.monotonic()
        print(f"starting the engine ({'launching SGLang' if args.engine == 'sglang' else 'embedded CPU engine'}, "
              f"model {model_dir}) ...", flush=True)
        async with Runtime(runtime_config(args, model_dir), reward_fn=reward_fn) as rt:
            assert rt.lifecycle is not None
            # the dispatch hook lives on the lifecycle's gate (or, in older versions, the lifecycle)
            getattr(rt.lifecycle, "gate", rt.lifecycle).on_generate = on_generate
            report["engine_start_seconds"] = round(time.monotonic() - t0, 1)
            report["engine_urls"] = rt.lifecycle.urls
            report["memory"]["engine_started_asleep"] = gpu_used_gib()
            model = trainer_model(args, model_dir, config, device)
            opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.99))
            report["trainer"] = {"parameters": sum(p.numel() for p in model.parameters()), "dtype": "float32 master weights, "
                                 "bf16 autocast" if device.type == "cuda" else "float32", "optimizer": "AdamW",
                                 "lr": args.lr}
            report["memory"]["trainer_loaded"] = gpu_used_gib()
            print(f"engine {args.engine} up in {report['engine_start_seconds']}s; trainer "
                  f"{report['trainer']['parameters'] / 1e6:.1f}M params; GPU used {gpu_used_gib()} GiB", flush=True)
            weights = live_state_dict(model)

            async def evaluate(tag: str) -> dict[str, Any]:
                timeline.set_phase(f"eval_{tag}")
                ev = await rt.step(tiny_samples(f"eval-{tag}", args.eval_prompts, seed=EVAL_SEED), weights, n=1)
                res = {"reward_mean": reward_of(ev.trajectories), "questions": len(ev.trajectories),
                       "status_counts": ev.metrics["status_counts"], "tool_calls": sum(t.tool_calls for t in ev.trajectories),
                       "weight_version": ev.weight_version, "seed": EVAL_SEED, "temperature": 1.0}
                print(f"held-out eval {tag}: reward {res['reward_mean']:.3f} over {res['questions']} questions", flush=True)
                return res

            if args.mode == "tiny" and args.eval_prompts:
                report["eval_before"] = await evaluate("before")
                save()
            for step in range(1, args.steps + 1):
                first_generate.clear()
                first_record = len(rt.lifecycle.records)
                mem_before = gpu_used_gib()
                timeline.set_phase("rollout")
                res = await rt.step(samples_for(step), weights)
                mem_after_sleep = gpu_used_gib()
                timeline.set_phase("train")
                if torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()
                    torch.cuda.synchronize()
                t_train = time.monotonic()
                try:
                    train = grpo_train_step(model, opt, res.batch, device)
                except torch.cuda.OutOfMemoryError as e:  # expected with --no-sleep in real mode: recorded
                    opt.zero_grad(set_to_none=True)
                    train = {"loss": math.nan, "train_outcome": "out_of_memory", "error": str(e).splitlines()[0][:600]}
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                    # The caching allocator keeps the step's activations reserved; SGLang's wake-up re-maps its KV
                    # cache into that same memory, so hand it back or resume_memory_occupation fails with OOM
                    # (seen on the H200 at step 2: torch_memory_saver "cudaError 2 (out of memory)" killed the server).
                    torch.cuda.empty_cache()
                train_seconds = time.monotonic() - t_train
                timeline.set_phase("idle")
                m, trajs = res.metrics, res.trajectories
                entry = {
                    "step": step, "weight_version": res.weight_version,
                    "trajectory_weight_versions": sorted({v for t in trajs for v in t.weight_versions}),
                    "trajectories": len(trajs), "status_counts": m["status_counts"],
                    "tool_calls": sum(t.tool_calls for t in trajs), "reward_mean": reward_of(trajs),
                    "sampled_tokens": int(res.batch["response_mask"].sum()),
                    "wake_up_seconds": round(m["wake_up_seconds"], 4), "rollout_seconds": round(m["rollout_seconds"], 3),
                    "sleep_seconds": round(m["sleep_seconds"], 4), "train_seconds": round(train_seconds, 3),
                    "stage_seconds": {k: round(v, 4) for k, v in m["stage_seconds"].items()},
                    "stages": [f"{r.phase}/{r.stage}" for r in rt.lifecycle.records[first_record:]],
                    "lifecycle_state_after_step": rt.lifecycle.state.value,
                    "generations_outside_awake": rt.lifecycle.generations_outside_awake,
                    "memory_gib": {
                        "before_wake": mem_before, "after_wake_first_generate": first_generate.get("memory"),
                        "rollout_peak": timeline.peak.get("rollout") or None, "after_sleep": mem_after_sleep,
                        "train_peak": timeline.peak.get("train") or None, "after_train": gpu_used_gib(),
                        "trainer_peak_allocated": round(torch.cuda.max_memory_allocated() / GIB, 3)
                        if torch.cuda.is_available() else None,
                    },
                    **train,
                }
                report["steps"].append(entry)
                save()
                mem = entry["memory_gib"]
                print(f"step {step:3d} v={res.weight_version} reward={entry['reward_mean']:.3f} loss={train['loss']:+.4f} "
                      f"|dlogp| mean/max={train.get('logprob_abs_diff_mean', 0):.2e}/{train.get('logprob_abs_diff_max', 0):.2e} "
                      f"wake/roll/sleep/train={m['wake_up_seconds']:.2f}/{m['rollout_seconds']:.2f}/"
                      f"{m['sleep_seconds']:.2f}/{train_seconds:.2f}s mem awake/asleep/train-peak="
                      f"{mem['after_wake_first_generate']}/{mem['after_sleep']}/{mem['train_peak']} GiB "
                      f"+{time.monotonic() - t_start:.0f}s", flush=True)
                if train.get("train_outcome") == "out_of_memory":
                    print(f"step {step}: the training step ran out of GPU memory: {train['error'][:200]}", flush=True)
                    torch.cuda.empty_cache()
                    break
            if args.mode == "tiny" and args.eval_prompts:
                report["eval_after"] = await evaluate("after")
                save()
            if args.probe_no_sleep:
                report["no_sleep_probe"] = await no_sleep_probe(rt, model, opt, weights, samples_for(args.steps + 1),
                                                                device, timeline)
                save()
            report["generations_outside_awake"] = rt.lifecycle.generations_outside_awake
            report["lifecycle_stages_total"] = len(rt.lifecycle.records)
    finally:
        timeline.stop()
        report["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        report["summary"] = summarize(report)
        save()
        print("summary: " + json.dumps(report["summary"]), flush=True)
        try:
            plot(report, png_path)
        except Exception as e:  # the JSON is the record; a plotting failure must not hide it
            print(f"plot failed: {type(e).__name__}: {e}", flush=True)
    return report


async def no_sleep_probe(rt: Runtime, model: torch.nn.Module, opt: torch.optim.Optimizer, weights: dict[str, Any],
                         samples: list[Sample], device: torch.device, timeline: MemoryTimeline) -> dict[str, Any]:
    """What a trainer that does not put the engine to sleep gets: roll out (the step sleeps as usual),
    wake the engine again (weights, KV cache, CUDA graphs resident), then run the training step."""
    assert rt.lifecycle is not None
    timeline.set_phase("no_sleep_probe")
    res = await rt.step(samples, weights)
    await rt.lifecycle.wake_up(weights)  # the same dict: resumes every tag and reloads it
    probe: dict[str, Any] = {"engine_state": rt.lifecycle.state.value, "memory_engine_awake_gib": gpu_used_gib()}
    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        probe["free_gib_for_the_trainer"] = round(free / GIB, 3)
        torch.cuda.reset_peak_memory_stats()
    t0 = time.monotonic()
    try:
        stats = grpo_train_step(model, opt, res.batch, device)
        probe.update(outcome="fit", train=stats)
    except torch.cuda.OutOfMemoryError as e:
        probe.update(outcome="out_of_memory", error=str(e).splitlines()[0][:600])
        opt.zero_grad(set_to_none=True)
    probe["seconds"] = round(time.monotonic() - t0, 3)
    if torch.cuda.is_available():
        probe["trainer_peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
        torch.cuda.empty_cache()
    await rt.lifecycle.sleep()
    probe["memory_after_sleep_gib"] = gpu_used_gib()
    timeline.set_phase("idle")
    print(f"no-sleep probe: training step with the engine awake -> {probe['outcome']} "
          f"(free for the trainer {probe.get('free_gib_for_the_trainer')} GiB)", flush=True)
    return probe


# ------------------------------------------------------------------ command line
SIZES = {  # per mode and engine: what a GPU run uses, and what the CPU dry run can do in seconds
    ("tiny", "sglang"): dict(steps=30, prompts=16, n=8, max_new_tokens=48, lr=5e-4, mem_fraction=0.3, eval_prompts=256),
    ("tiny", "cpu"): dict(steps=2, prompts=2, n=2, max_new_tokens=40, lr=5e-4, mem_fraction=0.3, eval_prompts=2),
    ("real", "sglang"): dict(steps=6, prompts=16, n=4, max_new_tokens=256, lr=1e-5, mem_fraction=0.8, eval_prompts=0),
    ("real", "cpu"): dict(steps=2, prompts=2, n=2, max_new_tokens=16, lr=1e-5, mem_fraction=0.8, eval_prompts=0),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["tiny", "real"], default="tiny")
    p.add_argument("--engine", choices=["auto", "sglang", "cpu"], default="auto",
                   help="auto: SGLang when a CUDA GPU and sglang are there, else the embedded CPU engine")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--prompts", type=int, default=None, help="prompts per step")
    p.add_argument("--n", type=int, default=None, help="trajectories per prompt (GRPO group size)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="per model turn")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--mem-fraction", type=float, default=None, help="SGLang --mem-fraction-static")
    p.add_argument("--eval-prompts", type=int, default=None, help="held-out questions (tiny mode; 0: no evaluation)")
    p.add_argument("--noise", type=float, default=0.3, help="tiny mode: weight noise of the weak checkpoint (x std)")
    p.add_argument("--vocab-size", type=int, default=151936, help="real mode: the policy's (padded) vocabulary")
    p.add_argument("--no-sleep", action="store_true", help="release nothing at sleep (engine.release_tags: [])")
    p.add_argument("--probe-no-sleep", action=argparse.BooleanOptionalAction, default=None,
                   help="after the steps, run one training step with the engine awake (default: on in real mode)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (and the CPU engine's)")
    p.add_argument("--out", default="grpo_gpu_out", help="folder for grpo_gpu_<mode>.json/.png")
    p.add_argument("--work", default=None, help="folder for the model folders (default: OUT/work_<mode>)")
    args = p.parse_args(argv)
    args.engine = resolve_engine(args.engine)
    for k, v in SIZES[(args.mode, args.engine)].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.probe_no_sleep is None:
        args.probe_no_sleep = args.mode == "real"
    return args


async def run_until_terminated(args: argparse.Namespace) -> dict[str, Any] | None:
    """`run`, cancelled cleanly on SIGTERM (a time limit): the report is saved and the SGLang server
    the runtime launched is stopped, so a next run finds the GPU free."""
    report: dict[str, Any] | None = None
    async with anyio.create_task_group() as tg:
        async def on_sigterm() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM) as signals:
                async for _ in signals:
                    print("SIGTERM: stopping (the report so far is saved, the engine is stopped)", flush=True)
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(on_sigterm)
        report = await run(args)
        tg.cancel_scope.cancel()
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = anyio.run(run_until_terminated, args)
    if report is None:
        return 124  # cut short by SIGTERM
    return 1 if report.get("generations_outside_awake") else 0


if __name__ == "__main__":
    sys.exit(main())
