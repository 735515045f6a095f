"""Weight-update cost: a full state dict pushed to a running server, one request vs buckets, GB/s.

The weights are the served model's full HF state dict as a trainer holds it (`trainer_weights`: on a
GPU, bf16 tensors of the served config's shapes; tied weights once). Ways of sending them, each
`--repeats` times (medians reported), each timed end to end and split into client-side preparation
(serialising CUDA-IPC handles, flattening a bucket) and the HTTP round trip (the server deserialises
the handles, copies the values into its parameters with the model's `load_weights`, answers):

- **agentloop**: `SGLangClient.update_weights_from_tensor` (what `Lifecycle` runs at wake-up: one
  request with every tensor; on the CPU engine the safetensors transport);
- **one_request**: the same single request built here (SGLang's `MultiprocessingSerializer` of the
  named-tensor list), so the client's own overhead shows as the difference (SGLang only);
- **buckets_<MB>**: the tensors in groups of at most MB megabytes, one request per group (SGLang only);
- **flattened_<MB>**: SGLang's `load_format="flattened_bucket"`: each group concatenated into one
  uint8 tensor (one IPC handle per bucket instead of one per tensor) plus its metadata (SGLang only);
- **noop**: one request with the smallest tensor: the fixed cost of the path (HTTP, tokenizer manager,
  scheduler, one IPC open), which every request pays.

    python benchmarks/weight_update.py --engine sglang --engine-url http://127.0.0.1:30000 --out DIR
    python benchmarks/weight_update.py --smoke          # CPU engine (agentloop + noop only)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable


sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    benchmark_parser,
    median,
    open_engine,
    pyplot,
    r4,
    run_benchmark,
    save_figure,
    title_suffix,
    trainer_weights,
    weights_bytes,
)

from agentloop.engine.sglang import SGLangClient  # noqa: E402


def buckets(named: list[tuple[str, Any]], max_bytes: int) -> list[list[tuple[str, Any]]]:
    """Consecutive groups of tensors of at most `max_bytes` each (a bigger tensor is a group alone)."""
    out: list[list[tuple[str, Any]]] = [[]]
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if out[-1] and size + n > max_bytes:
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += n
    return out


def _sglang_payload(group: list[tuple[str, Any]], flattened: bool) -> tuple[list[str], Any]:
    """SGLang's own request payload for one group (one TP rank); also what must stay alive until it answers."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()
    if not flattened:
        return [MultiprocessingSerializer.serialize(group, output_str=True)], group
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    bucket = FlattenedTensorBucket(named_tensors=group)
    data = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
    return [MultiprocessingSerializer.serialize(data, output_str=True)], data


async def send_raw(client: SGLangClient, groups: list[list[tuple[str, Any]]], *, flattened: bool) -> dict[str, float]:
    """One request per group, in order; seconds preparing payloads and seconds in HTTP round trips."""
    import torch

    prep = http = 0.0
    for g in groups:
        t0 = time.perf_counter()
        payload, keep = _sglang_payload(g, flattened)
        torch.cuda.synchronize()  # a flattened bucket is a device-side copy: count it where it happens
        t1 = time.perf_counter()
        await client._success_call("/update_weights_from_tensor", {  # noqa: SLF001 - the raw endpoint on purpose
            "serialized_named_tensors": payload, "load_format": "flattened_bucket" if flattened else None,
            "flush_cache": True, "abort_all_requests": False})
        http += time.perf_counter() - t1
        prep += t1 - t0
        del keep
    return {"prepare_s": prep, "http_s": http}


