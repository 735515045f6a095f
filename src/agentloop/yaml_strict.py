"""YAML read strictly: a mapping key given twice is an error naming both lines (PyYAML's own loaders
keep the last value silently, so a setting given twice in a config file would be quietly lost).

`safe_load` is `yaml.safe_load` with that check; `DuplicateKeyError` is a `yaml.YAMLError` with the
usual marks, so callers that report `problem_mark` as file:line:column need no change. Merge keys
(`<<: *anchor`) may still be overridden by explicit keys, as YAML allows.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.constructor import ConstructorError

__all__ = ["DuplicateKeyError", "StrictSafeLoader", "safe_load", "mark_where"]


class DuplicateKeyError(ConstructorError):
    """A mapping has the same key twice."""


class StrictSafeLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses duplicated mapping keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, yaml.Node] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=False)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:  # an unhashable key: the base class reports it
                    continue
                if first is not key_node:
                    raise DuplicateKeyError(
                        "while constructing a mapping", node.start_mark,
                        f"duplicated key {key!r} (first given at line {first.start_mark.line + 1})", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def safe_load(text: str) -> Any:
    """`yaml.safe_load(text)`, refusing duplicated keys (`DuplicateKeyError`)."""
    return yaml.load(text, Loader=StrictSafeLoader)  # noqa: S506 - a SafeLoader subclass


def mark_where(path: Any, error: yaml.YAMLError) -> str:
    """`path:line:column` of a YAML error (just `path` when it has no position)."""
    mark = getattr(error, "problem_mark", None)
    return f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
