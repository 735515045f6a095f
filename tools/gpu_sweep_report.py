"""Merge the per-point results of `tools/gpu_sweep.sh` into one report, with SGLang's own log figures.

Each throughput point of the sweep is one `benchmarks/rollout_throughput.py` run (its own JSON). This
puts their points into one `rollout_throughput_sweep_<engine>.json` (the first point's header: command,
versions, hardware, definitions; every point's own command kept) and adds, per point, what the server
logged while that point ran (the byte window of its log that `gpu_sweep.sh` recorded): SGLang's
"Decode batch" lines (`gen throughput (token/s)`, `#running-req`, `token usage`, whether a CUDA graph
ran) and "Prefill batch" lines (new and cached prompt tokens) — the engine's view of the same load,
to set against the client's tokens/s and explain the ceiling. Plots: tokens/s per point (the
benchmark's own plot), and client CPU-seconds per 1k generated tokens with SGLang's decode throughput.

    python tools/gpu_sweep_report.py --points DIR --windows FILE --server-log LOG --out DIR
    python tools/gpu_sweep_report.py --combine A.json B.json ... --out DIR --suffix _c256   # sweeps of several device calls
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from rollout_throughput import ALL_MODES as MODES  # noqa: E402

_NUM = r"([0-9.]+)"
_DECODE = {"gen_throughput": rf"gen throughput \(token/s\): {_NUM}", "running_req": rf"#running-req: {_NUM}",
           "token_usage": rf"token usage: {_NUM}", "queue_req": rf"#queue-req: {_NUM}"}
_PREFILL = {"new_seq": rf"#new-seq: {_NUM}", "new_token": rf"#new-token: {_NUM}", "cached_token": rf"#cached-token: {_NUM}"}


def parse_window(text: str) -> dict[str, Any]:
    """Summary of SGLang's per-batch log lines in `text` (decode lines are logged every N decode steps)."""
    dec: dict[str, list[float]] = {k: [] for k in _DECODE}
    pre: dict[str, list[float]] = {k: [] for k in _PREFILL}
    graph = 0
    for line in text.splitlines():
        if "Decode batch" in line:
            for k, rx in _DECODE.items():
                m = re.search(rx, line)
                if m:
                    dec[k].append(float(m.group(1)))
            graph += bool(re.search(r"graph: True", line))
        elif "Prefill batch" in line:
            for k, rx in _PREFILL.items():
                m = re.search(rx, line)
                if m:
                    pre[k].append(float(m.group(1)))
    out: dict[str, Any] = {"decode_lines": len(dec["gen_throughput"]), "prefill_lines": len(pre["new_seq"])}
    for k, xs in dec.items():
        if xs:
            out[f"decode_{k}_mean"] = round(statistics.fmean(xs), 2)
            out[f"decode_{k}_max"] = round(max(xs), 2)
    if dec["gen_throughput"]:
        out["decode_gen_throughput_p50"] = round(statistics.median(dec["gen_throughput"]), 2)
        out["decode_lines_with_cuda_graph"] = graph
    for k, xs in pre.items():
        if xs:
            out[f"prefill_{k}_sum"] = int(sum(xs))
    if pre["new_token"] and pre["cached_token"]:
        total = sum(pre["new_token"]) + sum(pre["cached_token"])
        out["prefill_cache_hit_fraction"] = round(sum(pre["cached_token"]) / total, 4) if total else 0.0
    return out


