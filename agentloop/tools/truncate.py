"""Token-budgeted truncation of tool output before it enters the token buffer.

Counts with the policy's tokenizer (never characters): a `transformers` tokenizer or a raw
`tokenizers.Tokenizer`. The cut is marked in the text (`...(truncated N tokens)...`) so the model can
tell output was dropped; the result re-encodes to at most `max_tokens` tokens.
"""

from __future__ import annotations

from typing import Any, Literal

Side = Literal["left", "right", "middle"]
SIDES: tuple[str, ...] = ("left", "right", "middle")

__all__ = ["truncate_by_tokens", "count_tokens", "Side", "SIDES"]


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


def truncate_by_tokens(text: str, tokenizer: Any, max_tokens: int, side: Side = "middle") -> tuple[str, bool]:
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
        out = _render(text, tokenizer, ids, keep, side)
        over = count_tokens(tokenizer, out) - max_tokens
        if over <= 0:
            return out, True
        keep = max(0, keep - over)
        if keep == 0:
            break
    out = _render(text, tokenizer, ids, 0, side)
    if count_tokens(tokenizer, out) <= max_tokens:
        return out, True
    return "", True  # not even the marker fits


def _render(text: str, tokenizer: Any, ids: list[int], keep: int, side: Side) -> str:
    """Keep about `keep` tokens in total (marker included) on the kept side(s)."""
    n = len(ids)
    marker = f"...(truncated {n} tokens)..."
    body = max(0, keep - count_tokens(tokenizer, marker))
    marker = f"...(truncated {n - body} tokens)..."
    if side == "right":
        return _clean_edge(_decode(tokenizer, ids[:body]), text, head=True) + marker
    if side == "left":
        return marker + _clean_edge(_decode(tokenizer, ids[n - body :] if body else []), text, head=False)
    head_n = (body + 1) // 2
    tail_n = body - head_n
    head = _clean_edge(_decode(tokenizer, ids[:head_n]), text, head=True)
    tail = _clean_edge(_decode(tokenizer, ids[n - tail_n :] if tail_n else []), text, head=False)
    return head + marker + tail
