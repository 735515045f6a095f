"""Bounding tool output: by bytes while it is produced (`BoundedText`), then by tokens before it
enters the token buffer (`truncate_by_tokens`).

`BoundedText` keeps at most `max_bytes` UTF-8 bytes of a tool's output as the pieces arrive (the head,
the tail or both, by the side that is cut), so memory stays flat however much a tool writes.
`truncate_by_tokens` counts with the policy's tokenizer (never characters): a `transformers` tokenizer
or a raw `tokenizers.Tokenizer`; the result re-encodes to at most `max_tokens` tokens.

Every cut is marked in the text so the model can tell output was dropped: the marker is a template
(`DEFAULT_MARKER`, `...(truncated {n} {unit})...`) filled with the amount dropped and its unit
(`tokens` or `bytes`); any text without placeholders works too.
"""

from __future__ import annotations

import threading
from typing import Any, Literal

Side = Literal["left", "right", "middle"]
SIDES: tuple[str, ...] = ("left", "right", "middle")
DEFAULT_MARKER = "...(truncated {n} {unit})..."
#: Bytes of a tool's output kept while it is produced, unless configured (`max_tool_response_bytes`).
DEFAULT_MAX_BYTES = 16384

__all__ = ["truncate_by_tokens", "count_tokens", "render_marker", "check_marker", "BoundedText",
           "DEFAULT_MARKER", "DEFAULT_MAX_BYTES", "OutputClosed", "Side", "SIDES"]


def render_marker(marker: str, n: int | str, unit: str) -> str:
    """The marker template filled in (`{n}`: how much was dropped, `{unit}`: tokens or bytes)."""
    return marker.format(n=n, unit=unit)


def check_marker(marker: str) -> str:
    """`marker` if it is a usable template (only `{n}` and `{unit}` placeholders), else ValueError."""
    try:
        render_marker(marker, 1, "tokens")
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"truncation marker {marker!r} is not a valid template (placeholders: {{n}}, {{unit}}): "
                         f"{type(e).__name__}: {e}") from None
    return marker


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "replace"))


#: Characters encoded at a time when only the UTF-8 length of a long stretch is wanted (<= 32 KiB of bytes).
_COUNT_CHUNK = 8192


def _utf8_len_of(text: str, start: int, stop: int) -> int:
    """`_utf8_len(text[start:stop])` without copying or encoding the stretch whole (it may be most of a
    10 MB tool output that is only counted): ASCII text is one byte a character, other text is encoded
    a chunk at a time (each character on its own, so the chunks' lengths add up exactly)."""
    if start >= stop:
        return 0
    if text.isascii():
        return stop - start
    return sum(len(text[i:min(i + _COUNT_CHUNK, stop)].encode("utf-8", "replace"))
               for i in range(start, stop, _COUNT_CHUNK))


def _head_bytes(text: str, limit: int) -> str:
    """The longest prefix of `text` of at most `limit` UTF-8 bytes (never half a character)."""
    # A character is at least one byte, so `limit` characters hold the answer: never encode more.
    return text[:limit].encode("utf-8", "replace")[:limit].decode("utf-8", "ignore")


def _tail_bytes(text: str, limit: int) -> str:
    """The longest suffix of `text` of at most `limit` UTF-8 bytes."""
    if limit <= 0:
        return ""
    data = text[-limit:].encode("utf-8", "replace")
    return data[len(data) - limit:].decode("utf-8", "ignore") if len(data) > limit else data.decode("utf-8")


class OutputClosed(Exception):
    """Raised into a producer that feeds a `BoundedText` after it was closed (its call was abandoned)."""