def read_windows(path: Path) -> dict[str, tuple[int, int, int]]:
    out: dict[str, tuple[int, int, int]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 4:
                out[parts[0]] = (int(parts[1]), int(parts[2]), int(parts[3]))
    return out


def merge(points_dir: Path, windows: dict[str, tuple[int, int, int]], log: bytes,
          suffix: str = "") -> dict[str, Any] | None:
    reports = []
    for d in sorted(points_dir.iterdir()) if points_dir.is_dir() else []:
        for f in d.glob("rollout_throughput_*.json"):
            reports.append((d.name, json.loads(f.read_text())))
    if not reports:
        return None
    merged = {k: v for k, v in reports[0][1].items() if k not in ("points", "runs", "complete")}
    merged["benchmark"] = "rollout_throughput_sweep"
    merged["points"], merged["runs"], merged["point_commands"] = [], [], []
    merged["complete"] = all(r.get("complete") for _, r in reports)
    for name, r in reports:
        win = windows.get(f"throughput{suffix}_{name}")
        for p in r.get("points", []):
            if win is not None:
                p["sglang_log"] = parse_window(log[win[0]:win[1]].decode(errors="replace"))
                p["exit_code"] = win[2]
            p["client_cpu_seconds_per_1k_tokens"] = {m: p[m].get("client_cpu_seconds_per_1k_tokens")
                                                     for m in MODES if m in p}
            for run in r.get("runs", []):  # each mode's own window, when the benchmark was given --server-log
                w = run.get("server_log_window")
                same = (run.get("concurrency"), run.get("tool_latency_mean_s")) == (p["concurrency"], p["tool_latency_mean_s"])
                if w and same and run.get("repeat", 0) == 0 and isinstance(p.get(run.get("mode")), dict):
                    p[run["mode"]]["sglang_log"] = parse_window(log[w[0]:w[1]].decode(errors="replace"))
            merged["points"].append(p)
        merged["runs"] += r.get("runs", [])
        merged["point_commands"].append(r.get("command"))
    merged["points"].sort(key=lambda p: (p["tool_latency_mean_s"], p["concurrency"]))
    merged["definitions"] = dict(merged.get("definitions", {}), sglang_log=(
        "SGLang's own per-batch log lines during the point's run (all its modes together): "
        "decode gen throughput (token/s, SGLang's figure over its log interval), running requests, KV token "
        "usage, CUDA-graph use; prefill new/cached prompt tokens; <mode>.sglang_log: the same over that mode's "
        "run alone (first repeat), where the benchmark recorded its log window"))
    return merged


def combine(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """Sweep reports of several device calls (each already merged, with its log figures) as one: the first
    one's header, every point, run and command; each point keeps the commit its call ran (`git_commit`)."""
    out = {k: v for k, v in docs[0].items() if k not in ("points", "runs", "point_commands", "complete")}
    out["points"], out["runs"], out["point_commands"] = [], [], []
    for d in docs:
        for p in d.get("points", []):
            out["points"].append(dict(p, git_commit=d.get("git_commit"), date=d.get("date")))
        out["runs"] += d.get("runs", [])
        out["point_commands"] += d.get("point_commands", [])
    out["complete"] = all(d.get("complete") for d in docs)
    out["points"].sort(key=lambda p: (p["tool_latency_mean_s"], p["concurrency"]))
    return out


def table(merged: dict[str, Any]) -> str:
    """One line per point: tokens/s and client CPU-seconds per 1k tokens of each mode it ran, the ratios, SGLang's log."""
    rows = []
    for p in merged["points"]:
        c = p["client_cpu_seconds_per_1k_tokens"]
        s = p.get("sglang_log", {})
        modes = "  ".join(f"{m} {p[m]['tokens_per_s']:.0f} tok/s ({c.get(m)} cpu_s/1k)" for m in MODES if m in p)
        ratios = "  ".join(f"{k[len('agentloop_over_'):]} {v:.3f}" for k, v in p.items()
                           if k.startswith("agentloop_over_") and isinstance(v, float) and not k.endswith("_of_medians"))
        rows.append(f"lat {p['tool_latency_mean_s']:g}s c={p['concurrency']}: {modes} | agentloop/ {ratios} | "
                    f"SGLang decode tok/s mean {s.get('decode_gen_throughput_mean')} max "
                    f"{s.get('decode_gen_throughput_max')}, running {s.get('decode_running_req_mean')}")
    return "\n".join(rows)


def plot_cpu(merged: dict[str, Any], path: Path) -> None:
    from _common import pyplot, save_figure, title_suffix

    plt = pyplot()
    pts = merged["points"]
    labels = [f"c={p['concurrency']}\n{p['tool_latency_mean_s']:g}s" for p in pts]
    fig, ax = plt.subplots(1, 2, figsize=(max(10.0, 1.6 * len(pts)), 4.4))
    modes = [m for m in MODES if any(m in p for p in pts)]
    width = 0.8 / len(modes)
    for k, mode in enumerate(modes):
        ax[0].bar([i + (k - (len(modes) - 1) / 2) * width for i in range(len(pts))],
                  [p["client_cpu_seconds_per_1k_tokens"].get(mode) or 0.0 for p in pts], width, label=mode)
    ax[0].set_xticks(range(len(pts)), labels, fontsize=7)
    ax[0].set(ylabel="client CPU-seconds per 1k generated tokens", title="client CPU cost")
    ax[0].legend(fontsize=8)
    width = 0.27
    for k, (key, label) in enumerate((("ceiling", "client: ceiling tok/s"), ("agentloop", "client: agentloop tok/s"))):
        ax[1].bar([i + (k - 1) * width for i in range(len(pts))],
                  [p.get(key, {}).get("tokens_per_s", 0.0) for p in pts], width, label=label)  # a point may omit a mode
    ax[1].bar([i + width for i in range(len(pts))], [p.get("sglang_log", {}).get("decode_gen_throughput_max", 0.0)
                                                     for p in pts], width, label="SGLang log: decode tok/s (max)")
    ax[1].set_xticks(range(len(pts)), labels, fontsize=7)
    ax[1].set(ylabel="tokens / s", title="client throughput vs SGLang's own decode figure")
    ax[1].legend(fontsize=8)
    fig.suptitle(f"Rollout sweep: {title_suffix(merged)}", fontsize=9)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--points", type=Path, help="folder of per-point result folders")
    p.add_argument("--windows", type=Path, help="'name start end rc' lines: each part's log byte window")
    p.add_argument("--server-log", type=Path)
    p.add_argument("--combine", type=Path, nargs="+", help="merged sweep JSONs of several calls, instead of the three above")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--suffix", default="", help="appended to the file names, e.g. _7b for the 7B-shape points")
    a = p.parse_args(argv)
    if a.combine:
        merged: dict[str, Any] | None = combine([json.loads(f.read_text()) for f in a.combine])
    elif a.points and a.windows and a.server_log:
        log = a.server_log.read_bytes() if a.server_log.is_file() else b""
        merged = merge(a.points, read_windows(a.windows), log, a.suffix)
    else:
        p.error("give --points, --windows and --server-log, or --combine")
    if merged is None:
        print("no throughput point finished: nothing to merge")
        return 1
    engine = merged.get("settings", {}).get("engine", "sglang")
    a.out.mkdir(parents=True, exist_ok=True)
    json_path = a.out / f"rollout_throughput_sweep_{engine}{a.suffix}.json"
    json_path.write_text(json.dumps(merged, indent=1) + "\n")
    from rollout_throughput import plot

    plot(merged, a.out / f"rollout_throughput_sweep_{engine}{a.suffix}.png")
    plot_cpu(merged, a.out / f"rollout_throughput_sweep_cpu_{engine}{a.suffix}.png")
    print(table(merged))
    print(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
