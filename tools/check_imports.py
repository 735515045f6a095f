"""Import cycles and upward imports in `src/agentloop`, against the declared layer order below.

Every `import` / `from ... import` of an `agentloop` module is an edge, wherever it is written (at
the top, inside a function, under `if TYPE_CHECKING:`): an import inside a function is still an
arrow a reader has to follow. A module belongs to a *unit*: its subpackage of `agentloop`
(`agentloop.engine.lifecycle` → `engine`) or, at the package root, the module itself
(`agentloop.chat` → `chat`). `LAYERS` orders the units from the top (entry points) down; a unit may
import units of its own layer and of the layers below. Reported:

- **upward imports**: an import from a unit to a unit of a higher layer;
- **unit cycles**: strongly connected groups of units (edges between different units);
- **module cycles**: strongly connected groups of modules (a package's `__init__` counts as a module;
  importing `agentloop.x.y` also runs `agentloop.x`'s `__init__`, but that implicit edge is not counted).

Run `python tools/check_imports.py` (exit status 1 if any is found); `tests/test_imports.py` asserts 0.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "src" / "agentloop"

#: Units from the top down; one layer may hold several units that do not import each other's layer upward.
LAYERS: list[set[str]] = [
    {"__main__", "cli", "commands"},  # entry points
    {"integrations"},  # trainer adapters (TRL, verl)
    {"distributed"},  # Ray mode
    {"runtime"},  # the step, and the assembly of its parts from config
    {"scheduler"},  # how many trajectories run, when they stop
    {"config"},  # the settings of everything below
    {"endpoint"},  # the OpenAI-compatible endpoint and the `openai` agent loop over it
    {"agents"},  # one trajectory
    {"rewards", "group_filters", "dataset"},  # grading a trajectory, a group; samples from files
    {"tools", "chat"},  # tool calls; token-exact chat rendering
    {"output"},  # data out: the output folder, summaries and plots (they read the lifecycle's records)
    {"engine"},  # engine access and clients, the CPU engine
    {"batch", "models", "data", "tasks"},  # trajectories -> tensors; shipped models, data; task generators
    {"types", "registry", "yaml_strict", "input_budget", "allocator", "__init__"},  # the data contracts; leaf utilities
]


@dataclass(frozen=True)
class Edge:
    src: str  #: importing module (dotted)
    dst: str  #: imported module (dotted)
    line: int


def module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def edges(root: Path = ROOT) -> tuple[set[str], list[Edge]]:
    """Every module under `root` and every import of an agentloop module written in one."""
    modules: dict[str, Path] = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    out: list[Edge] = []
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        package = mod if is_pkg else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                # `from pkg import name`: name may be a submodule (an edge to it) or an attribute (to pkg)
                targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in modules else stem for a in node.names]
            for t in targets:
                while t and t not in modules:  # `import agentloop.x.y.attr` style: the module that exists
                    t = t.rpartition(".")[0]
                if t.startswith("agentloop") and t != mod:
                    out.append(Edge(mod, t, node.lineno))
    return set(modules), sorted(set(out), key=lambda e: (e.src, e.line, e.dst))


def loaded_by_name(root: Path = ROOT) -> list[Edge]:
    """String constants that name an agentloop module (a plugin list imported with importlib, e.g. the
    built-in agent loops of `agents.registry`; a subprocess's `-m` module): the upward ones are shown
    for the reader, not counted as imports."""
    modules: dict[str, Path] = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    out = []
    for mod, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in modules:
                out.append(Edge(mod, node.value, node.lineno))
    return out


def layer_of(unit: str) -> int:
    for i, layer in enumerate(LAYERS):
        if unit in layer:
            return i
    raise KeyError(f"unit {unit!r} is in no layer of tools/check_imports.py LAYERS: add it where it belongs")


def upward(all_edges: list[Edge]) -> list[Edge]:
    return [e for e in all_edges if layer_of(unit_of(e.dst)) < layer_of(unit_of(e.src))]


def cycles(nodes: set[str], pairs: set[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected groups of more than one node (Tarjan, iterative)."""
    graph: dict[str, list[str]] = {n: [] for n in nodes}
    for a, b in pairs:
        if a != b:
            graph[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    n = stack.pop()
                    on_stack.discard(n)
                    group.append(n)
                    if n == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def report(root: Path = ROOT) -> dict[str, list]:
    modules, all_edges = edges(root)
    units = {unit_of(m) for m in modules}
    unit_pairs = {(unit_of(e.src), unit_of(e.dst)) for e in all_edges}
    return {
        "upward": upward(all_edges),
        "unit_cycles": cycles(units, unit_pairs),
        "module_cycles": cycles(modules, {(e.src, e.dst) for e in all_edges}),
    }


def main() -> int:
    r = report()
    for e in r["upward"]:
        print(f"upward: {e.src} (line {e.line}) imports {e.dst} ({unit_of(e.src)} -> {unit_of(e.dst)})")
    for c in r["unit_cycles"]:
        print("unit cycle: " + " <-> ".join(c))
    for c in r["module_cycles"]:
        print("module cycle: " + " <-> ".join(c))
    for e in upward(loaded_by_name()):  # shown, not counted: a plugin list or a subprocess's module
        print(f"(named upward as a string, not imported: {e.src} line {e.line} names {e.dst})")
    print(f"{len(r['upward'])} upward imports, {len(r['unit_cycles'])} unit cycles, "
          f"{len(r['module_cycles'])} module cycles")
    return 1 if any(r.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
