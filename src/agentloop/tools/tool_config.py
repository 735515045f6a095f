"""Tools from a verl-like config: reads a tools YAML file (or its parsed mapping/list), imports each
entry's `class_name`, builds it with its `config` and applies its `tool_schema` override.

Every problem is a `ToolConfigError` whose message names the entry (`tools[i]`) and the field; a
YAML file's errors also name the file and the line (`read_yaml` + `entry_line`). Registering the
built tools (name clashes, schema validity) is `ToolRegistry`'s job.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from ..yaml_strict import mark_where
from ..yaml_strict import safe_load as strict_yaml_load
from .base import Tool, ToolLike, first_line, function_of

__all__ = ["ISOLATIONS", "ToolConfigError", "build_entry", "config_entries", "entry_line", "isolation_of",
           "load_tool_class", "read_yaml"]

#: Where a tool's calls run: "process" (a tool worker process, `tools.worker_pool`) or "inline" (the
#: runtime's process, in a thread the step can abandon, `tools.call_thread`).
ISOLATIONS = ("process", "inline")


class ToolConfigError(ValueError):
    """A tool config entry is wrong; the message names the entry (`tools[i]`) and the field."""


def load_tool_class(path: str) -> type[ToolLike]:
    """Import `package.module.ClassName` and check it is a tool class: a `Tool` subclass, or any class
    with an `execute` method (its instances are checked against `ToolLike` when registered)."""
    module_name, _, cls_name = path.rpartition(".")
    if not module_name:
        raise ImportError(f"{path!r} is not a dotted path 'package.module.ClassName'")
    module = importlib.import_module(module_name)
    try:
        cls = getattr(module, cls_name)
    except AttributeError:
        raise ImportError(f"module {module_name!r} has no attribute {cls_name!r}") from None
    if not isinstance(cls, type):
        raise TypeError(f"{path} is a {type(cls).__name__}, not a class")
    if not (issubclass(cls, Tool) or callable(getattr(cls, "execute", None))):
        raise TypeError(
            f"{path} is not a tool class: no `execute` method "
            "(subclass agentloop.tools.Tool, or give it name, schema and async execute(arguments, context))"
        )
    return cls


def read_yaml(path: Path) -> tuple[Any, yaml.Node | None]:
    """The parsed tool config file and its node tree (for `entry_line`). Unreadable files and YAML
    problems (a duplicated key included) are `ToolConfigError`s naming the file and the line."""

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ToolConfigError(f"cannot read tool config {path}: {e}") from None
    # Imported here, not at the top: `agentloop.config` imports `agents.base`, which imports `tools`
    # (a top-level import made `import agentloop.agents.base` fail as a circular import).

    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = strict_yaml_load(text)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e)
        raise ToolConfigError(f"{mark_where(path, e)}: not valid YAML: {problem}") from None
    return data, root


def entry_line(root: yaml.Node | None, message: str) -> str:
    """`:line` of the `tools[i]` entry a message starts with (of the file's top node otherwise), or ""."""
    m = re.match(r"tools\[(\d+)\]", message)
    node = root
    if isinstance(root, yaml.MappingNode):
        node = next((v for k, v in root.value if getattr(k, "value", None) == "tools"), root)
    if m is not None and isinstance(node, yaml.SequenceNode) and int(m.group(1)) < len(node.value):
        node = node.value[int(m.group(1))]
    return f":{node.start_mark.line + 1}" if node is not None else ""


def config_entries(data: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None) -> list[Any]:
    """The entries of a config: `{"tools": [...]}` (verl's layout), the bare list, or None (no tools)."""
    if data is None:
        return []
    if isinstance(data, Mapping):
        if "tools" not in data:
            raise ToolConfigError(f"tool config needs a top-level 'tools' list; got keys {sorted(data)}")
        entries = data["tools"]
    else:
        entries = data
    if entries is None:
        entries = []
    if not isinstance(entries, list):
        raise ToolConfigError(f"'tools' must be a list, got {type(entries).__name__}")
    return entries


def build_entry(entry: Any, where: str) -> tuple[ToolLike, dict[str, Any] | None]:
    """The tool an entry builds and its `tool_schema` override's function part (None without one)."""
    if not isinstance(entry, Mapping):
        raise ToolConfigError(f"{where}: must be a mapping with 'class_name', got {type(entry).__name__}")
    config = entry.get("config") or {}
    if not isinstance(config, Mapping):
        raise ToolConfigError(f"{where}.config: must be a mapping, got {type(config).__name__}")
    config = _without_verl_type(config, where)  # before the field check: an mcp entry's 'mcp' key gets this error
    unknown = set(entry) - {"class_name", "config", "tool_schema", "isolation"}
    if unknown:
        raise ToolConfigError(
            f"{where}: unknown field(s) {sorted(unknown)}; expected class_name, config, tool_schema, isolation")
    if "isolation" in entry and entry["isolation"] not in ISOLATIONS:
        raise ToolConfigError(f"{where}.isolation: must be one of {list(ISOLATIONS)}, got {entry['isolation']!r}")
    class_name = entry.get("class_name")
    if not isinstance(class_name, str) or not class_name:
        raise ToolConfigError(f"{where}.class_name: required, a dotted path like agentloop.tools.builtin.calculator.CalculatorTool")
    try:
        tool_cls = load_tool_class(class_name)
    except (ImportError, TypeError) as e:
        raise ToolConfigError(f"{where}.class_name: cannot load {class_name!r}: {first_line(e)}") from None
    try:
        inspect.signature(tool_cls).bind(**config)
    except TypeError as e:
        raise ToolConfigError(f"{where}.config: {tool_cls.__name__} does not accept it: {e}") from None
    try:
        tool = tool_cls(**config)
    except Exception as e:
        raise ToolConfigError(f"{where}.config: {tool_cls.__name__}(...) failed: {type(e).__name__}: {first_line(e)}") from e
    schema = entry.get("tool_schema")
    return tool, (_apply_schema(tool, schema, where) if schema is not None else None)


def isolation_of(tool: Any, entry: Mapping[str, Any] | None, where: str) -> str:
    """Where a tool's calls run: the config entry's `isolation`, else the tool's own `isolation`
    attribute, else "process" for a tool from a config entry (code named by a config file is not
    trusted by default) and "inline" for a tool object built by the caller's own code."""
    if entry is not None and "isolation" in entry:
        return entry["isolation"]
    own = getattr(tool, "isolation", None)
    if own is None:
        return "process" if entry is not None else "inline"
    if own not in ISOLATIONS:
        raise ToolConfigError(f"{where}: {type(tool).__name__}.isolation must be one of {list(ISOLATIONS)}, got {own!r}")
    return own


def _without_verl_type(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The constructor's keyword arguments: `config` less verl's `type` key (verl's tool registry reads
    `config.type` to pick native, MCP or other tool kinds). Only native tools exist here, so `native`
    is dropped and any other kind is refused with a message saying so."""
    config = dict(config)
    if "type" not in config:
        return config
    kind = config.pop("type")
    if kind != "native":
        raise ToolConfigError(
            f"{where}.config.type: {kind!r} tools are not supported; agentloop runs native tools only "
            "(verl's `type: native`, a Tool subclass built from class_name and config)"
        )
    return config


def _apply_schema(tool: ToolLike, schema: Any, where: str) -> dict[str, Any]:
    """The tool's function schema with the entry's `tool_schema` fields (name, description, parameters)
    put over it. A `Tool` subclass instance also gets them as attributes, so its own `schema` agrees."""
    field = f"{where}.tool_schema"
    if not isinstance(schema, Mapping):
        raise ToolConfigError(f"{field}: must be a mapping, got {type(schema).__name__}")
    fn = function_of(schema)
    if fn is None:
        raise ToolConfigError(f"{field}: expected an OpenAI function schema {{type: function, function: {{name, description, parameters}}}}")
    if "name" in fn and (not isinstance(fn["name"], str) or not fn["name"]):
        raise ToolConfigError(f"{field}.function.name: must be a non-empty string")
    if "description" in fn and not isinstance(fn["description"], str):
        raise ToolConfigError(f"{field}.function.description: must be a string")
    if "parameters" in fn and not isinstance(fn["parameters"], Mapping):
        raise ToolConfigError(f"{field}.function.parameters: must be a JSON schema object")
    given = {k: (dict(fn[k]) if k == "parameters" else fn[k]) for k in ("name", "description", "parameters") if k in fn}
    if isinstance(tool, Tool):
        for k, v in given.items():
            setattr(tool, k, v)
    try:
        own = dict(function_of(tool.schema) or {})
    except Exception:  # a broken schema property: `add` reports it
        own = {}
    return {**own, **given}
