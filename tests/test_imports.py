"""The package's import graph against its declared layer order (tools/check_imports.py), and the one
generic name registry every "pick it by name" setting uses (agentloop.registry)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import check_imports  # noqa: E402

from agentloop.registry import Registry  # noqa: E402


def test_no_import_cycles_and_no_upward_imports() -> None:
    r = check_imports.report()
    assert [f"{e.src}:{e.line} -> {e.dst}" for e in r["upward"]] == []
    assert r["unit_cycles"] == []
    assert r["module_cycles"] == []


def test_every_unit_has_a_layer() -> None:
    modules, _ = check_imports.edges()
    for m in modules:
        check_imports.layer_of(check_imports.unit_of(m))  # raises naming a unit missing from LAYERS


def test_the_check_finds_an_upward_import_and_a_cycle(tmp_path: Path) -> None:
    # A package with engine -> agents (upward) and agents.a <-> agents.b (a module cycle).
    root = tmp_path / "agentloop"
    (root / "agents").mkdir(parents=True)
    (root / "engine").mkdir()
    (root / "__init__.py").write_text("")
    (root / "agents" / "__init__.py").write_text("")
    (root / "agents" / "a.py").write_text("from . import b\n")
    (root / "agents" / "b.py").write_text("def f():\n    from .a import x\n")
    (root / "engine" / "__init__.py").write_text("")
    (root / "engine" / "x.py").write_text("from ..agents import a\n")
    r = check_imports.report(root)
    assert [(e.src, e.dst) for e in r["upward"]] == [("agentloop.engine.x", "agentloop.agents.a")]
    assert r["module_cycles"] == [["agentloop.agents.a", "agentloop.agents.b"]]
    assert r["unit_cycles"] == []


def test_agents_never_import_the_endpoint() -> None:
    agents = Path(check_imports.ROOT) / "agents"
    for path in agents.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert "endpoint" not in (node.module or ""), f"{path.name}:{node.lineno} imports the endpoint"


def test_registry_registers_gets_and_names_what_is_missing() -> None:
    reg: Registry[int] = Registry("number")
    reg.register("one", "uno")(1)
    assert reg.get("uno") == 1 and reg.names() == ["one", "uno"] and "one" in reg
    with pytest.raises(KeyError, match=r"unknown number 'two'; registered: \['one', 'uno'\]"):
        reg.get("two")
    with pytest.raises(ValueError, match="a number needs a name"):
        reg.add("", 2)


def test_registry_check_and_error_type() -> None:
    def positive(name: str, v: int) -> None:
        if v <= 0:
            raise TypeError(f"{name}: {v} is not positive")

    reg: Registry[int] = Registry("count", error=ValueError, check=positive)
    with pytest.raises(TypeError, match="minus: -1 is not positive"):
        reg.add("minus", -1)
    with pytest.raises(ValueError, match="unknown count 'minus'"):
        reg.get("minus")


def test_registry_loads_its_builtins_on_first_lookup() -> None:
    from agentloop.agents.registry import AGENT_LOOPS, BUILTIN_AGENT_MODULES

    assert "agentloop.endpoint.agent" in BUILTIN_AGENT_MODULES
    assert {"openai", "tool", "single_turn", "interaction", "replay"} <= set(AGENT_LOOPS.names())
    reg: Registry[object] = Registry("thing", builtins=["agentloop.no_such_module"])
    with pytest.raises(ModuleNotFoundError):
        reg.names()
