"""Where the client's CPU goes: agentloop vs a bare aiohttp client on the same multi-turn work, profiled.

The same `replay` workload (N trajectories x K turns, prompt and turn lengths fixed, tool results of
fixed length, no tool latency) is generated two ways against one engine, with this process's CPU time
measured (`time.process_time`) and, in a second pass, profiled (`cProfile` with a CPU-time clock):

- **bare**: one aiohttp session; per trajectory, turn after turn, POST SGLang's `/generate` JSON
  (`input_ids`, sampling params, `return_logprob`), append the returned ids and some filler ids for the
  tool result, at most `--concurrency` requests in flight — what any multi-turn client must do;
- **agentloop**: `Runtime.step` with the replay agent loop (scheduler, router, lifecycle gate,
  SGLangClient, token buffer, collation), per-server concurrency the same.

Reported: CPU-seconds per 1k generated tokens for both and their ratio (the issue's target is <= 2),
and agentloop's top functions by own CPU time and by cumulative CPU time (the profile's overhead
inflates both ways alike; the ratio comes from the unprofiled pass).

    python benchmarks/client_cpu_profile.py            # CPU engine, about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import re
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    GcTimer,
    add_client_args,
    benchmark_parser,
    filler_ids,
    open_engine,
    r4,
    run_benchmark,
    runtime_config,
    trainer_heap,
    versioned_weights,
)

from agentloop.engine.lifecycle import Weights  # noqa: E402
from agentloop.runtime import Runtime  # noqa: E402
from agentloop.types import Sample  # noqa: E402


def workload(args: argparse.Namespace) -> list[list[dict[str, Any]]]:
    last = args.turns - 1
    return [[{"gen_tokens": args.gen_tokens, "tool_latency_s": 0.0, "tool_result_tokens": 0 if k == last else args.tool_tokens}
             for k in range(args.turns)] for _ in range(args.trajectories)]


async def run_bare(url: str, args: argparse.Namespace) -> int:
    limit = anyio.Semaphore(args.concurrency)
    tokens = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def one(i: int) -> None:
            nonlocal tokens
            ids = filler_ids(args.prompt_tokens, salt=i)
            for k in range(args.turns):
                body = {"input_ids": ids, "return_logprob": True, "sampling_params": {
                    "max_new_tokens": args.gen_tokens, "temperature": 1.0, "ignore_eos": True}}
                async with limit:
                    async with s.post(url + "/generate", json=body) as r:
                        out = await r.json()
                new = out["output_ids"]
                lps = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
                assert len(new) == len(lps) == args.gen_tokens
                tokens += len(new)
                ids = ids + new + (filler_ids(args.tool_tokens, salt=i + k) if k < args.turns - 1 else [])

        async with anyio.create_task_group() as tg:
            for i in range(args.trajectories):
                tg.start_soon(one, i)
    return tokens


async def run_agentloop(rt: Runtime, work: list[list[dict[str, Any]]], args: argparse.Namespace, tag: str,
                        weights: Weights) -> int:
    samples = [Sample(uid=f"{tag}-{i}", messages=[], agent="replay",
                      extra={"replay": {"prompt_tokens": args.prompt_tokens, "turns": turns}})
               for i, turns in enumerate(work)]
    extra = {"gc_freeze": True} if args.gc_freeze else {}  # only when asked: older trees lack the setting
    res = await rt.step(samples, weights, concurrency=args.trajectories, **extra)
    return int(res.metrics["sampled_tokens"])


def top(prof: cProfile.Profile, key: str, n: int) -> list[dict[str, Any]]:
    st = pstats.Stats(prof, stream=io.StringIO())
    st.sort_stats(key)
    out = []
    for func in st.fcn_list[:n]:  # type: ignore[attr-defined]
        cc, nc, tt, ct, _ = st.stats[func]  # type: ignore[attr-defined]
        file, line, name = func
        out.append({"function": f"{Path(file).name}:{line}({name})", "path": file, "calls": nc,
                    "own_cpu_s": r4(tt), "cumulative_cpu_s": r4(ct)})
    return out


def module_of(path: str, func: str) -> str:
    """A readable group for a profiled function: agentloop's module, a third-party package, a stdlib module."""
    if "/agentloop/" in path and "site-packages" not in path:
        return "agentloop/" + path.split("/agentloop/", 1)[1]
    if "site-packages/" in path:
        return "/".join(path.split("site-packages/", 1)[1].split("/")[:2])
    if path == "~":
        return "builtin " + func.split(" of ")[0].strip("<>")[:40]
    m = re.search(r"lib/python3\.\d+/([^/]+)", path)
    return "stdlib " + m.group(1) if m else Path(path).name


