"""A tool's return value as bounded text: the byte bound kept while a call produces its output
(`OutputBound`), reading a returned text or a (sync or async) stream of pieces into it (`collect`),
and the token cut made afterwards (`truncate_tokens_locked`).

Anything a tool returns that cannot be made text (a `__str__` that raises or returns a non-string)
is a `ResultTextError` whose message names the tool, so the registry can report it to the model.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from .base import describe
from .truncate import BoundedText, Side, truncate_by_tokens

__all__ = ["OutputBound", "ResultTextError", "collect", "truncate_tokens_locked"]


_tokenizer_lock = threading.Lock()


def truncate_tokens_locked(text: str, tokenizer: Any, max_tokens: int, side: Side, marker: str) -> tuple[str, bool]:
    """`truncate_by_tokens`, one call at a time: tokenizers are not guaranteed thread-safe."""
    with _tokenizer_lock:
        return truncate_by_tokens(text, tokenizer, max_tokens, side, marker)


@dataclass(frozen=True)
class OutputBound:
    """How much of a call's output is kept while it is produced, and how a cut is marked."""

    max_bytes: int | None
    side: Side
    marker: str

    def sink(self) -> BoundedText:
        return BoundedText(sys.maxsize if self.max_bytes is None else self.max_bytes, self.side, self.marker)


class ResultTextError(Exception):
    """A tool's result cannot be turned into text (its `__str__` raised, a piece is not text)."""


def _as_text(value: Any, name: str | None) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", "replace")
    try:
        text = str(value)
    except Exception as e:  # a result object with a broken __str__: say so, not a bare traceback
        raise ResultTextError(f"tool {name!r} returned a {type(value).__name__} whose str() raised {describe(e)}") from e
    if not isinstance(text, str):
        raise ResultTextError(f"tool {name!r} returned a {type(value).__name__} whose str() is not a string")
    return text


def _take(sink: BoundedText, piece: Any, name: str | None) -> bool:
    """Feed one streamed piece; True when the sink wants no more (a head-only sink is full)."""
    sink.feed(_as_text(piece, name))
    sink.stopped_early = sink.full
    return sink.full


async def collect(out: Any, sink: BoundedText, name: str | None) -> None:
    """Feed a tool's result into `sink`: a text (or anything `str()` turns into one), or a stream of
    pieces (a sync or async iterator), read only until the sink is full (head-only) or it ends, and
    closed either way."""
    if isinstance(out, AsyncIterator):
        try:
            async for piece in out:
                if _take(sink, piece, name):
                    break
        finally:
            if hasattr(out, "aclose"):
                await out.aclose()
    elif isinstance(out, Iterator) and not isinstance(out, (str, bytes)):
        try:
            for piece in out:
                if _take(sink, piece, name):
                    break
        finally:
            if hasattr(out, "close"):
                out.close()
    else:
        sink.feed(_as_text(out, name))
