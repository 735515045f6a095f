"""The benchmarks' command lines: help text and flag names (parsing only; nothing is measured or run)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def bench_module(name: str) -> ModuleType:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))  # as running the script does: it imports its sibling _common
    return importlib.import_module(name)


@pytest.mark.parametrize("flag", ["--tool-latency-means", "--tool-latency-mean", "--tool-latency"])
def test_rollout_throughput_tool_latency_aliases(flag: str) -> None:
    rt = bench_module("rollout_throughput")
    assert rt.parse_args([flag, "0.3", "0.05"]).tool_latency_means == [0.3, 0.05]
    assert rt.parse_args(["--tool-latency-dist", "constant"]).tool_latency_dist == "constant"


def test_long_tail_tool_latency_flag() -> None:
    lt = bench_module("long_tail")
    assert lt.parse_args(["--tool-latency-mean", "0.3"]).tool_latency_mean == 0.3


def test_long_tail_ways_and_slot_limit() -> None:
    lt = bench_module("long_tail")
    a = lt.parse_args(["--ways", "wait_all", "oversample", "oversample_oldest_first", "--slot-limit", "256"])
    assert a.ways == ["wait_all", "oversample", "oversample_oldest_first"] and a.slot_limit == 256
    assert lt.parse_args([]).ways == ["wait_all", "oversample"] and lt.parse_args([]).slot_limit is None
    for bad in (["oversample", "wait_all"], ["wait_all", "oversample", "oversample"]):  # baseline first, each once
        with pytest.raises(SystemExit):
            lt.parse_args(["--ways", *bad])


@pytest.mark.parametrize("name", ["long_tail", "continuous"])
def test_slot_limit_takes_auto_or_a_positive_integer(name: str) -> None:
    mod = bench_module(name)
    assert mod.parse_args(["--slot-limit", "auto"]).slot_limit == "auto"
    assert mod.parse_args(["--slot-limit", "64"]).slot_limit == 64
    for bad in ("0", "-3", "Auto", "2.5", ""):
        with pytest.raises(SystemExit):
            mod.parse_args(["--slot-limit", bad])


@pytest.mark.parametrize("name", ["long_tail", "lifecycle", "rollout_throughput"])
def test_help_shows_the_whole_first_paragraph(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    mod = bench_module(name)
    with pytest.raises(SystemExit) as e:
        mod.parse_args(["--help"])
    assert e.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    first_paragraph = " ".join(mod.__doc__.split("\n\n")[0].split())
    assert first_paragraph in help_text


@pytest.mark.parametrize("name", ["cpu_engine_batching", "scheduler_overhead", "rollout_throughput", "long_tail",
                                  "lifecycle", "serve_threads"])
def test_every_benchmark_takes_engine_url_or_runs_its_own(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--engine-url` is the one spelling across benchmarks (serve_threads starts its own engines by design);
    the two that used `--url` keep it as an alias."""
    mod = bench_module(name)
    parse = getattr(mod, "parse_args", None)
    with pytest.raises(SystemExit):
        (parse or mod.main)(["--help"])
    help_text = capsys.readouterr().out
    assert ("--engine-url" in help_text) != (name == "serve_threads"), help_text
    if name in ("cpu_engine_batching", "scheduler_overhead"):
        assert "--url" in help_text


def test_smoke_runs_write_outside_the_checkout(tmp_path: Path) -> None:
    """Without --out, a `--smoke` run's files go to a temporary folder, not into benchmarks/results/."""
    common = bench_module("_common")
    args = common.benchmark_parser("x").parse_args(["--smoke"])
    json_path, png_path = common.result_paths(args, "long_tail")
    assert common.RESULTS.resolve() not in json_path.resolve().parents and json_path.name == "long_tail_cpu_smoke.json"
    assert png_path.parent == json_path.parent
    args = common.benchmark_parser("x").parse_args(["--smoke", "--out", str(tmp_path)])
    assert common.result_paths(args, "long_tail")[0] == tmp_path / "long_tail_cpu_smoke.json"  # an explicit --out wins
    real = common.benchmark_parser("x").parse_args([])
    assert common.result_paths(real, "long_tail")[0] == common.RESULTS / "long_tail_cpu.json"


def test_filler_ids_are_per_salt_prefix_consistent_streams() -> None:
    """The benchmarks' filler contexts: plain ints in range, deterministic, each salt its own sequence
    (no prefix shared across trajectories), and a shorter context a prefix of a longer one."""
    common = bench_module("_common")
    for n, salt in [(0, 0), (1, 5), (256, 3), (4000, 123456)]:
        ids = common.filler_ids(n, salt=salt)
        assert ids == common.filler_ids(n, salt=salt) and len(ids) == n
        assert all(type(t) is int and 3 <= t < 200 for t in ids)
        assert common.filler_ids(n // 3, salt=salt) == ids[: n // 3]
    assert len({tuple(common.filler_ids(8, salt=i)) for i in range(1024)}) == 1024