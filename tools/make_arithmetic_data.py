"""Write the bundled arithmetic prompt set, `src/agentloop/data/arithmetic.jsonl`.

Questions come from `agentloop.tasks.arithmetic.generate_questions` with a seed used neither for
training the tiny model (1234) nor for its evaluation (20261202), so the demo shows unseen
questions. Each row: `uid`, one user message, the `calculator` tool schema, the `tool` agent loop,
the reward-function name, the integer answer as `ground_truth`, and `extra` with the expected
calculator calls (carried through to the trajectories for people reading them).

    python tools/make_arithmetic_data.py [--n 64] [--seed 7] [--out src/agentloop/data/arithmetic.jsonl]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from agentloop.tasks.arithmetic import CALCULATOR_TOOL, generate_questions

DATA_SEED = 7
REWARD = "arithmetic"
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "src" / "agentloop" / "data" / "arithmetic.jsonl"


def rows(n: int, seed: int) -> list[dict]:
    out = []
    for i, q in enumerate(generate_questions(n, seed)):
        out.append({
            "uid": f"arith-{i:03d}",
            "messages": [{"role": "user", "content": q.question}],
            "tools": [CALCULATOR_TOOL],
            "agent": "tool",
            "reward": REWARD,
            "ground_truth": q.answer,
            "extra": {"expected_calls": q.expected_calls()},
        })
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--seed", type=int, default=DATA_SEED)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as f:
        for r in rows(args.n, args.seed):
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"wrote {args.n} rows to {args.out}")


if __name__ == "__main__":
    main()
