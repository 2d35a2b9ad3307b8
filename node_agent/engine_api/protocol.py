"""The engine API wire format: versioned, typed, size-limited; no pickle.

A message is a ZeroMQ multipart message: frame 0 is a UTF-8 JSON header, the
following frames are raw little-endian arrays the header refers to.

Request header::

    {"v": 1, "id": 7, "op": "store_kv",
     "args": {"rid": "r1"},
     "arrays": {"token_ids": {"frame": 1, "dtype": "int64", "len": 32},
                "kv_indices": {"frame": 2, "dtype": "int64", "len": 32}}}

Reply header::

    {"v": 1, "id": 7, "ok": true, "result": 32}
    {"v": 1, "id": 7, "ok": false,
     "error": {"type": "ValueError", "message": "store_kv: token_ids has ..."}}

Every operation has a fixed argument schema (:data:`OPS`); a request with an
unknown op, a missing, extra or mistyped argument, an array of a dtype that is
not allowed, a length that disagrees with its frame, or a size over the limits is
rejected with :class:`ProtocolError` before any handler runs. Replies to requests
whose id could not be read carry ``"id": null``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Final, Union

import msgspec
import numpy as np
import numpy.typing as npt

from node_agent.vocab.layout import KVLayout
from node_agent.vocab.tokens import int64_array

VERSION: Final = 1
MAX_HEADER_BYTES: Final = 256 * 1024
MAX_FRAMES: Final = 8
MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024
MAX_STRING: Final = 1024
MAX_ARRAY_LEN: Final = 4 * 1024 * 1024
MAX_WAIT_MS: Final = 1000
"""Longest ``wait_completed`` wait (below any ``engineCallSeconds``); clients loop."""

Frame = bytes | memoryview
"""A frame as sent or received (``memoryview`` for large arrays sent without a copy)."""

_DTYPES: Final = {"int64": np.dtype("<i8"), "bool": np.dtype("?")}

#: Error types a reply may carry; the client re-raises the matching Python type.
ERROR_TYPES: Final = frozenset(
    {"ValueError", "TimeoutError", "ProtocolError", "NotReady", "KeyError", "InternalError",
     "SlotsInUse"}
)
"""``SlotsInUse``: a ``retrieve`` whose load copy did not stop may still write the
call's slots; the engine must keep them out of use (docs/agent.md "Call deadlines")."""


class ProtocolError(ValueError):
    """A message does not follow the wire format; the message says what and how to fix it."""


# Argument kinds: "str", "int", "bool", "json" (a JSON object), "str?" (optional
# string); arrays are declared separately with their dtype and whether optional.
@dataclass(frozen=True)
class OpSchema:
    args: Mapping[str, str] = field(default_factory=dict)
    arrays: Mapping[str, tuple[str, bool]] = field(default_factory=dict)
    """name -> (dtype, required)"""


OPS: Final[Mapping[str, OpSchema]] = {
    "ping": OpSchema(),
    "register": OpSchema(args={"rank": "json", "layout": "json", "buffers": "list"}),
    "lookup": OpSchema(
        args={"rid": "str", "rank": "json"},
        arrays={"token_ids": ("int64", True), "token_mask": ("bool", False)},
    ),
    "retrieve": OpSchema(
        args={"rid": "str", "rank": "json"}, arrays={"slot_mapping": ("int64", True)}
    ),
    "store_kv": OpSchema(
        args={"rid": "str", "rank": "json"},
        arrays={"token_ids": ("int64", True), "kv_indices": ("int64", True)},
    ),
    "lookup_claim": OpSchema(
        args={"rid": "str", "rank": "json"},
        arrays={"token_ids": ("int64", True), "token_mask": ("bool", False)},
    ),
    "claim_load": OpSchema(args={"rid": "str", "rank": "json"}),
    "tier": OpSchema(args={"rank": "json"}),
    "commit_load": OpSchema(args={"rid": "str", "rank": "json", "claim": "int"}),
    "poll_completed": OpSchema(args={"rank": "json"}),
    "wait_completed": OpSchema(args={"rank": "json", "timeoutMs": "int"}),
    "release": OpSchema(args={"rid": "str", "rank": "json"}),
    "status": OpSchema(),
}


