"""What pinning glibc's malloc thresholds (`agentloop.allocator.tune_allocator`) costs torch's CPU
work in the same process: why a trainer embedding the runtime is not tuned by `Runtime.start`.

Each repeat runs one fresh interpreter per setting, alternating (`default`, `tuned`, `default`, ...):
a random Qwen2 (4 layers, hidden 256, vocabulary 8000) trains with AdamW on one batch of 8 × 256
tokens, one torch thread; 2 warm-up iterations, then the mean seconds of `--iters` iterations of
forward + backward + optimizer step. JSON (+ PNG: seconds per iteration per repeat and setting).

    python benchmarks/allocator_training.py            # ~1.5 min on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, run_benchmark  # noqa: E402

DEFINITIONS = {
    "seconds_per_iter": "mean wall seconds of one forward + backward + AdamW step after 2 warm-up iterations",
    "tuned": "tune_allocator() called first in that interpreter (glibc's mmap and trim thresholds pinned to 128 KiB)",
    "tuned_over_default": "median seconds per iteration tuned / median default",
}

PROBE = """
import sys, time, torch
if sys.argv[1] == "tuned":
    from agentloop.allocator import tune_allocator
    assert tune_allocator().applied
torch.manual_seed(0); torch.set_num_threads(1)
from transformers import Qwen2Config, Qwen2ForCausalLM
m = Qwen2ForCausalLM(Qwen2Config(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=8000))
opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
x = torch.randint(0, 8000, (8, 256))
def it():
    m(input_ids=x, labels=x).loss.backward(); opt.step(); opt.zero_grad()
it(); it()
t = time.perf_counter()
for _ in range(int(sys.argv[2])):
    it()
print((time.perf_counter() - t) / int(sys.argv[2]))
"""


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--smoke", action="store_true", help="1 repeat of 1 iteration")
    args = p.parse_args(argv)
    if args.smoke:
        args.repeats, args.iters = 1, 1
    return args


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    runs = []
    for r in range(args.repeats):
        for setting in ("default", "tuned"):
            out = subprocess.run([sys.executable, "-c", PROBE, setting, str(args.iters)], capture_output=True,
                                 text=True, check=True, timeout=600)
            runs.append({"repeat": r, "setting": setting, "seconds_per_iter": float(out.stdout.split()[-1])})
            print(runs[-1], flush=True)
    med = {s: statistics.median(x["seconds_per_iter"] for x in runs if x["setting"] == s) for s in ("default", "tuned")}
    return {"runs": runs, "summary": {"median_seconds_per_iter": med, "tuned_over_default": med["tuned"] / med["default"]}}


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    for setting, color in (("default", "tab:gray"), ("tuned", "tab:red")):
        rs = [x for x in report["runs"] if x["setting"] == setting]
        ax.plot([x["repeat"] for x in rs], [x["seconds_per_iter"] for x in rs], "o-", color=color, label=setting)
    ax.set_xlabel("repeat")
    ax.set_ylabel("seconds per training iteration")
    ax.set_title(f"in-process CPU training: tuned / default {report['summary']['tuned_over_default']:.2f}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    return run_benchmark("allocator_training", argv, parse_args, DEFINITIONS, measure, plot)


if __name__ == "__main__":
    raise SystemExit(main())
