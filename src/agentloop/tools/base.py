"""The tool contract: what a tool is (`ToolLike`, structurally; `Tool`, a convenient base class), what it
sees per trajectory (`ToolContext`) and what one call produced (`ToolResult`).

Any object with a `name`, an OpenAI function `schema` and an `execute(arguments, context)` is a
tool; subclassing `Tool` is optional. `tool_problems` says what an object lacks. `execute` may be
async or plain (a plain one never runs on the event loop) and may return the text, or stream it as a
(sync or async) iterator of text pieces, which the registry reads only up to its byte limit.
A tool runs in a tool worker process (`isolation = "process"`, `tools.worker_pool`), or in this
process on its own event loop in a thread the step can abandon (`tools.call_thread`), unless it sets
`runs_on_event_loop`.

Tools are built once per worker and shared by every trajectory, so a tool keeps per-trajectory data in
`context.state` (created/released by `create_state(context)`/`release_state(context)`), or, verl-style,
keyed by the trajectory id it gets in `create(instance_id, **kwargs)`/`release(instance_id, **kwargs)`;
never in one shared attribute. `state_hooks` finds a tool's pair, whichever names it uses.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, ClassVar, Literal, Mapping, Protocol, runtime_checkable

ErrorKind = Literal["parse", "unknown_tool", "bad_arguments", "timeout", "exception"]


class ToolError(Exception):
    """Raise from `execute` to answer the model with an error: the registry returns `Error: <message>`
    (ok=False) instead of the exception's type and text. `kind` is the result's error_kind ("timeout"
    for a tool's own time limit, else "exception")."""

    def __init__(self, message: str, *, kind: "ErrorKind" = "exception") -> None:
        super().__init__(message)
        self.kind: ErrorKind = kind


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none), for one-line reports."""
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def describe(e: BaseException) -> str:
    """`Type: first line of the message` (just `Type` when there is no message)."""
    msg = str(e).strip()
    return f"{type(e).__name__}: {msg.splitlines()[0]}" if msg else type(e).__name__


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


@runtime_checkable
class ToolLike(Protocol):
    """What the registry needs of a tool. Structural: any object with these members is a tool.
    `execute` is `async def` or plain `def`, returning text or an iterator of text pieces.
    Optional members: `create_state(context)`/`release_state(context)` or verl's
    `create(instance_id, **kwargs)`/`release(instance_id, **kwargs)` (see `state_hooks`), and
    `runs_on_event_loop` (see `Tool`)."""

    name: str

    @property
    def schema(self) -> Mapping[str, Any]:
        """OpenAI function schema `{"type": "function", "function": {"name", "description", "parameters"}}`."""
        ...

    def execute(self, arguments: dict[str, Any], context: "ToolContext") -> Any: ...


def is_async_callable(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def tool_problems(obj: Any) -> list[str]:
    """What keeps `obj` from being a tool (empty if nothing): each item names the missing or wrong member."""
    problems: list[str] = []
    name = getattr(obj, "name", None)
    if not isinstance(name, str) or not name:
        problems.append("`name` (a non-empty str)" + ("" if name is None else f", got {name!r}"))
    execute = getattr(obj, "execute", None)
    if execute is None or not callable(execute):
        problems.append("`execute` (async def execute(self, arguments, context) -> str)")
    elif getattr(obj, "runs_on_event_loop", False) and not (
            is_async_callable(execute) or inspect.isasyncgenfunction(execute)):
        problems.append("`execute` must be async when `runs_on_event_loop` is set (a plain one would block the event loop)")
    try:
        schema = getattr(obj, "schema", None)
    except Exception as e:  # a schema property that raises
        problems.append(f"`schema` raised {type(e).__name__}: {e}")
        return problems
    if schema is None:
        problems.append('`schema` (an OpenAI function schema {"type": "function", "function": {...}})')
    elif function_of(schema) is None:
        problems.append('`schema` must be an OpenAI function schema {"type": "function", "function": {"name", "parameters"}}'
                        f", got {schema!r:.120}")
    for hook in ("create_state", "release_state"):  # verl's create/release count only when async
        fn = getattr(obj, hook, None)
        if fn is not None and not is_async_callable(fn):
            problems.append(f"`{hook}` must be an async method")
    return problems


def function_of(schema: Any) -> Mapping[str, Any] | None:
    """The `function` part of an OpenAI tool schema (a bare function dict is accepted too), or None."""
    if not isinstance(schema, Mapping) or schema.get("type", "function") != "function":
        return None
    fn = schema.get("function", schema)
    return fn if isinstance(fn, Mapping) else None


StateHook = Callable[["ToolContext"], Awaitable[Any]]


def _overrides(tool: Any, attr: str) -> bool:
    """`tool` has an `attr` of its own (not the no-op default of the `Tool` base class)."""
    own = getattr(tool, attr, None)
    return own is not None and getattr(own, "__func__", own) is not getattr(Tool, attr)


def state_hooks(tool: Any, name: str | None = None) -> tuple[StateHook | None, StateHook | None]:
    """(create, release) of a tool's per-trajectory state as callables of the `ToolContext`, or None.

    `create_state(context)`/`release_state(context)` (this package's names) are used when the tool
    defines either; otherwise verl's `create(instance_id, **create_kwargs)`/`release(instance_id,
    **release_kwargs)` with the trajectory id as instance id and, as in verl, the keyword arguments
    from the sample's `tools_kwargs[<name>]["create_kwargs"/"release_kwargs"]` when it has them
    (`name`: the tool's registered name, default `tool.name`)."""
    if _overrides(tool, "create_state") or _overrides(tool, "release_state"):
        return (tool.create_state if _overrides(tool, "create_state") else None,
                tool.release_state if _overrides(tool, "release_state") else None)
    # Only async ones: a sync `create` is more likely a factory than verl's per-trajectory hook.
    create, release = (
        fn if is_async_callable(fn) else None for fn in (getattr(tool, "create", None), getattr(tool, "release", None))
    )
    if create is None and release is None:
        return None, None
    name = name if name is not None else getattr(tool, "name", "")

    def kwargs(context: ToolContext, key: str) -> dict[str, Any]:
        every = context.extra.get("tools_kwargs")
        mine = every.get(name) if isinstance(every, Mapping) else None
        args = mine.get(key) if isinstance(mine, Mapping) else None
        return dict(args) if isinstance(args, Mapping) else {}

    async def create_hook(context: ToolContext) -> Any:
        return await create(context.trajectory_id, **kwargs(context, "create_kwargs"))

    async def release_hook(context: ToolContext) -> Any:
        return await release(context.trajectory_id, **kwargs(context, "release_kwargs"))

    return (create_hook if create is not None else None, release_hook if release is not None else None)


class Tool(ABC):
    """Subclass, set `name`/`description`/`parameters` (class attributes or in `__init__`), implement
    `execute`. Keyword arguments of `__init__` are the tool's YAML `config`."""

    name: ClassVar[str] | str = ""
    description: ClassVar[str] | str = ""
    #: False (default): every call runs on its own event loop in a daemon thread, so a call that blocks,
    #: ignores cancellation or outlives its timeout is abandoned and the step goes on. True: calls are
    #: awaited on the worker's event loop — for async tools that share loop-bound state (a per-loop
    #: limiter, connections made in `create_state`) and promise never to block and to honour
    #: cancellation; a tool that breaks the promise can stall the step.
    runs_on_event_loop: ClassVar[bool] = False
    #: Where calls run (see docs/tools.md): "process" — a tool worker process, so a tool that exits,
    #: holds the GIL, or leaves threads or processes behind ends only its own call; "inline" — this
    #: process (trusted code only: the built-in calculator and python tools). None: the registry
    #: decides — "process" for a tool from a YAML config, "inline" for an object passed in code. A
    #: YAML entry's `isolation:` field overrides both.
    isolation: ClassVar[str | None] = None
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
    async def execute(self, arguments: dict[str, Any], context: ToolContext) -> Any:
        """Run one call and return the text for the model (or an iterator of text pieces). Raise on
        failure: the registry turns the exception into an error result; it never ends the trajectory.
        May also be overridden by a plain `def` (it then runs in its thread like any call)."""

    async def create_state(self, context: ToolContext) -> None:
        """Set up per-trajectory state in `context.state` (called once when a trajectory opens)."""

    async def release_state(self, context: ToolContext) -> None:
        """Release what `create_state` made (called once when the trajectory closes, even on failure)."""

    def has_state(self) -> bool:
        """Whether the tool has per-trajectory state hooks (either naming, see `state_hooks`)."""
        return state_hooks(self) != (None, None)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
