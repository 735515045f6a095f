"""Resolving `"package.module:attribute"` paths, as YAML configs and dataset rows name user code."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["import_path"]


def import_path(spec: str, what: str) -> Any:
    """The object at `"package.module:attribute"` (dotted attributes allowed). Raises ImportError
    saying which part is missing, prefixed by `what` (e.g. "interaction 'x:y'")."""
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise ImportError(f"{what}: expected an importable 'package.module:attribute' path")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"{what}: cannot import module {module_name!r}: {e}") from None
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(f"{what}: module {module_name!r} has no attribute {attr_path!r}") from None
    return obj
