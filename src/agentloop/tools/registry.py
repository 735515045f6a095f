"""The per-worker tool registry: registers tools once (objects — anything shaped like `ToolLike` — or
the entries of a verl-like YAML config, built by `tool_config`), opens/closes their per-trajectory
state, hands their schemas to chat templates, and executes one turn's calls with timeouts, bounded
parallelism and argument validation, always returning one `ToolResult` per call in call order.

Nothing a model writes, and nothing a tool does, can make `execute_calls` raise or overstay: parse
errors, unknown tools, arguments that do not match the tool's JSON schema, timeouts, any exception a
tool raises (`SystemExit`, `KeyboardInterrupt` and `CancelledError` included) and results that cannot
be made text all become results with `ok=False` and an error message written for the model. Each call
runs where the step can abandon it: a tool that is not trusted in a tool worker process
(`worker_pool`, `isolation = "process"`: the default for tools from a YAML config), a trusted one in
this process in a thread (`call_thread`). Its output is bounded in bytes while it is produced, then
in tokens (`tool_output`).
"""

from __future__ import annotations

import inspect
import logging
import pickle
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import anyio
import jsonschema

from .base import (
    ErrorKind, StateHook, ToolContext, ToolError, ToolLike, ToolResult, describe, first_line, function_of, state_hooks,
    tool_problems,
)
from .call_thread import run_in_thread, run_on_loop
from .parsers import ToolCall
from .tool_config import (
    ToolConfigError, build_entry, config_entries, entry_line, isolation_of, load_tool_class, read_yaml,
)
from .process_tools import ProcessTools
from .worker_pool import WorkerPool
from .tool_output import OutputBound, collect, truncate_tokens_locked
from .truncate import DEFAULT_MARKER, DEFAULT_MAX_BYTES, SIDES, Side, check_marker

# Re-exported: `agentloop.tools.registry.ToolConfigError` / `load_tool_class` are public names.
__all__ = ["ToolRegistry", "ToolConfigError", "load_tool_class"]

logger = logging.getLogger(__name__)


@dataclass
class _Registered:
    """A tool as registered: its OpenAI schema (YAML overrides applied), argument validator, state hooks
    (run here for an inline tool; in the trajectory's worker for a process tool) and where it runs."""

    tool: ToolLike
    schema: dict[str, Any]
    validator: Any
    create: StateHook | None
    release: StateHook | None
    isolation: str = "inline"
    spec: tuple[str, Any] | None = None  # how a worker builds it: ("entry", config entry) or ("object", tool)


