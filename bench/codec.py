"""Wire codec benchmark: msgspec against the hand-written codecs, same process.

Encode + decode (with strict validation), ``msgspec`` against a hand-written
``baseline``, of:

* the fan-out's 2K-block put decision (``bench/fanout.py``'s decision: a
  32768-token span mask, 1792 plan blocks in runs of 8). Baseline: the
  module's codec (``node_agent/pp/messages.py``: a fixed binary struct body);
  msgspec: the whole body as one typed ``msgspec.Struct``, the plan runs as a
  msgpack ``bin``, with the same checks (span scan, run limit at encode, plan
  runs and mask coverage at decode) but no packed-bit mask fallback;
* a cancel, a release and a result. msgspec: the module's codec (wire version
  6, a ``msgspec.Struct`` per op, ``array_like=True``, bounds as ``Meta``
  constraints, msgpack); baseline: wire version 5's JSON object with its
  per-field Python checks (kept here as the reference);
* the engine socket's ``lookup`` request (``node_agent/engine_api/protocol.py``)
  with a 2048-token ``token_ids`` frame: (a) encode + decode, the module's JSON
  header against a typed header ``Struct`` in msgpack (a prototype that checks
  the ``lookup`` schema only: a wire change, not taken); (b) decode alone,
  ``decode_request`` (the JSON header read by one typed ``msgspec.json``
  decode) against ``_checked_request``, the field-by-field checks it falls
  back to for a header that is not well-formed.

Every candidate keeps the fixed header struct (magic, op, wire version checked
before the body is read) and the bulk arrays as raw little-endian frames, and
decodes to the same objects. Each case is timed in alternating rounds (the
best round counts: the one least disturbed by other load), so both see the
same machine state. Prints one JSON object per case with the ratio
msgspec / baseline (below 1: msgspec is faster).

    python -P bench/codec.py            # default run (a few seconds)
    python -P bench/codec.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node_agent.engine_api import protocol
from node_agent.pp import messages as m
from node_agent.vocab.placement import Direction

BLOCKS, TOKENS_PER_BLOCK, CACHED, RUN = 2048, 16, 256, 8


def make_decision() -> m.Decision:
    """The fan-out benchmark's put decision."""
    mask = np.zeros(BLOCKS * TOKENS_PER_BLOCK, dtype=np.bool_)
    mask[CACHED * TOKENS_PER_BLOCK:] = True
    starts = np.arange(0, (BLOCKS - CACHED) * 2, RUN * 2)[: (BLOCKS - CACHED) // RUN]
    runs = np.stack([np.zeros_like(starts), starts, np.full_like(starts, RUN)], axis=1)
    return m.Decision(Direction.STORE, "req-17", 17, 1017, mask, runs.astype(np.int64), None,
                      digest=12345, life=0, cache_epoch=0)


# -- the decision as one msgspec Struct (candidate) ------------------------------------

NonNeg = Annotated[int, msgspec.Meta(ge=0)]


class DecisionBody(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """A decision's whole body, the plan runs as msgpack ``bin``."""

    rid: str
    n: NonNeg
    task_id: Annotated[int, msgspec.Meta(ge=-1)]
    length: Annotated[int, msgspec.Meta(ge=0, le=1 << 24)]
    start: int
    stop: int
    plan: Annotated[int, msgspec.Meta(ge=-1)]
    digest: NonNeg
    life: NonNeg
    cache_epoch: NonNeg
    error: str | None
    runs: bytes


_HEADER = struct.Struct("<4sBBqqdq")
_ENC = msgspec.msgpack.Encoder()
_DEC_DECISION = msgspec.msgpack.Decoder(DecisionBody)


def ms_decision_encode(env: m.Envelope, d: m.Decision) -> bytes:
    g = env.group.encode()
    head = _HEADER.pack(m.MAGIC, int(env.op), m.WIRE_VERSION, env.epoch, env.seq, env.sent_at,
                        env.incarnation)
    raw = np.ascontiguousarray(d.mask).view(np.uint8).tobytes()
    first = raw.find(1)
    start, stop = (0, 0) if first < 0 else (first, raw.rfind(1) + 1)
    if raw.find(0, start, stop) >= 0:
        raise ValueError("the candidate sends span masks only")
    assert d.runs is not None
    if d.runs.size and int(d.runs.max()) > (1 << 31) - 1:
        raise ValueError("run above the wire limit")
    wire = DecisionBody(d.rid, d.n, d.task_id, d.mask.size, start, stop, d.num_blocks,
                        d.digest, d.life, d.cache_epoch, d.error,
                        np.ascontiguousarray(d.runs, "<i4").tobytes())
    return b"".join([head, bytes([len(g)]), g, _ENC.encode(wire)])


def _env(data: bytes, version: int) -> tuple[m.Envelope, int]:
    magic, code, ver, epoch, seq, sent_at, inc = _HEADER.unpack_from(data)
    if magic != m.MAGIC or ver != version:
        raise m.MalformedMessage(f"Fan-out wire version {ver} is not supported")
    gl = data[_HEADER.size]
    group = data[_HEADER.size + 1:_HEADER.size + 1 + gl].decode()
    return m.Envelope(m.Op(code), group, epoch, seq, sent_at, inc), _HEADER.size + 1 + gl


def ms_decision_decode(data: bytes) -> m.Message:
    env, pos = _env(data, m.WIRE_VERSION)
    try:
        b = _DEC_DECISION.decode(memoryview(data)[pos:])
    except msgspec.ValidationError as exc:
        raise m.MalformedMessage(str(exc)) from None
    if not 0 <= b.start <= b.stop <= b.length:
        raise m.MalformedMessage("span")
    mask = m._span_mask(b.length, b.start, b.stop)
    runs = m._decode_runs(b.plan, b.runs)
    total = b.stop - b.start
    if (b.plan == 0) != (total == 0) or (b.plan and total % b.plan):
        raise m.MalformedMessage("mask cannot cover the plan")
    return m.Message(env, m.Decision(Direction.STORE, b.rid, b.n, b.task_id, mask, runs,
                                     b.error, b.digest, b.life, b.cache_epoch))


# -- wire version 5's JSON bodies (baseline) ----------------------------------------------

_V5_FIELDS: dict[m.Op, tuple[type, dict[str, str]]] = {
    m.Op.CANCEL: (m.Cancel, {"rid": "str", "kind": "kind", "n": "nonneg", "task_id": "int"}),
    m.Op.RELEASE: (m.Release, {"rid": "str", "life": "nonneg"}),
    m.Op.RESULT: (m.Result, {"rid": "str", "kind": "kind", "n": "nonneg", "task_id": "int",
                             "ok": "bool"}),
}


def v5_encode(env: m.Envelope, body: Any) -> bytes:
    """Version 5: header struct + group + a JSON object of the body's fields."""
    g = env.group.encode()
    head = _HEADER.pack(m.MAGIC, int(env.op), 5, env.epoch, env.seq, env.sent_at,
                        env.incarnation)
    fields = {k: getattr(body, k) for k in _V5_FIELDS[env.op][1]}
    if "kind" in fields:
        fields["kind"] = fields["kind"].value
    return b"".join([head, bytes([len(g)]), g,
                     json.dumps(fields, separators=(",", ":")).encode()])


def _v5_field(fields: dict[str, Any], key: str, kind: str) -> Any:
    if key not in fields:
        raise m.MalformedMessage(f"Missing field {key!r}")
    v = fields[key]
    if kind in ("int", "nonneg"):
        if isinstance(v, bool) or not isinstance(v, int) or (kind == "nonneg" and v < 0):
            raise m.MalformedMessage(f"Field {key!r} must be an integer, got {v!r}")
        return v
    if kind == "kind":
        try:
            return m.Kind(v)
        except ValueError:
            raise m.MalformedMessage(f"Field 'kind' must be put or get, got {v!r}") from None
    if not isinstance(v, str if kind == "str" else bool):
        raise m.MalformedMessage(f"Field {key!r} must be {kind}, got {v!r}")
    return v


def v5_decode(data: bytes) -> m.Message:
    env, pos = _env(data, 5)
    try:
        fields = json.loads(data[pos:].decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise m.MalformedMessage(f"Body is not valid UTF-8 / JSON: {exc}") from None
    if not isinstance(fields, dict):
        raise m.MalformedMessage("Body must be a JSON object")
    cls, schema = _V5_FIELDS[env.op]
    return m.Message(env, cls(*(_v5_field(fields, k, t) for k, t in schema.items())))


# Engine socket request header (lookup): msgspec JSON / msgpack of a typed Struct.
class ArrayDesc(msgspec.Struct, frozen=True):
    frame: Annotated[int, msgspec.Meta(ge=1, lt=protocol.MAX_FRAMES)]
    dtype: str
    len: Annotated[int, msgspec.Meta(ge=0, le=protocol.MAX_ARRAY_LEN)]


class LookupArgs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    rid: Annotated[str, msgspec.Meta(min_length=1, max_length=protocol.MAX_STRING)]
    rank: dict[str, Any]


class LookupArrays(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    token_ids: ArrayDesc
    token_mask: ArrayDesc | None = None


class LookupHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    v: int
    id: int
    op: str
    args: LookupArgs
    arrays: LookupArrays


_HDR_ENC = msgspec.msgpack.Encoder()
_HDR_DEC = msgspec.msgpack.Decoder(LookupHeader)


def ms_request(tokens: np.ndarray) -> bytes:
    h = LookupHeader(1, 7, "lookup", LookupArgs("r1", {"tp": 0}),
                     LookupArrays(ArrayDesc(1, "int64", int(tokens.shape[0]))))
    return _HDR_ENC.encode(h)


_HDR_JSON_DEC = msgspec.json.Decoder(LookupHeader)


def ms_decode_request(frames: list[Any], json_header: bool = False,
                      ) -> tuple[LookupHeader, np.ndarray]:
    """The typed header (msgpack, or with ``json_header`` today's JSON bytes)
    and the token frame checked against it."""
    h = (_HDR_JSON_DEC if json_header else _HDR_DEC).decode(frames[0])
    d = h.arrays.token_ids
    if h.v != protocol.VERSION or d.dtype != "int64" or len(frames[d.frame]) != 8 * d.len:
        raise protocol.ProtocolError("bad")
    return h, np.frombuffer(frames[d.frame], dtype="<i8").copy()


# -- timing ---------------------------------------------------------------------------


def _per_call(fn: Callable[[], object], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def compare(name: str, ours: Callable[[], object], cand: Callable[[], object], n: int,
            rounds: int, wire: tuple[int, int]) -> dict[str, Any]:
    a, b = [], []
    for _ in range(rounds):
        a.append(_per_call(ours, n))
        b.append(_per_call(cand, n))
    t_ours, t_ms = min(a), min(b)  # best round: the least disturbed by other load
    return {"bench": "codec", "case": name, "baseline_us": round(t_ours * 1e6, 2),
            "msgspec_us": round(t_ms * 1e6, 2), "ratio": round(t_ms / t_ours, 2),
            "baseline_median_us": round(statistics.median(a) * 1e6, 2),
            "msgspec_median_us": round(statistics.median(b) * 1e6, 2),
            "wire_bytes": {"baseline": wire[0], "msgspec": wire[1]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run")
    args = ap.parse_args()
    n, rounds = (200, 3) if args.quick else (3000, 9)
    d = make_decision()
    env = m.Envelope(m.Op.PUT, "group-a", 3, 99, 1.0, 42)
    got, want = ms_decision_decode(ms_decision_encode(env, d)), m.decode(m.encode(env, d))
    assert got.env == want.env and isinstance(got.body, m.Decision)
    assert isinstance(want.body, m.Decision) and got.body.num_blocks == want.body.num_blocks
    assert np.array_equal(got.body.mask, want.body.mask)
    print(json.dumps(compare(
        "put decision, 2K blocks", lambda: m.decode(m.encode(env, d)),
        lambda: ms_decision_decode(ms_decision_encode(env, d)), n, rounds,
        (len(m.encode(env, d)[0]), len(ms_decision_encode(env, d))))), flush=True)

    cases: list[tuple[str, m.Op, Any]] = [
        ("cancel", m.Op.CANCEL, m.Cancel("req-17", m.Kind.PUT, 17, 1017)),
        ("release", m.Op.RELEASE, m.Release("req-17", 3)),
        ("result", m.Op.RESULT, m.Result("req-17", m.Kind.PUT, 17, 1017, True)),
    ]
    for name, op, body in cases:
        env = m.Envelope(op, "group-a", 3, 99, 1.0, 42)
        assert v5_decode(v5_encode(env, body)) == m.decode(m.encode(env, body))

        def base(env: m.Envelope = env, body: Any = body) -> object:
            return v5_decode(v5_encode(env, body))

        def cand(env: m.Envelope = env, body: Any = body) -> object:
            return m.decode(m.encode(env, body))

        print(json.dumps(compare(name, base, cand, n, rounds,
                                 (len(v5_encode(env, body)), len(m.encode(env, body)[0])))),
              flush=True)

    tokens = np.arange(2048, dtype=np.int64)
    rank = {"tp": 0}

    def ours_req() -> object:
        frames = protocol.encode_request(7, "lookup", {"rid": "r1", "rank": rank},
                                         {"token_ids": tokens})
        return protocol.decode_request(frames)

    def ms_req() -> object:
        return ms_decode_request([ms_request(tokens), tokens.tobytes()])

    sizes = (len(protocol.encode_request(7, "lookup", {"rid": "r1", "rank": rank},
                                         {"token_ids": tokens})[0]), len(ms_request(tokens)))
    print(json.dumps(compare("engine lookup request header + 2048 tokens", ours_req, ms_req,
                             n, rounds, sizes)), flush=True)

    frames = protocol.encode_request(7, "lookup", {"rid": "r1", "rank": rank},
                                     {"token_ids": tokens})
    print(json.dumps(compare("engine lookup request decode, typed msgspec.json",
                             lambda: protocol._checked_request(frames),
                             lambda: protocol.decode_request(frames), n, rounds,
                             (len(frames[0]), len(frames[0])))), flush=True)
    with open("/proc/loadavg") as f:
        print(json.dumps({"bench": "codec", "loadavg": " ".join(f.read().split()[:3])}),
              flush=True)


if __name__ == "__main__":
    main()
