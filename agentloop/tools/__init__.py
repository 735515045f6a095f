"""Tools for agent loops: the `Tool` contract, call parsers, the per-worker registry, output truncation
and the built-in tools (`calculator`, `python`).

Layering: tools import nothing above them (no agents, scheduler or runtime) and nothing of the engine.
"""

from .base import Tool, ToolContext, ToolError, ToolResult
from .parsers import ToolCall, ToolCallParser, get_parser, register_parser, registered_parsers
from .registry import ToolConfigError, ToolRegistry
from .truncate import truncate_by_tokens

__all__ = [
    "Tool",
    "ToolCall",
    "ToolCallParser",
    "ToolConfigError",
    "ToolContext",
    "ToolError",
    "ToolRegistry",
    "ToolResult",
    "get_parser",
    "register_parser",
    "registered_parsers",
    "truncate_by_tokens",
]
