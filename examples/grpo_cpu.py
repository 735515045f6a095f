"""A minimal GRPO trainer on CPU that embeds agentloop's `Runtime` (the way a PPO/GRPO trainer would).

Each step:
1. `Runtime.step(samples, weights)` wakes the embedded CPU engine in stages with the trainer's latest
   weights (a state dict; step 1 serves the shipped weights), rolls out the tiny tool model on
   arithmetic prompts (`n` trajectories per prompt, multi-turn calculator calls), collates the batch
   and puts the engine back to sleep.
2. Group-normalised advantages from the rewards: A_i = (r_i - mean(group)) / (std(group) + eps).
3. One policy-gradient step with torch on the trainer's own copy of the model: the PPO-clipped
   surrogate over the mask-1 (sampled) tokens of the batch, against the engine's rollout logprobs.
4. The new state dict goes to the next `step`, so the engine's weight_version advances.

It starts from a deliberately weakened tiny model (`agentloop.models.weak_tiny_tool_model`: the
shipped model with seeded noise of `--noise` x each tensor's std on every weight; `--noise 0` trains the
shipped model, which is already ~97% right, so its groups mostly have equal rewards and nothing to
learn). `--eval-prompts K` evaluates the policy on K held-out questions (same sampling) before the
first step and after the last; `--plot FILE.png` draws the reward curve.

It also checks the data contract on the way: the trainer's logprobs of the sampled tokens must agree
with the engine's (same weights, same tokens), which fails loudly if a mask or an offset is wrong.

Run: `python examples/grpo_cpu.py --steps 3 --prompts 4 --n 4 [--out report.json]`; the learning
demo of the README: `python examples/grpo_cpu.py --steps 12 --prompts 8 --n 8 --eval-prompts 64
--out report.json --plot curve.png` (a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import torch

from agentloop.batch import RolloutBatch
from agentloop.runtime import Runtime
from agentloop.tasks.arithmetic import CALCULATOR_TOOL, generate_questions
from agentloop.types import Sample


def make_samples(step: int, num_prompts: int, seed: int) -> list[Sample]:
    """Fresh arithmetic prompts for one step (a different seed per step)."""
    qs = generate_questions(num_prompts, seed=seed * 1000 + step)
    return [
        Sample(uid=f"step{step}-q{i}", messages=[{"role": "user", "content": q.question}], tools=[CALCULATOR_TOOL],
               agent="tool", reward="arithmetic", ground_truth=q.answer)
        for i, q in enumerate(qs)
    ]


EVAL_SEED = 987654  # held-out questions: a seed no training step uses (steps use seed * 1000 + step)


def group_advantages(rewards: torch.Tensor, group_ids: list[str], eps: float = 1e-6) -> torch.Tensor:
    """GRPO: each reward minus its group's mean, over the group's std (0 for a group of equal rewards)."""
    adv = torch.zeros_like(rewards)
    for g in set(group_ids):
        idx = torch.tensor([i for i, x in enumerate(group_ids) if x == g])
        r = rewards[idx]
        std = r.std(unbiased=False) if len(idx) > 1 else torch.tensor(0.0)
        adv[idx] = (r - r.mean()) / (std + eps) if std > 0 else 0.0
    return adv


def sampled_token_logprobs(model: torch.nn.Module, batch: RolloutBatch, rows: torch.Tensor) -> torch.Tensor:
    """log p(response token | everything before it) under `model`, shape [rows, R]."""
    p_len = batch["prompts"].shape[1]
    out = model(
        input_ids=batch["input_ids"][rows],
        attention_mask=batch["attention_mask"][rows],
        position_ids=batch["position_ids"][rows],
    )
    # logits at position t predict token t+1: the response starts at column p_len.
    logits = out.logits[:, p_len - 1 : -1].float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, batch["responses"][rows].unsqueeze(-1)).squeeze(-1)


def grpo_update(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: RolloutBatch, *, clip: float = 0.2) -> dict[str, float]:
    statuses = batch["statuses"]
    rows = torch.tensor([i for i, s in enumerate(statuses) if s in ("completed", "truncated")], dtype=torch.long)
    if len(rows) == 0:
        return {"loss": 0.0, "trained_rows": 0, "logprob_max_abs_diff": 0.0}
    adv = group_advantages(batch["rewards"][rows], [batch["group_ids"][i] for i in rows.tolist()])
    mask = batch["response_mask"][rows].bool()
    old = batch["rollout_log_probs"][rows]
    model.train()
    new = sampled_token_logprobs(model, batch, rows)
    diff = (new.detach() - old).abs()[mask]
    ratio = torch.exp(torch.where(mask, new - old, torch.zeros_like(new)))
    a = adv.unsqueeze(1)
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a)
    loss = -torch.where(mask, surrogate, torch.zeros_like(surrogate)).sum() / mask.sum().clamp(min=1)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return {
        "loss": float(loss.detach()),
        "trained_rows": int(len(rows)),
        "trained_tokens": int(mask.sum()),
        "nonzero_advantages": int((adv != 0).sum()),
        # Same weights, same tokens: the trainer must reproduce the engine's logprobs.
        "logprob_max_abs_diff": float(diff.max()) if diff.numel() else 0.0,
        "logprob_mean_abs_diff": float(diff.mean()) if diff.numel() else 0.0,
    }


async def train(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from agentloop.models import weak_tiny_tool_model

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    model_arg = args.model or (str(weak_tiny_tool_model(args.noise, args.seed)) if args.noise > 0 else None)
    print(f"starting the embedded CPU engine ({model_arg or 'the shipped tiny tool model'}) ...", flush=True)
    config = {
        # request_timeout well under trajectory_timeout: a stuck request can still be retried elsewhere.
        "engine": {"model": model_arg, "request_timeout": 120},
        "scheduler": {"n": args.n, "concurrency": max(args.prompts * args.n, args.eval_prompts),
                      "trajectory_timeout": 300},
        "agent": {"max_assistant_turns": 3, "max_new_tokens_per_turn": args.max_new_tokens,
                  "max_response_tokens": 3 * args.max_new_tokens + 64, "sampling": {"temperature": 1.0, "seed": None}},
    }
    report: dict[str, Any] = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "steps": [],
                              "model": {"noise": args.noise if not args.model else None, "seed": args.seed,
                                        "path": args.model or ("weak_tiny_tool_model" if args.noise > 0 else "tiny_tool_model")}}
    t_run = time.monotonic()
    async with Runtime(config) as rt:
        model_dir = args.model or rt.model_path
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        weights: dict[str, torch.Tensor] | None = None  # step 1 serves the weights on disk

        async def evaluate(tag: str) -> dict[str, Any]:
            """The current policy on the held-out questions (the step's weights; not trained on)."""
            ev = await rt.step(make_samples(0, args.eval_prompts, EVAL_SEED), weights, n=1)
            out = {"reward_mean": float(ev.batch["rewards"].mean()), "questions": len(ev.trajectories),
                   "weight_version": ev.weight_version, "status_counts": ev.metrics["status_counts"]}
            print(f"held-out evaluation {tag}: reward {out['reward_mean']:.3f} over {out['questions']} questions",
                  flush=True)
            return out

        if args.eval_prompts:
            report["eval_before"] = await evaluate("before training")
        for step in range(1, args.steps + 1):
            t0 = time.monotonic()
            res = await rt.step(make_samples(step, args.prompts, args.seed), weights)
            t_roll = time.monotonic() - t0
            stats = grpo_update(model, opt, res.batch)
            # The trainer's new policy, handed to the next step (copied: the engine must not alias it).
            weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
            trajs = res.trajectories
            entry = {
                "step": step,
                "weight_version": res.weight_version,
                "trajectory_weight_versions": sorted({v for t in trajs for v in t.weight_versions}),
                "trajectories": len(trajs),
                "status_counts": res.metrics["status_counts"],
                "tool_calls": sum(t.tool_calls for t in trajs),
                "reward_mean": float(res.batch["rewards"].mean()) if trajs else math.nan,
                "lifecycle_state_after_step": rt.lifecycle.state.value,
                "stages": [f"{r.phase}/{r.stage}" for r in rt.lifecycle.records],
                "rollout_seconds": t_roll,
                "sampled_tokens_per_second": res.metrics["sampled_tokens_per_second"],
                **stats,
            }
            report["steps"].append(entry)
            print(f"step {step}: version={entry['weight_version']} reward={entry['reward_mean']:.3f} "
                  f"loss={entry['loss']:+.4f} non-zero advantages={entry.get('nonzero_advantages', 0)} "
                  f"tool_calls={entry['tool_calls']} "
                  f"logprob|diff|max={entry['logprob_max_abs_diff']:.2e} state={entry['lifecycle_state_after_step']}",
                  flush=True)
        if args.eval_prompts:
            report["eval_after"] = await evaluate("after training")
        report["generations_outside_awake"] = rt.lifecycle.generations_outside_awake
    report["seconds"] = round(time.monotonic() - t_run, 1)
    return report


def plot_curves(reports: list[dict[str, Any]], path: Path) -> None:
    """Reward per step of each run (and its held-out evaluation before and after), one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, rep in enumerate(reports):
        steps = [s["step"] for s in rep["steps"]]
        line, = ax.plot(steps, [s["reward_mean"] for s in rep["steps"]], "o-", label=f"run {i + 1}: rollout reward")
        for key, x, marker in (("eval_before", 0, "s"), ("eval_after", max(steps, default=0), "D")):
            if key in rep:
                ax.plot([x], [rep[key]["reward_mean"]], marker, color=line.get_color(), markersize=9,
                        label=f"run {i + 1}: held-out {key.removeprefix('eval_')}")
    ax.set_xlabel("step (0 = before training)")
    ax.set_ylabel("mean reward")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("GRPO on CPU: the weakened tiny tool model learns (examples/grpo_cpu.py)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--n", type=int, default=4, help="trajectories per prompt (GRPO group size)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="per model turn")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the trainer")
    p.add_argument("--noise", type=float, default=0.3,
                   help="weight noise (x each tensor's std) of the weak starting model; 0: the shipped tiny model")
    p.add_argument("--eval-prompts", type=int, default=0, help="held-out questions before and after (0: none)")
    p.add_argument("--model", default=None, help="model folder (default: the weakened tiny tool model, see --noise)")
    p.add_argument("--out", default=None, help="write the per-step report as JSON here")
    p.add_argument("--plot", default=None, help="draw the reward curve into this PNG")
    p.add_argument("--plot-with", nargs="*", default=[], metavar="REPORT.json",
                   help="earlier reports (--out) drawn in the same plot, e.g. a second run")
    args = p.parse_args(argv)
    report = anyio.run(train, args)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    if args.plot:
        earlier = [json.loads(Path(f).read_text()) for f in args.plot_with]
        plot_curves([*earlier, report], Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