class BoundedText:
    """Collects a tool's output piece by piece, keeping at most `max_bytes` UTF-8 bytes: the head
    (`side="right"` cuts the right), the tail (`"left"`) or half of each (`"middle"`). What is
    dropped is only counted. `full` says a head-only collector needs nothing more (a stream can be
    closed). Thread-safe: a call abandoned on timeout may still be writing while its partial text
    is read; `close()` makes its next `feed` raise `OutputClosed`, so a stream that never ends and
    ignores cancellation still stops at its next piece."""

    def __init__(self, max_bytes: int, side: Side = "middle", marker: str = DEFAULT_MARKER) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        if side not in SIDES:
            raise ValueError(f"truncate side must be one of {SIDES}, got {side!r}")
        self.side, self.marker = side, marker
        self.head_cap = max_bytes if side == "right" else (max_bytes + 1) // 2 if side == "middle" else 0
        self.tail_cap = max_bytes - self.head_cap
        self._head: list[str] = []
        self._head_bytes = 0
        self._tail: list[str] = []
        self._tail_bytes = 0
        self.dropped = 0
        self.stopped_early = False  # a stream was closed once full: more may have been coming
        self.closed = False
        self._lock = threading.Lock()

    def close(self) -> None:
        self.closed = True

    @property
    def full(self) -> bool:
        """Nothing more would be kept: only true when the tail is not kept (side "right")."""
        return self.tail_cap == 0 and self._head_bytes >= self.head_cap

    @property
    def truncated(self) -> bool:
        return self.dropped > 0 or self.stopped_early

    def feed(self, piece: str) -> None:
        if self.closed:
            raise OutputClosed("the call was abandoned: its output is no longer read")
        # Only what is kept is copied or encoded: the rest of `piece` (up to all of a 10 MB output) is
        # read in place, `start` being where the part not taken by the head begins, and only counted.
        with self._lock:
            start, end = 0, len(piece)
            room = self.head_cap - self._head_bytes
            if room > 0:
                kept = _head_bytes(piece, room)
                self._head.append(kept)
                self._head_bytes += _utf8_len(kept)
                start = len(kept)
            if start >= end:
                return
            if self.tail_cap == 0:
                self.dropped += _utf8_len_of(piece, start, end)
                return
            if end - start >= self.tail_cap:  # the rest alone fills the tail: what was there goes
                # At most tail_cap bytes are kept, so at most the last tail_cap characters.
                kept = _tail_bytes(piece[end - self.tail_cap:], self.tail_cap)
                self.dropped += self._tail_bytes + _utf8_len_of(piece, start, end - len(kept))
                self._tail, self._tail_bytes = [kept], _utf8_len(kept)
                return
            piece = piece[start:]  # shorter than tail_cap characters
            self._tail.append(piece)
            self._tail_bytes += _utf8_len(piece)
            self._trim_tail()

    def _trim_tail(self) -> None:
        """Drop (and count) the oldest tail bytes beyond `tail_cap`; the caller holds the lock."""
        while self._tail_bytes > self.tail_cap:
            over = self._tail_bytes - self.tail_cap
            first = self._tail[0]
            size = _utf8_len(first)
            if size <= over:
                self._tail.pop(0)
                self._tail_bytes -= size
                self.dropped += size
            else:
                kept = _tail_bytes(first, size - over)
                self._tail[0] = kept
                self._tail_bytes -= size - _utf8_len(kept)
                self.dropped += size - _utf8_len(kept)

    def text(self) -> str:
        """What was kept, with the marker where output was dropped."""
        with self._lock:
            head, tail = "".join(self._head), "".join(self._tail)
            if not self.truncated:
                return head + tail
            n: int | str = f"{self.dropped}+" if self.stopped_early else self.dropped
            return head + render_marker(self.marker, n, "bytes") + tail


def _encode(tokenizer: Any, text: str) -> list[int]:
    enc = tokenizer.encode(text, add_special_tokens=False)
    return list(enc.ids) if hasattr(enc, "ids") else list(enc)


def _decode(tokenizer: Any, ids: list[int]) -> str:
    if not ids:
        return ""
    try:
        return tokenizer.decode(ids, skip_special_tokens=False)
    except TypeError:  # a raw tokenizers.Tokenizer takes it positionally
        return tokenizer.decode(ids, False)


def count_tokens(tokenizer: Any, text: str) -> int:
    return len(_encode(tokenizer, text))


def _clean_edge(piece: str, original: str, *, head: bool) -> str:
    """Cutting byte-level BPE ids mid-character decodes to U+FFFD at the cut; drop those artifacts."""
    if "\ufffd" in original:
        return piece
    return piece.rstrip("\ufffd") if head else piece.lstrip("\ufffd")


def truncate_by_tokens(text: str, tokenizer: Any, max_tokens: int, side: Side = "middle",
                       marker: str = DEFAULT_MARKER) -> tuple[str, bool]:
    """Return (text, was_truncated). `side` is the side that is cut: "right" keeps the head, "left" keeps
    the tail, "middle" keeps both ends. The marker's own tokens count against `max_tokens`."""
    if side not in SIDES:
        raise ValueError(f"truncate side must be one of {SIDES}, got {side!r}")
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    ids = _encode(tokenizer, text)
    n = len(ids)
    if n <= max_tokens:
        return text, False

    keep = max_tokens
    for _ in range(8):  # re-encoding across the cut can merge/split tokens: shrink until it fits
        out = _render(text, tokenizer, ids, keep, side, marker)
        over = count_tokens(tokenizer, out) - max_tokens
        if over <= 0:
            return out, True
        keep = max(0, keep - over)
        if keep == 0:
            break
    out = _render(text, tokenizer, ids, 0, side, marker)
    if count_tokens(tokenizer, out) <= max_tokens:
        return out, True
    return "", True  # not even the marker fits


def _render(text: str, tokenizer: Any, ids: list[int], keep: int, side: Side, template: str) -> str:
    """Keep about `keep` tokens in total (marker included) on the kept side(s)."""
    n = len(ids)
    body = max(0, keep - count_tokens(tokenizer, render_marker(template, n, "tokens")))
    marker = render_marker(template, n - body, "tokens")
    if side == "right":
        return _clean_edge(_decode(tokenizer, ids[:body]), text, head=True) + marker
    if side == "left":
        return marker + _clean_edge(_decode(tokenizer, ids[n - body :] if body else []), text, head=False)
    head_n = (body + 1) // 2
    tail_n = body - head_n
    head = _clean_edge(_decode(tokenizer, ids[:head_n]), text, head=True)
    tail = _clean_edge(_decode(tokenizer, ids[n - tail_n :] if tail_n else []), text, head=False)
    return head + marker + tail
