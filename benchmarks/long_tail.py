"""Long tails: step time to get G complete GRPO groups with over-sampling + abort (partial rollout) vs
waiting for every trajectory.

Each group has n members with their own heavy-tailed multi-turn `replay` workload (a lognormal
per-trajectory length factor with a large sigma: a few trajectories are many times longer than the
median), drawn from one seeded stream of groups that both ways consume in order. `--steps` steps of
each way, interleaved (wait_all step k and oversample step k, alternating which goes first, so the
machine's background load hits both alike), each a full `Runtime.step` (staged wake-up with new
weights → rollout → sleep):

- **wait_all**: G fresh groups per step; the step ends when every trajectory has finished;
- **oversample**: ceil(G x factor) groups per step — the previous step's carry-over (aborted members
  and the finished members of their groups, resumed where they stopped: partial rollout) topped up
  with fresh groups — with `target_groups=G`: once G groups are complete the rest are aborted
  (counted in the step's sleep) and carried over to the next step.
- **oversample_oldest_first** (with `--ways`): the same over-sampling with `slot_order="oldest_first"`:
  with a per-server request limit (`--slot-limit`, the runtime's `per_server_concurrency`), a freed
  request slot goes to the trajectory that started first — the carried groups, then the fresh ones in
  order — so the surplus only takes slots the older groups leave free instead of slowing every group
  alike. `--slot-limit` applies to every way (wait_all's step at or below it is not limited by it).
- **oversample_target_first** (with `--ways`): the same over-sampling with `slot_order="target_first"`
  and the per-server limit: a freed slot goes to the groups that will meet the target (fewest members
  left, then the oldest), and a target group's turn that finds every slot taken preempts a surplus
  request (aborted, its turn continued in place later); `oversample_target_first_no_preempt`: the same
  order without preemption.
- **oversample_priority** (with `--ways`): the same over-sampling with `server_priority="oldest_first"`:
  every request carries SGLang's `priority` (older trajectories higher), so a server launched with
  `--enable-priority-scheduling --max-running-requests N` runs the oldest trajectories' turns first and
  preempts younger running requests for them (the ordering done inside the server; on the CPU engine:
  `agentloop serve --enable-priority-scheduling`). A server without priority scheduling ignores it.

Both return exactly G complete groups per step (checked). Reported: per-step seconds (whole step and
rollout phase), the reduction of the mean step time, tokens of the returned trajectories per second,
how many trajectories were carried over, and how many returned trajectories mix weight versions (the
price of partial rollout).

    python benchmarks/long_tail.py                     # CPU engine, about two minutes
    python benchmarks/long_tail.py --engine sglang --engine-url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    SLOT_LIMIT_HELP,
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

from agentloop.engine.lifecycle import Weights  # noqa: E402
from agentloop.runtime import Runtime  # noqa: E402
from agentloop.types import Sample  # noqa: E402


WAYS = ("wait_all", "oversample", "oversample_oldest_first", "oversample_target_first",
        "oversample_target_first_no_preempt", "oversample_priority")


def group_stream(spec: WorkloadSpec, n: int, tag: str, cap: float = math.inf) -> Iterator[list[Sample]]:
    """Groups of `n` members, each member its own replay workload (lengths differ inside a group, as
    sampled answers do). Members are given with their `group_id`, so the scheduler runs each once."""
    work = make_workload(spec)
    for turns in work:  # --tool-latency-cap (the issue-27 workload: exponential tools capped at 3 s)
        for t in turns:
            t["tool_latency_s"] = min(t["tool_latency_s"], cap)
    for g in range(len(work) // n):
        gid = f"{tag}-g{g}"
        yield [Sample(uid=f"{gid}_{i}", messages=[], agent="replay", group_id=gid, index_in_group=i,
                      extra={"replay": {"prompt_tokens": spec.prompt_tokens, "turns": work[g * n + i]}})
               for i in range(n)]


async def run_mode(rt: Runtime, mode: str, args: argparse.Namespace, spec: WorkloadSpec,
                   weights_sd: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """One way's steps, one per `__anext__` (the caller interleaves the two ways step by step, so a change
    in the machine's background load hits both alike)."""
    stream = group_stream(spec, args.group_size, mode, args.tool_latency_cap)
    per_step = args.target_groups if mode == "wait_all" else math.ceil(args.target_groups * args.oversample)
    over: dict[str, Any] = {} if mode == "wait_all" else {"target_groups": args.target_groups, "partial_rollout": True}
    if mode == "oversample_oldest_first":
        over["slot_order"] = "oldest_first"
    if mode.startswith("oversample_target_first"):
        over["slot_order"] = "target_first"
        over["slot_preemption"] = not mode.endswith("_no_preempt")
    if mode == "oversample_priority":
        over["server_priority"] = "oldest_first"
    carry: list[Sample] = []
    steps = []
    for k in range(args.steps):
        carried_groups = len({s.group_id for s in carry})
        fresh = [m for _ in range(per_step - carried_groups) for m in next(stream)]
        samples = carry + fresh
        emitted: list[float] = []
        t_call = time.monotonic()
        res = await rt.step(samples, Weights(state_dict=weights_sd, version=f"{mode}-v{k}"),
                            on_trajectory=lambda t: emitted.append(time.monotonic()), **over)
        m = res.metrics
        groups: dict[str, list[Any]] = {}
        for t in res.trajectories:
            groups.setdefault(t.group_id, []).append(t)
        complete = [g for g, ts in groups.items()
                    if len(ts) == args.group_size and all(t.status in ("completed", "truncated") for t in ts)]
        failed = [t for t in res.trajectories if t.status == "failed"]
        if failed:
            raise RuntimeError(f"{mode} step {k}: {len(failed)} failed trajectories, e.g. {failed[0].uid}: {failed[0].error}")
        if len(complete) != args.target_groups or len(groups) != args.target_groups:
            raise RuntimeError(f"{mode} step {k}: {len(complete)} complete groups of {len(groups)} returned, "
                               f"wanted {args.target_groups}")
        tokens = sum(sum(t.response_mask) for t in res.trajectories)
        # When the last returned trajectory was handed over, from the start of the rollout phase: the rest of
        # that phase is the early stop (aborting the others and waiting for them to return).
        to_target = max(emitted) - (t_call + m["wake_up_seconds"]) if emitted else float("nan")
        steps.append({
            "step": k, "samples_in": len(samples), "groups_in": carried_groups + len(fresh) // args.group_size,
            "carried_in": len(carry), "step_s": r4(m["step_seconds"]), "rollout_s": r4(m["rollout_seconds"]),
            "wake_up_s": r4(m["wake_up_seconds"]), "sleep_s": r4(m["sleep_seconds"]),
            "last_returned_done_s": r4(to_target), "stop_tail_s": r4(m["rollout_seconds"] - to_target),
            "complete_groups": len(complete), "trajectories_returned": len(res.trajectories),
            "carried_out": len(res.carry_over), "returned_sampled_tokens": int(tokens),
            "returned_tokens_per_s": r4(tokens / m["step_seconds"]),
            "returned_mixing_weight_versions": sum(len(set(t.weight_versions)) > 1 for t in res.trajectories),
            "resumed_trajectories_returned": sum(t.metrics.get("resumed", 0) > 0 for t in res.trajectories),
            "slot_preemptions": int(m.get("slot_preemptions", 0)),
            "misaligned_answers": int(m.get("misaligned_answers", 0)),
        })
        print(f"{mode:10s} step {k}: {steps[-1]['step_s']:7.3f}s  ({len(samples)} trajectories in, "
              f"{len(res.trajectories)} returned, {len(res.carry_over)} carried over)", flush=True)
        carry = list(res.carry_over)
        yield steps[-1]


