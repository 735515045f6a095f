"""`agentloop bench NAME [ARGS...]`: run one of the repository's benchmarks (`benchmarks/NAME.py`).

`agentloop bench --list` (or no NAME) lists them with the first paragraph of each docstring; the
arguments after NAME go to the benchmark unchanged (`agentloop bench long_tail --smoke`,
`agentloop bench rollout_throughput --help`).

Owns finding the benchmarks and handing over to one; what a benchmark measures and writes is its own.
Parsing the command line imports nothing heavy: the list reads the scripts' docstrings with `ast`,
and torch & co. are imported only by the benchmark that runs.

Why the benchmarks are not importable (not inside the package): they are tools for people working on
agentloop, like `tools/`, not part of its API. They write their results into the repository
(`benchmarks/results/`, committed with the git commit they ran at) and read the repository's layout;
shipped in a wheel they would write into site-packages. So they live in the source checkout, and
this command finds them next to the package of an editable install (`pip install -e .`), or wherever
`--dir` says (e.g. a checkout, when agentloop itself was installed from a wheel).
"""

from __future__ import annotations

import argparse
import ast
import runpy
import shutil
import sys
import textwrap
from pathlib import Path

# commands/bench.py -> agentloop/ -> src/ -> the repository root, which holds benchmarks/ in a source checkout.
DEFAULT_DIR = Path(__file__).resolve().parents[3] / "benchmarks"
MARKER = "_common.py"  # what tells a benchmarks folder of this project from any other folder of that name


class BenchError(Exception):
    """A benchmark that cannot be found or named; the message says what and where."""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench", help="run a benchmark of the source checkout (benchmarks/NAME.py); --list names them",
        description=__doc__.split("\n\n")[0],
        epilog="Arguments after NAME go to the benchmark: `agentloop bench NAME --help` shows its own options.")
    p.add_argument("--list", action="store_true", help="list the benchmarks with their descriptions")
    p.add_argument("--dir", type=Path, default=None,
                   help=f"the benchmarks folder (default: the source checkout's, {DEFAULT_DIR})")
    p.add_argument("name", nargs="?", metavar="NAME", help="benchmark to run (a file benchmarks/NAME.py)")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="the benchmark's own arguments")
    return p


def benchmarks_dir(path: Path | None = None) -> Path:
    """The benchmarks folder: `path` if given, else the one beside the package of an editable install."""
    d = (path or DEFAULT_DIR).resolve()
    if (d / MARKER).is_file():
        return d
    if path is not None:
        raise BenchError(f"{d} is not agentloop's benchmarks folder (it has no {MARKER})")
    raise BenchError(
        f"no benchmarks folder at {d}: the benchmarks live in agentloop's source checkout, not in the "
        "installed package (e.g. a wheel). Clone the repository and `pip install -e .` there, or pass "
        "--dir PATH/TO/benchmarks")


def available(d: Path) -> dict[str, str]:
    """Benchmark name -> the first paragraph of its docstring on one line (`_*.py` are shared helpers)."""
    out: dict[str, str] = {}
    for f in sorted(d.glob("*.py")):
        if f.name.startswith("_"):
            continue
        try:
            doc = ast.get_docstring(ast.parse(f.read_text(encoding="utf-8"), filename=str(f))) or ""
        except (OSError, SyntaxError, UnicodeDecodeError) as e:
            doc = f"(unreadable: {type(e).__name__}: {e})"
        out[f.stem] = " ".join(doc.split("\n\n")[0].split())
    return out


def script(d: Path, name: str) -> Path:
    names = available(d)
    if name not in names:
        raise BenchError(f"unknown benchmark {name!r} in {d}; choose one of: {', '.join(names) or '(none)'}")
    return d / f"{name}.py"


def run_script(path: Path, argv: list[str]) -> int:
    """Run `path` as `python path ARGV...` would, in this process: `__main__`, argv, its folder first on
    sys.path. Its exit status is returned (a SystemExit message goes to stderr, status 1, as Python does)."""
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    # Its sibling modules (`_common`, ...) must be the ones of *its* folder: a same-named module
    # already imported in this process (another benchmarks folder) is set aside and put back after.
    siblings = {p.stem for p in path.parent.glob("*.py")}
    saved_modules = {n: sys.modules.pop(n) for n in siblings if n in sys.modules}
    sys.argv = [str(path), *argv]
    sys.path.insert(0, str(path.parent))
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return int(e.code or 0)
        print(e.code, file=sys.stderr)
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        for n in siblings:
            sys.modules.pop(n, None)
        sys.modules.update(saved_modules)
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        d = benchmarks_dir(args.dir)
        if args.list or not args.name:
            names = available(d)
            width = max(map(len, names), default=0)
            cols = max(shutil.get_terminal_size().columns, width + 40)
            print(f"benchmarks in {d} (run: agentloop bench NAME [ARGS...]; NAME --help for its options):")
            for name, desc in names.items():
                print(textwrap.fill(desc, cols, initial_indent=f"  {name:<{width}}  ",
                                    subsequent_indent=" " * (width + 4)))
            return 0
        path = script(d, args.name)
    except BenchError as e:
        print(f"agentloop bench: {e}", file=sys.stderr)
        return 2
    return run_script(path, list(args.args))
