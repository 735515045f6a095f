"""JSON on the generate hot path: orjson where it gives exactly the standard library's result.

A `/generate` body carries the whole context's token ids on every turn, and the standard library's
encoder is ~10x slower than orjson on a list of ints; at thousands of tokens per request that was a
large share of the rollout client's CPU (`benchmarks/client_cpu_profile.py`). Exactness is kept:

- `generate_body` encodes only the ids (plain ints, already checked by the caller) with orjson and
  the rest of the body with the standard library, so non-finite floats or odd values in sampling
  params are sent exactly as before (orjson would write NaN as null);
- `loads` parses with orjson (floats correctly rounded, the same values as `json.loads`) and falls
  back to the standard library for anything orjson refuses (NaN/Infinity literals, which the CPU
  engine's stdlib encoder can write, integers beyond 64 bits), so it accepts what `json.loads`
  accepts and raises `ValueError` for what it refuses.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import orjson

__all__ = ["generate_body", "int_list", "loads"]

#: All a JSON list of ints can contain; anything else in orjson's output means a non-int element.
_INT_LIST_CHARS = b"0123456789,-[]"


def loads(data: bytes | str) -> Any:
    """`json.loads(data)`, faster."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def int_list(ids: Any) -> bytes | None:
    """The JSON of `ids` if it is a flat list of ints (64-bit), else None (then convert and encode the
    ints). One pass in C instead of a Python `int()` per id: the ids are the whole context, every turn."""
    if type(ids) is not list:
        return None
    try:
        out = orjson.dumps(ids)
    except orjson.JSONEncodeError:  # numpy scalars, ints beyond 64 bits, objects
        return None
    # A float, bool, None or string writes other characters; a nested list a second bracket.
    if out.translate(None, _INT_LIST_CHARS) or out.count(b"[") != 1:
        return None
    return out


def generate_body(input_ids: list[int] | bytes, rest: Mapping[str, Any]) -> bytes:
    """The JSON bytes of `{"input_ids": input_ids, **rest}`: `input_ids` a list of ints, or the bytes
    `int_list` made of one."""
    tail = json.dumps(dict(rest))
    if isinstance(input_ids, bytes):
        ids = input_ids
    else:
        try:
            ids = orjson.dumps(input_ids)
        except orjson.JSONEncodeError:  # an int beyond 64 bits (the vocabulary was unknown): as before
            ids = json.dumps(input_ids).encode()
    if tail == "{}":
        return b'{"input_ids":' + ids + b"}"
    return b'{"input_ids":' + ids + b"," + tail[1:].encode()