async def measure(args: argparse.Namespace, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Both ways; `save(out)` after each, so a run cut short still leaves its results."""
    out: dict[str, Any] = {}
    spec = workload_spec(args, trajectories=10_000 // args.group_size * args.group_size,
                         tool_latency_mean=args.tool_latency_mean, tool_latency_dist=args.tool_latency_dist)
    first = make_workload(WorkloadSpec(**{**spec.as_dict(), "trajectories": args.target_groups * args.group_size}))
    out["workload"] = {"spec": {**spec.as_dict(), "trajectories": "stream"},
                       "first_step_wait_all": workload_stats(first)}
    total = math.ceil(args.target_groups * args.oversample) * args.group_size
    async with open_engine(args, max_running=max(256, total)) as engine:
        out["engine"] = engine.description
        weights_sd = trainer_weights(engine)
        cfg = runtime_config(engine, args, concurrency=total, n=1, per_server_concurrency=args.slot_limit)
        async with Runtime(cfg) as rt, left_awake(rt, lambda: Weights(state_dict=weights_sd, version="final")):
            out["concurrency"] = rt.concurrency.as_dict() if rt.concurrency else None
            await rt.step([m for g in group_stream(warm_up_spec(), 2, "warm") for m in g],
                          Weights(state_dict=weights_sd, version="v0"))
            modes: dict[str, list[dict[str, Any]]] = {}
            out["steps"] = modes
            ways = {mode: run_mode(rt, mode, args, spec, weights_sd) for mode in args.ways}
            for k in range(args.steps):
                # The order rotates step by step, so a change in the machine's background load hits every way alike.
                for mode in args.ways[k % len(args.ways):] + args.ways[:k % len(args.ways)]:
                    modes.setdefault(mode, []).append(await ways[mode].__anext__())
                save(out)
            for way in ways.values():
                await way.aclose()
    summary: dict[str, Any] = {}
    for mode, steps in modes.items():
        summary[mode] = {
            "mean_step_s": r4(sum(s["step_s"] for s in steps) / len(steps)),
            "mean_rollout_s": r4(sum(s["rollout_s"] for s in steps) / len(steps)),
            "mean_sleep_s": r4(sum(s["sleep_s"] for s in steps) / len(steps)),
            "returned_tokens_per_s": r4(sum(s["returned_sampled_tokens"] for s in steps) / sum(s["step_s"] for s in steps)),
            "trajectories_mixing_versions": sum(s["returned_mixing_weight_versions"] for s in steps),
            "mean_stop_tail_s": r4(sum(s["stop_tail_s"] for s in steps) / len(steps)),
        }
    base = summary["wait_all"]
    for mode in args.ways[1:]:
        # `oversample`'s figures keep their names from before the third way; the others get the way's prefix.
        pre = "" if mode == "oversample" else f"{mode}_"
        summary[f"{pre}step_time_reduction"] = r4(1 - summary[mode]["mean_step_s"] / base["mean_step_s"])
        summary[f"{pre}first_step_time_reduction"] = r4(1 - modes[mode][0]["step_s"] / modes["wait_all"][0]["step_s"])
        summary[f"{pre}steady_state_step_time_reduction"] = \
            r4(1 - _mean_after_first(modes[mode]) / _mean_after_first(modes["wait_all"])) if args.steps > 1 else None
        summary[mode]["returned_tokens_per_s_over_wait_all"] = \
            r4(summary[mode]["returned_tokens_per_s"] / base["returned_tokens_per_s"])
        summary[mode]["after_first_step_returned_tokens_per_s_over_wait_all"] = \
            r4(_rate_after_first(modes[mode]) / _rate_after_first(modes["wait_all"])) if args.steps > 1 else None
        print(f"mean step: wait_all {base['mean_step_s']:.3f}s  {mode} {summary[mode]['mean_step_s']:.3f}s  "
              f"reduction {100 * summary[f'{pre}step_time_reduction']:.1f}%; returned tokens/s "
              f"{summary[mode]['returned_tokens_per_s_over_wait_all']:.2f}x wait_all's"
              + (f" ({summary[mode]['after_first_step_returned_tokens_per_s_over_wait_all']:.2f}x after the first step)"
                 if args.steps > 1 else ""), flush=True)
    out["summary"] = summary
    return out


def _rate_after_first(steps: list[dict[str, Any]]) -> float:
    """Returned tokens/s over the steps after the first (the cold step, with nothing carried, left out)."""
    rest = steps[1:]
    return sum(s["returned_sampled_tokens"] for s in rest) / sum(s["step_s"] for s in rest)


def _mean_after_first(steps: list[dict[str, Any]]) -> float:
    rest = steps[1:]
    return sum(s["step_s"] for s in rest) / len(rest)


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.8, 4.2))
    over = f"over-sample x{report['settings']['oversample']:g} + abort"
    labels = {"wait_all": "wait for every trajectory", "oversample": over,
              "oversample_oldest_first": f"{over}, oldest first",
              "oversample_target_first": f"{over}, target first + preemption",
              "oversample_target_first_no_preempt": f"{over}, target first",
              "oversample_priority": f"{over}, server priority"}
    ways = [m for m in labels if m in report["steps"]]
    width = 0.8 / len(ways)
    for j, mode in enumerate(ways):
        label = labels[mode]
        steps = report["steps"][mode]
        xs = [s["step"] + (j - (len(ways) - 1) / 2) * width for s in steps]
        roll = [s["rollout_s"] - max(0.0, s["stop_tail_s"]) for s in steps]
        tail = [max(0.0, s["stop_tail_s"]) for s in steps]
        rest = [s["step_s"] - s["rollout_s"] for s in steps]
        bars = ax.bar(xs, roll, width, label=f"{label}: rollout to the last returned trajectory")
        color = bars.patches[0].get_facecolor()
        if any(t > 0.001 for t in tail):
            ax.bar(xs, tail, width, bottom=roll, color=color, alpha=0.45, hatch="//",
                   label=f"{label}: early stop (abort, wait for the rest)")
        ax.bar(xs, rest, width, bottom=[a + b for a, b in zip(roll, tail)], color="gray", alpha=0.5,
               label="wake-up + sleep" if j == len(ways) - 1 else None)
    s = report["summary"]
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_xticks(range(report["settings"]["steps"]))
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    st = report["settings"]
    means = " / ".join(f"{s[m]['mean_step_s']:.2f}s" for m in ways[1:])
    ratios = " / ".join(f"{s[m].get('returned_tokens_per_s_over_wait_all', float('nan')):.2f}x" for m in ways[1:])
    ax.set_title(f"Time to {st['target_groups']} complete groups of {st['group_size']}: mean step "
                 f"{s['wait_all']['mean_step_s']:.2f}s -> {means} (returned tok/s {ratios} wait-all's)"
                 f"\n{title_suffix(report)}", fontsize=8)
    save_figure(fig, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = benchmark_parser(__doc__)
    w = p.add_argument_group("workload")
    w.add_argument("--target-groups", type=int, default=8)
    w.add_argument("--group-size", type=int, default=4)
    w.add_argument("--oversample", type=float, default=1.5, help="groups in flight per step = ceil(target x this)")
    w.add_argument("--steps", type=int, default=6)
    add_turn_args(w, turns=2, prompt_tokens=32, gen_median=16.0, gen_sigma=0.4, traj_sigma=1.5, gen_max=512)
    w.add_argument("--tool-latency-mean", type=float, default=0.02)
    w.add_argument("--tool-latency-dist", choices=["lognormal", "exponential", "constant"], default="lognormal")
    w.add_argument("--tool-latency-cap", type=float, default=float("inf"), help="tool latency cap, seconds")
    w.add_argument("--tool-result-median", type=float, default=8.0)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--ways", nargs="+", choices=WAYS, default=["wait_all", "oversample"],
                   help="ways to compare, side by side (wait_all first: the others' ratios are to it)")
    w.add_argument("--slot-limit", type=slot_limit, default=None, help=SLOT_LIMIT_HELP)
    args = p.parse_args(argv)
    if args.ways[0] != "wait_all" or len(set(args.ways)) != len(args.ways):
        p.error("--ways: wait_all first, each way once")
    if args.smoke:
        args.target_groups, args.group_size, args.oversample, args.steps = 2, 2, 2.0, 2
        args.gen_median, args.gen_max, args.prompt_tokens, args.tool_latency_mean, args.tool_result_median = 3, 12, 8, 0.0, 2
    return args


def main(argv: list[str] | None = None) -> int:
    return run_benchmark("long_tail", argv, parse_args, {
        "step_s": "Runtime.step seconds: staged wake-up with new weights + rollout + sleep (which aborts stragglers)",
        "step_time_reduction": "1 - mean oversample step seconds / mean wait_all step seconds",
        "steady_state_step_time_reduction": "the same over steps after the first (carry-over in play)",
        "after_first_step_returned_tokens_per_s_over_wait_all": "returned tokens/s over the steps after the first, "
                                                                 "over wait_all's over the same steps",
        "last_returned_done_s": "seconds from the rollout's start until the last returned trajectory was handed over "
                                "(on_trajectory); stop_tail_s = rollout seconds - that (the early stop's cost)",
    }, measure, plot, checkpoints=True)


if __name__ == "__main__":
    sys.exit(main())