def by_module(prof: cProfile.Profile, n: int) -> list[dict[str, Any]]:
    """Own CPU seconds summed per module group, largest first."""
    acc: dict[str, float] = {}
    for (path, _, func), (_, _, tt, _, _) in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
        key = module_of(path, func)
        acc[key] = acc.get(key, 0.0) + tt
    return [{"module": k, "own_cpu_s": r4(v)} for k, v in sorted(acc.items(), key=lambda kv: -kv[1])[:n]]


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with open_engine(args, max_running=max(256, args.concurrency)) as engine:
        out["engine"] = engine.description
        heap = trainer_heap(args.trainer_heap)
        out["client_gc_tracked_objects"] = heap["gc_tracked_objects"]
        cfg = runtime_config(engine, argparse.Namespace(gen_max=args.gen_tokens, turns=args.turns),
                             concurrency=args.trajectories, per_server_concurrency=args.concurrency)
        cfg["agent"]["max_context_tokens"] += args.prompt_tokens  # long prompts must not hit the context budget
        weights = versioned_weights(engine)

        async with Runtime(cfg) as rt:
            assert rt.lifecycle is not None
            lc = rt.lifecycle

            async def run(mode: str, a: argparse.Namespace, tag: str) -> int:
                """Generated tokens of one run; only the run itself is inside the caller's measurement."""
                if mode == "agentloop":
                    return await run_agentloop(rt, workload(a), a, tag, weights())
                return await run_bare(engine.url, a)

            async def measured(mode: str, a: argparse.Namespace, tag: str,
                               prof: cProfile.Profile | None = None) -> tuple[int, float, float, float]:
                if mode == "bare":  # the engine sleeps between steps: wake it (outside the measurement) as a step does
                    await lc.wake_up(weights())
                # Each run starts from a collected heap, so neither way pays for the other's garbage.
                gc.collect()
                try:
                    if prof is not None:
                        prof.enable()
                    with GcTimer() as gct:
                        c0, w0 = time.process_time(), time.perf_counter()
                        tokens = await run(mode, a, tag)
                        c, w = time.process_time() - c0, time.perf_counter() - w0
                    if prof is not None:
                        prof.disable()
                    full_collections[mode].append(gct.collections[2])
                    return tokens, c, w, gct.seconds
                finally:
                    if mode == "bare":
                        await lc.sleep()

            full_collections: dict[str, list[int]] = {"bare": [], "agentloop": []}
            warm = argparse.Namespace(**{**vars(args), "trajectories": 4})
            for mode in ("agentloop", "bare"):
                await measured(mode, warm, "warm")
            full_collections = {"bare": [], "agentloop": []}
            cpu: dict[str, list[float]] = {"bare": [], "agentloop": []}
            gcs: dict[str, list[float]] = {"bare": [], "agentloop": []}
            for rep in range(args.repeats):
                for mode in (("bare", "agentloop") if rep % 2 == 0 else ("agentloop", "bare")):
                    tokens, c, w, g = await measured(mode, args, f"r{rep}")
                    cpu[mode].append(1000 * c / tokens)
                    gcs[mode].append(g)
                    print(f"{mode:9s} {tokens} tokens  {w:6.2f}s wall  {c:6.2f}s CPU  {1000 * c / tokens:.4f} CPU-s/1k tok"
                          f"  (gc {g:.3f}s)", flush=True)
            out["cpu_seconds_per_1k_tokens"] = {m: r4(sorted(v)[len(v) // 2]) for m, v in cpu.items()}
            out["cpu_seconds_per_1k_tokens_all"] = {m: [r4(x) for x in v] for m, v in cpu.items()}
            out["gc_seconds_all"] = {m: [r4(x) for x in v] for m, v in gcs.items()}
            out["gc_full_collections_all"] = {m: list(v) for m, v in full_collections.items()}
            out["agentloop_over_bare_cpu"] = r4(out["cpu_seconds_per_1k_tokens"]["agentloop"] /
                                                out["cpu_seconds_per_1k_tokens"]["bare"])
            profiles = {}
            for mode in ("bare", "agentloop"):
                prof = cProfile.Profile(time.process_time)
                tokens, _, _, _ = await measured(mode, args, "prof", prof)
                total = sum(v[2] for v in pstats.Stats(prof).stats.values())  # type: ignore[attr-defined]
                profiles[mode] = {"tokens": tokens, "profiled_cpu_s": r4(total),
                                  "by_module": by_module(prof, args.top), "top_own": top(prof, "tottime", args.top),
                                  "top_cumulative": top(prof, "cumulative", args.top)}
                if args.pstats:
                    prof.dump_stats(str(Path(args.out) / f"client_cpu_profile_{mode}.pstats"))
            out["profiles"] = profiles
    print(f"CPU-s per 1k tokens: bare {out['cpu_seconds_per_1k_tokens']['bare']}, agentloop "
          f"{out['cpu_seconds_per_1k_tokens']['agentloop']} (x{out['agentloop_over_bare_cpu']})")
    bare = {m["module"]: m["own_cpu_s"] for m in out["profiles"]["bare"]["by_module"]}
    for m in out["profiles"]["agentloop"]["by_module"][:15]:
        print(f"  own CPU {m['own_cpu_s']:7.3f}s (bare {bare.get(m['module'], 0.0):7.3f}s)  {m['module']}")
    return out


def plot(report: dict[str, Any], path: Path) -> None:
    from _common import pyplot, save_figure, title_suffix

    plt = pyplot()
    mods = report["profiles"]["agentloop"]["by_module"][:14][::-1]
    bare = {m["module"]: m["own_cpu_s"] for m in report["profiles"]["bare"]["by_module"]}
    fig, ax = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1, 3]})
    c = report["cpu_seconds_per_1k_tokens"]
    ax[0].bar(["bare aiohttp", "agentloop"], [c["bare"], c["agentloop"]])
    ax[0].set(ylabel="client CPU-seconds per 1k generated tokens", title=f"x{report['agentloop_over_bare_cpu']}")
    ys = range(len(mods))
    ax[1].barh([y + 0.2 for y in ys], [m["own_cpu_s"] for m in mods], 0.4, label="agentloop")
    ax[1].barh([y - 0.2 for y in ys], [bare.get(m["module"], 0.0) for m in mods], 0.4, label="bare aiohttp")
    ax[1].set_yticks(list(ys), [m["module"][:50] for m in mods], fontsize=7)
    ax[1].legend(fontsize=8)
    ax[1].set(xlabel="own CPU seconds (cProfile, same work)", title="where the client CPU goes, by module")
    fig.suptitle(f"Client CPU cost, {title_suffix(report)}", fontsize=9)
    save_figure(fig, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = benchmark_parser(__doc__)
    p.add_argument("--trajectories", type=int, default=64)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--gen-tokens", type=int, default=8)
    p.add_argument("--tool-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--pstats", action="store_true", help="also write the raw .pstats files next to the JSON")
    add_client_args(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.trajectories, args.turns, args.repeats, args.top = 8, 2, 1, 10
    return args


def main(argv: list[str] | None = None) -> int:
    return run_benchmark("client_cpu_profile", argv, parse_args, {
        "cpu_seconds_per_1k_tokens": "this process's CPU seconds (time.process_time) per 1000 generated tokens, median "
                                     "over repeats, unprofiled",
        "top_own / top_cumulative": "cProfile with a CPU-time clock, one extra pass of each way",
        "gc_seconds_all": "CPU seconds the garbage collector ran during each unprofiled run (included in its CPU); "
                          "every run starts after a gc.collect()",
        "client_gc_tracked_objects": "objects the garbage collector tracked before the runs (--trainer-heap adds a "
                                     "trainer's: transformers and a 0.5B-shaped model on the meta device)",
        "--gc-freeze": "agentloop ran with scheduler.gc_freeze (settings.gc_freeze)",
    }, measure, plot)


if __name__ == "__main__":
    sys.exit(main())
