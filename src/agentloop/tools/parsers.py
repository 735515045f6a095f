"""Tool-call parsers: turn a model turn's text into (content without the calls, the calls).

A parser never raises on model output: a malformed call (bad JSON, no name, an unterminated tag) comes
back as a `ToolCall` with `error` set, so the agent loop can answer the model with the error as the tool
result. So does a pathological one: JSON nested deeper than `MAX_CALL_DEPTH` levels or a call longer
than `MAX_CALL_CHARS` characters is refused with a message saying so (never a RecursionError). Formats plug in with `@register_parser("name")`; built-in: `hermes` (alias `qwen`, `qwen25`) and `llama3` (Llama 3.1/3.2 JSON calls).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

from ..registry import Registry

__all__ = [
    "ToolCall",
    "ToolCallParser",
    "HermesToolCallParser",
    "Llama3ToolCallParser",
    "PARSERS",
    "register_parser",
    "get_parser",
    "registered_parsers",
    "format_hermes_call",
    "format_llama3_calls",
    "CallTooComplex",
    "MAX_CALL_DEPTH",
    "MAX_CALL_CHARS",
]


@dataclass
class ToolCall:
    """One call as the model wrote it. `raw` is the exact text of the call (tags included); when `error`
    is set, `name` and/or `arguments` may be None."""

    name: str | None
    arguments: dict[str, Any] | None
    raw: str
    error: str | None = None
    id: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class ToolCallParser(ABC):
    """Subclass and register with `@register_parser(name)`."""

    name: str = ""

    @abstractmethod
    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """Return (the text with the calls removed, the calls in order). Never raises on model output."""


def _check_parser(name: str, cls: Any) -> None:
    if not (isinstance(cls, type) and issubclass(cls, ToolCallParser)):
        raise TypeError(f"{cls!r} is not a ToolCallParser subclass")


PARSERS: Registry[type[ToolCallParser]] = Registry("tool-call parser", check=_check_parser)


def register_parser(*names: str) -> Callable[[type[ToolCallParser]], type[ToolCallParser]]:
    """Class decorator: `@register_parser("hermes", "qwen")` registers the class under each name."""
    if not names:
        raise ValueError("register_parser needs at least one name")

    def deco(cls: type[ToolCallParser]) -> type[ToolCallParser]:
        PARSERS.register(*names)(cls)
        if not cls.name:
            cls.name = names[0]
        return cls

    return deco


def get_parser(name: str) -> ToolCallParser:
    """A new parser of the format registered as `name`."""
    return PARSERS.get(name)()


def registered_parsers() -> list[str]:
    return PARSERS.names()


#: Most nesting levels (objects and arrays) a tool call's JSON may have; deeper is refused.
MAX_CALL_DEPTH = 64
#: Most characters one tool call's JSON may have; longer is refused.
MAX_CALL_CHARS = 1_000_000


class CallTooComplex(ValueError):
    """A tool call's JSON is nested too deeply or too long (the message says which, and the limit)."""


