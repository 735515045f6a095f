"""`BoundedText.feed` copies and encodes only what it keeps (issue 29's soak: a 10 MB tool output made
~29 MB of allocations on top of itself, the dropped middle copied twice and encoded whole just to be
counted). The result is byte for byte what the straightforward version gives (`Reference` below,
the code before the change): kept head and tail, the dropped byte count, `truncated`, the text."""

from __future__ import annotations

import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentloop.tools.truncate import SIDES, BoundedText, _head_bytes, _tail_bytes, _utf8_len, _utf8_len_of


class Reference(BoundedText):
    """`BoundedText.feed` as it was: slices and encodes the whole piece."""

    def feed(self, piece: str) -> None:
        with self._lock:
            room = self.head_cap - self._head_bytes
            if room > 0:
                kept = _head_bytes(piece, room)
                self._head.append(kept)
                self._head_bytes += _utf8_len(kept)
                piece = piece[len(kept):]
            if not piece:
                return
            if self.tail_cap == 0:
                self.dropped += _utf8_len(piece)
                return
            if len(piece) >= self.tail_cap:
                kept = _tail_bytes(piece, self.tail_cap)
                self.dropped += self._tail_bytes + _utf8_len(piece[: len(piece) - len(kept)])
                self._tail, self._tail_bytes = [kept], _utf8_len(kept)
                return
            self._tail.append(piece)
            self._tail_bytes += _utf8_len(piece)
            self._trim_tail()


def state(b: BoundedText) -> tuple:
    return b.text(), b.dropped, b.truncated, b._head_bytes, b._tail_bytes, "".join(b._head), "".join(b._tail)


# 1-, 2-, 3- and 4-byte characters and lone surrogates (encoded as "?" by the "replace" handler).
CHARS = st.one_of(st.characters(max_codepoint=0x7F), st.characters(min_codepoint=0x80, max_codepoint=0x7FF),
                  st.characters(min_codepoint=0x800, max_codepoint=0xFFFF),
                  st.characters(min_codepoint=0x10000), st.sampled_from(["\ud800", "\udfff"]))
PIECES = st.lists(st.text(CHARS, max_size=40) | st.text(st.characters(max_codepoint=0x7F), max_size=40), max_size=8)


@settings(max_examples=400, deadline=None)
@given(pieces=PIECES, max_bytes=st.integers(0, 48), side=st.sampled_from(SIDES))
def test_feed_matches_the_straightforward_version(pieces, max_bytes, side):
    new, ref = BoundedText(max_bytes, side), Reference(max_bytes, side)
    for p in pieces:
        new.feed(p)
        ref.feed(p)
        assert state(new) == state(ref)


@settings(max_examples=100, deadline=None)
@given(text=st.text(CHARS, max_size=200), a=st.integers(0, 220), b=st.integers(0, 220))
def test_counting_a_stretch_in_chunks_is_exact(text, a, b):
    import agentloop.tools.truncate as truncate

    a, b = min(a, len(text)), min(b, len(text))  # feed's stretches lie within the piece (a > b: empty)

    old, truncate._COUNT_CHUNK = truncate._COUNT_CHUNK, 7  # many chunk edges in short text
    try:
        assert _utf8_len_of(text, a, b) == _utf8_len(text[a:b])
    finally:
        truncate._COUNT_CHUNK = old


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("unit", ["0123456789", "é€🙂x"])
def test_long_pieces_match_too(side, unit):
    """Pieces far over the cap and the chunk size, fed after short ones (a tail already there)."""
    pieces = ["ab", "ç" * 3, unit * 5000, "tail", unit * 3001, "z"]
    new, ref = BoundedText(4096, side), Reference(4096, side)
    for p in pieces:
        new.feed(p)
        ref.feed(p)
        assert state(new) == state(ref)


def peak_extra(bounded: BoundedText, piece: str) -> int:
    """Bytes allocated at the peak while `piece` (already allocated) is fed."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        bounded.feed(piece)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak - base


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("unit", ["0123456789", "é€🙂x"])  # ASCII (the soak's flood), then 1- to 4-byte characters
def test_a_10_mb_piece_allocates_well_under_a_mebibyte(side, unit):
    piece = unit * (10_000_000 // len(unit.encode()))  # 10 MB of UTF-8
    new = BoundedText(4096, side)
    extra = peak_extra(new, piece)
    assert extra < 1 << 20, extra
    ref = Reference(4096, side)
    assert peak_extra(ref, piece) > 10_000_000  # the measurement sees the old copies (~29 MB for "middle")
    assert state(new) == state(ref)
