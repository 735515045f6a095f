"""Every measured figure in README.md, docs/*.md and benchmarks/README.md comes from a committed JSON.

The figures are listed in `tools/figures.yaml`, one entry per piece of doc text:

    - doc: benchmarks/README.md                            # the document (repo-relative)
      source: benchmarks/results/cpu_engine_batching.json  # the committed JSON it comes from
      values:                                              # names -> JSON paths (see below)
        x16: results[concurrency=16].speedup_vs_c1
      computed:                                            # optional: arithmetic on the values
        ms16: results[concurrency=16].mean_decode_batch / results[concurrency=16].engine_tokens_per_busy_s * 1000
      text: "rise {x16:.2f}× from 1 to 16"                 # Python format: the doc must contain it

A path is dot-separated keys; `key[3]` indexes a list, `key[*]` takes every element (a list of
results), `key[k=v,k2=v2]` the one element whose fields equal those values, `key[?k=v]` every
element whose fields equal them (a list). A value may wrap a path
in `min(...)`, `max(...)`, `median(...)`, `mean(...)`, `sum(...)` or `len(...)`. `computed`
expressions use + - * /, parentheses and min(...)/max(...) over paths, numbers and named values.

Checks: each `source` is a file tracked by git; each `text`, formatted with its values, occurs
verbatim in its `doc`. Exit 0 when all hold, else 1 with one line per failure; `results/*.json`
files the documents name but git does not hold are listed as notes (`python tools/check_figures.py`; run in CI by
tests/test_figures.py).
"""

from __future__ import annotations

import ast
import json
import operator
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import yaml

REPO = Path(__file__).resolve().parent.parent
REGISTRY = REPO / "tools" / "figures.yaml"
DOCS = ("README.md", "docs/*.md", "benchmarks/README.md")
AGGREGATES: dict[str, Callable[[list[Any]], Any]] = {
    "min": min, "max": max, "median": statistics.median, "mean": statistics.fmean, "sum": sum, "len": len,
}
_SEGMENT = re.compile(r"([^.\[\]]+)((?:\[[^\]]*\])*)")
_PATH = re.compile(r"[A-Za-z_][\w-]*(?:\[[^\]]*\])*(?:\.[\w-]+(?:\[[^\]]*\])*)*")


class FigureError(ValueError):
    """A figure that cannot be read from its source, or a malformed registry entry."""


def _literal(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def resolve(data: Any, path: str) -> Any:
    """The value at `path` in `data` (syntax in the module docstring); a list where `[*]` was used."""
    current: list[Any] = [data]
    spread = False
    for key, selectors in _SEGMENT.findall(path):
        nxt = []
        for item in current:
            if not isinstance(item, dict) or key not in item:
                raise FigureError(f"{path}: no key {key!r}")
            nxt.append(item[key])
        current = nxt
        for sel in re.findall(r"\[([^\]]*)\]", selectors):
            out = []
            for item in current:
                if not isinstance(item, list):
                    raise FigureError(f"{path}: [{sel}] on a {type(item).__name__}, not a list")
                if sel == "*":
                    out.extend(item)
                    spread = True
                elif sel.startswith("?"):
                    want = {k.strip(): _literal(v.strip()) for k, v in (p.split("=", 1) for p in sel[1:].split(","))}
                    out.extend(e for e in item if isinstance(e, dict) and all(e.get(k) == v for k, v in want.items()))
                    spread = True
                elif "=" in sel:
                    want = {k.strip(): _literal(v.strip()) for k, v in (p.split("=", 1) for p in sel.split(","))}
                    hits = [e for e in item if isinstance(e, dict) and all(e.get(k) == v for k, v in want.items())]
                    if len(hits) != 1:
                        raise FigureError(f"{path}: [{sel}] matches {len(hits)} elements, not 1")
                    out.append(hits[0])
                else:
                    out.append(item[int(sel)])
            current = out
    return current if spread else current[0]


def value(data: Any, spec: str) -> Any:
    m = re.fullmatch(r"\s*(\w+)\((.*)\)\s*", spec)
    if m and m.group(1) in AGGREGATES:
        got = resolve(data, m.group(2).strip())
        return AGGREGATES[m.group(1)](got if isinstance(got, list) else [got])
    return resolve(data, spec.strip())


_OPS: dict[type, Callable[[Any, Any], Any]] = {ast.Add: operator.add, ast.Sub: operator.sub,
                                               ast.Mult: operator.mul, ast.Div: operator.truediv}


def compute(data: Any, expr: str, names: dict[str, Any]) -> float:
    """Arithmetic over paths, numbers and named values (no eval: a small AST walk)."""
    paths: dict[str, str] = {}

    def placeholder(m: re.Match[str]) -> str:
        if m.group(0) in names or m.group(0) in ("min", "max"):
            return m.group(0)
        key = f"_p{len(paths)}"
        paths[key] = m.group(0)
        return key

    tree = ast.parse(_PATH.sub(placeholder, expr), mode="eval")

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.Name):
            return names[node.id] if node.id in names else resolve(data, paths[node.id])
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("min", "max"):
            args = [walk(a) for a in node.args]
            flat = [x for a in args for x in (a if isinstance(a, list) else [a])]
            return (min if node.func.id == "min" else max)(flat)
        raise FigureError(f"computed {expr!r}: only + - * / ( ) min max, numbers, paths and names are allowed")

    return walk(tree.body)


