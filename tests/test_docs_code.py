"""The Python code blocks of README.md, docs/*.md and benchmarks/README.md are programs that work.

Every ```python block must be a complete program (it compiles as a module: no top-level `await`,
no fragments) whose imports resolve against this checkout. A block runs as pasted, in a fresh
interpreter in an empty folder, and must exit 0, unless the line before its fence says why it
cannot run here: `<!-- docs-test: compile-only (REASON) -->` (e.g. it needs GPUs).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "README.md"]
FENCE = re.compile(r"(?:^(?P<marker><!-- docs-test: compile-only \((?P<reason>[^)]+)\) -->)\n)?^```python\n(?P<code>.*?)^```$",
                   re.M | re.S)


def code_blocks() -> list[tuple[str, str, str | None]]:
    """(id as file:line, code, compile-only reason or None) of every python block."""
    blocks = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start("code"))
            blocks.append((f"{doc.relative_to(REPO)}:{line}", m.group("code"), m.group("reason")))
    return blocks


BLOCKS = code_blocks()

#: Packages of optional extras a doc block may import (module -> extra): without them the block is skipped.
OPTIONAL_EXTRAS = {"verl": "verl", "trl": "trl", "datasets": "trl"}


def _top_level_modules(imports: list[ast.stmt]) -> set[str]:
    names = {a.name for node in imports if isinstance(node, ast.Import) for a in node.names}
    names |= {node.module for node in imports if isinstance(node, ast.ImportFrom) and node.module and not node.level}
    return {n.split(".")[0] for n in names}


def test_the_docs_have_python_blocks() -> None:
    assert any(where.startswith("README.md:") for where, _, _ in BLOCKS)
    # A marker must sit right above a python fence, or it would silently stop applying.
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        assert text.count("<!-- docs-test:") == len(re.findall(r"<!-- docs-test: compile-only \([^)]+\) -->\n```python\n", text)), doc


def _block_params() -> list[Any]:
    """A block that runs a `Runtime` starts the embedded CPU engine and rolls out (15-30 s of wall on
    the 2-core machine each): `slow`, so the fast subset stays fast; CI runs every block."""
    return [pytest.param(where, code, reason, id=where,
                         marks=[pytest.mark.slow] if reason is None and "Runtime(" in code else [])
            for where, code, reason in BLOCKS]


@pytest.mark.parametrize("where,code,reason", _block_params())
def test_python_block_is_a_working_program(where: str, code: str, reason: str | None, tmp_path: Path) -> None:
    tree = compile(code, where, "exec", ast.PyCF_ONLY_AST)  # a SyntaxError names the doc and line
    imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    for name in _top_level_modules(imports) & OPTIONAL_EXTRAS.keys():  # a block for an extra that is not installed
        pytest.importorskip(name, reason=f"{where} needs the {OPTIONAL_EXTRAS[name]!r} extra")
    exec(compile(ast.Module(body=imports, type_ignores=[]), where, "exec"), {})  # every import resolves
    if reason is not None:
        return
    script = tmp_path / "block.py"
    script.write_text(code, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}
    env.pop("ENGINE_URL", None)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, f"{where} failed as pasted:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def test_the_repo_cites_no_file_outside_it() -> None:
    """Code and docs point only at files a reader of the repository has: no relative path that climbs out
    of the checkout (`../name/...`), which only exists on the machine it was written on (the GPU recipe is
    docs/gpu.md with its scripts in tools/gpu/, the recorded SGLang responses are in tests/fixtures/)."""
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    climbing = re.compile(r"(?<![\w.])(?:\.\./)+[\w.-]+/[\w./-]+")
    hits = []
    for name in files:
        if not name.endswith((".py", ".md", ".sh", ".yaml", ".toml")) or name == "tests/test_docs_code.py":
            continue
        if name.startswith("tests/test_python_sandbox"):  # path-traversal attacks on the sandbox, on purpose
            continue
        folder = (REPO / name).parent
        for n, line in enumerate((REPO / name).read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for m in climbing.finditer(line):
                target = (folder / m.group(0)).resolve()
                if REPO.resolve() not in target.parents:
                    hits.append(f"{name}:{n}: {m.group(0)}")
    assert hits == [], "\n".join(hits)