@dataclass(frozen=True)
class Request:
    """A decoded, schema-checked request."""

    id: int
    op: str
    args: dict[str, Any]
    arrays: dict[str, npt.NDArray[Any]]


@dataclass(frozen=True)
class Reply:
    """A decoded reply: ``ok`` with ``result``, or an error type and message."""

    id: int | None
    ok: bool
    result: Any = None
    error_type: str | None = None
    error_message: str | None = None


def _check_arg(op: str, name: str, kind: str, value: object) -> None:
    ok = {
        "str": isinstance(value, str) and 0 < len(value) <= MAX_STRING,
        "int": isinstance(value, int) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "json": isinstance(value, dict),
        "list": isinstance(value, list),
    }[kind]
    if not ok:
        shown = repr(value)[:80]
        raise ProtocolError(
            f"{op}: argument {name!r} must be {kind}"
            + (f" of 1..{MAX_STRING} chars" if kind == "str" else "")
            + f", got {shown}"
        )


def array_length(where: str, values: object) -> int:
    """Entries along the first axis of ``values`` (what ``store_kv``'s length check
    compares, docs/pp.md "Engine API"), without converting it; ``ValueError``
    naming ``where`` when it has no length."""
    shape = getattr(values, "shape", None)
    if shape is not None:
        if len(shape) == 0:
            raise ValueError(f"{where} is a scalar; pass a 1-D sequence (one entry per token)")
        return int(shape[0])
    try:
        return len(values)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{where} of type {type(values).__name__} has no length; pass a 1-D "
                         "sequence of ints") from None


def bool_array(where: str, values: object) -> npt.NDArray[np.bool_]:
    """``values`` as a 1-D bool array, refusing any other dtype (a float mask is
    not rounded into flags) and any other shape."""
    if hasattr(values, "detach") and hasattr(values, "cpu"):  # a torch tensor
        values = values.detach().cpu().numpy()
    try:
        arr = np.asarray(values)
    except (OverflowError, ValueError, TypeError) as exc:
        raise ValueError(f"{where} cannot be read as a bool array ({exc})") from None
    if arr.dtype != np.bool_:
        raise ValueError(f"{where} has dtype {arr.dtype}; pass a bool array (one flag per "
                         "token)")
    if arr.ndim != 1:
        raise ValueError(f"{where} has shape {arr.shape}; it must be 1-D (one flag per token)")
    return np.ascontiguousarray(arr)


_JSON: Final = json.JSONEncoder(separators=(",", ":"))
"""One compact encoder for every header (``json.dumps`` with options builds one per call)."""
_DECODE: Final = json.JSONDecoder().decode
_BARE_HEADER: Final = b'{"v":%d,"id":%%d,"op":"%%s","args":{},"arrays":{}}' % VERSION
"""The header of a request without arguments or arrays (``ping``, ``status``)."""
_ZERO_COPY_BYTES: Final = 64 * 1024
_WIRE_INT64: Final = np.dtype("<i8")


def _is_wire_int64(value: object) -> bool:
    """True for a 1-D, C-contiguous little-endian int64 ndarray (sent as it is)."""
    return (type(value) is np.ndarray and value.dtype == _WIRE_INT64 and value.ndim == 1
            and value.flags.c_contiguous)


