"""`agentloop.engine.wire_json`: the fast JSON of the generate path gives exactly the standard library's results."""

from __future__ import annotations

import json
import math
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentloop.engine.wire_json import generate_body, int_list, loads


@given(st.lists(st.integers(0, 2**31 - 1), max_size=300),
       st.dictionaries(st.text(max_size=8).filter(lambda k: k != "input_ids"),
                       st.one_of(st.integers(), st.floats(allow_nan=False), st.text(), st.booleans(), st.none(),
                                 st.lists(st.integers(), max_size=4)), max_size=6))
@settings(max_examples=200, deadline=None)
def test_generate_body_is_the_same_json_as_the_stdlib(ids: list[int], rest: dict) -> None:
    assert json.loads(generate_body(ids, rest)) == json.loads(json.dumps({"input_ids": ids, **rest}))


def test_generate_body_keeps_what_only_the_stdlib_writes() -> None:
    # orjson would write NaN as null (a changed value) and refuses ints beyond 64 bits: as before, the
    # standard library's text is sent and the server decides.
    body = generate_body([1, 2**70], {"sampling_params": {"temperature": float("nan")}, "rid": "r"})
    assert b"NaN" in body and str(2**70).encode() in body
    assert generate_body([], {}) == b'{"input_ids":[]}'


@given(st.floats(allow_nan=False, allow_infinity=False))
@settings(max_examples=500, deadline=None)
def test_loads_floats_are_exactly_the_stdlib_values(x: float) -> None:
    text = json.dumps({"meta_info": {"output_token_logprobs": [[x, 7, None]]}})
    assert loads(text.encode()) == json.loads(text)
    assert struct.pack("<d", loads(text.encode())["meta_info"]["output_token_logprobs"][0][0]) == struct.pack("<d", x)


def test_loads_accepts_what_the_stdlib_accepts_and_refuses_the_rest() -> None:
    # The CPU engine answers through the stdlib encoder, which writes -Infinity/NaN literals.
    out = loads(b'{"output_token_logprobs": [[-Infinity, 3, null], [NaN, 4, null]]}')
    assert out["output_token_logprobs"][0][0] == -math.inf and math.isnan(out["output_token_logprobs"][1][0])
    assert loads(b'[' + str(2**70).encode() + b']') == [2**70]
    with pytest.raises(ValueError):
        loads(b'{"a": ')


def test_int_list_only_for_a_flat_list_of_plain_ints() -> None:
    import numpy as np

    ids = [0, 5, 151_000, -3, 2**63 - 1]
    assert int_list(ids) is not None and json.loads(int_list(ids)) == ids
    assert int_list([]) == b"[]"
    # Everything else goes through int() as before: the caller converts when this says None.
    for other in ([1, 2.0], [1, True], [1, None], [1, "2"], [[1, 2]], [1, 2**64], [np.int64(3)], (1, 2), np.arange(3)):
        assert int_list(other) is None, other
    assert json.loads(generate_body(int_list(ids), {"rid": "r"})) == {"input_ids": ids, "rid": "r"}