def tracked(path: str) -> bool:
    res = subprocess.run(["git", "ls-files", "--error-unmatch", path], cwd=REPO, capture_output=True)
    return res.returncode == 0


def uncommitted_results() -> list[str]:
    """`results/*.json` files a document names that are not committed: a note, not a failure (a
    document may say where a benchmark writes before its run is committed), but a figure quoted
    from such a file cannot be checked, so it must not be registered or published."""
    notes = []
    for pattern in DOCS:
        for doc in sorted(REPO.glob(pattern)):
            # Every benchmark result lives in benchmarks/results/, whichever way a document names it.
            for name in sorted(set(re.findall(r"results/[\w.-]+\.json", doc.read_text(encoding="utf-8")))):
                if not tracked("benchmarks/" + name):
                    notes.append(f"{doc.relative_to(REPO)} names {name}, which is not a committed file")
    return notes


def check(registry: Path = REGISTRY) -> list[str]:
    """Every failure as one line (empty: all figures match)."""
    problems: list[str] = []
    entries = yaml.safe_load(registry.read_text(encoding="utf-8")) or []
    sources: dict[str, Any] = {}
    for i, e in enumerate(entries):
        where = f"{registry.name}[{i}] ({e.get('doc')}: {e.get('text', '')[:50]!r})"
        try:
            src = e["source"]
            if src not in sources:
                if not (REPO / src).is_file() or not tracked(src):
                    raise FigureError(f"source {src} is not a committed file")
                sources[src] = json.loads((REPO / src).read_text(encoding="utf-8"))
            data = sources[src]
            names: dict[str, Any] = {k: value(data, v) for k, v in (e.get("values") or {}).items()}
            for k, expr in (e.get("computed") or {}).items():
                names[k] = compute(data, str(expr), names)
            text = e["text"].format(**names)
        except (FigureError, KeyError, IndexError, TypeError, ValueError) as exc:
            problems.append(f"{where}: {exc}")
            continue
        doc = (REPO / e["doc"]).read_text(encoding="utf-8")
        if text not in doc:
            problems.append(f"{where}: {e['doc']} does not contain {text!r} (from {e['source']})")
    return problems


def main() -> int:
    problems = check()
    for note in uncommitted_results():
        print(f"note: {note}", file=sys.stderr)
    for p in problems:
        print(p, file=sys.stderr)
    if not problems:
        n = len(yaml.safe_load(REGISTRY.read_text(encoding="utf-8")) or [])
        print(f"check_figures: {n} figures match their JSON files")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