class ToolRegistry:
    """Tools by name. Build once per worker; share across trajectories (per-trajectory data lives in the
    `ToolContext`, see `open_trajectory`)."""

    def __init__(self, tools: Iterable[ToolLike] = ()) -> None:
        self._tools: dict[str, _Registered] = {}
        self._workers = ProcessTools(self._tools)  # the process tools' workers and pins
        for i, tool in enumerate(tools):
            self.add(tool, where=f"tools[{i}]")

    # ---- building -------------------------------------------------------------------------------
    def add(self, tool: ToolLike, *, where: str = "tool", function: Mapping[str, Any] | None = None,
            entry: Mapping[str, Any] | None = None) -> None:
        """Register `tool`: any object with `name`, an OpenAI function `schema` and an async `execute`
        (`ToolLike`; a `Tool` subclass or not). `function` (name/description/parameters) replaces the
        function part of the tool's own schema (a YAML `tool_schema`). `entry`: the config entry the
        tool was built from (a worker process rebuilds it from there). Where its calls run is
        `isolation_of(tool, entry)`: a process tool given as an object must be picklable."""
        problems = tool_problems(tool)
        if problems:
            raise ToolConfigError(
                f"{where}: {type(tool).__name__} object is not a tool: " + "; ".join(problems)
                + " (see agentloop.tools.ToolLike)"
            )
        if function is None:
            fn = dict(function_of(tool.schema) or {})
            if fn.get("name", tool.name) != tool.name:
                raise ToolConfigError(f"{where}: tool name {tool.name!r} differs from its schema's function name {fn['name']!r}")
        else:
            fn = dict(function)
        name = fn["name"] = fn.get("name") or tool.name
        if name in self._tools:
            raise ToolConfigError(f"{where}: duplicate tool name {name!r}")
        params = fn.setdefault("parameters", {"type": "object", "properties": {}})
        try:
            if not isinstance(params, Mapping):
                raise jsonschema.SchemaError(f"{params!r} is not an object")
            cls = jsonschema.validators.validator_for(params)
            cls.check_schema(params)
        except jsonschema.SchemaError as e:
            raise ToolConfigError(f"{where}: parameters of tool {name!r} are not a valid JSON schema: {e.message}") from None
        create, release = state_hooks(tool, name)
        isolation = isolation_of(tool, entry, where)
        spec: tuple[str, Any] | None = None
        if isolation == "process":
            if getattr(tool, "runs_on_event_loop", False):
                raise ToolConfigError(f"{where}: tool {name!r} sets runs_on_event_loop, which needs isolation 'inline'"
                                      " (a process tool runs on its worker's loop)")
            if entry is not None:
                spec = ("entry", {**entry, "isolation": "inline"})
            else:
                try:
                    pickle.dumps(tool)
                except Exception as e:
                    raise ToolConfigError(f"{where}: tool {name!r} has isolation 'process' but cannot be sent to a "
                                          f"worker process: {describe(e)} (load it from a YAML config instead)") from None
                spec = ("object", tool)
        self._tools[name] = _Registered(tool, {"type": "function", "function": fn}, cls(params), create, release,
                                        isolation, spec)
        self._workers.reset()  # rebuilt with the new tool on the next call

    @classmethod
    def load(cls, path: str | Path | None) -> "ToolRegistry":
        """The tools of a runtime: the YAML file at `path` (`agent.tools`), else the built-in default,
        the calculator the shipped tiny model was trained to call. Used by `Runtime` and by Ray workers."""
        if path is not None:
            return cls.from_yaml(path)
        from .builtin import CalculatorTool

        return cls([CalculatorTool()])

    @classmethod
    def from_yaml(cls, path: str | Path) -> "ToolRegistry":
        """Build from a YAML tool config (see `from_config`). Errors are `ToolConfigError`s naming the
        file and the line: of the YAML problem (a duplicated key included), or of the entry at fault."""
        path = Path(path)
        data, root = read_yaml(path)
        try:
            return cls.from_config(data)
        except ToolConfigError as e:
            raise ToolConfigError(f"{path}{entry_line(root, str(e))}: {e}") from None

    @classmethod
    def from_config(cls, data: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None) -> "ToolRegistry":
        """`{"tools": [{"class_name": ..., "config": {...}, "tool_schema": {...}}]}` (verl's layout), or the
        bare list. `tool_schema` (optional) overrides name/description/parameters of the built tool.
        verl's `config.type` is understood: `native` is accepted (and not passed to the constructor),
        other kinds (e.g. `mcp`) are refused with a ToolConfigError."""
        reg = cls([])
        for i, entry in enumerate(config_entries(data)):
            where = f"tools[{i}]"
            tool, function = build_entry(entry, where)
            reg.add(tool, where=where, function=function, entry=entry)
        return reg

    # ---- lookup ---------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._tools)

    def get(self, name: str) -> ToolLike:
        try:
            return self._tools[name].tool
        except KeyError:
            raise KeyError(f"unknown tool {name!r}; registered: {self.names()}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)

    def schemas(self, names: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """OpenAI function schemas, for the chat template's `tools=` (all tools, or `names` in order)."""
        if names is None:
            names = self.names()
        else:
            for n in names:
                self.get(n)  # KeyError naming the unknown tool
        return [_copy_schema(self._tools[n].schema) for n in names]

    # ---- per-trajectory state -------------------------------------------------------------------
    async def open_trajectory(self, context: ToolContext) -> None:
        """Create every stateful tool's per-trajectory state (`create_state(context)`, or verl's
        `create(instance_id)`: see `tools.base.state_hooks`): an inline tool's here, a process tool's in
        a worker the trajectory is pinned to until `close_trajectory`. If one fails, the ones already
        created are released and the error (naming the tool) is raised."""
        opened: list[str] = []
        for name, reg in self._tools.items():
            if reg.create is not None and reg.isolation == "inline":
                try:
                    await reg.create(context)
                except BaseException as e:  # SystemExit & co. included: they fail this trajectory only
                    await self._release(opened, context)
                    if isinstance(e, anyio.get_cancelled_exc_class()):
                        raise
                    raise RuntimeError(f"tool {name!r}: create_state failed for trajectory {context.trajectory_id}: {first_line(e)}") from e
            opened.append(name)
        if any(r.isolation == "process" and (r.create or r.release) for r in self._tools.values()):
            try:
                await self._workers.pin(context)
            except BaseException:
                await self._release(opened, context)
                raise

    async def close_trajectory(self, context: ToolContext) -> None:
        """Release every stateful tool's per-trajectory state (all of them, even if one fails;
        shielded from cancellation so a cancelled trajectory still cleans up). Raises the first
        failure afterwards."""
        await self._release(list(self._tools), context)

    async def _release(self, names: list[str], context: ToolContext) -> None:
        errors: list[str] = []
        with anyio.CancelScope(shield=True):
            for name in names:
                release = self._tools[name].release
                if release is None or self._tools[name].isolation != "inline":
                    continue
                try:
                    await release(context)
                except BaseException as e:  # noqa: BLE001 - shielded: no cancellation of ours reaches here
                    errors.append(f"tool {name!r}: release_state failed: {first_line(e)}")
            unpinned = await self._workers.unpin(context)
            if unpinned is not None:
                errors.append(unpinned)
        if errors:
            raise RuntimeError(f"trajectory {context.trajectory_id}: " + "; ".join(errors))

    # ---- worker processes -----------------------------------------------------------------------
    def pool(self) -> WorkerPool:
        """The worker processes of this registry's process tools (started on first use)."""
        return self._workers.pool()

    def isolation(self, name: str) -> str:
        """Where the named tool's calls run: "process" or "inline"."""
        self.get(name)
        return self._tools[name].isolation

    def close(self) -> None:
        """Stop this registry's idle worker processes (the ones still busy are killed when their call
        ends; any left at interpreter exit are killed then)."""
        self._workers.close()

    @asynccontextmanager
    async def trajectory(self, context: ToolContext) -> AsyncIterator[ToolContext]:
        """`async with registry.trajectory(ctx):` = open_trajectory … close_trajectory."""
        await self.open_trajectory(context)
        try:
            yield context
        finally:
            await self.close_trajectory(context)

    # ---- execution ------------------------------------------------------------------------------
    def check_call(self, call: ToolCall) -> tuple[str, str] | None:
        """(error_kind, message for the model) if the call cannot run, else None."""
        if call.error is not None:
            return "parse", f"Error: could not parse tool call: {call.error}"
        if call.name not in self._tools:
            avail = ", ".join(self._tools) or "(none)"
            return "unknown_tool", f"Error: unknown tool {call.name!r}; available: {avail}"
        args = call.arguments if call.arguments is not None else {}
        errors = sorted(self._tools[call.name].validator.iter_errors(args), key=lambda e: list(e.absolute_path))
        if errors:
            msgs = []
            for e in errors[:3]:
                loc = "/".join(str(p) for p in e.absolute_path)
                msgs.append(f"{loc}: {e.message}" if loc else e.message)
            return "bad_arguments", f"Error: invalid arguments for tool {call.name!r}: " + "; ".join(msgs)
        return None

    async def execute_calls(
        self,
        calls: Sequence[ToolCall],
        *,
        context: ToolContext,
        timeout: float,
        max_parallel: int,
        tokenizer: Any = None,
        max_result_tokens: int | None = None,
        truncate_side: Side = "middle",
        max_result_bytes: int | None = DEFAULT_MAX_BYTES,
        truncation_marker: str = DEFAULT_MARKER,
    ) -> list[ToolResult]:
        """Run one turn's calls, at most `max_parallel` at once, each under `timeout` seconds; return
        their results in call order. Each call's output is kept up to `max_result_bytes` UTF-8 bytes
        while it is produced (None: no byte limit); then, with `tokenizer` and `max_result_tokens`,
        truncated by tokens. Both cuts are on `truncate_side` and marked with `truncation_marker`
        (result.truncated says so). Whatever a tool does, this returns within about `timeout` per
        wave of calls (see `tools.call_thread`)."""
        if max_parallel < 1:
            raise ValueError(f"max_parallel must be >= 1, got {max_parallel}")
        if not (timeout > 0):
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if truncate_side not in SIDES:
            raise ValueError(f"truncate_side must be one of {SIDES}, got {truncate_side!r}")
        check_marker(truncation_marker)
        results: list[ToolResult | None] = [None] * len(calls)
        limiter = anyio.CapacityLimiter(max_parallel)
        bound = OutputBound(max_result_bytes, truncate_side, truncation_marker)

        async def run_one(i: int, call: ToolCall) -> None:
            async with limiter:
                res = await self._execute_one(i, call, context, timeout, bound)
            if tokenizer is not None and max_result_tokens is not None:
                # Off the event loop (tokenizing is CPU work), one at a time (tokenizers are not
                # guaranteed thread-safe); the text is already bounded in bytes.
                text, cut = await anyio.to_thread.run_sync(
                    truncate_tokens_locked, res.content, tokenizer, max_result_tokens, truncate_side, truncation_marker)
                res.content, res.truncated = text, res.truncated or cut
            results[i] = res

        async with anyio.create_task_group() as tg:
            for i, call in enumerate(calls):
                tg.start_soon(run_one, i, call)
        return [r for r in results if r is not None]

    async def _execute_one(self, index: int, call: ToolCall, context: ToolContext, timeout: float,
                           bound: OutputBound) -> ToolResult:
        problem = self.check_call(call)
        if problem is not None:
            kind, msg = problem
            return ToolResult(index, call.name, msg, ok=False, error_kind=kind, call_id=call.id)  # type: ignore[arg-type]
        tool = self._tools[call.name].tool  # type: ignore[index]
        name = call.name
        sink = bound.sink()
        arguments = dict(call.arguments or {})

        async def work() -> None:
            out = tool.execute(arguments, context)
            if inspect.isawaitable(out):
                out = await out
            await collect(out, sink, name)  # type: ignore[arg-type]

        t0 = time.monotonic()
        if self._tools[name].isolation == "process":  # type: ignore[index]
            return await self._workers.call(index, call, context, timeout, bound, t0)
        try:
            if getattr(tool, "runs_on_event_loop", False):
                outcome = await run_on_loop(work, timeout=timeout)
            else:
                outcome = await run_in_thread(work, timeout=timeout, name=name or "", on_abandon=sink.close)
        finally:
            sink.close()  # an abandoned producer stops at its next piece (time bound on output)
        seconds = time.monotonic() - t0

        def error(text: str, kind: ErrorKind) -> ToolResult:
            return ToolResult(index, name, text, ok=False, error_kind=kind, seconds=seconds, call_id=call.id,
                              truncated=sink.truncated)

        if outcome.timed_out:
            partial = sink.text()
            more = f"; its output so far:\n{partial}" if partial else ""
            return error(f"Error: tool {name!r} timed out after {timeout:g} seconds{more}", "timeout")
        e = outcome.error
        if isinstance(e, ToolError):
            return error(f"Error: {e}", e.kind)
        if e is not None:
            # Not a ToolError, so possibly a bug in the tool: keep the traceback for whoever runs the worker.
            logger.warning("tool %r raised in trajectory %s", name, context.trajectory_id, exc_info=e)
            return error(f"Error: {describe(e)}", "exception")
        return ToolResult(index, name, sink.text(), seconds=seconds, call_id=call.id, truncated=sink.truncated)


def _copy_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy callers may edit without changing the registry (the parameters schema is shared, read-only)."""
    return {**schema, "function": dict(schema["function"])}
