"""The tool contract: what a tool is (`Tool`), what it sees per trajectory (`ToolContext`) and what one
call produced (`ToolResult`).

Tools are built once per worker and shared by every trajectory, so a tool keeps per-trajectory data in
`context.state` (created/released by `create_state`/`release_state`), never on `self`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

ErrorKind = Literal["parse", "unknown_tool", "bad_arguments", "timeout", "exception"]


class ToolError(Exception):
    """Raise from `execute` to answer the model with an error: the registry returns `Error: <message>`
    (ok=False) instead of the exception's type and text. `kind` is the result's error_kind ("timeout"
    for a tool's own time limit, else "exception")."""

    def __init__(self, message: str, *, kind: "ErrorKind" = "exception") -> None:
        super().__init__(message)
        self.kind: ErrorKind = kind


@dataclass
class ToolContext:
    """What a tool may know about the trajectory calling it.

    `state` is the trajectory's private scratch space for tools (key it by tool name); `scratch_dir` a
    directory the trajectory may use for files (None = tools make their own); `extra` is free-form
    (e.g. the sample's ground truth for tools that grade)."""

    trajectory_id: str
    state: dict[str, Any] = field(default_factory=dict)
    scratch_dir: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class ToolResult:
    """The outcome of one call, in the order the calls were made. `content` is the text the model will
    see (an error message meant for the model when `ok` is False)."""

    index: int
    name: str | None
    content: str
    ok: bool = True
    error_kind: ErrorKind | None = None
    seconds: float = 0.0
    truncated: bool = False
    call_id: str | None = None


class Tool(ABC):
    """Subclass, set `name`/`description`/`parameters` (class attributes or in `__init__`), implement
    `execute`. Keyword arguments of `__init__` are the tool's YAML `config`."""

    name: ClassVar[str] | str = ""
    description: ClassVar[str] | str = ""
    #: JSON schema of the arguments object (OpenAI function `parameters`).
    parameters: ClassVar[dict[str, Any]] | dict[str, Any] = {"type": "object", "properties": {}}

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI function schema, as chat templates and SGLang expect it."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    @abstractmethod
    async def execute(self, arguments: dict[str, Any], context: ToolContext) -> str:
        """Run one call and return the text for the model. Raise on failure: the registry turns the
        exception into an error result; it never ends the trajectory."""

    async def create_state(self, context: ToolContext) -> None:
        """Set up per-trajectory state in `context.state` (called once when a trajectory opens)."""

    async def release_state(self, context: ToolContext) -> None:
        """Release what `create_state` made (called once when the trajectory closes, even on failure)."""

    @classmethod
    def has_state(cls) -> bool:
        return cls.create_state is not Tool.create_state or cls.release_state is not Tool.release_state

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
