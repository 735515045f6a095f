"""`agentloop bench`: listing the repository's benchmarks, running one with its arguments passed through,
and clear errors when the benchmarks cannot be found (e.g. agentloop installed from a wheel)."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from agentloop.cli import main
from agentloop.commands import bench

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = ("rollout_throughput", "lifecycle", "long_tail", "scheduler_overhead", "cpu_engine_batching")


def agentloop(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "agentloop", *argv], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=REPO)


def test_list_names_every_benchmark_with_its_description() -> None:
    out = agentloop("bench", "--list")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    for name in BENCHMARKS:
        doc = bench.available(REPO / "benchmarks")[name]
        assert f"{name} {doc}" in text, name
    assert "_common" not in text  # shared helpers are not benchmarks
    # No name lists them too.
    assert agentloop("bench").stdout == out.stdout


def test_parsing_the_command_line_imports_nothing_heavy() -> None:
    code = ("import sys; from agentloop.cli import build_parser; "
            "a = build_parser().parse_args(['bench', 'long_tail', '--smoke', '--out', 'x']); "
            "print(a.name, a.args, sorted(m for m in ('torch', 'transformers', 'numpy', 'agentloop.runtime') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "long_tail ['--smoke', '--out', 'x'] []"


def test_unknown_benchmark_names_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "no_such_bench"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'no_such_bench'" in err and "long_tail" in err and "rollout_throughput" in err
    assert main(["bench", "_common"]) == 2  # the helpers module is not a benchmark


def test_missing_benchmarks_folder_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # As installed from a wheel: site-packages has agentloop/ but no benchmarks/ beside it.
    monkeypatch.setattr(bench, "DEFAULT_DIR", tmp_path / "site-packages" / "benchmarks")
    assert main(["bench", "--list"]) == 2
    err = capsys.readouterr().err
    assert f"no benchmarks folder at {tmp_path / 'site-packages' / 'benchmarks'}" in err
    assert "pip install -e ." in err and "--dir" in err
    # --dir pointing at some other folder is refused with its path.
    assert main(["bench", "--dir", str(tmp_path), "long_tail"]) == 2
    assert f"{tmp_path} is not agentloop's benchmarks folder" in capsys.readouterr().err


def test_arguments_and_exit_status_pass_through(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A benchmark runs as `python benchmarks/NAME.py ARGS` would: __main__, its argv, its folder importable;
    its exit status comes back, and the caller's sys.argv / sys.path are restored."""
    (tmp_path / "_common.py").write_text("GREETING = 'from _common'\n")
    (tmp_path / "echo.py").write_text(
        '"""Echo: prints its argv.\n\nMore text that the list leaves out."""\n'
        "import sys\n"
        "from _common import GREETING\n"
        "if __name__ == '__main__':\n"
        "    print(GREETING, sys.argv[1:])\n"
        "    sys.exit(int(sys.argv[1]))\n")
    argv, path = sys.argv[:], sys.path[:]
    # A `_common` of another benchmarks folder already imported in this process (as after the smoke
    # tests) is not the one this folder's script gets, and is back in place afterwards.
    other = types.ModuleType("_common")
    saved = sys.modules.get("_common")
    sys.modules["_common"] = other
    try:
        assert main(["bench", "--dir", str(tmp_path), "echo", "3", "--smoke", "--list"]) == 3
        assert sys.modules["_common"] is other
    finally:
        if saved is not None:
            sys.modules["_common"] = saved
        else:
            sys.modules.pop("_common", None)
    assert capsys.readouterr().out == "from _common ['3', '--smoke', '--list']\n"
    assert sys.argv == argv and sys.path == path
    assert main(["bench", "--dir", str(tmp_path), "echo", "0"]) == 0
    capsys.readouterr()
    assert main(["bench", "--dir", str(tmp_path)]) == 0
    listing = capsys.readouterr().out
    assert "Echo: prints its argv." in listing and "More text" not in listing


# The end-to-end run of a real benchmark through `python -m agentloop bench` is
# tests/test_benchmarks_smoke.py::test_smoke_run_through_the_cli: it shares long_tail's smoke run with that file.
