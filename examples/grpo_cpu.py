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

It also checks the data contract on the way: the trainer's logprobs of the sampled tokens must agree
with the engine's (same weights, same tokens), which fails loudly if a mask or an offset is wrong.

Run: `python examples/grpo_cpu.py --steps 3 --prompts 4 --n 4 [--out report.json]`.
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

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    config = {
        "engine": {"model": args.model},
        "scheduler": {"n": args.n, "concurrency": args.prompts * args.n, "trajectory_timeout": 300},
        "agent": {"max_assistant_turns": 3, "max_new_tokens_per_turn": args.max_new_tokens,
                  "max_response_tokens": 3 * args.max_new_tokens + 64, "temperature": 1.0, "seed": None},
    }
    report: dict[str, Any] = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "steps": []}
    async with Runtime(config) as rt:
        model_dir = args.model or rt.model_path
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        weights: dict[str, torch.Tensor] | None = None  # step 1 serves the weights on disk
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
                  f"loss={entry['loss']:+.4f} tool_calls={entry['tool_calls']} "
                  f"logprob|diff|max={entry['logprob_max_abs_diff']:.2e} state={entry['lifecycle_state_after_step']}",
                  flush=True)
        report["generations_outside_awake"] = rt.lifecycle.generations_outside_awake
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--n", type=int, default=4, help="trajectories per prompt (GRPO group size)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="per model turn")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the trainer")
    p.add_argument("--model", default=None, help="model folder (default: the shipped tiny tool model)")
    p.add_argument("--out", default=None, help="write the per-step report as JSON here")
    args = p.parse_args(argv)
    report = anyio.run(train, args)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
