"""The rollout benchmarks still run: each one in its tiny `--smoke` configuration on the CPU engine.

Runs the scripts as a user would (a subprocess: they set the matplotlib backend and their import
path) into a temporary folder, and checks the report's fields and the plot. No timing thresholds:
speed is measured in `benchmarks/`, not asserted in tests.

`rollout_throughput` and `lifecycle` start their own CPU engine (they read its process: CPU time,
memory); the other random-model benchmarks attach to one running server with `--engine-url`, as
they are run against SGLang, instead of starting one each (seconds of CPU per start).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
HEADER = ("benchmark", "command", "date", "git_commit", "versions", "hardware", "settings", "engine")


def bench_command(script: str, out: Path, *, via_cli: bool = False, engine_url: str | None = None) -> list[str]:
    """`python benchmarks/NAME.py --smoke --out OUT [--engine-url URL]`, or the same run through
    `python -m agentloop bench`."""
    attach = ["--engine-url", engine_url] if engine_url else []
    if via_cli:
        return [sys.executable, "-m", "agentloop", "bench", script, "--smoke", "--out", str(out), *attach]
    return [sys.executable, f"benchmarks/{script}.py", "--smoke", "--out", str(out), *attach]


def run_smoke(script: str, out: Path, *, via_cli: bool = False, engine_url: str | None = None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run(bench_command(script, out, via_cli=via_cli, engine_url=engine_url), cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"{script} --smoke failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    path = out / f"{script}_cpu_smoke.json"
    assert path.is_file(), f"{script} wrote no {path.name}; files: {sorted(p.name for p in out.iterdir())}"
    png = path.with_suffix(".png")
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{script}: no PNG plot"
    report = json.loads(path.read_text())
    for key in HEADER:
        assert key in report, f"{script}: report lacks {key!r}"
    assert report["benchmark"] == script
    assert "--smoke" in report["command"]
    for v in ("agentloop", "torch", "transformers", "sglang"):
        assert v in report["versions"], f"{script}: versions lack {v}"
    assert report["hardware"]["cpu"] is not None and "gpu" in report["hardware"]
    if engine_url:  # it drove the running server, not one of its own
        assert report["engine"]["attached"] == engine_url, report["engine"]
    return report


@pytest.fixture(scope="module")
def long_tail_via_cli(tmp_path_factory: pytest.TempPathFactory, local_engine: str) -> tuple[dict, Path]:
    """long_tail's smoke run, once for the module, through `python -m agentloop bench` (the way
    tests/test_cli_bench.py's users run it): both its report test and the CLI's end-to-end test read it."""
    out = tmp_path_factory.mktemp("long_tail")
    return run_smoke("long_tail", out, via_cli=True, engine_url=local_engine), out


@pytest.mark.slow
def test_rollout_throughput_smoke(tmp_path: Path) -> None:
    r = run_smoke("rollout_throughput", tmp_path)
    assert len(r["points"]) == 1
    p = r["points"][0]
    for mode in ("ceiling", "agentloop", "turn_sync"):
        m = p[mode]
        for key in ("tokens_per_s", "trajectories_per_s", "wall_s", "engine_has_work_fraction", "mean_requests_in_flight"):
            assert key in m, f"{mode} lacks {key}"
        # every mode generated exactly the workload's tokens
        assert m["generated_tokens"] == p["workload"]["generated_tokens"] > 0
        assert 0 < m["engine_has_work_fraction"] <= 1
    assert p["agentloop_over_ceiling"] > 0 and p["agentloop_over_turn_sync"] > 0
    # the name for the second headline ratio: the turn-synchronous design is the baseline
    assert p["agentloop_over_baseline"] == p["agentloop_over_turn_sync"]
    assert "engine_cpu_busy_fraction" in p["agentloop"]  # the CPU engine we started is sampled
    assert {"tool_latency_below_turn_time", "mean_turn_generate_s"} <= set(p)
    assert len(r["runs"]) == 4
    # the ceiling ignores turn order; the bound a turn-ordered client has is reported beside it
    assert p["critical_path_s"] > 0 and p["dependency_ceiling_tokens_per_s"] <= p["ceiling"]["tokens_per_s"]
    assert p["agentloop_over_dependency_ceiling"] >= p["agentloop_over_ceiling"]


@pytest.mark.slow
def test_lifecycle_smoke(tmp_path: Path) -> None:
    r = run_smoke("lifecycle", tmp_path)
    wake, sleep = r["timing"]["wake_up"], r["timing"]["sleep"]
    for stage in ("resume_weights", "update_weights", "resume_kv_cache", "total"):
        assert wake[stage]["agentloop_s"] > 0 and wake[stage]["raw_s"] > 0 and wake[stage]["ratio"] > 0
    for stage in ("pause", "flush_cache", "release", "total"):
        assert sleep[stage]["raw_s"] > 0 and sleep[stage]["ratio"] > 0
    assert len(r["cycles"]["agentloop"]) == len(r["cycles"]["raw"]) == r["settings"]["repeats"]
    assert r["weights"]["bytes"] > 0 and r["weights"]["tensors"] > 0
    mem = r["memory"]
    assert mem["staged_peak_gib"] > 0 and mem["one_stage_peak_gib"] > 0 and "kv_pool_gib" in mem
    assert {run["mode"] for run in mem["runs"]} == {"staged", "one_stage"}


@pytest.mark.slow
def test_long_tail_smoke(long_tail_via_cli: tuple[dict, Path]) -> None:
    r, _ = long_tail_via_cli
    s = r["settings"]
    for mode in ("wait_all", "oversample"):
        steps = r["steps"][mode]
        assert len(steps) == s["steps"]
        assert all(st["complete_groups"] == s["target_groups"] for st in steps)
        assert r["summary"][mode]["mean_step_s"] > 0
    # over-sampling ran more groups than it returned and carried the rest over
    assert all(st["samples_in"] > st["trajectories_returned"] for st in r["steps"]["oversample"])
    assert r["steps"]["oversample"][1]["carried_in"] > 0
    assert all(st["carried_out"] == 0 for st in r["steps"]["wait_all"])
    assert "step_time_reduction" in r["summary"]


@pytest.mark.slow
def test_weight_update_smoke(tmp_path: Path, local_engine: str) -> None:
    r = run_smoke("weight_update", tmp_path, engine_url=local_engine)
    assert r["weights"]["tensors"] > 0 and r["weights"]["bytes"] > 0
    # the CPU engine takes safetensors: agentloop's own path and the one-tensor request (SGLang adds the raw ways)
    assert set(r["methods"]) == {"agentloop", "noop"}
    for m in r["methods"].values():
        assert isinstance(m["seconds"], float) and m["requests"] == 1  # a field, not a speed
    assert r["methods"]["agentloop"]["gb_per_s"] > 0  # (the one-tensor request's rounds to 0 GB/s)
    assert r["methods"]["agentloop"]["bytes"] == r["weights"]["bytes"] > r["methods"]["noop"]["bytes"]


@pytest.mark.slow
def test_client_cpu_profile_smoke(tmp_path: Path, local_engine: str) -> None:
    r = run_smoke("client_cpu_profile", tmp_path, engine_url=local_engine)
    cpu = r["cpu_seconds_per_1k_tokens"]
    assert cpu["bare"] > 0 and cpu["agentloop"] > 0
    assert r["agentloop_over_bare_cpu"] == pytest.approx(cpu["agentloop"] / cpu["bare"], rel=1e-3)
    for mode in ("bare", "agentloop"):
        prof = r["profiles"][mode]
        assert prof["tokens"] > 0 and prof["top_own"] and prof["top_cumulative"] and prof["by_module"]
    # the profile sees agentloop's own modules, not only the event loop
    assert any("agentloop" in f["path"] for f in r["profiles"]["agentloop"]["top_cumulative"])


@pytest.mark.slow
def test_openai_endpoint_smoke(tmp_path: Path) -> None:
    r = run_smoke("openai_endpoint", tmp_path)
    (row,) = r["summary"]
    assert row["tool_calls_per_step"] > 0 and row["openai_calls_per_step"] > 0
    assert {x["agent"] for x in r["runs"]} == {"tool", "openai"}
    assert all(x["statuses"]["failed"] == 0 for x in r["runs"])


@pytest.mark.slow
def test_smoke_run_through_the_cli(long_tail_via_cli: tuple[dict, Path]) -> None:
    """A real benchmark end to end through `python -m agentloop bench` (its --smoke configuration).
    (`agentloop bench`'s other tests are in tests/test_cli_bench.py; this one shares long_tail's run.)"""
    report, out = long_tail_via_cli
    assert report["benchmark"] == "long_tail" and report["complete"] is True
    assert report["command"].startswith("python benchmarks/long_tail.py --smoke --out")
    assert report["command"].endswith(f"--engine-url {report['engine']['attached']}")
    assert (out / "long_tail_cpu_smoke.png").read_bytes()[:4] == b"\x89PNG"
    # The benchmark's own argument errors keep its exit status (argparse: 2).
    bad = subprocess.run([sys.executable, "-m", "agentloop", "bench", "long_tail", "--no-such-flag"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unrecognized arguments: --no-such-flag" in bad.stderr


@pytest.mark.slow
def test_continuous_smoke(tmp_path: Path, local_engine: str) -> None:
    r = run_smoke("continuous", tmp_path, engine_url=local_engine)
    modes = {run["mode"] for run in r["runs"]}
    assert modes == {"per_step", "over_admission", "streaming", "streaming_kv_reuse", "streaming_kv_reuse_server_drain",
                     "bare_refill"} and not r["skipped"]
    for run in r["runs"]:
        assert run["steps"] == 3 and run["complete_steps"] and run["trained_tokens"] > 0, run
        assert 0 <= run["engine_has_work_fraction"] <= 1
        assert sum(run["staleness_histogram"].values()) == run["trained_tokens"]
    by = {run["mode"]: run for run in r["runs"]}
    assert set(by["per_step"]["staleness_histogram"]) == {"0"}  # a synchronous step trains on-policy tokens only
    for mode in ("streaming", "streaming_kv_reuse", "streaming_kv_reuse_server_drain"):
        assert by[mode]["generations_outside_awake"] == 0 and by[mode]["update_seconds"]
        assert max(int(k) for k in by[mode]["staleness_histogram"]) <= by[mode]["max_staleness"]
    ratios = r["summary"]["0.01s"]["ratios"]
    assert {"streaming@6_over_per_step", "over_admission@6_over_per_step", "streaming_over_bare_refill@6",
            "streaming_kv_reuse_over_bare_refill@6"} <= set(ratios)