def _depth(obj: Any) -> int:
    """Nesting depth of decoded JSON (iterative: a deep value must not recurse here either)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, dict):
            o = list(o.values())
        if isinstance(o, list):
            deepest = max(deepest, d)
            if d > MAX_CALL_DEPTH:
                break
            stack.extend((v, d + 1) for v in o if isinstance(v, (dict, list)))
    return deepest


def decode_json(decoder: json.JSONDecoder, text: str, pos: int) -> tuple[Any, int]:
    """`decoder.raw_decode(text, pos)` within the limits: raises json.JSONDecodeError for bad JSON and
    `CallTooComplex` for JSON longer than `MAX_CALL_CHARS` or nested deeper than `MAX_CALL_DEPTH`."""
    try:
        obj, end = decoder.raw_decode(text, pos)
    except RecursionError:
        raise CallTooComplex(f"tool call JSON is nested too deeply (more than {MAX_CALL_DEPTH} levels)") from None
    if end - pos > MAX_CALL_CHARS:
        raise CallTooComplex(f"tool call JSON is {end - pos} characters long, more than the limit of {MAX_CALL_CHARS}")
    if _depth(obj) > MAX_CALL_DEPTH:
        raise CallTooComplex(f"tool call JSON is nested too deeply (more than {MAX_CALL_DEPTH} levels)")
    return obj, end


def _normalize_call(obj: Any) -> tuple[str | None, dict[str, Any] | None, str | None]:
    """(name, arguments, error) from a decoded `{"name": ..., "arguments": ...}` object."""
    if not isinstance(obj, dict):
        return None, None, f"a tool call must be a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None, None, 'tool call has no "name" (a non-empty string)'
    # "parameters" is what some Hermes fine-tunes write; absent arguments mean a call without arguments.
    args: Any = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
    if isinstance(args, str):
        try:
            args = decode_json(json.JSONDecoder(), args, len(args) - len(args.lstrip()))[0] if args.strip() else {}
        except json.JSONDecodeError as e:
            return name, None, f'"arguments" of {name!r} is a string that is not valid JSON: {e}'
        except CallTooComplex as e:
            return name, None, f'"arguments" of {name!r}: {e}'
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return name, None, f'"arguments" of {name!r} must be a JSON object, got {type(args).__name__}'
    return name, args, None


@register_parser("hermes", "qwen", "qwen25")
class HermesToolCallParser(ToolCallParser):
    """Hermes / Qwen2.5 / Qwen3 format: each call is `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
    several per turn allowed. The JSON is decoded with a real JSON decoder rather than a regex, so a
    string argument may itself contain `</tool_call>`."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def __init__(self) -> None:
        self._decoder = json.JSONDecoder()
        self._ws = re.compile(r"\s*")

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls: list[ToolCall] = []
        content: list[str] = []
        pos = 0
        while True:
            start = text.find(self.open_tag, pos)
            if start < 0:
                content.append(text[pos:])
                break
            content.append(text[pos:start])
            call, pos = self._parse_one(text, start)
            calls.append(call)
        return "".join(content).strip(), calls

    def _parse_one(self, text: str, start: int) -> tuple[ToolCall, int]:
        body = start + len(self.open_tag)
        j = self._ws.match(text, body).end()  # type: ignore[union-attr]
        try:
            obj, end = decode_json(self._decoder, text, j)
        except CallTooComplex as e:
            close = text.find(self.close_tag, body)
            end = len(text) if close < 0 else close + len(self.close_tag)
            return ToolCall(None, None, text[start:end], str(e)), end
        except json.JSONDecodeError as e:
            close = text.find(self.close_tag, body)
            if close < 0:
                return ToolCall(None, None, text[start:], f"unterminated {self.open_tag} (no {self.close_tag}); invalid JSON: {e.msg}"), len(text)
            end = close + len(self.close_tag)
            return ToolCall(None, None, text[start:end], f"invalid JSON in tool call: {e.msg} at char {e.pos - j}"), end
        k = self._ws.match(text, end).end()  # type: ignore[union-attr]
        if not text.startswith(self.close_tag, k):
            close = text.find(self.close_tag, k)
            if close < 0:
                name, args, err = _normalize_call(obj)
                msg = f"unterminated {self.open_tag} (no {self.close_tag})"
                return ToolCall(name, args, text[start:], msg if err is None else f"{msg}; {err}"), len(text)
            end = close + len(self.close_tag)
            return ToolCall(None, None, text[start:end], f"unexpected text after the JSON object in tool call: {text[k:close][:80]!r}"), end
        end = k + len(self.close_tag)
        name, args, err = _normalize_call(obj)
        return ToolCall(name, args, text[start:end], err), end


@register_parser("llama3", "llama32")
class Llama3ToolCallParser(ToolCallParser):
    """Llama 3.1/3.2 JSON tool calls: `<|python_tag|>{"name": ..., "parameters": {...}}` (several objects
    separated by `;`), or a whole message that is such a JSON object (Llama 3.1's JSON-based calling).
    Text before `<|python_tag|>` is content. A message that merely starts with `{` but is not a call
    object stays content."""

    tag = "<|python_tag|>"

    def __init__(self) -> None:
        self._decoder = json.JSONDecoder()

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        at = text.find(self.tag)
        if at >= 0:
            return text[:at].strip(), self._parse_calls(text, at + len(self.tag))
        stripped = text.lstrip()
        if stripped.startswith("{"):
            start = len(text) - len(stripped)
            try:
                obj, _ = decode_json(self._decoder, text, start)
            except json.JSONDecodeError:
                return text.strip(), []
            except CallTooComplex:  # as a call it is refused below, with the reason
                return "", self._parse_calls(text, start)
            if isinstance(obj, dict) and "name" in obj:
                return "", self._parse_calls(text, start)
        return text.strip(), []

    def _parse_calls(self, text: str, pos: int) -> list[ToolCall]:
        calls: list[ToolCall] = []
        n = len(text)
        while True:
            while pos < n and (text[pos].isspace() or text[pos] == ";"):
                pos += 1
            if pos >= n:
                return calls
            try:
                obj, end = decode_json(self._decoder, text, pos)
            except CallTooComplex as e:
                calls.append(ToolCall(None, None, text[pos:], str(e)))
                return calls
            except json.JSONDecodeError as e:
                calls.append(ToolCall(None, None, text[pos:], f"invalid JSON in tool call: {e.msg} at char {e.pos - pos}"))
                return calls
            name, args, err = _normalize_call(obj)
            calls.append(ToolCall(name, args, text[pos:end], err))
            pos = end


def format_llama3_calls(calls: list[tuple[str, dict[str, Any]]]) -> str:
    """Render calls the way Llama 3.2 does: `<|python_tag|>` then JSON objects joined by `; `."""
    return "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)


def format_hermes_call(name: str, arguments: dict[str, Any]) -> str:
    """Render one call the way Hermes/Qwen chat templates do (used by tests and replay specs)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"