def encode_request(
    req_id: int,
    op: str,
    args: Mapping[str, Any] | None = None,
    arrays: Mapping[str, npt.ArrayLike | None] | None = None,
) -> list[Frame]:
    """Build the frames of a request. Arrays are converted to the op's dtype (a
    1-D contiguous int64 ndarray is sent as it is; large arrays as views of
    their memory, so the caller must not change them until the send returns)."""
    schema = OPS.get(op)
    if schema is None:
        raise ProtocolError(f"unknown op {op!r}; known ops are {', '.join(sorted(OPS))}")
    if not args and not arrays and type(req_id) is int:
        # ping, status: the header the encoder below would write, without building it.
        return [_BARE_HEADER % (req_id, op.encode())]
    header: dict[str, Any] = {"v": VERSION, "id": req_id, "op": op, "args": dict(args or {})}
    frames: list[Frame] = []
    descs: dict[str, Any] = {}
    for name, value in (arrays or {}).items():
        if value is None:
            continue
        dtype_name = schema.arrays[name][0]
        arr: npt.NDArray[Any]
        if dtype_name == "int64" and isinstance(value, np.ndarray) and _is_wire_int64(value):
            arr = value  # checked already (the client converts before encoding)
        elif dtype_name == "int64":
            arr = int64_array(f"{op}: {name}", value)
        else:
            raw = np.asarray(value)
            if raw.ndim != 1:
                raise ValueError(f"{op}: {name} has shape {raw.shape}; it must be 1-D")
            try:
                arr = np.ascontiguousarray(raw.astype(_DTYPES[dtype_name], casting="safe"))
            except TypeError:
                raise ValueError(
                    f"{op}: {name} has dtype {raw.dtype}, which does not convert "
                    f"safely to {dtype_name}; pass a {dtype_name} array"
                ) from None
        descs[name] = {"frame": len(frames) + 1, "dtype": dtype_name, "len": int(arr.shape[0])}
        # Small arrays are copied into the frame (cheaper than pinning a buffer);
        # large ones travel as a view of the array, without a copy.
        frames.append(arr.tobytes() if arr.nbytes < _ZERO_COPY_BYTES else arr.data)
    header["arrays"] = descs
    return [_JSON.encode(header).encode(), *frames]


_ARG_TYPES: Final[Mapping[str, Any]] = {
    "str": Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STRING)],
    "int": int, "bool": bool, "json": dict[str, Any], "list": list[Any],
}
"""The msgspec type of each argument kind (as strict as :func:`_check_arg`)."""


class _ArrayDesc(msgspec.Struct):
    frame: int
    dtype: str
    len: int


def _request_type(op: str, schema: OpSchema) -> Any:
    """A typed header of ``op`` (``{"v", "id", "op", "args", "arrays"}``) for
    msgspec: required arguments and arrays, nothing unknown inside them."""
    args = msgspec.defstruct(f"_{op}_args", [(n, _ARG_TYPES[k]) for n, k in schema.args.items()],
                             forbid_unknown_fields=True)
    arrays = msgspec.defstruct(
        f"_{op}_arrays",
        [(n, _ArrayDesc) if required else (n, _ArrayDesc | None, None)
         for n, (_, required) in schema.arrays.items()],
        forbid_unknown_fields=True, kw_only=True)
    need_arrays = any(required for _, required in schema.arrays.values())
    return msgspec.defstruct(
        f"_{op}_request",
        [("v", int), ("id", int),
         ("args", args) if schema.args else ("args", args, msgspec.field(default_factory=args)),
         ("arrays", arrays) if need_arrays
         else ("arrays", arrays, msgspec.field(default_factory=arrays))],
        tag_field="op", tag=op, kw_only=True)


_REQUEST: Final = msgspec.json.Decoder(
    Union[tuple(_request_type(op, s) for op, s in OPS.items())]  # noqa: UP007
)
"""Decodes and type-checks a well-formed request header in one pass."""


def _typed_request(frames: Sequence[Frame]) -> Request | None:
    """The request when its header is well-formed (msgspec's typed decode),
    else None: the caller then runs the full checks, whose errors name the
    defect. Accepts exactly what those checks accept, returns the same request."""
    try:
        h = _REQUEST.decode(frames[0])
    except msgspec.MsgspecError:
        return None
    if h.v != VERSION:
        return None
    op: str = type(h).__struct_config__.tag
    schema = OPS[op]
    args = {name: getattr(h.args, name) for name in schema.args}
    descs = {name: {"frame": d.frame, "dtype": d.dtype, "len": d.len}
             for name in schema.arrays if (d := getattr(h.arrays, name)) is not None}
    return Request(id=h.id, op=op, args=args, arrays=_decode_arrays(op, schema, descs, frames))


def decode_request(frames: Sequence[Frame]) -> Request:
    """Parse and check a request; raises :class:`ProtocolError` naming the defect.

    A well-formed header is read by one typed msgspec decode; any other goes
    through the checks below, which name what is wrong."""
    _check_frames(frames)
    req = _typed_request(frames)
    return req if req is not None else _checked_request(frames)


