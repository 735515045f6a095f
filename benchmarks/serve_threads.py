"""`agentloop serve`'s torch thread count: output tokens/s of the CPU engine with `--num-threads` 1, 2
and 0 (torch's choice: one per core), on the shipped tiny tool model (or `--model`), under a
rollout-like load.

For each thread setting an `agentloop serve` process is started; then `--rounds` rounds each run
`--concurrency` closed-loop clients (greedy, `--max-new-tokens` out, ignore_eos)
against every engine in turn, the order rotating per round so load from other processes on a
shared machine falls on all settings alike. Reports each setting's best and median tokens/s and
writes `benchmarks/results/serve_threads.json` (command, date, commit, versions, hardware with the
load average). This is the measurement behind `agentloop serve`'s `--num-threads` default.

    python benchmarks/serve_threads.py            # about a minute on 2 idle cores
    python benchmarks/serve_threads.py --smoke    # seconds: proves it runs
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_commit  # noqa: E402  (shared benchmark helpers)
from cpu_engine_batching import hardware, run_level, versions  # noqa: E402

from agentloop.engine.lifecycle import Lifecycle  # noqa: E402
from agentloop.engine.local.process import LocalEngineProcess  # noqa: E402
from agentloop.engine.sglang import SGLangClient  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


async def main(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from agentloop.models import tiny_tool_model

    model = Path(args.model) if args.model else tiny_tool_model()
    settings: list[int] = list(args.threads)
    procs = {t: LocalEngineProcess(model, extra_args=["--num-threads", str(t), "--log-level", "warning"])
             for t in settings}
    runs: dict[int, list[float]] = {t: [] for t in settings}
    try:
        urls = {t: await p.start(timeout=180) for t, p in procs.items()}
        clients = {t: SGLangClient(u) for t, u in urls.items()}
        try:
            level_args = argparse.Namespace(max_new_tokens=args.max_new_tokens, prompt_len=args.prompt_len,
                                            requests_per_client=args.requests_per_client)
            for t, c in clients.items():  # warm-up
                await run_level(Lifecycle([c], awake=True), c, 2, argparse.Namespace(**{**vars(level_args),
                                                                                        "requests_per_client": 1}))
            for r in range(args.rounds):
                order = settings[r % len(settings):] + settings[: r % len(settings)]
                for t in order:
                    res = await run_level(Lifecycle([clients[t]], awake=True), clients[t], args.concurrency, level_args)
                    runs[t].append(res["tokens_per_s"])
                    print(f"round {r + 1}: --num-threads {t}: {res['tokens_per_s']:.1f} tok/s", flush=True)
        finally:
            for c in clients.values():
                await c.close()
    finally:
        for p in procs.values():
            await p.stop()
    results = [{"num_threads": t, "tokens_per_s_best": max(v),
                "tokens_per_s_median": round(statistics.median(v), 2), "tokens_per_s_all_rounds": v}
               for t, v in runs.items()]
    return {
        "benchmark": "serve_threads",
        "command": " ".join(["python", *sys.argv]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "versions": versions(),
        "hardware": hardware(),
        "model": str(model) if args.model else "agentloop.models.tiny_tool_model()",
        "settings": {"concurrency": args.concurrency, "requests_per_client": args.requests_per_client,
                     "prompt_len": args.prompt_len, "max_new_tokens": args.max_new_tokens, "rounds": args.rounds,
                     "sampling": "greedy, ignore_eos",
                     "num_threads_0_means": f"torch's choice (this machine: {torch.get_num_threads()})"},
        "results": results,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model folder (default: the shipped tiny tool model)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 0],
                   help="--num-threads values to compare (0: torch's choice)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="tiny configuration that only proves the benchmark runs")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON file (default: benchmarks/results/serve_threads.json; --smoke: a temporary folder)")
    args = p.parse_args(argv)
    if args.smoke:
        args.concurrency, args.requests_per_client, args.max_new_tokens, args.rounds = 2, 1, 8, 1
    return args


if __name__ == "__main__":
    arguments = parse_args()
    report = asyncio.run(main(arguments))
    out = arguments.out
    if out is None:
        if arguments.smoke:
            import tempfile

            out = Path(tempfile.mkdtemp(prefix="agentloop-bench-")) / "serve_threads_smoke.json"
        else:
            out = RESULTS / "serve_threads.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
