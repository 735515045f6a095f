"""Tools for agent loops: the tool contract (`ToolLike`, structural; `Tool`, a base class), call parsers,
the per-worker registry, output truncation and the built-in tools (`calculator`, `python`).

Layering: tools import nothing above them (no agents, scheduler or runtime) and nothing of the engine.
"""

from .base import Tool, ToolContext, ToolError, ToolLike, ToolResult, state_hooks, tool_problems
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
    "ToolLike",
    "ToolRegistry",
    "ToolResult",
    "get_parser",
    "register_parser",
    "registered_parsers",
    "state_hooks",
    "tool_problems",
    "truncate_by_tokens",
]
