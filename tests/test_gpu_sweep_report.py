"""`tools/gpu_sweep_report.py`: SGLang's per-batch log lines summarised per sweep point, points merged.

The log lines are in sglang 0.5.17's format (`scheduler_components/metrics_reporter.py`)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_sweep_report", ROOT / "tools" / "gpu_sweep_report.py")
assert _spec is not None and _spec.loader is not None
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)

DECODE = ("[2026-12-03 08:01:02] Decode batch, #running-req: {r}, #token: 51200, token usage: {u}, cuda graph: {g}, "
          "gen throughput (token/s): {t}, #queue-req: 0")
PREFILL = ("[2026-12-03 08:01:01] Prefill batch, #new-seq: {s}, #new-token: {n}, #cached-token: {c}, token usage: 0.01, "
           "#running-req: 0, #queue-req: 0, #pending-token: 0, ")


def test_parse_window_summarises_decode_and_prefill_lines() -> None:
    text = "\n".join([PREFILL.format(s=4, n=1024, c=0), DECODE.format(r=256, u=0.10, g="True", t=15000.0),
                      "INFO some other line", PREFILL.format(s=2, n=100, c=412),
                      DECODE.format(r=128, u=0.20, g="False", t=9000.0)])
    s = report.parse_window(text)
    assert s["decode_lines"] == 2 and s["prefill_lines"] == 2
    assert s["decode_gen_throughput_mean"] == 12000.0 and s["decode_gen_throughput_max"] == 15000.0
    assert s["decode_running_req_mean"] == 192.0 and s["decode_token_usage_max"] == 0.2
    assert s["decode_lines_with_cuda_graph"] == 1
    assert s["prefill_new_token_sum"] == 1124 and s["prefill_cached_token_sum"] == 412
    assert s["prefill_cache_hit_fraction"] == pytest.approx(412 / 1536, abs=1e-4)
    assert report.parse_window("no batch lines here") == {"decode_lines": 0, "prefill_lines": 0}


def _point(conc: int, lat: float) -> dict:
    modes = {m: {"tokens_per_s": 100.0 * (k + 1), "client_cpu_seconds_per_1k_tokens": 0.1 * (k + 1)}
             for k, m in enumerate(("ceiling", "agentloop", "turn_sync"))}
    return {"tool_latency_mean_s": lat, "concurrency": conc, **modes, "agentloop_over_ceiling": 2.0,
            "agentloop_over_turn_sync": 0.67}


def test_merge_takes_each_points_log_window(tmp_path: Path) -> None:
    log = b""
    windows = {}
    for name, conc, lat, tput in (("c256_l0.5", 256, 0.5, 15000.0), ("c64_l0.5", 64, 0.5, 5000.0)):
        d = tmp_path / "points" / name
        d.mkdir(parents=True)
        (d / "rollout_throughput_sglang.json").write_text(json.dumps({
            "benchmark": "rollout_throughput", "command": f"python benchmarks/rollout_throughput.py --concurrency {conc}",
            "settings": {"engine": "sglang"}, "points": [_point(conc, lat)], "runs": [{"mode": "ceiling"}],
            "complete": True}))
        start = len(log)
        log += (DECODE.format(r=conc, u=0.1, g="True", t=tput) + "\n").encode()
        windows[f"throughput_{name}"] = (start, len(log), 0)
    merged = report.merge(tmp_path / "points", windows, log)
    assert merged is not None and merged["benchmark"] == "rollout_throughput_sweep" and merged["complete"]
    by_conc = {p["concurrency"]: p for p in merged["points"]}
    assert by_conc[256]["sglang_log"]["decode_gen_throughput_max"] == 15000.0  # its own window, not the other's
    assert by_conc[64]["sglang_log"]["decode_running_req_mean"] == 64.0
    assert by_conc[64]["client_cpu_seconds_per_1k_tokens"] == {"ceiling": 0.1, "agentloop": 0.2, "turn_sync": pytest.approx(0.3)}
    assert len(merged["point_commands"]) == 2 and len(merged["runs"]) == 2
    rows = report.table(merged).splitlines()
    assert len(rows) == 2 and rows[0].startswith("lat 0.5s c=64:") and rows[1].startswith("lat 0.5s c=256:")
    assert all("ceiling" in r and "agentloop" in r and "cpu_s/1k" in r for r in rows)


def test_merge_with_a_suffix_reads_the_suffixed_windows_only(tmp_path: Path) -> None:
    """The 7B server's points share the windows file with the 0.5B ones: a suffix keeps them apart."""
    d = tmp_path / "points7b" / "c256_l0.5"
    d.mkdir(parents=True)
    (d / "rollout_throughput_sglang.json").write_text(json.dumps({
        "benchmark": "rollout_throughput", "command": "x", "settings": {"engine": "sglang"},
        "points": [_point(256, 0.5)], "runs": [], "complete": True}))
    log = (DECODE.format(r=256, u=0.1, g="True", t=9000.0) + "\n").encode()
    small = len(log)
    log += (DECODE.format(r=256, u=0.1, g="True", t=4000.0) + "\n").encode()
    windows = {"throughput_c256_l0.5": (0, small, 0), "throughput_7b_c256_l0.5": (small, len(log), 0)}
    merged = report.merge(tmp_path / "points7b", windows, log, "_7b")
    assert merged is not None and merged["points"][0]["sglang_log"]["decode_gen_throughput_max"] == 4000.0
    assert report.merge(tmp_path / "points7b", windows, log)["points"][0]["sglang_log"]["decode_gen_throughput_max"] == 9000.0


