"""Continuous rollout: trained tokens per second of five ways to keep one engine busy over many
training steps: agentloop's per-step mode, over-admission with carried partials, the streaming mode
(its prefix cache flushed or kept at each update), and
a bare client that refills a finished trajectory's slot at once.

Every way serves the same seeded stream of GRPO groups (`--group-size` members; a group's members
share its multi-turn `replay` workload and differ in token ids: prompt and tool results are the replay
loop's per-uid ids, which the bare client draws the same way), and counts a training step as
`--batch-groups` complete groups; a run is `--steps` steps (or fewer, cut at `--run-limit` seconds,
said in the JSON):

- **per_step**: `Runtime.step(B fresh groups, new weights)`: staged wake-up → every trajectory to its
  end → sleep. Its in-flight count is the batch (B × n trajectories).
- **over_admission**: `Runtime.step(carry, target_groups=B, active=active, more_samples=feeder)`: the
  scheduler keeps `active` trajectories in flight, refilling a finished one's slot from the feeder at
  once, returns once B groups are complete, and carries the rest (partial rollout) into the next step,
  where carried trajectories older than `--max-staleness` versions are restarted. Wake-up and sleep
  every step.
- **streaming**: `rollout_stream` (`agentloop.runtime.stream`) keeping `active` trajectories in
  flight; after each batch the trainer applies new weights in flight (`update_weights`); the engine
  never sleeps. AReaL's bound `--max-staleness`. Each update flushes the engine's prefix cache, so
  every context in flight is prefilled again under the new weights.
- **streaming_kv_reuse**: the same with `StreamConfig(kv_on_update="reuse")`: the prefix cache survives
  each update, so a turn cut by it goes on from the KV the old weights wrote (PipelineRL's in-flight
  update) instead of re-prefilling it.
- **streaming_kv_reuse_server_drain**: the same with `StreamConfig(drain="server")`: each update's load
  goes out with `abort_all_requests` and the server drains itself while this process parses the
  aborted answers (the default waits until every answer is back here before the load).
- **bare_refill**: no agentloop runtime: `active` tasks, each running one trajectory after another
  (turn, tool sleep, next turn) through the same `Lifecycle.generate` and client; a step = the next B
  groups completed. No weight updates: the ceiling a continuous mode can reach at that in-flight count.

Reported per run: trained tokens (sampled tokens of the groups handed to the trainer) per second of
wall time (wake-ups, sleeps and weight updates included), the fraction of wall time the engine had a
request in flight and the mean number in flight (the gate's count, sampled every 20 ms), the engine's
busy fraction (CPU engine: its CPU seconds per second; GPU: nvidia-smi utilisation), the staleness
histogram of trained tokens (versions between the weights that sampled a token and those of the step
that trained it), groups restarted for staleness, and per tool latency the ratios the issue asks for.

    python benchmarks/continuous.py                                  # CPU engine, a few minutes
    python benchmarks/continuous.py --engine sglang --engine-url http://127.0.0.1:30000 --gpu-scale
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    SLOT_LIMIT_HELP,
    BusySampler,
    WorkloadSpec,
    add_turn_args,
    benchmark_parser,
    left_awake,
    make_workload,
    open_engine,
    pyplot,
    r4,
    run_benchmark,
    runtime_config,
    save_figure,
    slot_limit,
    title_suffix,
    trainer_weights,
    warm_up_spec,
    workload_spec,
    workload_stats,
)

from agentloop.runtime import Runtime  # noqa: E402  (first: the package's import order)
from agentloop.agents.replay import _fixed_ids  # noqa: E402  (the replay loop's own per-uid ids)
from agentloop.engine.base import SamplingParams  # noqa: E402
from agentloop.engine.lifecycle import Weights  # noqa: E402
from agentloop.engine.route_session import SLOT_ORDERS  # noqa: E402
from agentloop.runtime.stream import StreamConfig, rollout_stream  # noqa: E402
from agentloop.scheduler.gc_scope import frozen_heap  # noqa: E402
from agentloop.types import Sample  # noqa: E402

MODES = ("per_step", "over_admission", "streaming", "streaming_kv_reuse", "streaming_kv_reuse_server_drain",
         "bare_refill")
#: The streaming runs: `streaming_kv_reuse` keeps the engine's prefix cache across each update
#: (`StreamConfig.kv_on_update="reuse"`), `streaming` flushes it (the default); mode → (kv_on_update, drain).
STREAMING = {"streaming": ("recompute", "client"), "streaming_kv_reuse": ("reuse", "client"),
             "streaming_kv_reuse_server_drain": ("reuse", "server")}


class GroupSource:
    """The seeded stream of groups every way consumes in the same order: group g has workload `work[g]`."""

    def __init__(self, spec: WorkloadSpec, cap: float, tag: str) -> None:
        self.work = make_workload(spec)
        for turns in self.work:  # the tool latency: exponential, capped
            for t in turns:
                t["tool_latency_s"] = min(t["tool_latency_s"], cap)
        self.spec, self.tag, self.next_group = spec, tag, 0

    def take(self) -> tuple[str, list[dict[str, Any]]]:
        g = self.next_group
        if g >= len(self.work):
            raise RuntimeError(f"the workload has only {len(self.work)} groups; raise its size")
        self.next_group += 1
        return f"{self.tag}-g{g}", self.work[g]

    def sample(self) -> Sample:
        gid, turns = self.take()
        return Sample(uid=gid, messages=[], agent="replay",
                      extra={"replay": {"prompt_tokens": self.spec.prompt_tokens, "turns": turns}})

    def samples(self) -> Iterator[Sample]:
        while True:
            yield self.sample()


class InFlight:
    """Samples the gate's requests in flight every 20 ms: the engine's has-work fraction and mean load."""

    def __init__(self, gate: Any) -> None:
        self.gate, self.samples = gate, []  # type: ignore[var-annotated]

    async def run(self) -> None:
        while True:
            self.samples.append(self.gate.in_flight())
            await anyio.sleep(0.02)

    def result(self) -> dict[str, float]:
        s = self.samples or [0]
        return {"engine_has_work_fraction": r4(sum(1 for x in s if x > 0) / len(s)),
                "mean_requests_in_flight": r4(sum(s) / len(s))}


def _add_hist(total: dict[int, int], part: dict[int, int]) -> None:
    for k, v in part.items():
        total[k] = total.get(k, 0) + v


async def _measured(rt: Runtime, engine: Any, body: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    """Run `body(run)` with the in-flight and busy samplers around it; `run` collects its figures."""
    run: dict[str, Any] = {"trained_tokens": 0, "prefill_tokens": 0, "steps": 0, "staleness_histogram": {},
                           "stage_seconds": 0.0}
    sampler = InFlight(rt.lifecycle.gate)
    with BusySampler(engine) as bs:
        async with anyio.create_task_group() as tg:
            tg.start_soon(sampler.run)
            t0 = time.monotonic()
            await body(run)
            run["wall_s"] = r4(time.monotonic() - t0)
            tg.cancel_scope.cancel()
    run.update(sampler.result(), **bs.result())
    run["trained_tokens_per_s"] = r4(run["trained_tokens"] / max(run["wall_s"], 1e-9))
    run["prefill_per_trained_token"] = r4(run["prefill_tokens"] / max(run["trained_tokens"], 1))
    run["staleness_histogram"] = {str(k): v for k, v in sorted(run["staleness_histogram"].items())}
    return run


def _prefill_tokens(trajs: list[Any]) -> int:
    """Context tokens the engine computed (not found in its prefix cache) for the turns of `trajs`: each
    turn's context (prompt + response so far) minus the engine's `cached_tokens` for it."""
    return sum(len(t.prompt_ids) + tr.start - tr.cached_tokens for t in trajs for tr in t.turns)


def _step_tokens(trajs: list[Any], n: int, want_groups: int, mode: str) -> int:
    bad = [t for t in trajs if t.status != "completed"]
    if bad:
        raise RuntimeError(f"{mode}: {len(bad)} trajectories not completed, e.g. {bad[0].uid}: {bad[0].status} {bad[0].error}")
    if len(trajs) != want_groups * n:
        raise RuntimeError(f"{mode}: {len(trajs)} trajectories returned, wanted {want_groups} groups of {n}")
    return sum(sum(t.response_mask) for t in trajs)


def _hist(metrics: dict[str, Any]) -> dict[int, int]:
    """The step's staleness histogram of returned sampled tokens (the scheduler's `token_staleness`)."""
    return {int(k): v for k, v in metrics.get("token_staleness", {}).items()}


async def per_step(rt: Runtime, engine: Any, args: argparse.Namespace, src: GroupSource, weights: Callable[[], Weights],
                   active: int) -> dict[str, Any]:
    B, n = args.batch_groups, args.group_size

    async def body(run: dict[str, Any]) -> None:
        t0 = time.monotonic()
        while run["steps"] < args.steps and time.monotonic() - t0 < args.run_limit:
            res = await rt.step([src.sample() for _ in range(B)], weights(), n=n, concurrency=B * n)
            run["trained_tokens"] += _step_tokens(res.trajectories, n, B, "per_step")
            run["prefill_tokens"] += _prefill_tokens(res.trajectories)
            _add_hist(run["staleness_histogram"], _hist(res.metrics))
            run["stage_seconds"] += res.metrics["wake_up_seconds"] + res.metrics["sleep_seconds"]
            run["steps"] += 1

    out = await _measured(rt, engine, body)
    out["in_flight"] = B * n
    return out


async def over_admission(rt: Runtime, engine: Any, args: argparse.Namespace, src: GroupSource,
                         weights: Callable[[], Weights], active: int) -> dict[str, Any]:
    """The scheduler's over-admission: `active` trajectories in flight, refilled from the feeder as soon as
    one finishes, until B groups are accepted; the rest carried (partial rollout) into the next step, where
    `max_staleness` restarts the ones that started too many versions ago."""
    B, n = args.batch_groups, args.group_size
    feeder = src.samples()

    async def body(run: dict[str, Any]) -> None:
        carry: list[Sample] = []
        t0 = time.monotonic()
        run.update(carried=[], restarted_for_staleness=0, started=[], stop_tail_s=[])
        while run["steps"] < args.steps and time.monotonic() - t0 < args.run_limit:
            emitted: list[float] = []
            t_call = time.monotonic()
            res = await rt.step(carry, weights(), n=n, concurrency=active, target_groups=B, active=active,
                                more_samples=feeder, partial_rollout=True, max_staleness=args.max_staleness,
                                stale_policy="restart", on_trajectory=lambda t: emitted.append(time.monotonic()))
            m = res.metrics
            run["trained_tokens"] += _step_tokens(res.trajectories, n, B, "over_admission")
            run["prefill_tokens"] += _prefill_tokens(res.trajectories)
            _add_hist(run["staleness_histogram"], _hist(m))
            run["stage_seconds"] += m["wake_up_seconds"] + m["sleep_seconds"]
            if emitted:
                run["stop_tail_s"].append(r4(m["rollout_seconds"] - (max(emitted) - t_call - m["wake_up_seconds"])))
            run["restarted_for_staleness"] += int(m.get("stale_restarted", 0))
            run["carried"].append(len(res.carry_over))
            run["started"].append(m.get("started"))
            carry = list(res.carry_over)
            run["steps"] += 1

    out = await _measured(rt, engine, body)
    out["in_flight"] = active
    return out


async def streaming(rt: Runtime, engine: Any, args: argparse.Namespace, src: GroupSource, weights: Callable[[], Weights],
                    active: int, *, kv_on_update: str = "recompute", drain: str = "client") -> dict[str, Any]:
    B, n = args.batch_groups, args.group_size
    cfg = StreamConfig(batch_groups=B, active=active, max_staleness=args.max_staleness,
                       max_queued_batches=args.max_queued_batches, kv_on_update=kv_on_update,  # type: ignore[arg-type]
                       drain=drain)  # type: ignore[arg-type]

    async def body(run: dict[str, Any]) -> None:
        t0 = time.monotonic()
        async with rollout_stream(rt, src.samples(), cfg, weights=weights(), n=n, concurrency=active) as s:
            async for batch in s:
                run["trained_tokens"] += _step_tokens(batch.trajectories, n, len(batch.groups), "streaming")
                run["prefill_tokens"] += _prefill_tokens(batch.trajectories)
                _add_hist(run["staleness_histogram"], batch.staleness)
                run["steps"] += 1
                if run["steps"] >= args.steps or time.monotonic() - t0 >= args.run_limit:
                    break
                await s.update_weights(weights())
            m = s.metrics
            # the stream's close (stopping what runs, the one sleep) is after the last batch: not in the wall
            run["wall_to_last_batch_s"] = r4(time.monotonic() - t0)
        run["stage_seconds"] = r4(s.t_awake - t0 if s.t_awake else 0.0) + sum(m["update_seconds"])
        ups = max(1, len(m["update_seconds"]))
        run.update(update_seconds_mean=r4(sum(m["update_seconds"]) / ups),
                   update_load_seconds_mean=r4(sum(m["update_load_seconds"]) / ups),
                   update_drain_seconds_mean=r4(sum(m["update_drain_seconds"]) / ups),
                   update_cpu_seconds_mean=r4(sum(m["update_cpu_seconds"]) / ups),
                   update_seconds=[r4(x) for x in m["update_seconds"]],
                   interrupted_per_update=r4(sum(m["update_interrupted"]) / ups),
                   resumed_per_update=r4(m["trajectories_resumed"] / ups),
                   trajectories_resumed=m["trajectories_resumed"], groups_dropped_stale=m["groups_dropped_stale"],
                   groups_restarted_stale=m["groups_restarted_stale"], max_buffered_groups=m["max_buffered_groups"],
                   generations_outside_awake=m["generations_outside_awake"],
                   # the answer check takes a server out on a mark not ours: 0 on a healthy server
                   servers_taken_out=len(rt.lifecycle.gate.out))

    out = await _measured(rt, engine, body)
    # trained tokens per second up to the last batch the trainer took (the close is after the run)
    out["trained_tokens_per_s"] = r4(out["trained_tokens"] / max(out["wall_to_last_batch_s"], 1e-9))
    out["in_flight"] = active
    return out


async def bare_refill(rt: Runtime, engine: Any, args: argparse.Namespace, src: GroupSource, weights: Callable[[], Weights],
                      active: int) -> dict[str, Any]:
    """`active` tasks, each running trajectories one after another: a finished one's slot is refilled at once."""
    B, n = args.batch_groups, args.group_size
    lc = rt.lifecycle
    prompt = src.spec.prompt_tokens

    def members() -> Iterator[tuple[str, str, list[dict[str, Any]]]]:
        while True:
            gid, turns = src.take()
            for i in range(n):
                yield gid, f"{gid}_{i}", turns

    async def body(run: dict[str, Any]) -> None:
        jobs = members()
        done: dict[str, int] = {}
        tokens: dict[str, int] = {}
        prefill: dict[str, int] = {}
        want = args.steps * B
        t0 = time.monotonic()
        finished = anyio.Event()
        ready = 0

        async def trajectory(gid: str, uid: str, turns: list[dict[str, Any]]) -> None:
            nonlocal ready
            ctx = _fixed_ids(f"{uid}/prompt", prompt, 3, 200)
            got = computed = 0
            for k, t in enumerate(turns):
                out = await lc.generate(engine.url, ctx, SamplingParams(max_new_tokens=t["gen_tokens"], temperature=1.0,
                                                                        ignore_eos=True), timeout=600)
                got += len(out.output_ids)
                computed += len(ctx) - out.cached_tokens
                ctx = ctx + out.output_ids
                if k < len(turns) - 1:
                    await anyio.sleep(t["tool_latency_s"])
                    ctx = ctx + _fixed_ids(f"{uid}/tool{k}", t["tool_result_tokens"], 3, 200)
            tokens[gid] = tokens.get(gid, 0) + got
            prefill[gid] = prefill.get(gid, 0) + computed
            done[gid] = done.get(gid, 0) + 1
            if done[gid] == n and ready < want:  # a complete group: one of the next step's B
                ready += 1
                run["trained_tokens"] += tokens[gid]
                run["prefill_tokens"] += prefill[gid]
                run["steps"] = ready // B
                if ready >= want:
                    finished.set()

        async def worker() -> None:
            while not finished.is_set():
                await trajectory(*next(jobs))

        await lc.wake_up(weights())
        run["stage_seconds"] = r4(time.monotonic() - t0)
        try:
            # the same heap freeze as the other modes' (scheduler.gc_freeze), for the whole run
            with frozen_heap(args.gc_freeze):
                async with anyio.create_task_group() as tg:
                    for _ in range(active):
                        tg.start_soon(worker)
                    with anyio.move_on_after(max(0.0, args.run_limit - (time.monotonic() - t0))):
                        await finished.wait()
                    run["wall_to_last_batch_s"] = r4(time.monotonic() - t0)
                    tg.cancel_scope.cancel()  # the trajectories still running are not part of any step
            run["staleness_histogram"] = {0: run["trained_tokens"]}  # one version, never updated
        finally:
            with anyio.CancelScope(shield=True):
                await lc.sleep()

    out = await _measured(rt, engine, body)
    out["trained_tokens_per_s"] = r4(out["trained_tokens"] / max(out["wall_to_last_batch_s"], 1e-9))
    out["in_flight"] = active
    return out


