"""Per-call overhead of the OpenAI-compatible endpoint vs the built-in `tool` loop, on the same workload.

One `Runtime` on the CPU engine serving the shipped tiny tool model (or `--engine-url` of a server that
serves it). The same arithmetic prompts are rolled out two ways, alternating in every repeat:

- **tool**: the built-in `tool` agent loop (parse → calculator from the registry → template delta);
- **openai**: `examples/openai_calculator.py`'s `calculator_agent` through the `openai` loop — the
  official `openai` client → loopback aiohttp endpoint → recorder (message comparison, template delta)
  → the same scheduler / router / gate, and the JSON back through the client's pydantic models.

Sampling is greedy, so both ways ask the engine for the same turns (`identical_trajectories` counts the
uids whose tokens and masks agree exactly). Measured per step: client-process CPU seconds
(`time.process_time`; the engine is another process) and the rollout phase's wall seconds, each divided
by the number of model calls. Overhead per call = openai − tool (medians over repeats). Writes
`benchmarks/results/openai_endpoint_cpu.json` and a PNG.

    python benchmarks/openai_endpoint.py        # ~3 min on 2 shared cores
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, RESULTS, median, pyplot, r4, run_benchmark, save_figure  # noqa: E402

sys.path.insert(0, str(REPO / "examples"))
from openai_calculator import calculator_agent  # noqa: E402  (the docs' agent, measured as users run it)

from agentloop.models import tiny_tool_model  # noqa: E402
from agentloop.runtime import Runtime  # noqa: E402
from agentloop.tasks.arithmetic import generate_questions  # noqa: E402
from agentloop.types import Sample, Trajectory  # noqa: E402

NAME = "openai_endpoint"
DEFINITIONS = {
    "cpu_ms_per_call": "client-process CPU milliseconds of a whole step (wake, rollout, sleep) / model calls",
    "wall_ms_per_call": "rollout-phase wall milliseconds / model calls",
    "overhead_cpu_ms_per_call": "median openai cpu_ms_per_call - median tool cpu_ms_per_call",
    "overhead_wall_ms_per_call": "median openai wall_ms_per_call - median tool wall_ms_per_call",
    "identical_trajectories": "uids whose prompt+response ids and mask are equal in the tool and openai runs "
                              "(greedy sampling; of the last repeat)",
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=["cpu", "sglang"], default="cpu", help="which engine serves the tiny model")
    p.add_argument("--engine-url", default=None, help="attach to a running server of the tiny tool model")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--smoke", action="store_true", help="tiny configuration that only proves the benchmark runs")
    p.add_argument("--prompts", type=int, default=16, help="arithmetic prompts per step")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="trajectories in flight")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    if args.smoke:
        args.prompts, args.concurrency, args.repeats = 2, [2], 1
    return args


def samples(agent: str, prompts: int, seed: int) -> list[Sample]:
    extra = {"function": calculator_agent} if agent == "openai" else {}
    return [Sample(uid=f"q{i}", messages=[{"role": "user", "content": q.question}], ground_truth=q.answer,
                   agent=agent, extra=dict(extra))
            for i, q in enumerate(generate_questions(prompts, seed=seed))]


def tokens(trajs: list[Trajectory]) -> dict[str, tuple[list[int], list[int]]]:
    return {t.uid: (t.prompt_ids + t.response_ids, t.response_mask) for t in trajs}


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    model = tiny_tool_model()
    engine: dict[str, Any] = {"local": {"num_threads": 1}}
    if args.engine_url:
        engine = {"urls": [args.engine_url], "tokenizer": str(model)}
    config = {"engine": engine, "scheduler": {"n": 1},
              "agent": {"sampling": {"temperature": 0.0}, "max_new_tokens_per_turn": 64, "max_assistant_turns": 4,
                        "max_response_tokens": 384}}
    runs: list[dict[str, Any]] = []
    identical: dict[int, dict[str, int]] = {}
    async with Runtime(config) as rt:
        for agent in ("tool", "openai"):  # warm-up: imports, the endpoint server, first connections
            await rt.step(samples(agent, min(2, args.prompts), seed=99))
        for c in args.concurrency:
            for r in range(args.repeats):
                seen: dict[str, Any] = {}
                for agent in (("tool", "openai") if r % 2 == 0 else ("openai", "tool")):
                    batch = samples(agent, args.prompts, seed=r)
                    cpu0 = time.process_time()
                    res = await rt.step(batch, concurrency=c)
                    cpu = time.process_time() - cpu0
                    calls = sum(t.num_turns for t in res.trajectories)
                    seen[agent] = tokens(res.trajectories)
                    runs.append({
                        "agent": agent, "concurrency": c, "repeat": r, "calls": calls,
                        "statuses": res.metrics["status_counts"], "tool_calls": res.metrics["tool_calls"],
                        "sampled_tokens": res.metrics["sampled_tokens"],
                        "rollout_seconds": r4(res.metrics["rollout_seconds"]), "cpu_seconds": r4(cpu),
                        "cpu_ms_per_call": r4(1000 * cpu / calls), "wall_ms_per_call":
                            r4(1000 * res.metrics["rollout_seconds"] / calls),
                    })
                    print(f"c={c} r={r} {agent:6s} calls={calls} cpu/call={1000 * cpu / calls:.2f} ms "
                          f"wall/call={1000 * res.metrics['rollout_seconds'] / calls:.2f} ms", flush=True)
                same = sum(seen["tool"].get(u) == v for u, v in seen["openai"].items())
                identical[c] = {"identical": same, "of": len(seen["openai"])}
    summary = []
    for c in args.concurrency:
        row: dict[str, Any] = {"concurrency": c}
        for agent in ("tool", "openai"):
            mine = [x for x in runs if x["agent"] == agent and x["concurrency"] == c]
            row[f"{agent}_cpu_ms_per_call"] = r4(median([x["cpu_ms_per_call"] for x in mine]))
            row[f"{agent}_wall_ms_per_call"] = r4(median([x["wall_ms_per_call"] for x in mine]))
            row[f"{agent}_calls_per_step"] = median([x["calls"] for x in mine])
        row["overhead_cpu_ms_per_call"] = r4(row["openai_cpu_ms_per_call"] - row["tool_cpu_ms_per_call"])
        row["overhead_wall_ms_per_call"] = r4(row["openai_wall_ms_per_call"] - row["tool_wall_ms_per_call"])
        row["identical_trajectories"] = identical[c]
        summary.append(row)
    return {"engine": {"kind": args.engine, "url": args.engine_url, "model": str(model)}, "summary": summary,
            "runs": runs}


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    rows = report["summary"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, kind, label in ((axes[0], "cpu", "client CPU ms per model call"), (axes[1], "wall", "rollout wall ms per model call")):
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r[f"tool_{kind}_ms_per_call"] for r in rows], 0.4, label="tool loop")
        ax.bar([x + 0.2 for x in xs], [r[f"openai_{kind}_ms_per_call"] for r in rows], 0.4, label="openai endpoint")
        ax.set_xticks(list(xs), [f"c={r['concurrency']}" for r in rows])
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(f"OpenAI endpoint vs built-in tool loop, same greedy workload ({report['settings']['engine']} engine, "
                 f"tiny tool model, {str(report['hardware'].get('cpu', ''))[:40]})", fontsize=9)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    return run_benchmark(NAME, argv, parse_args, DEFINITIONS, measure, plot)


if __name__ == "__main__":
    sys.exit(main())
