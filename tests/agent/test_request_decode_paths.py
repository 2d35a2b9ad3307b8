"""The engine socket's request decoder has two paths: a typed msgspec decode of a
well-formed header, and the field-by-field checks that name a defect. Whatever
the header, decode_request must answer exactly what the checks answer (the same
request, or a ProtocolError with the same message)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node_agent.engine_api import protocol
from node_agent.engine_api.protocol import ProtocolError


def _outcome(fn: Any, frames: list[bytes]) -> object:
    try:
        req = fn(frames)
    except ProtocolError as exc:
        return ("error", str(exc))
    return ("ok", req.id, req.op, req.args, {k: (v.dtype.str, v.tolist())
                                             for k, v in req.arrays.items()})


def _same(frames: list[bytes]) -> None:
    assert _outcome(protocol.decode_request, frames) == \
        _outcome(protocol._checked_request, frames), frames[0][:200]


_TOKENS = np.arange(9, dtype="<i8").tobytes()
_LOOKUP = {"v": 1, "id": 6, "op": "lookup", "args": {"rid": "x", "rank": {"replica": "e"}},
           "arrays": {"token_ids": {"frame": 1, "dtype": "int64", "len": 9}}}


@pytest.mark.parametrize("change", [
    {}, {"v": True}, {"v": 2}, {"id": True}, {"id": 1.0}, {"id": 2**70}, {"op": "nope"},
    {"args": {"rid": "", "rank": {}}}, {"args": {"rid": "x" * 1025, "rank": {}}},
    {"args": {"rid": "x" * 1024, "rank": {}}}, {"args": {"rid": "é" * 1024, "rank": {}}},
    {"args": {"rid": "x", "rank": []}}, {"args": {"rid": "x"}},
    {"args": {"rid": "x", "rank": {}, "more": 1}}, {"args": None},
    {"args": {"rid": "x", "rank": {"big": 2**80, "f": 1.5, "n": None}}},
    {"arrays": {}}, {"arrays": None}, {"arrays": {"token_ids": None}},
    {"arrays": {"token_ids": {"frame": 1, "dtype": "int64", "len": 8}}},
    {"arrays": {"token_ids": {"frame": 2, "dtype": "int64", "len": 9}}},
    {"arrays": {"token_ids": {"frame": True, "dtype": "int64", "len": 9}}},
    {"arrays": {"token_ids": {"frame": 1, "dtype": "bool", "len": 9}}},
    {"arrays": {"token_ids": {"frame": 1, "dtype": "int64", "len": 9, "x": 0}}},
    {"arrays": {"token_ids": {"frame": 1, "dtype": "int64", "len": 9},
                "token_mask": None}},
    {"arrays": {"token_ids": {"frame": 1, "dtype": "int64", "len": 9},
                "token_mask": {"frame": 1, "dtype": "bool", "len": 9}}},
    {"arrays": {"token_ids": {"frame": 1, "dtype": "int64", "len": 9}, "other": {}}},
    {"extra_top_level": [1, 2]},
])
def test_each_header_variant_decodes_as_the_checks_decide(change: dict[str, Any]) -> None:
    _same([json.dumps({**_LOOKUP, **change}).encode(), _TOKENS])


@pytest.mark.parametrize("raw", [
    b'{"v": 1, "id": 5, "op": "ping"}', b'{"v": 1, "id": 5, "op": "status", "args": {}}',
    b'{"v": 1, "id": 5, "op": "ping", "op": "status"}', b'{"v": 1, "v": 2, "id": 5, "op": "ping"}',
    b'{"v": 1, "id": 5, "op": "ping", "args": {"x": 1}}',
    b'\xef\xbb\xbf{"v": 1, "id": 5, "op": "ping"}',
    b'{"v": 1, "id": 5, "op": "wait_completed", "args": {"rank": {}, "timeoutMs": true}}',
    b'{"v": 1, "id": 5, "op": "wait_completed", "args": {"rank": {}, "timeoutMs": 10}}',
    b'{"v": 1, "id": 5, "op": "register", "args": {"rank": {}, "layout": {}, "buffers": []}}',
    b'{"v": 1, "id": NaN, "op": "ping"}', b'[1]', b'"x"', b'{"v": 1, "id": 5, "op": "ping"} x',
    b'{"v": 1, "id": 5, "op": "poll_completed", "args": {"rank": {"a": 1e400}}}',
    b"\xff", b"",
])
def test_raw_headers_decode_as_the_checks_decide(raw: bytes) -> None:
    _same([raw])


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(protocol.OPS)), st.dictionaries(
    st.sampled_from(["v", "id", "args", "arrays", "x"]), _JSON_VALUES, max_size=4),
    st.dictionaries(st.sampled_from(["rid", "rank", "timeoutMs", "layout", "buffers", "y"]),
                    _JSON_VALUES, max_size=4))
def test_any_header_decodes_as_the_checks_decide(op: str, top: dict[str, Any],
                                                 args: dict[str, Any]) -> None:
    header = {"v": 1, "id": 3, "op": op, "args": args, **top}
    _same([json.dumps(header).encode(), _TOKENS])
