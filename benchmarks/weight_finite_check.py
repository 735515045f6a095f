"""What refusing NaN/Inf weights costs: `agentloop.engine.weight_payloads.check_finite`, in ms per GB.

Times the check on a model-shaped set of finite tensors (the case that matters: every update pays
it), for float32 and bfloat16, next to the plain element-wise scan (`torch.isfinite(t).all()` per
tensor) it replaces, and reports ms per GB of weights. `--device cuda` times it on a GPU (tensors
on the device, synchronised), so a GPU script can measure the cost where real updates run.
Writes benchmarks/results/weight_finite_check_<device>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_engine_batching import hardware, versions  # noqa: E402  (shared benchmark helpers)

from agentloop.engine.weight_payloads import check_finite  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--gb", type=float, default=1.0, help="weights per timed update, in GB (default 1.0)")
    p.add_argument("--tensor-mb", type=float, default=16.0, help="size of each tensor, in MB (default 16)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats; the median is reported (default 5)")
    p.add_argument("--out", type=Path, default=RESULTS, help="output folder (default benchmarks/results)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script runs")
    return p.parse_args(argv)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    fn()  # warm-up (allocator, kernels)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure(dtype: torch.dtype, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    elem = torch.tensor([], dtype=dtype).element_size()
    per_tensor = max(1, int(args.tensor_mb * 2**20 / elem))
    count = max(1, round(args.gb * 2**30 / (per_tensor * elem)))
    named = [(f"layers.{i}.weight", torch.randn(per_tensor, device=device).to(dtype)) for i in range(count)]
    gb = count * per_tensor * elem / 2**30
    check = _median_seconds(lambda: check_finite(named), device, args.repeats)
    scan = _median_seconds(lambda: [bool(torch.isfinite(t).all()) for _, t in named], device, args.repeats)
    return {"dtype": str(dtype).removeprefix("torch."), "tensors": count, "gb": round(gb, 4),
            "check_finite_s": round(check, 6), "check_finite_ms_per_gb": round(1000 * check / gb, 2),
            "isfinite_all_ms_per_gb": round(1000 * scan / gb, 2)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:
        args.gb, args.tensor_mb, args.repeats = 0.01, 1.0, 2
    device = torch.device(args.device)
    rows = [measure(dtype, args, device) for dtype in (torch.float32, torch.bfloat16)]
    report = {
        "benchmark": "weight_finite_check",
        "command": " ".join(["python", "benchmarks/weight_finite_check.py", *map(shlex.quote, sys.argv[1:] if argv is None else argv)]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "hardware": {**hardware(), "device": str(device),
                     "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
        "settings": {"gb": args.gb, "tensor_mb": args.tensor_mb, "repeats": args.repeats, "torch_threads": torch.get_num_threads()},
        "results": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"weight_finite_check_{device.type}{'_smoke' if args.smoke else ''}.json"
    (args.out / name).write_text(json.dumps(report, indent=1) + "\n")
    for r in rows:
        print(f"{r['dtype']:>9}: check_finite {r['check_finite_ms_per_gb']:8.1f} ms/GB   "
              f"isfinite().all() {r['isfinite_all_ms_per_gb']:8.1f} ms/GB   ({r['gb']:.2f} GB in {r['tensors']} tensors)")
    print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