def _checked_request(frames: Sequence[Frame]) -> Request:
    """:func:`decode_request` by field-by-field checks, each error naming its defect."""
    header = _decode_header(frames)
    req_id = header.get("id")
    if not isinstance(req_id, int) or isinstance(req_id, bool):
        raise ProtocolError(f"header 'id' must be an integer, got {req_id!r}")
    op = header.get("op")
    schema = OPS.get(op) if isinstance(op, str) else None
    if schema is None or not isinstance(op, str):
        raise ProtocolError(f"unknown op {op!r}; known ops are {', '.join(sorted(OPS))}")
    args = header.get("args", {})
    if not isinstance(args, dict):
        raise ProtocolError(f"{op}: 'args' must be an object, got {type(args).__name__}")
    extra = sorted(set(args) - set(schema.args))
    if extra:
        raise ProtocolError(
            f"{op}: unexpected argument {extra[0]!r}; allowed {sorted(schema.args)}"
        )
    for name, kind in schema.args.items():
        if name not in args:
            raise ProtocolError(f"{op}: missing argument {name!r}")
        _check_arg(op, name, kind, args[name])
    arrays = _decode_arrays(op, schema, header.get("arrays", {}), frames)
    return Request(id=req_id, op=op, args=args, arrays=arrays)


def _check_frames(frames: Sequence[Frame]) -> None:
    """The message's frame count and sizes are within the limits."""
    if not frames:
        raise ProtocolError("empty message; send a JSON header frame")
    if len(frames) > MAX_FRAMES:
        raise ProtocolError(f"{len(frames)} frames exceed the limit of {MAX_FRAMES}")
    total = sum(len(f) for f in frames)
    if total > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {total} bytes exceeds the limit of {MAX_MESSAGE_BYTES}")
    if len(frames[0]) > MAX_HEADER_BYTES:
        raise ProtocolError(
            f"header of {len(frames[0])} bytes exceeds the limit of {MAX_HEADER_BYTES}"
        )


