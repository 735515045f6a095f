"""Wake-up and sleep cost: agentloop's `Lifecycle` vs the raw engine calls it wraps, per stage, as ratios;
and peak memory during the weight update with staged vs one-stage wake-up.

Per repeat (the order of the two alternates), after a small batch of generations while awake:

- **agentloop**: `Lifecycle.sleep()` (pause(abort) → settle → continue → flush_cache → release all
  tags) then `Lifecycle.wake_up(weights)` (resume weights → update weights from tensor → resume
  kv_cache + cuda_graph), stage times from the lifecycle's own records and wall time around each call;
- **raw**: the same `SGLangClient` calls in the same order, timed one by one, with no lifecycle.

Medians over `--repeats`; ratios agentloop/raw per stage and for the whole wake-up and sleep. The
weights are a full state dict of the served model (the CPU engine's own random weights over
safetensors; on a GPU, bf16 tensors of the served config's shapes over CUDA IPC), sent as a trainer
would.

Memory (where readable): with a staged and with a one-stage `Lifecycle`, memory in use is polled every
millisecond during the weight update (GPU: device-wide `torch.cuda.mem_get_info`, so the server's
allocations count; CPU engine: its process RSS) and read after every stage. On SGLang the staged
wake-up loads weights while the KV pool is still released, so its peak should sit below the one-stage
peak by about the KV pool (measured as the memory the kv_cache/cuda_graph resume adds). The CPU engine
allocates its KV cache per request (no pool), so there the two are expected to match.

    python benchmarks/lifecycle.py                     # CPU engine, about a minute
    python benchmarks/lifecycle.py --engine sglang --engine-url http://127.0.0.1:30000
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
    Engine,
    PeakSampler,
    benchmark_parser,
    filler_ids,
    median,
    memory_reader,
    open_engine,
    pyplot,
    r4,
    run_benchmark,
    save_figure,
    title_suffix,
    trainer_weights,
    weights_bytes,
)

from agentloop.engine.base import MEMORY_TAGS, SamplingParams  # noqa: E402
from agentloop.engine.lifecycle import Lifecycle, Weights  # noqa: E402
from agentloop.engine.sglang import SGLangClient  # noqa: E402

WAKE = ("resume_weights", "update_weights", "resume_kv_cache")
SLEEP = ("pause", "settle", "continue", "flush_cache", "release")
KV_TAGS = [t for t in MEMORY_TAGS if t != "weights"]


async def generate_batch(lc: Lifecycle, url: str, n: int, tokens: int, salt: int) -> None:
    """A few generations through the gate: the engine has work (and a cache) before it sleeps, and
    proves it serves after every wake-up."""
    params = SamplingParams(max_new_tokens=tokens, temperature=1.0, ignore_eos=True)

    async def one(i: int) -> None:
        out = await lc.generate(url, filler_ids(32, salt=salt * 100 + i), params, timeout=300)
        if len(out.output_ids) != tokens:
            raise RuntimeError(f"generate after wake-up returned {len(out.output_ids)} of {tokens} tokens: {out.finish_reason}")

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)


async def agentloop_cycle(lc: Lifecycle, sd: dict[str, Any], version: str) -> dict[str, dict[str, float]]:
    first = len(lc.records)
    t0 = time.perf_counter()
    await lc.sleep()
    t1 = time.perf_counter()
    await lc.wake_up(Weights(state_dict=sd, version=version))
    t2 = time.perf_counter()
    out: dict[str, dict[str, float]] = {"sleep": {"total": t1 - t0}, "wake_up": {"total": t2 - t1}}
    for r in lc.records[first:]:
        out[r.phase][r.stage] = out[r.phase].get(r.stage, 0.0) + r.seconds
    return out


async def raw_cycle(client: SGLangClient, sd: dict[str, Any], version: str) -> dict[str, dict[str, float]]:
    sleep: dict[str, float] = {}
    wake: dict[str, float] = {}

    async def timed(d: dict[str, float], stage: str, fn: Callable[[], Any]) -> Any:
        a = time.perf_counter()
        r = await fn()
        d[stage] = d.get(stage, 0.0) + time.perf_counter() - a
        return r

    async def flush() -> None:
        for _ in range(50):  # the lifecycle's own retry policy: 400 while requests are running
            if await client.flush_cache():
                return
            await anyio.sleep(0.05)
        raise RuntimeError("flush_cache: engine still busy after 50 tries")

    t0 = time.perf_counter()
    await timed(sleep, "pause", lambda: client.pause_generation("abort"))
    await timed(sleep, "continue", client.continue_generation)
    await timed(sleep, "flush_cache", flush)
    await timed(sleep, "release", lambda: client.release_memory_occupation(list(MEMORY_TAGS)))
    t1 = time.perf_counter()
    await timed(wake, "resume_weights", lambda: client.resume_memory_occupation(["weights"]))
    await timed(wake, "update_weights", lambda: client.update_weights_from_tensor(
        list(sd.items()), weight_version=version, flush_cache=True))
    await timed(wake, "resume_kv_cache", lambda: client.resume_memory_occupation(KV_TAGS))
    t2 = time.perf_counter()
    sleep["total"], wake["total"] = t1 - t0, t2 - t1
    return {"sleep": sleep, "wake_up": wake}


class ProbeClient:
    """Delegates to an `SGLangClient`; polls memory during each weight update and reads it after every
    memory/weight call (the lifecycle sees an ordinary client)."""

    CALLS = ("release_memory_occupation", "resume_memory_occupation", "update_weights_from_tensor")

    def __init__(self, inner: SGLangClient, read: Callable[[], int | None]) -> None:
        self.inner = inner
        self.url = inner.url
        self.read = read
        self.events: list[dict[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in self.CALLS:
            return attr

        async def call(*args: Any, **kwargs: Any) -> Any:
            before = self.read()
            sampler = PeakSampler(self.read) if name == "update_weights_from_tensor" else None
            if sampler is not None:
                sampler.start()
            try:
                return await attr(*args, **kwargs)
            finally:
                peak = sampler.stop() if sampler is not None else None
                tags = args[0] if args and name != "update_weights_from_tensor" else None
                self.events.append({"call": name, "tags": tags, "before": before, "after": self.read(), "peak": peak})

        return call


async def memory_cycle(client: SGLangClient, read: Callable[[], int | None], staged: bool, sd: dict[str, Any],
                       version: str) -> dict[str, Any]:
    probe = ProbeClient(client, read)
    lc = Lifecycle([probe], awake=True, staged=staged)  # type: ignore[list-item]
    awake_before = read()
    await lc.sleep()
    asleep = read()
    await lc.wake_up(Weights(state_dict=sd, version=version))
    awake_after = read()
    await generate_batch(lc, client.url, 2, 4, salt=9)
    lc.close()  # gives up its owner lease, so the next cycle's lifecycle may drive the server
    upd = next(e for e in probe.events if e["call"] == "update_weights_from_tensor")
    out: dict[str, Any] = {"mode": "staged" if staged else "one_stage", "awake_before": awake_before, "asleep": asleep,
                           "before_update": upd["before"], "peak_during_update": upd["peak"], "after_update": upd["after"],
                           "awake_after": awake_after, "calls": probe.events}
    if staged:
        kv = next(e for e in probe.events if e["call"] == "resume_memory_occupation" and e["tags"] == KV_TAGS)
        out["kv_pool_bytes"] = (kv["after"] or 0) - (kv["before"] or 0)
    return out


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with open_engine(args) as engine:
        out["engine"] = engine.description
        sd = trainer_weights(engine)
        async with SGLangClient(engine.url, timeout=600) as client:
            # The client picks the transport the same way: the CPU engine announces safetensors.
            transport = (await client.server_info()).get("tensor_transport") or "cuda_ipc (sglang MultiprocessingSerializer)"
            out["weights"] = {"tensors": len(sd), "bytes": weights_bytes(sd), "mib": r4(weights_bytes(sd) / 2**20),
                              "transport": transport, "dtype": str(next(iter(sd.values())).dtype)}
            async def one(way: str, salt: int, version: str) -> dict[str, dict[str, float]]:
                # A lifecycle's marks carry its owner lease; the raw calls rewrite the weight version as a
                # second client would, so each cycle gets a fresh lifecycle (found awake) that gives the
                # server up (`close`) before the raw calls run.
                lc = Lifecycle([client], awake=True, staged=True)
                try:
                    await generate_batch(lc, engine.url, args.requests, args.tokens, salt=salt)
                    if way == "agentloop":
                        return await agentloop_cycle(lc, sd, version)
                finally:
                    lc.close()
                return await raw_cycle(client, sd, version)

            await one("agentloop", 0, "warm-a")  # warm-up of the engine and the client
            await one("raw", 0, "warm-r")
            cycles: dict[str, list[dict[str, dict[str, float]]]] = {"agentloop": [], "raw": []}
            for rep in range(args.repeats):
                for way in (("agentloop", "raw") if rep % 2 == 0 else ("raw", "agentloop")):
                    cycles[way].append(await one(way, rep, f"{way[0]}{rep}"))
            lc = Lifecycle([client], awake=True, staged=True)
            await generate_batch(lc, engine.url, args.requests, args.tokens, salt=999)  # serves after the last wake
            lc.close()
            out["timing"] = summarize_timing(cycles)
            out["cycles"] = cycles
            mem = memory_reader(engine)
            if mem is None:
                out["memory"] = {"note": "memory not readable for this engine from here"}
            else:
                what, read = mem
                runs = []
                for rep in range(args.memory_repeats):
                    for staged in (True, False):
                        runs.append(await memory_cycle(client, read, staged, sd, f"m{rep}{int(staged)}"))
                out["memory"] = summarize_memory(what, runs, engine)
            for phase in ("wake_up", "sleep"):
                t = out["timing"][phase]["total"]
                print(f"{phase:8s}: agentloop {1000 * t['agentloop_s']:8.2f} ms  raw {1000 * t['raw_s']:8.2f} ms  "
                      f"ratio {t['ratio']:.3f}", flush=True)
            m = out["memory"]
            if "staged_peak_gib" in m:
                print(f"peak during weight update: staged {m['staged_peak_gib']:.3f} GiB, one-stage {m['one_stage_peak_gib']:.3f} GiB"
                      f" (difference {m['difference_gib']:.3f} GiB; KV pool {m['kv_pool_gib']:.3f} GiB)", flush=True)
    return out


def summarize_timing(cycles: dict[str, list[dict[str, dict[str, float]]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for phase, stages in (("wake_up", WAKE), ("sleep", SLEEP)):
        rows: dict[str, Any] = {}
        for stage in (*stages, "total"):
            a = [c[phase].get(stage, 0.0) for c in cycles["agentloop"]]
            r = [c[phase].get(stage, 0.0) for c in cycles["raw"]]
            ma, mr = median(a), median(r)
            rows[stage] = {"agentloop_s": round(ma, 7), "raw_s": round(mr, 7),
                           "ratio": r4(ma / mr) if mr > 0 else None,
                           "overhead_ms": round(1000 * (ma - mr), 3)}
        rows["_stage_note"] = ("'settle' (wait for aborted requests to return) has no raw call; the raw sequence "
                               "has nothing to wait for" if phase == "sleep" else "")
        out[phase] = rows
    return out


def summarize_memory(what: str, runs: list[dict[str, Any]], engine: Engine) -> dict[str, Any]:
    gib = 2**30
    st = [r for r in runs if r["mode"] == "staged"]
    one = [r for r in runs if r["mode"] == "one_stage"]
    sp = median([r["peak_during_update"] for r in st])
    op = median([r["peak_during_update"] for r in one])
    kv = median([r["kv_pool_bytes"] for r in st])
    out = {
        "measure": what,
        "staged_peak_gib": r4(sp / gib), "one_stage_peak_gib": r4(op / gib),
        "difference_gib": r4((op - sp) / gib), "kv_pool_gib": r4(kv / gib),
        "difference_over_kv_pool": r4((op - sp) / kv) if kv > 0 else None,
        "asleep_gib": r4(median([r["asleep"] for r in runs]) / gib),
        "awake_gib": r4(median([r["awake_after"] for r in runs]) / gib),
        "runs": runs,
    }
    if engine.kind == "cpu":
        out["note"] = ("the CPU engine allocates KV per request (no preallocated pool): staged and one-stage are "
                       "expected to match; the staging's memory benefit shows on SGLang")
    return out


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    mem = report.get("memory", {})
    has_mem = "staged_peak_gib" in mem
    fig, axes = plt.subplots(1, 3 if has_mem else 2, figsize=(15 if has_mem else 10, 4.2), squeeze=False)
    for ax, phase, stages in ((axes[0][0], "wake_up", WAKE), (axes[0][1], "sleep", SLEEP)):
        t = report["timing"][phase]
        names = [*stages, "total"]
        xs = range(len(names))
        a = [1000 * t[s]["agentloop_s"] for s in names]
        r = [1000 * t[s]["raw_s"] for s in names]
        ax.bar([x - 0.2 for x in xs], a, 0.4, label="agentloop Lifecycle")
        ax.bar([x + 0.2 for x in xs], r, 0.4, label="raw client calls")
        for x, s in zip(xs, names):
            if t[s]["ratio"] is not None:
                ax.annotate(f"{t[s]['ratio']:.2f}x", (x, max(a[x], r[x])), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(xs), names, rotation=20, fontsize=8)
        ax.set_ylabel("median ms")
        ax.set_title(f"{phase} (median of {report['settings']['repeats']})", fontsize=9)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    if has_mem:
        ax = axes[0][2]
        vals = [mem["staged_peak_gib"], mem["one_stage_peak_gib"]]
        ax.bar(["staged", "one-stage"], vals, color=["tab:green", "tab:red"])
        ax.axhline(mem["staged_peak_gib"] + mem["kv_pool_gib"], ls="--", color="gray",
                   label=f"staged + KV pool ({mem['kv_pool_gib']:.2f} GiB)")
        ax.set_ylabel("GiB in use, peak during weight update")
        ax.set_title(mem["measure"].split(" (")[0], fontsize=9)
        ax.legend(fontsize=8)
    w = report["weights"]
    fig.suptitle(f"Lifecycle cost: agentloop vs raw engine calls; weight update {w['mib']:.1f} MiB in {w['tensors']} tensors\n"
                 f"{title_suffix(report)}", fontsize=9)
    save_figure(fig, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = benchmark_parser(__doc__)
    p.add_argument("--repeats", type=int, default=10, help="cycles of each way (medians are reported)")
    p.add_argument("--memory-repeats", type=int, default=2, help="staged and one-stage cycles with memory polling")
    p.add_argument("--requests", type=int, default=8, help="generations before each sleep")
    p.add_argument("--tokens", type=int, default=16, help="tokens of each of those generations")
    # CPU engine: a model of a few tens of MiB, so the weight update is not only fixed per-call costs.
    p.set_defaults(hidden_size=512, num_layers=4)
    args = p.parse_args(argv)
    if args.smoke:
        args.repeats, args.memory_repeats, args.requests, args.tokens = 2, 1, 2, 2
        args.hidden_size, args.num_layers = 64, 2
    return args


def main(argv: list[str] | None = None) -> int:
    return run_benchmark("lifecycle", argv, parse_args, {
        "agentloop": "Lifecycle.sleep() / Lifecycle.wake_up(weights) (staged), stage seconds from Lifecycle.records",
        "raw": "the same SGLangClient calls in the same order, no lifecycle",
        "ratio": "median agentloop seconds / median raw seconds",
        "peak_during_update": "memory in use polled every ms during update_weights_from_tensor",
        "kv_pool": "memory added by resuming kv_cache + cuda_graph in the staged wake-up",
    }, measure, plot)


if __name__ == "__main__":
    sys.exit(main())