async def measure(args: argparse.Namespace, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    out: dict[str, Any] = {"methods": {}}
    async with open_engine(args) as engine:
        out["engine"] = engine.description
        sd = trainer_weights(engine)
        named = list(sd.items())
        total = weights_bytes(sd)
        out["weights"] = {"tensors": len(named), "bytes": total, "dtype": str(named[0][1].dtype),
                          "device": str(named[0][1].device)}
        print(f"{len(named)} tensors, {total / 1e9:.3f} GB ({named[0][1].dtype} on {named[0][1].device})", flush=True)
        smallest = min(named, key=lambda kv: kv[1].numel())
        methods: list[tuple[str, Callable[[], Any], int]] = []  # (name, send once, requests per update)
        async with SGLangClient(engine.url, timeout=600) as client:
            # the raw ways build SGLang's own CUDA-IPC payloads: only against a server that takes them
            sglang = await client.served.resolve_tensor_transport() == "cuda_ipc"
            methods.append(("agentloop", lambda: client.update_weights_from_tensor(named, flush_cache=True), 1))
            if sglang:
                methods.append(("one_request", lambda: send_raw(client, [named], flattened=False), 1))
                for mb in args.bucket_mb:
                    groups = buckets(named, mb * 2**20)
                    methods.append((f"buckets_{mb}", lambda g=groups: send_raw(client, g, flattened=False), len(groups)))
                    methods.append((f"flattened_{mb}", lambda g=groups: send_raw(client, g, flattened=True), len(groups)))
                methods.append(("noop", lambda: send_raw(client, [[smallest]], flattened=False), 1))
            else:
                methods.append(("noop", lambda: client.update_weights_from_tensor([smallest], flush_cache=True), 1))
            for name, fn, requests in methods:
                runs = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    parts = await fn()
                    wall = time.perf_counter() - t0
                    runs.append({"seconds": wall, **(parts if isinstance(parts, dict) and "http_s" in parts else {})})
                sent = smallest[1].numel() * smallest[1].element_size() if name == "noop" else total
                secs = median([r["seconds"] for r in runs])
                m = {"seconds": r4(secs), "seconds_all": [r4(r["seconds"]) for r in runs], "bytes": sent,
                     "gb_per_s": r4(sent / secs / 1e9), "requests": requests}
                for k in ("prepare_s", "http_s"):
                    if k in runs[0]:
                        m[k] = r4(median([r[k] for r in runs]))
                out["methods"][name] = m
                save(out)
                print(f"{name:16s} {m['seconds'] * 1e3:9.1f} ms  {m['gb_per_s']:8.2f} GB/s  requests {m['requests']}"
                      + (f"  prepare {m['prepare_s'] * 1e3:.1f} ms  http {m['http_s'] * 1e3:.1f} ms" if "http_s" in m else ""),
                      flush=True)
    return out


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    ms = {k: v for k, v in report["methods"].items() if k != "noop"}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(ms)), 4.2))
    names = list(ms)
    prep = [ms[n].get("prepare_s", 0.0) for n in names]
    rest = [ms[n]["seconds"] - p for n, p in zip(names, prep)]
    ax.bar(names, prep, label="client: prepare payload")
    ax.bar(names, rest, bottom=prep, label="HTTP round trip (server loads)")
    for i, n in enumerate(names):
        ax.annotate(f"{ms[n]['gb_per_s']:.1f} GB/s", (i, ms[n]["seconds"]), ha="center", va="bottom", fontsize=8)
    noop = report["methods"].get("noop")
    if noop:
        ax.axhline(noop["seconds"], ls="--", color="gray", lw=0.8, label=f"noop request {noop['seconds'] * 1e3:.1f} ms")
    w = report.get("weights", {})
    ax.set(ylabel="seconds per full update",
           title=f"Weight update, {w.get('tensors')} tensors, {w.get('bytes', 0) / 1e9:.2f} GB {w.get('dtype')}\n"
                 f"{title_suffix(report)}")
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = benchmark_parser(__doc__)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bucket-mb", type=int, nargs="+", default=[256, 1024], help="bucket sizes, megabytes")
    args = p.parse_args(argv)
    if args.smoke:
        args.repeats, args.bucket_mb = 1, [1]
    return args


def main(argv: list[str] | None = None) -> int:
    return run_benchmark("weight_update", argv, parse_args, {
        "seconds": "median wall seconds of one full update (all tensors), client-side preparation included",
        "gb_per_s": "bytes of the state dict / seconds",
        "prepare_s": "client: serialising the CUDA-IPC handles (and, flattened, the device-side concatenation)",
        "http_s": "the request(s) round trip: the server opens the handles and copies into its parameters",
        "noop": "one request carrying the smallest tensor: the fixed per-request cost",
    }, measure, plot, checkpoints=True)


if __name__ == "__main__":
    sys.exit(main())
