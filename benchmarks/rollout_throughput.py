"""Multi-turn rollout throughput: agentloop vs the engine's own ceiling vs a turn-synchronous baseline.

One workload — N trajectories x K turns, turn lengths heavy-tailed (lognormal per turn times a
lognormal per trajectory, seeded), a simulated tool between turns (latency from a configurable
distribution, a tool result of a lognormal number of tokens appended to the context) — is run three
ways against the same engine, in one process, for each (tool-latency mean, concurrency c) of the sweep,
`--repeats` times with the order of the three rotating:

- **ceiling**: every turn as an independent single-turn request (the same context length and
  generated-token count as that turn has in the trajectory), all submitted at once with at most c in
  flight, longest first — what the engine does with no agent logic and no dependencies;
- **agentloop**: `Runtime.step` with the `replay` agent loop (scheduler, sticky router, lifecycle gate,
  token buffers): every trajectory starts, the router holds at most c requests in flight on the
  server (`per_server_concurrency`), so a trajectory's tool wait overlaps others' generation;
- **turn-synchronous**: turn t of every trajectory as one batch (at most c requests in flight), then
  every tool call, then turn t+1 — the naive multi-turn design;
- **multiturn_raw**: the smallest correct multi-turn client — one task per trajectory, turn, tool
  sleep, next turn, at most c requests in flight (FIFO) — with none of agentloop's machinery: what
  agentloop's own overhead is measured against;
- **agentloop_gc_freeze** (only with `--modes`): agentloop with `scheduler.gc_freeze` (the step's
  garbage collections skip the objects that existed before it; see `agentloop.gc_scope`);
- **agentloop_depth_first** (only with `--modes`): agentloop with `scheduler.slot_order: depth_first`
  instead of the default `fifo` (a trajectory back from its tool goes before fresh first turns).
  (`agentloop_fifo`, the name of the other order's mode in the H200 sweep of 2026-12-03, when
  depth_first was briefly the default, is accepted too.)

The ceiling ignores that turn t+1 of a trajectory can only start after turn t and its tool: no
multi-turn client can reach it when one trajectory's chain is longer than the whole batch takes. Each
point therefore also reports `critical_path_s` — the longest trajectory's chain of its turns'
on-server seconds (as measured in the ceiling run, same load) plus its tool latencies — and
`dependency_ceiling_tokens_per_s` = tokens / max(ceiling wall, critical path): the best any client
that respects turn order could do at that per-request speed (`agentloop_over_dependency_ceiling`).

Ceiling and baseline send their requests through the same `Lifecycle.generate` and `SGLangClient` as
agentloop (the engine is woken before and put to sleep after, as a step does), so the comparison is
of the scheduling only. Reported per run: generated tokens/s, trajectories/s, wall seconds, the
fraction of wall time the engine had a request and the mean number in flight (from request
intervals), the engine's CPU busy fraction (CPU engine we started) or mean GPU utilisation
(nvidia-smi); per sweep point the medians and the ratios agentloop/ceiling and agentloop/baseline
(`agentloop_over_ceiling`, `agentloop_over_baseline` = `agentloop_over_turn_sync`).

    python benchmarks/rollout_throughput.py                       # CPU engine, a few minutes on 2 cores
    python benchmarks/rollout_throughput.py --engine sglang --engine-url http://127.0.0.1:30000 ...
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    BusySampler,
    Engine,
    WorkloadSpec,
    add_client_args,
    add_turn_args,
    benchmark_parser,
    filler_ids,
    interval_stats,
    left_awake,
    make_workload,
    median,
    open_engine,
    pyplot,
    r4,
    run_benchmark,
    runtime_config,
    save_figure,
    title_suffix,
    trainer_heap,
    versioned_weights,
    warm_up_spec,
    workload_spec,
    workload_stats,
)

from agentloop.engine.base import SamplingParams  # noqa: E402
from agentloop.engine.lifecycle import Weights  # noqa: E402
from agentloop.runtime import Runtime  # noqa: E402
from agentloop.types import Sample  # noqa: E402

MODES = ("ceiling", "agentloop", "turn_sync", "multiturn_raw")
ALL_MODES = MODES + ("agentloop_depth_first", "agentloop_fifo", "agentloop_gc_freeze")


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True)


def _summary(mode: str, wall: float, tokens: int, n_traj: int, requests: int, intervals: list[tuple[float, float]],
             t0: float, busy: dict[str, float], **extra: Any) -> dict[str, Any]:
    lat = [b - a for a, b in intervals]
    if "client_cpu_seconds" in busy:  # the client's cost per unit of work, comparable across modes and engines
        extra["client_cpu_seconds_per_1k_tokens"] = r4(1000.0 * busy["client_cpu_seconds"] / max(tokens, 1))
    return {"mode": mode, "wall_s": r4(wall), "generated_tokens": tokens, "tokens_per_s": r4(tokens / wall),
            "trajectories_per_s": r4(n_traj / wall), "requests": requests,
            "request_seconds_mean": r4(sum(lat) / len(lat)) if lat else 0.0,
            **interval_stats(intervals, t0, t0 + wall), **busy, **extra}


async def run_ceiling(rt: Runtime, engine: Engine, work: list[list[dict[str, Any]]], prompt: int, conc: int,
                      weights: Weights) -> dict[str, Any]:
    lc = rt.lifecycle
    assert lc is not None
    reqs = []
    for i, turns in enumerate(work):
        ctx = prompt
        for k, t in enumerate(turns):
            reqs.append((i, k, ctx, t["gen_tokens"]))
            ctx += t["gen_tokens"] + t["tool_result_tokens"]
    reqs.sort(key=lambda r: -r[3])  # longest first: the best makespan a dependency-free batch can have
    await lc.wake_up(weights)
    intervals: list[tuple[float, float]] = []
    on_server: dict[tuple[int, int], float] = {}
    tokens = 0
    limit = anyio.Semaphore(conc)

    async def one(i: int, k: int, ctx: int, gen: int) -> None:
        nonlocal tokens
        async with limit:
            a = time.perf_counter()
            out = await lc.generate(engine.url, filler_ids(ctx, salt=i), _params(gen), timeout=600)
            b = time.perf_counter()
            intervals.append((a, b))
            on_server[(i, k)] = b - a
        if len(out.output_ids) != gen:
            raise RuntimeError(f"ceiling: asked {gen} tokens, got {len(out.output_ids)} ({out.finish_reason})")
        tokens += gen

    try:
        with BusySampler(engine) as bs:
            t0 = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for r in reqs:
                    tg.start_soon(one, *r)
            wall = time.perf_counter() - t0
    finally:
        await lc.sleep()
    chains = [sum(on_server[(i, k)] for k in range(len(turns))) + sum(t["tool_latency_s"] for t in turns[:-1])
              for i, turns in enumerate(work)]
    return _summary("ceiling", wall, tokens, len(work), len(reqs), intervals, t0, bs.result(),
                    critical_path_s=r4(max(chains)))


async def run_turn_sync(rt: Runtime, engine: Engine, work: list[list[dict[str, Any]]], prompt: int, conc: int,
                        weights: Weights) -> dict[str, Any]:
    lc = rt.lifecycle
    assert lc is not None
    ctxs = [filler_ids(prompt, salt=i) for i in range(len(work))]
    intervals: list[tuple[float, float]] = []
    tokens = requests = 0
    limit = anyio.Semaphore(conc)
    await lc.wake_up(weights)

    async def gen_one(i: int, n: int) -> None:
        nonlocal tokens, requests
        async with limit:
            a = time.perf_counter()
            out = await lc.generate(engine.url, ctxs[i], _params(n), timeout=600)
            intervals.append((a, time.perf_counter()))
        if len(out.output_ids) != n:
            raise RuntimeError(f"turn_sync: asked {n} tokens, got {len(out.output_ids)} ({out.finish_reason})")
        ctxs[i] = ctxs[i] + out.output_ids  # the model's tokens verbatim, as a multi-turn buffer keeps them
        tokens += n
        requests += 1

    async def tool_one(i: int, turn: dict[str, Any]) -> None:
        await anyio.sleep(turn["tool_latency_s"])
        ctxs[i] = ctxs[i] + filler_ids(turn["tool_result_tokens"], salt=i + 7)

    try:
        with BusySampler(engine) as bs:
            t0 = time.perf_counter()
            for k in range(max(len(t) for t in work)):
                async with anyio.create_task_group() as tg:  # turn k of every trajectory: one batch
                    for i, turns in enumerate(work):
                        if k < len(turns):
                            tg.start_soon(gen_one, i, turns[k]["gen_tokens"])
                async with anyio.create_task_group() as tg:  # then every tool call
                    for i, turns in enumerate(work):
                        if k < len(turns) - 1:
                            tg.start_soon(tool_one, i, turns[k])
            wall = time.perf_counter() - t0
    finally:
        await lc.sleep()
    return _summary("turn_sync", wall, tokens, len(work), requests, intervals, t0, bs.result())


async def run_multiturn_raw(rt: Runtime, engine: Engine, work: list[list[dict[str, Any]]], prompt: int, conc: int,
                            weights: Weights) -> dict[str, Any]:
    lc = rt.lifecycle
    assert lc is not None
    intervals: list[tuple[float, float]] = []
    tokens = requests = 0
    limit = anyio.Semaphore(conc)
    await lc.wake_up(weights)

    async def trajectory(i: int, turns: list[dict[str, Any]]) -> None:
        nonlocal tokens, requests
        ctx = filler_ids(prompt, salt=i)
        for k, t in enumerate(turns):
            async with limit:
                a = time.perf_counter()
                out = await lc.generate(engine.url, ctx, _params(t["gen_tokens"]), timeout=600)
                intervals.append((a, time.perf_counter()))
            if len(out.output_ids) != t["gen_tokens"]:
                raise RuntimeError(f"multiturn_raw: asked {t['gen_tokens']} tokens, got {len(out.output_ids)}")
            tokens += len(out.output_ids)
            requests += 1
            ctx = ctx + out.output_ids
            if k < len(turns) - 1:
                await anyio.sleep(t["tool_latency_s"])
                ctx = ctx + filler_ids(t["tool_result_tokens"], salt=i + 7)

    try:
        with BusySampler(engine) as bs:
            t0 = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for i, turns in enumerate(work):
                    tg.start_soon(trajectory, i, turns)
            wall = time.perf_counter() - t0
    finally:
        await lc.sleep()
    return _summary("multiturn_raw", wall, tokens, len(work), requests, intervals, t0, bs.result())


async def run_agentloop(rt: Runtime, engine: Engine, work: list[list[dict[str, Any]]], prompt: int, conc: int,
                        weights: Weights, tag: str, *, mode: str = "agentloop") -> dict[str, Any]:
    samples = [Sample(uid=f"{tag}-{i}", messages=[], agent="replay",
                      extra={"replay": {"prompt_tokens": prompt, "turns": turns}})
               for i, turns in enumerate(work)]
    # "agentloop" runs the configured default (fifo); agentloop_fifo is the 2026-12-03 sweep's explicit name for it
    order = "depth_first" if mode == "agentloop_depth_first" else "fifo"
    with BusySampler(engine) as bs:
        # gc_freeze only when asked: the same script measures older trees (without the setting) side by side
        extra = {"gc_freeze": True} if mode == "agentloop_gc_freeze" else {}
        res = await rt.step(samples, weights, concurrency=conc, slot_order=order, **extra)
    bad = [t for t in res.trajectories if t.status != "completed"]
    if bad:
        raise RuntimeError(f"agentloop: {len(bad)} trajectories not completed, e.g. {bad[0].uid}: {bad[0].status} {bad[0].error}")
    want = sum(t["gen_tokens"] for tr in work for t in tr)
    tokens = int(res.metrics["sampled_tokens"])
    if tokens != want:
        raise RuntimeError(f"agentloop: sampled {tokens} tokens, the workload has {want}")
    wall = float(res.metrics["rollout_seconds"])
    gens = [iv for t in res.trajectories for iv in dispatch_intervals(t)]
    t0 = min(e.start for t in res.trajectories for e in t.timeline if e.kind == "queue")
    return _summary(mode, wall, tokens, len(work), len(gens), gens, t0, bs.result(),
                    step_s=r4(res.metrics["step_seconds"]), wake_up_s=r4(res.metrics["wake_up_seconds"]),
                    sleep_s=r4(res.metrics["sleep_seconds"]),
                    tool_seconds_mean=r4(res.metrics["tool_seconds"] / max(1, res.metrics["tool_calls"])))


def dispatch_intervals(traj: Any) -> list[tuple[float, float]]:
    """When each model turn was on the server: its "generate" span minus the router's "wait" (for the
    per-server slot) at its start — the same thing the other two modes time around their requests."""
    waits = [e for e in traj.timeline if e.kind == "wait"]
    out = []
    for g in (e for e in traj.timeline if e.kind == "generate"):
        inside = [w.end for w in waits if g.start <= w.start < g.end]
        out.append((max(inside, default=g.start), g.end))
    return out


async def measure(args: argparse.Namespace, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """The sweep; `save(out)` after every point, so a run cut short still leaves its results."""
    out: dict[str, Any] = {"points": [], "runs": []}
    async with open_engine(args, max_running=max(256, max(args.concurrency))) as engine:
        out["engine"] = engine.description
        weights = versioned_weights(engine)
        heap = trainer_heap(args.trainer_heap)
        out["client_gc_tracked_objects"] = heap["gc_tracked_objects"]

        specs = [workload_spec(args, trajectories=args.trajectories, tool_latency_dist=args.tool_latency_dist,
                               tool_latency_mean=lat)
                 for lat in args.tool_latency_means]
        works = [make_workload(spec) for spec in specs]
        for conc in args.concurrency:
            # Every trajectory of the step starts (scheduler concurrency = N); the router holds at most
            # `conc` requests in flight on the server — the same engine-side cap as the other two modes.
            # (The router's per-server limit is fixed when the runtime starts: one runtime per level.)
            cfg = runtime_config(engine, args, concurrency=args.trajectories, per_server_concurrency=conc)
            async with Runtime(cfg) as rt, left_awake(rt, weights):
                warm = make_workload(warm_up_spec())
                await run_agentloop(rt, engine, warm, 8, 4, weights(), f"warm{conc}")
                await run_ceiling(rt, engine, warm, 8, 4, weights())
                for lat, spec, work in zip(args.tool_latency_means, specs, works):
                    modes = args.modes
                    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
                    for rep in range(args.repeats):
                        r0 = rep % len(modes)
                        for mode in modes[r0:] + modes[:r0]:  # rotate: no mode always goes first
                            log0 = _log_size(args.server_log)
                            if mode == "ceiling":
                                r = await run_ceiling(rt, engine, work, args.prompt_tokens, conc, weights())
                            elif mode == "turn_sync":
                                r = await run_turn_sync(rt, engine, work, args.prompt_tokens, conc, weights())
                            elif mode == "multiturn_raw":
                                r = await run_multiturn_raw(rt, engine, work, args.prompt_tokens, conc, weights())
                            else:
                                r = await run_agentloop(rt, engine, work, args.prompt_tokens, args.trajectories,
                                                        weights(), f"{mode}l{lat}c{conc}r{rep}", mode=mode)
                            r.update(tool_latency_mean_s=lat, concurrency=conc, repeat=rep)
                            if args.server_log is not None:  # this run's bytes of the server's log (tools/gpu_sweep_report.py)
                                r["server_log_window"] = [log0, _log_size(args.server_log)]
                            runs[mode].append(r)
                            out["runs"].append(r)
                    point = summarize_point(lat, conc, spec, work, runs)
                    out["points"].append(point)
                    save(out)
                    print(f"tool latency {lat:6.3f}s  c={conc:4d}: tok/s "
                          + "  ".join(f"{m} {point[m]['tokens_per_s']:9.1f}" for m in modes) + "  "
                          + "  ".join(f"{k} {v:.3f}" for k, v in point.items() if k.startswith("agentloop_over_")
                                      and isinstance(v, float) and not k.endswith("_of_medians")), flush=True)
    return out


def _log_size(path: Path | None) -> int:
    try:
        return path.stat().st_size if path is not None else 0
    except OSError:
        return 0


def summarize_point(lat: float, conc: int, spec: WorkloadSpec, work: list[list[dict[str, Any]]],
                    runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    point: dict[str, Any] = {"tool_latency_mean_s": lat, "concurrency": conc, "workload": workload_stats(work)}
    for mode, rs in runs.items():
        m = {k: r4(median([r[k] for r in rs])) for k in rs[0]
             if isinstance(rs[0][k], (int, float)) and k not in ("repeat", "concurrency", "tool_latency_mean_s")}
        m["tokens_per_s_all"] = [r["tokens_per_s"] for r in rs]
        point[mode] = m
    # Paired: each repeat runs the modes back to back, so a ratio within a repeat sees one background load;
    # the median of those is the headline (robust to load drifting between repeats on a shared machine).
    for other in (m for m in ("ceiling", "turn_sync", "multiturn_raw", "agentloop_depth_first", "agentloop_fifo",
                              "agentloop_gc_freeze") if m in runs):
        paired = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs["agentloop"], runs[other])]
        point[f"agentloop_over_{other}"] = r4(median(paired))
        point[f"agentloop_over_{other}_per_repeat"] = [r4(x) for x in paired]
        point[f"agentloop_over_{other}_of_medians"] = r4(point["agentloop"]["tokens_per_s"] / point[other]["tokens_per_s"])
    # Client CPU per generated token, paired within a repeat like the throughput ratios: agentloop's own cost
    # against a client without its machinery (the target: <= 2x the ceiling client's).
    for a in (m for m in ("agentloop", "agentloop_gc_freeze", "agentloop_depth_first") if m in runs):
        for b in (m for m in ("ceiling", "multiturn_raw") if m in runs):
            key = "client_cpu_seconds_per_1k_tokens"
            paired = [x[key] / y[key] for x, y in zip(runs[a], runs[b]) if key in x and key in y and y[key] > 0]
            if paired:
                point[f"client_cpu_{a}_over_{b}"] = r4(median(paired))
    # The issue names the two headline ratios agentloop/ceiling and agentloop/baseline; the turn-synchronous
    # design is that baseline. Same value under the name; the old key stays for existing readers.
    if "turn_sync" in runs:
        point["agentloop_over_baseline"] = point["agentloop_over_turn_sync"]
    if "ceiling" in runs:  # what a client bound by turn order could reach (see the module docstring)
        c = point["ceiling"]
        # = tokens / max(ceiling wall, critical path), from the ceiling's own rate so rounding cannot lift it above
        point["dependency_ceiling_tokens_per_s"] = r4(min(c["tokens_per_s"], c["generated_tokens"] / c["critical_path_s"]))
        point["critical_path_s"] = c["critical_path_s"]
        point["agentloop_over_dependency_ceiling"] = r4(point["agentloop"]["tokens_per_s"] / point["dependency_ceiling_tokens_per_s"])
    # The target's condition: is the mean tool latency below the mean time of a model turn?
    point["mean_turn_generate_s"] = point["agentloop"]["request_seconds_mean"]
    point["tool_latency_below_turn_time"] = bool(point["workload"]["tool_latency_mean_s"] < point["mean_turn_generate_s"])
    return point


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    lats = sorted({p["tool_latency_mean_s"] for p in report["points"]})
    fig, axes = plt.subplots(1, len(lats), figsize=(5.2 * len(lats), 4.2), squeeze=False)
    styles = {"ceiling": ("kD--", "ceiling (independent requests)"), "agentloop": ("o-", "agentloop"),
              "turn_sync": ("s-", "turn-synchronous"), "multiturn_raw": ("^:", "bare multi-turn client"),
              "agentloop_depth_first": ("x-.", "agentloop, depth-first slots"),
              "agentloop_gc_freeze": ("d-", "agentloop, scheduler.gc_freeze")}
    for ax, lat in zip(axes[0], lats):
        pts = sorted((p for p in report["points"] if p["tool_latency_mean_s"] == lat), key=lambda p: p["concurrency"])
        xs = [p["concurrency"] for p in pts]
        for mode, (style, label) in styles.items():
            if all(mode in p for p in pts):
                ax.plot(xs, [p[mode]["tokens_per_s"] for p in pts], style, label=label)
        for p in pts:
            ax.annotate("\n".join(f"{p[k]:.2f}x {name}" for k, name in (
                ("agentloop_over_ceiling", "ceil"), ("agentloop_over_dependency_ceiling", "dep. ceil"),
                ("agentloop_over_turn_sync", "sync"), ("agentloop_over_multiturn_raw", "bare")) if k in p),
                        (p["concurrency"], p["agentloop"]["tokens_per_s"]), textcoords="offset points", xytext=(4, -22),
                        fontsize=7)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("concurrency (requests in flight on the engine)")
        ax.set_ylabel("generated tokens / s")
        ax.set_ylim(bottom=0)
        ax.set_title(f"mean tool latency {lat:g}s", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    s = report["settings"]
    fig.suptitle(f"Rollout throughput: {s['trajectories']} trajectories x {s['turns']} turns, heavy-tailed lengths "
                 f"(median {s['gen_median']:g} tok)\n{title_suffix(report)}", fontsize=9)
    save_figure(fig, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = benchmark_parser(__doc__)
    w = p.add_argument_group("workload")
    w.add_argument("--trajectories", type=int, default=48)
    add_turn_args(w, turns=3, prompt_tokens=64, gen_median=16.0, gen_sigma=0.6, traj_sigma=0.6, gen_max=256)
    w.add_argument("--tool-latency-dist", choices=["lognormal", "exponential", "constant"], default="lognormal")
    # Aliases: `--tool-latency-mean` is long_tail.py's name for it, and a bare `--tool-latency` would
    # otherwise be refused by argparse as an ambiguous prefix of --tool-latency-dist / --tool-latency-means.
    w.add_argument("--tool-latency-means", "--tool-latency-mean", "--tool-latency", dest="tool_latency_means",
                   type=float, nargs="+", default=[0.02, 0.2], help="mean tool latency, seconds (a sweep)")
    w.add_argument("--tool-result-median", type=float, default=16.0, help="median tokens of a tool result")
    w.add_argument("--concurrency", type=int, nargs="+", default=[4, 12, 48])
    w.add_argument("--repeats", type=int, default=5)
    w.add_argument("--modes", nargs="+", choices=ALL_MODES, default=list(MODES),
                   help="what to run at each point (agentloop is always run: the ratios are agentloop's)")
    w.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-log", type=Path, default=None,
                   help="the --engine-url server's log file: each run records its byte window of it, so the "
                        "server's own per-batch lines can be read per mode (tools/gpu_sweep_report.py)")
    add_client_args(p, gc_freeze=False)  # the agentloop_gc_freeze mode runs agentloop with it, side by side
    args = p.parse_args(argv)
    args.modes = ["agentloop"] + [m for m in dict.fromkeys(args.modes) if m != "agentloop"]
    if args.smoke:
        args.trajectories, args.turns, args.prompt_tokens, args.gen_median, args.gen_max = 6, 2, 8, 3, 8
        args.tool_latency_means, args.concurrency, args.repeats, args.tool_result_median = [0.005], [3], 1, 3
    return args


def main(argv: list[str] | None = None) -> int:
    return run_benchmark("rollout_throughput", argv, parse_args, {
        "ceiling": "every turn as an independent request (same context length and generated tokens), all submitted "
                   "at once, at most `concurrency` in flight, longest first",
        "agentloop": "Runtime.step with the replay agent loop: every trajectory started, at most `concurrency` "
                     "requests in flight on the server (router per-server limit); wall = the scheduler's rollout "
                     "seconds (wake-up and sleep reported apart)",
        "turn_sync": "turn t of all trajectories as one batch (at most `concurrency` requests in flight), then all "
                     "tools, then turn t+1",
        "multiturn_raw": "one task per trajectory (turn, tool sleep, next turn), at most `concurrency` requests in "
                         "flight (FIFO), through the same Lifecycle.generate: a bare correct multi-turn client",
        "agentloop_depth_first": "agentloop with scheduler.slot_order=depth_first (default fifo)",
        "agentloop_gc_freeze": "agentloop with scheduler.gc_freeze (gc.freeze for the step: its collections skip the "
                               "objects older than the step)",
        "client_gc_seconds": "CPU seconds this process's garbage collector ran during the run (part of "
                             "client_cpu_seconds); client_gc_full_collections: full collections among them; "
                             "client_gc_collected_objects: unreachable objects they freed (reference cycles)",
        "client_gc_tracked_objects": "objects the garbage collector tracked before the sweep (--trainer-heap adds a "
                                     "trainer's: transformers and a 0.5B-shaped model on the meta device)",
        "critical_path_s": "the longest trajectory's chain: its turns' on-server seconds in the ceiling run plus its "
                           "tool latencies; no client respecting turn order finishes sooner at that per-request speed",
        "dependency_ceiling_tokens_per_s": "generated tokens / max(ceiling wall, critical_path_s)",
        "engine_has_work_fraction": "fraction of wall time with >= 1 generate request in flight (client side)",
        "engine_cpu_busy_fraction": "CPU engine process CPU seconds per wall second (its model runs on --engine-threads)",
        "gpu_utilization_mean": "nvidia-smi utilization.gpu, mean of 100 ms samples",
        "client_cpu_busy_fraction": "this benchmark process's CPU seconds per wall second (the client side)",
        "client_cpu_seconds_per_1k_tokens": "this benchmark process's CPU seconds per 1000 generated tokens (agentloop: "
                                            "the whole step, its wake-up and sleep included)",
        "request_seconds_mean": "mean time a model turn spent on the server (agentloop: excluding the wait for a "
                                "per-server slot)",
        "ratios": "agentloop_over_X: median over repeats of (agentloop tokens/s / X tokens/s) within one repeat (the "
                  "three run back to back, order rotating); _of_medians: ratio of the medians; same workload, same "
                  "engine, same process",
        "agentloop_over_baseline": "= agentloop_over_turn_sync (the turn-synchronous design is the issue's baseline)",
    }, measure, plot, checkpoints=True, plot_checkpoints=True)


if __name__ == "__main__":
    sys.exit(main())