def _decode_header(frames: Sequence[Frame]) -> dict[str, Any]:
    _check_frames(frames)
    try:
        header = _DECODE(bytes(frames[0]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"header is not UTF-8 JSON ({exc}); send a JSON object") from exc
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a JSON object, got {type(header).__name__}")
    if header.get("v") != VERSION:
        raise ProtocolError(
            f"protocol version {header.get('v')!r} is not supported; this agent speaks "
            f"v{VERSION}: upgrade the client library to the agent's version"
        )
    return header


def _decode_arrays(
    op: str, schema: OpSchema, descs: object, frames: Sequence[Frame]
) -> dict[str, npt.NDArray[Any]]:
    if not isinstance(descs, dict):
        raise ProtocolError(f"{op}: 'arrays' must be an object")
    extra = sorted(set(descs) - set(schema.arrays))
    if extra:
        raise ProtocolError(f"{op}: unexpected array {extra[0]!r}; allowed {sorted(schema.arrays)}")
    out: dict[str, npt.NDArray[Any]] = {}
    used: set[int] = set()
    for name, (dtype_name, required) in schema.arrays.items():
        desc = descs.get(name)
        if desc is None:
            if required:
                raise ProtocolError(f"{op}: missing array {name!r}")
            continue
        if not isinstance(desc, dict):
            raise ProtocolError(f"{op}: array {name!r} descriptor must be an object")
        idx, dt, n = desc.get("frame"), desc.get("dtype"), desc.get("len")
        if dt != dtype_name:
            raise ProtocolError(f"{op}: array {name!r} must have dtype {dtype_name}, got {dt!r}")
        if (
            not isinstance(idx, int) or isinstance(idx, bool)
            or not 1 <= idx < len(frames) or idx in used
        ):
            raise ProtocolError(f"{op}: array {name!r} names frame {idx!r}, which is not there")
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_ARRAY_LEN:
            raise ProtocolError(
                f"{op}: array {name!r} length {n!r} is not in 0..{MAX_ARRAY_LEN}"
            )
        dtype = _DTYPES[dtype_name]
        if len(frames[idx]) != n * dtype.itemsize:
            raise ProtocolError(
                f"{op}: array {name!r} declares {n} x {dtype_name} but its frame holds "
                f"{len(frames[idx])} bytes"
            )
        used.add(idx)
        out[name] = np.frombuffer(frames[idx], dtype=dtype).copy()
    return out


def encode_reply(req_id: int | None, result: Any) -> list[bytes]:
    """Frames of a successful reply; ``result`` must be JSON-serialisable."""
    body = {"v": VERSION, "id": req_id, "ok": True, "result": result}
    return [_JSON.encode(body).encode()]


def encode_error(req_id: int | None, error_type: str, message: str) -> list[bytes]:
    """Frames of an error reply; unknown types are sent as ``InternalError``."""
    etype = error_type if error_type in ERROR_TYPES else "InternalError"
    body = {"v": VERSION, "id": req_id, "ok": False,
            "error": {"type": etype, "message": message[:4096]}}
    return [_JSON.encode(body).encode()]


def decode_reply(frames: Sequence[Frame]) -> Reply:
    """Parse a reply; raises :class:`ProtocolError` when it is malformed."""
    header = _decode_header(frames)
    rid = header.get("id")
    if rid is not None and (not isinstance(rid, int) or isinstance(rid, bool)):
        raise ProtocolError(f"reply 'id' must be an integer or null, got {rid!r}")
    if header.get("ok") is True:
        return Reply(id=rid, ok=True, result=header.get("result"))
    err = header.get("error")
    if not isinstance(err, dict):
        raise ProtocolError("error reply without an 'error' object")
    return Reply(
        id=rid,
        ok=False,
        error_type=str(err.get("type", "InternalError")),
        error_message=str(err.get("message", "")),
    )


def peek_id(frames: Sequence[Frame]) -> int | None:
    """Best-effort request id of a message that failed to decode (for the error reply)."""
    try:
        if frames and len(frames[0]) <= MAX_HEADER_BYTES:
            header = json.loads(bytes(frames[0]).decode("utf-8"))
            rid = header.get("id") if isinstance(header, dict) else None
            if isinstance(rid, int) and not isinstance(rid, bool):
                return rid
    except (UnicodeDecodeError, json.JSONDecodeError):
        pass
    return None


_LAYOUT_KEYS = {"numLayers": "num_layers", "numKvHeads": "num_kv_heads",
                "headSize": "head_size", "kvDim": "kv_dim", "dtype": "dtype",
                "tokensPerBlock": "tokens_per_block", "tpSize": "tp_size", "name": "name"}
_LAYOUT_REQUIRED = ("numLayers", "numKvHeads", "headSize")


def parse_layout(raw: Mapping[str, Any]) -> KVLayout:
    """A :class:`KVLayout` from its wire form (camelCase keys)."""
    unknown = sorted(set(raw) - set(_LAYOUT_KEYS))
    if unknown:
        raise ValueError(f"layout key {unknown[0]!r} is unknown; allowed {sorted(_LAYOUT_KEYS)}")
    missing = [k for k in _LAYOUT_REQUIRED if k not in raw]
    if missing:
        raise ValueError(f"layout key {missing[0]!r} is missing; a layout needs "
                         f"{', '.join(_LAYOUT_REQUIRED)} (optional: "
                         f"{', '.join(k for k in _LAYOUT_KEYS if k not in _LAYOUT_REQUIRED)})")
    try:
        return KVLayout(**{_LAYOUT_KEYS[k]: v for k, v in raw.items()})
    except (TypeError, KeyError) as exc:
        raise ValueError(f"layout {dict(raw)!r} is invalid: {exc}") from None


def layout_to_wire(layout: KVLayout) -> dict[str, Any]:
    """The wire form of a layout (what :func:`parse_layout` reads)."""
    return {"numLayers": layout.num_layers, "numKvHeads": layout.num_kv_heads,
            "headSize": layout.head_size, "kvDim": layout.kv_dim, "dtype": layout.dtype.value,
            "tokensPerBlock": layout.tokens_per_block, "tpSize": layout.tp_size,
            "name": layout.name.value}