def test_merge_reads_each_modes_own_log_window(tmp_path: Path) -> None:
    d = tmp_path / "points" / "c64_l0.5"
    d.mkdir(parents=True)
    log = b""
    runs = []
    for mode, tput in (("ceiling", 7000.0), ("agentloop", 3000.0)):
        start = len(log)
        log += (DECODE.format(r=64, u=0.1, g="True", t=tput) + "\n").encode()
        runs.append({"mode": mode, "concurrency": 64, "tool_latency_mean_s": 0.5, "repeat": 0,
                     "server_log_window": [start, len(log)]})
    (d / "rollout_throughput_sglang.json").write_text(json.dumps({
        "benchmark": "rollout_throughput", "command": "x", "settings": {"engine": "sglang"},
        "points": [_point(64, 0.5)], "runs": runs, "complete": True}))
    merged = report.merge(tmp_path / "points", {"throughput_c64_l0.5": (0, len(log), 0)}, log)
    p = merged["points"][0]
    assert p["sglang_log"]["decode_lines"] == 2
    assert p["ceiling"]["sglang_log"]["decode_gen_throughput_max"] == 7000.0
    assert p["agentloop"]["sglang_log"]["decode_gen_throughput_max"] == 3000.0
    assert "sglang_log" not in p["turn_sync"]  # no window recorded for it


def _merged_point(conc: int, lat: float) -> dict:
    p = _point(conc, lat)
    return dict(p, client_cpu_seconds_per_1k_tokens={m: p[m]["client_cpu_seconds_per_1k_tokens"] for m in ("ceiling", "agentloop")})


def test_combine_keeps_every_calls_points_with_its_commit(tmp_path: Path) -> None:
    a = {"benchmark": "rollout_throughput_sweep", "git_commit": "aaa", "date": "d1", "hardware": {"gpu": "H200"},
         "settings": {"engine": "sglang", "trajectories": 8, "turns": 2, "gen_median": 4.0},
         "points": [_merged_point(256, 2.0)], "runs": [{"mode": "ceiling"}], "point_commands": ["x"], "complete": True}
    b = dict(a, git_commit="bbb", points=[_merged_point(256, 0.05)], point_commands=["y"])
    out = report.combine([a, b])
    assert [p["tool_latency_mean_s"] for p in out["points"]] == [0.05, 2.0]
    assert [p["git_commit"] for p in out["points"]] == ["bbb", "aaa"]
    assert out["point_commands"] == ["x", "y"] and len(out["runs"]) == 2 and out["complete"]
    files = []
    for i, d in enumerate((a, b)):
        files.append(tmp_path / f"{i}.json")
        files[-1].write_text(json.dumps(d))
    assert report.main(["--combine", *map(str, files), "--out", str(tmp_path / "o"), "--suffix", "_c"]) == 0
    assert json.loads((tmp_path / "o" / "rollout_throughput_sweep_sglang_c.json").read_text())["points"][1]["git_commit"] == "aaa"