RUNNERS = {"per_step": per_step, "over_admission": over_admission, "bare_refill": bare_refill,
           **{mode: functools.partial(streaming, kv_on_update=kv, drain=by) for mode, (kv, by) in STREAMING.items()}}


def _points(args: argparse.Namespace) -> list[tuple[float, str, int]]:
    """(tool latency, mode, in flight) in the order they run: per latency, per in-flight count, every mode
    (per_step once per latency: its in-flight count is the batch)."""
    pts = []
    for lat in args.tool_latency_means:
        if "per_step" in args.modes:
            pts.append((lat, "per_step", args.batch_groups * args.group_size))
        for active in args.active:
            pts += [(lat, m, active) for m in args.modes if m != "per_step"]
    return pts


async def measure(args: argparse.Namespace, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    out: dict[str, Any] = {"runs": [], "skipped": []}
    n = args.group_size
    groups_needed = (args.steps + 2) * (max(args.active) // n + args.batch_groups) + 16
    spec = workload_spec(args, trajectories=groups_needed, tool_latency_dist="exponential", tool_latency_mean=0.0)
    out["workload"] = {"spec": {**spec.as_dict(), "trajectories": "one per group, as needed",
                                "tool_latency_cap_s": args.tool_latency_cap},
                       "first_groups": workload_stats(make_workload(WorkloadSpec(**{**spec.as_dict(), "trajectories": 256})))}
    t_start = time.monotonic()
    async with open_engine(args, max_running=max(256, *args.active)) as engine:
        out["engine"] = engine.description
        sd = trainer_weights(engine)
        counter = iter(range(1, 1 << 30))

        def weights() -> Weights:
            return Weights(state_dict=sd, version=f"w{next(counter)}")

        cfg = runtime_config(engine, args, concurrency=max(args.active), n=n, gc_freeze=args.gc_freeze,
                             per_server_concurrency=args.slot_limit, slot_order=args.slot_order)
        async with Runtime(cfg) as rt, left_awake(rt, weights):
            out["concurrency"] = rt.concurrency.as_dict() if rt.concurrency else None
            await rt.step([Sample(uid=f"warm{i}", messages=[], agent="replay",
                                  extra={"replay": {"prompt_tokens": 8, "turns": t}})
                           for i, t in enumerate(make_workload(warm_up_spec()))], weights(), n=1)
            for lat, mode, active in _points(args):
                left = args.deadline - (time.monotonic() - t_start)
                limit = args.per_step_limit if mode == "per_step" and args.per_step_limit else args.run_limit
                if left < min(limit, 30.0):
                    out["skipped"].append({"tool_latency_mean_s": lat, "mode": mode, "active": active,
                                           "why": f"deadline: {left:.0f}s left"})
                    continue
                eta = args.max_staleness if args.max_staleness is not None else \
                    2 * math.ceil(active / (args.batch_groups * args.group_size))
                run_args = argparse.Namespace(**{**vars(args), "run_limit": min(limit, left), "max_staleness": eta})
                src = GroupSource(WorkloadSpec(**{**spec.as_dict(), "tool_latency_mean": lat}), args.tool_latency_cap,
                                  tag=f"{mode}-{active}-{lat:g}")
                print(f"{mode:15s} tools {lat:g}s, {active} in flight ...", flush=True)
                run = await RUNNERS[mode](rt, engine, run_args, src, weights, active)
                run.update(mode=mode, tool_latency_mean_s=lat, active=active, run_limit_s=r4(run_args.run_limit),
                           max_staleness=eta if mode == "over_admission" or mode in STREAMING else None,
                           complete_steps=run["steps"] >= args.steps)
                out["runs"].append(run)
                print(f"{mode:15s} tools {lat:g}s, {run['in_flight']} in flight: {run['trained_tokens_per_s']:9.1f} trained tok/s "
                      f"over {run['steps']} steps, engine has work {run['engine_has_work_fraction']:.2f}", flush=True)
                out["summary"] = summarize(out["runs"])
                save(out)
    out["summary"] = summarize(out["runs"])
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per tool latency: tokens/s per (mode, in flight), and the ratios the issue's targets are stated in."""
    summary: dict[str, Any] = {}
    for lat in sorted({r["tool_latency_mean_s"] for r in runs}):
        rs = [r for r in runs if r["tool_latency_mean_s"] == lat]
        tps = {f"{r['mode']}@{r['in_flight']}": r["trained_tokens_per_s"] for r in rs}
        by = {(r["mode"], r["active"]): r["trained_tokens_per_s"] for r in rs}
        base = next((r["trained_tokens_per_s"] for r in rs if r["mode"] == "per_step"), None)
        ratios: dict[str, float] = {}
        for (mode, active), v in by.items():
            if (mode in STREAMING or mode == "over_admission") and base:
                ratios[f"{mode}@{active}_over_per_step"] = r4(v / base)
            if mode in STREAMING and by.get(("bare_refill", active)):
                ratios[f"{mode}_over_bare_refill@{active}"] = r4(v / by[("bare_refill", active)])
        summary[f"{lat:g}s"] = {"trained_tokens_per_s": tps, "ratios": ratios}
    return summary


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    lats = sorted({r["tool_latency_mean_s"] for r in report.get("runs", [])})
    fig, axes = plt.subplots(1, max(1, len(lats)), figsize=(5.2 * max(1, len(lats)), 4.0), squeeze=False)
    colors = {"per_step": "tab:gray", "over_admission": "tab:orange", "streaming": "tab:blue",
              "streaming_kv_reuse": "tab:cyan", "streaming_kv_reuse_server_drain": "tab:purple",
              "bare_refill": "tab:green"}
    for ax, lat in zip(axes[0], lats):
        rs = [r for r in report["runs"] if r["tool_latency_mean_s"] == lat]
        labels = [f"{r['mode']}\n{r['in_flight']}" for r in rs]
        ax.bar(range(len(rs)), [r["trained_tokens_per_s"] for r in rs], color=[colors[r["mode"]] for r in rs])
        for i, r in enumerate(rs):
            ax.text(i, r["trained_tokens_per_s"], f"{r['engine_has_work_fraction']:.2f}", ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(rs)))
        ax.set_xticklabels(labels, fontsize=6, rotation=45, ha="right")
        ax.set_ylabel("trained tokens / s (wake, sleep, updates included)")
        ax.set_title(f"tools {lat:g} s (numbers: engine has-work fraction)", fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"Continuous rollout, {report['settings']['steps']} steps of {report['settings']['batch_groups']} groups "
                 f"x {report['settings']['group_size']}\n{title_suffix(report)}", fontsize=8)
    save_figure(fig, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = benchmark_parser(__doc__)
    w = p.add_argument_group("workload")
    w.add_argument("--batch-groups", type=int, default=4, help="complete groups per training step (B)")
    w.add_argument("--group-size", type=int, default=2, help="members per group (n)")
    w.add_argument("--steps", type=int, default=10, help="training steps per run")
    w.add_argument("--active", type=int, nargs="+", default=[8, 24], help="trajectories in flight (a sweep)")
    add_turn_args(w, turns=3, prompt_tokens=32, gen_median=8.0, gen_sigma=1.0, traj_sigma=0.0, gen_max=64)
    w.add_argument("--tool-latency-means", "--tool-latency-mean", dest="tool_latency_means", type=float, nargs="+",
                   default=[0.05, 0.2], help="mean tool latency, seconds (exponential, capped; a sweep)")
    w.add_argument("--tool-latency-cap", type=float, default=3.0, help="tool latency cap, seconds")
    w.add_argument("--tool-result-median", type=float, default=8.0)
    w.add_argument("--max-staleness", type=int, default=None,
                   help="η: over-admission's carried trajectories, streaming's bound (default: per run, "
                        "2 x ceil(active / (batch_groups x group_size)): AReaL's rule admits at most (η + 1) batches "
                        "ahead, so a smaller η could not keep `active` in flight, and trajectories stay in flight "
                        "about active / batch steps)")
    w.add_argument("--max-queued-batches", type=int, default=2, help="streaming: the queue bound, in batches")
    w.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    w.add_argument("--run-limit", type=float, default=120.0, help="seconds one run may take (it stops after its step)")
    w.add_argument("--per-step-limit", type=float, default=None, help="per_step's own --run-limit (its steps wait "
                   "for their slowest trajectory: at 2 s tools they are the longest)")
    w.add_argument("--deadline", type=float, default=1e9, help="seconds for the whole benchmark; runs that would "
                   "start later are skipped and listed")
    w.add_argument("--gpu-scale", action="store_true", help="the issue's H200 workload: 4 turns, 256-token prompts, "
                   "lognormal(64, sigma 1) turns up to 1024, 32-token tool results, B=64 groups x 4 (the issue's "
                   "step of 256 trajectories), 768/1536 in flight, 2 s and 0.5 s tools")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=True,
                   help="every mode runs with the client heap frozen while it generates (scheduler.gc_freeze: per "
                   "step, over the stream's life, over the bare client's run), so full collections walk what the run "
                   "allocated, not the trainer-side heap (torch, the weights' model) built before it")
    w.add_argument("--slot-limit", type=slot_limit, default=None,
                   help="agentloop's modes: " + SLOT_LIMIT_HELP + " (the bare client is not limited)")
    w.add_argument("--slot-order", choices=SLOT_ORDERS, default="fifo",
                   help="with --slot-limit: who gets a freed slot (scheduler.slot_order)")
    args = p.parse_args(argv)
    if args.gpu_scale:  # the workload as defaults: flags given on the command line still win
        p.set_defaults(turns=4, prompt_tokens=256, gen_median=64.0, gen_sigma=1.0, gen_max=1024, tool_result_median=32.0,
                       batch_groups=64, group_size=4, active=[768, 1536], tool_latency_means=[2.0, 0.5])
        args = p.parse_args(argv)
    if args.smoke:
        args.batch_groups, args.group_size, args.steps, args.active, args.turns = 2, 2, 3, [6], 2
        args.tool_latency_means, args.gen_median, args.gen_max, args.prompt_tokens = [0.01], 3, 8, 8
        args.tool_result_median = 3
    if args.batch_groups < 1 or args.group_size < 1 or args.steps < 1 or min(args.active) < 1:
        raise SystemExit("--batch-groups, --group-size, --steps and --active must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    return run_benchmark("continuous", argv, parse_args, {
        "trained_tokens_per_s": "sampled tokens of the groups handed to the trainer / wall seconds of the run (per_step "
                                "and over_admission: every wake-up and sleep included; streaming: the first wake-up "
                                "and every in-flight update included, up to the last batch; bare_refill: one wake-up, "
                                "up to the last complete group of the last step)",
        "engine_has_work_fraction": "fraction of 20 ms samples with >= 1 generate request in flight (the gate's count)",
        "mean_requests_in_flight": "mean of the same samples",
        "engine_cpu_busy_fraction": "CPU engine process CPU seconds per wall second",
        "gpu_utilization_mean": "nvidia-smi utilization.gpu, mean of 100 ms samples",
        "staleness_histogram": "versions between the weights that sampled a trained token and the step's weights -> "
                               "tokens (per_step: all 0)",
        "stage_seconds": "seconds spent in wake-ups and sleeps (per_step, over_admission), in the first wake-up and "
                         "the in-flight updates (streaming), in the wake-up (bare_refill)",
        "prefill_per_trained_token": "context tokens the engine computed (each turn's prompt + response so far minus "
                                     "its cached_tokens) per trained token, over the trained groups: re-prefill after "
                                     "a flush (a wake-up, an in-flight update) shows here",
        "stop_tail_s": "over_admission: rollout seconds after the last returned trajectory (aborting and carrying the rest)",
        "in_flight": "trajectories in flight: per_step = the batch; the others = active",
        "ratios": "per tool latency: X@active_over_per_step and streaming_over_bare_refill@active, one run each, same "
                  "process and engine",
    }, measure, plot, checkpoints=True, plot_checkpoints=True)


if __name__ == "__main__":
    sys.exit(main())
