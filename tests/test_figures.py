"""Every figure registered in tools/figures.yaml matches the committed JSON it comes from, and no
document names a result file that is not in the repo (tools/check_figures.py, run here so CI keeps
the published numbers honest). Also checks that the checker itself catches a wrong figure."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _checker():
    spec = importlib.util.spec_from_file_location("check_figures", REPO / "tools" / "check_figures.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def test_every_registered_figure_matches_its_json() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "check_figures.py")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "figures match their JSON files" in proc.stdout


def test_a_figure_that_differs_from_its_json_is_reported(tmp_path: Path) -> None:
    check = _checker()
    registry = tmp_path / "figures.yaml"
    registry.write_text(
        "- doc: benchmarks/README.md\n"
        "  source: benchmarks/results/cpu_engine_batching.json\n"
        "  values: {x16: 'results[concurrency=16].speedup_vs_c1'}\n"
        "  computed: {x16_wrong: x16 + 1}\n"
        "  text: 'rise {x16_wrong:.2f}× from 1 to 16'\n"
        "- doc: README.md\n"
        "  source: benchmarks/results/no_such_file.json\n"
        "  text: 'x'\n"
        "- doc: README.md\n"
        "  source: benchmarks/results/cpu_engine_batching.json\n"
        "  values: {y: 'results[concurrency=3].tokens_per_s'}\n"
        "  text: '{y}'\n")
    problems = check.check(registry)
    assert any("does not contain 'rise 4.56× from 1 to 16'" in p for p in problems), problems
    assert any("no_such_file.json is not a committed file" in p for p in problems), problems
    assert any("[concurrency=3] matches 0 elements, not 1" in p for p in problems), problems


def test_paths_aggregates_and_arithmetic() -> None:
    check = _checker()
    data = {"points": [{"c": 4, "lat": 0.02, "r": {"v": 1.5}}, {"c": 12, "lat": 0.2, "r": {"v": 2.5}},
                       {"c": 48, "lat": 0.02, "r": {"v": 0.5}}], "runs": [[1, 2], [3]]}
    assert check.value(data, "points[c=12].r.v") == 2.5
    assert check.value(data, "max(points[?lat=0.02].r.v)") == 1.5
    assert check.value(data, "median(points[*].r.v)") == 1.5 and check.value(data, "len(points[*])") == 3
    assert check.value(data, "runs[0][1]") == 2
    assert check.compute(data, "(points[c=4].r.v - x) * 100 / 2", {"x": 0.5}) == 50.0
    assert check.compute(data, "min(points[?lat=0.02].r.v, 0.7)", {}) == 0.5
