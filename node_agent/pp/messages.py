"""Typed fan-out messages and their wire encoding (no pickle; strict decode).

A message travels as one ZeroMQ frame that packs its *sections* (:func:`pack`:
a section count, each section's length, then the bytes):

* section 0: fixed header ``<4sBBqqdq``: magic ``b"FKV1"``, op code, wire version,
  epoch, seq, sender wall-clock time (for the lag metric), sender incarnation
  (a random id of the sending stream instance: a restarted leader process,
  even under the same epoch and address, has a new one);
* section 1: group name, UTF-8;
* section 2: body: for decisions (PUT, GET) a fixed binary struct followed by
  the rid and error sections; for every other op a MessagePack array of the
  op's fields in a fixed order, encoded and validated (types, bounds, arity)
  by a ``msgspec.Struct`` per op;
* further sections: binary arrays of the op (masks, plans, moves), little-endian.

:func:`decode` checks every frame, key and type and raises
:class:`MalformedMessage` naming what was wrong; the channel drops such a
message and counts it (reason ``malformed``). Nothing is ever unpickled.

Masks are contiguous spans by the backend contract, so a mask travels as
``(length, start, stop)``; a non-contiguous mask (not expected) falls back to
packed bits. Plans travel as runs ``(tier, first index, count)`` of consecutive
blocks, which keeps a 2K-block plan small when the allocator hands out runs.
"""

from __future__ import annotations

import enum
import re
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Annotated

import msgspec
import numpy as np
import numpy.typing as npt

from node_agent.vocab.placement import BlockLocation, Direction, Tier, TierMove, TransferPlan

MAGIC = b"FKV1"
WIRE_VERSION = 6
"""Version 6: the body of every op but PUT and GET is a MessagePack array
(version 5: a JSON object). Version 5: decisions carry the leader's life of
their rid and the cache epoch they were made under; MOVES carry their cache
epoch and REMOTE indices as whole 128-bit block digests; RELEASE carries the
rid's next life. A message of any other version is refused
(:class:`MalformedMessage`) before its body is read."""
NO_CACHE_EPOCH = -1
"""The cache epoch of moves made while the leader's ``cacheEpoch`` switched: no
stage applies their remote part."""
_RUN_MAX = (1 << 31) - 1
"""Largest block index or run length on the wire (plan runs travel as int32)."""
_HEADER = struct.Struct("<4sBBqqdq")
_TIER_CODES = {Tier.CPU: 0, Tier.SSD: 1, Tier.REMOTE: 2}
_TIER_BY_CODE = {v: k for k, v in _TIER_CODES.items()}
_NO_TIER = 255
_U64 = (1 << 64) - 1
_MAX_GROUP_LEN = 253
_MAX_TOKENS = 1 << 24

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
"""An integer field that the decoder refuses below 0."""


class MalformedMessage(ValueError):
    """A received message failed validation; it must be dropped, never applied."""


class Op(enum.IntEnum):
    """Operation tag of a message. Leader-to-follower ops below 64 are in the
    ordered stream (they consume a seq); the others are control messages."""

    PUT = 1
    """Put decision for one ``store_kv`` call."""
    GET = 2
    """Get decision for one ``lookup`` call."""
    MOVES = 3
    """Leader-decided tier moves (spills, drops), applied before later plans."""
    RELEASE = 4
    """Engine released a request: drop its pending decisions."""
    CANCEL = 5
    """Leader gave up a task: a follower must not start (or keep) it."""
    RESULT = 6
    """Leader's group verdict on a task (put published / discarded; get loaded / miss)."""
    RESET = 7
    """Flush every tier and every pending decision (a resync point)."""
    SYNC = 64
    """Per-follower start point: the next stream seq is ``seq + 1``."""
    HEARTBEAT = 65
    """Leader liveness; ``seq`` is the last stream seq sent (lets followers see gaps)."""
    HELLO = 96
    """Follower to leader: my rank, epoch and last applied seq; asks for a SYNC."""
    ACK = 97
    """Follower to leader: a task's outcome on this stage (or stream progress)."""

    @property
    def in_stream(self) -> bool:
        """True for ordered leader decisions that consume a seq."""
        return self < 64


_OPS = {int(o): o for o in Op}


class Kind(enum.Enum):
    """Which engine call a decision or ack belongs to."""

    PUT = "put"
    GET = "get"


@dataclass(frozen=True)
class Envelope:
    """Fields every message carries."""

    op: Op
    group: str
    epoch: int
    seq: int
    sent_at: float = field(default_factory=time.time, compare=False)
    incarnation: int = 0
    """The sending stream instance (a leader's per-role random id; 0 when unset)."""


@dataclass(frozen=True, eq=False)
class Decision:
    """A put or get decision (``Op.PUT`` / ``Op.GET``).

    A decoded decision's ``mask`` is read-only (it may share memory with other
    decoded masks).

    ``n`` is the leader's decision number, unique within its role (acks,
    cancels and results name the decision by ``(rid, kind, n)``); it never
    decides pairing. ``digest`` identifies the tokens the decision was made for
    (:func:`node_agent.coordinator.inputs.token_digest`): a follower applies the
    decision only to its own call of the same rid, kind and digest. ``mask``
    is over the page-aligned tokens (put) or all tokens (get). The plan travels as ``runs``, rows
    ``(tier code, first block index, count)`` (None when ``task_id`` is -1);
    :attr:`plan` expands it. ``error`` is set when the leader's manager call
    failed (task -1, nothing to do).

    ``life`` is the leader's life of the rid (how many times the leader's
    engine released the rid before this call, counted by the leader role): a
    follower's call takes only a decision of its own life of the rid, even
    when the RELEASE that ended a life was lost in a gap. ``cache_epoch`` is
    the ``cacheEpoch`` the decision was made under: a stage whose key epoch
    differs refuses it.
    """

    direction: Direction
    rid: str
    n: int
    task_id: int
    mask: npt.NDArray[np.bool_]
    runs: npt.NDArray[np.int64] | None
    error: str | None = None
    digest: int = 0
    life: int = 0
    cache_epoch: int = 0

    @classmethod
    def build(
        cls,
        direction: Direction,
        rid: str,
        n: int,
        task_id: int,
        mask: npt.NDArray[np.bool_],
        plan: TransferPlan | None,
        error: str | None = None,
        digest: int = 0,
        life: int = 0,
        cache_epoch: int = 0,
    ) -> Decision:
        """A decision from a backend plan (checks the plan's direction)."""
        if plan is not None and plan.direction is not direction:
            raise ValueError(
                f"A {direction.value} decision cannot carry a {plan.direction.value} plan"
            )
        runs = None if plan is None else plan_runs(plan)
        return cls(direction, rid, n, task_id, np.asarray(mask, dtype=np.bool_), runs, error,
                   digest, life, cache_epoch)

    @property
    def num_blocks(self) -> int:
        """Blocks in the plan (0 without one)."""
        return 0 if self.runs is None else int(self.runs[:, 2].sum())

    @property
    def plan(self) -> TransferPlan | None:
        """The physical plan, expanded from its runs."""
        if self.runs is None:
            return None
        blocks: list[BlockLocation] = []
        for code, start, count in self.runs.tolist():
            tier = _TIER_BY_CODE[code]
            blocks.extend(BlockLocation(tier, i) for i in range(start, start + count))
        return TransferPlan(self.direction, tuple(blocks))

    @property
    def active(self) -> bool:
        """True when the stage has something to copy."""
        return self.task_id >= 0 and self.num_blocks > 0


@dataclass(frozen=True)
class Moves:
    """``Op.MOVES``: tier moves in decision order.

    ``cache_epoch``: the ``cacheEpoch`` whose remote keys the REMOTE moves name
    (:data:`NO_CACHE_EPOCH` when it switched while they were decided); a stage
    on another epoch fetches and writes none of them."""

    moves: tuple[TierMove, ...]
    cache_epoch: int = 0


class _Body(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """A control message body: on the wire a MessagePack array of the fields in
    declaration order; decoding checks each field's type and bound (a bool is
    never an int, nor an int a bool) and the array's length."""


class Release(_Body, frozen=True):
    """``Op.RELEASE``: the request is finished on the engine side; ``life`` is
    the leader's next life of the rid (the life of its next decisions)."""

    rid: str
    life: NonNegative = 1


class Cancel(_Body, frozen=True):
    """``Op.CANCEL``: the leader abandoned task ``task_id`` of ``rid``."""

    rid: str
    kind: Kind
    n: NonNegative
    task_id: int


class Result(_Body, frozen=True):
    """``Op.RESULT``: group verdict; ``ok`` means every stage finished the task."""

    rid: str
    kind: Kind
    n: NonNegative
    task_id: int
    ok: bool


class Reset(_Body, frozen=True):
    """``Op.RESET``: flush; ``reason`` is for logs."""

    reason: str


class Sync(_Body, frozen=True):
    """``Op.SYNC``: answer to a HELLO; the follower continues after envelope seq.

    ``gen`` is the HELLO's ``gen`` plus one; a follower accepts only the SYNC
    answering its latest HELLO.
    """

    rank: NonNegative
    gen: NonNegative


class Heartbeat(_Body, frozen=True):
    """``Op.HEARTBEAT``: no body (an empty array)."""


class Hello(_Body, frozen=True):
    """``Op.HELLO``: sent by a follower on (re)connect and after a gap.

    ``envelope.seq`` is the follower's last applied seq (-1 when none) and
    ``envelope.epoch`` the epoch it follows. ``session`` identifies the
    follower's stream instance (new after a restart or an epoch change) and
    ``gen`` counts the SYNCs it accepted in that session, so the leader can
    ignore a HELLO it already answered. ``resync`` says a gap was seen.
    """

    rank: NonNegative
    session: NonNegative
    gen: NonNegative
    resync: bool


class Ack(_Body, frozen=True):
    """``Op.ACK``: outcome of a task on the sending stage (``rank``)."""

    rank: NonNegative
    rid: str
    kind: Kind
    n: NonNegative
    task_id: int
    ok: bool
    error: str | None = None


class _MovesHead(_Body, frozen=True):
    """The body of ``Op.MOVES`` (the moves follow as one array section)."""

    count: NonNegative
    cache_epoch: Annotated[int, msgspec.Meta(ge=NO_CACHE_EPOCH)]


Body = Decision | Moves | Release | Cancel | Result | Reset | Sync | Heartbeat | Hello | Ack


@dataclass(frozen=True)
class Message:
    """A decoded message: envelope plus the body of its op."""

    env: Envelope
    body: Body


# -- encoding ----------------------------------------------------------------------


# A decision's body frame: n, task_id, mask length, span start, span stop (-1, -1:
# packed bits follow), plan block count (-1: no plan), token digest, life of the
# rid, cache epoch, flags (bit 0: error set).
_DECISION = struct.Struct("<qqqqqqqqqB")


def _encode_decision(d: Decision) -> list[bytes]:
    """Frames after the group: body, rid, error, [packed mask], [plan runs]."""
    m = d.mask
    # Byte scans (memchr speed): first and last True, then no False between.
    raw = np.ascontiguousarray(m, dtype=np.bool_).view(np.uint8).tobytes()
    first = raw.find(1)
    extra: list[bytes] = []
    if first < 0:
        start = stop = 0
    else:
        start, stop = first, raw.rfind(1) + 1
        if raw.find(0, start, stop) >= 0:
            start = stop = -1
            extra.append(np.packbits(m).tobytes())
    plan = -1
    if d.runs is not None:
        plan = d.num_blocks
        if d.runs.size and int(d.runs.max()) > _RUN_MAX:
            raise ValueError(
                f"Plan of {d.rid!r} holds a block index or run above {_RUN_MAX}, the wire "
                "limit; use fewer, larger blocks per tier"
            )
        extra.append(np.ascontiguousarray(d.runs, dtype="<i4").tobytes())
    body = _DECISION.pack(d.n, d.task_id, m.size, start, stop, plan, d.digest, d.life,
                          d.cache_epoch, d.error is not None)
    return [body, d.rid.encode(), (d.error or "").encode(), *extra]


class _SpanMasks:
    """Read-only masks of one contiguous span, as views of two shared arrays.

    A put's mask is a suffix span (the cached prefix is skipped) and a get's a
    prefix span, so decoding them needs no new array: ``after`` is ``size``
    False then ``size`` True, ``before`` the opposite, and the mask of
    ``[start, length)`` is the window of ``after`` that starts ``start`` before
    its middle. Other spans get a fresh array. The arrays grow (doubling) to
    the longest mask seen; the views stay valid because an older array lives
    as long as a view of it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._size = 0
        self._after = np.zeros(0, dtype=np.bool_)
        self._before = np.zeros(0, dtype=np.bool_)

    def _arrays(self, length: int) -> tuple[int, npt.NDArray[np.bool_], npt.NDArray[np.bool_]]:
        size, after, before = self._size, self._after, self._before
        if length <= size:
            return size, after, before
        with self._lock:
            if length > self._size:
                size = max(4096, 1 << (length - 1).bit_length())
                after = np.zeros(2 * size, dtype=np.bool_)
                after[size:] = True
                before = ~after
                after.flags.writeable = False
                before.flags.writeable = False
                self._size, self._after, self._before = size, after, before
            return self._size, self._after, self._before

    def get(self, length: int, start: int, stop: int) -> npt.NDArray[np.bool_]:
        """The mask of ``length`` tokens, True exactly on ``[start, stop)``."""
        if stop == length or start == 0:
            size, after, before = self._arrays(length)
            if stop == length:
                return after[size - start:size - start + length]
            return before[size - stop:size - stop + length]
        mask = np.zeros(length, dtype=np.bool_)
        mask[start:stop] = True
        mask.flags.writeable = False
        return mask


_span_mask = _SpanMasks().get

_Deferred = list[tuple[int, bytes]]
"""Plan-run frames decoded without their value checks: ``(plan count, frame)``."""


def _decode_decision(op: Op, frames: list[bytes], defer: _Deferred | None = None) -> Decision:
    """``defer``: when given, the plan runs' value checks are left to the caller
    (:func:`decode_many` runs them for many messages at once); the frame is
    appended to it."""
    if len(frames) < 3 or len(frames[0]) != _DECISION.size:
        raise MalformedMessage(f"{op.name} needs a {_DECISION.size}-byte body, rid and error")
    n, task_id, length, start, stop, plan, digest, life, cache_epoch, flags = \
        _DECISION.unpack(frames[0])
    try:
        rid, error = frames[1].decode(), frames[2].decode()
    except UnicodeDecodeError:
        raise MalformedMessage(f"{op.name} rid or error is not UTF-8") from None
    if n < 0 or task_id < -1 or flags > 1 or digest < 0 or life < 0 or cache_epoch < 0 \
            or not 0 <= length <= _MAX_TOKENS:
        raise MalformedMessage(
            f"{op.name} fields out of range: n={n} task_id={task_id} mask_len={length} "
            f"digest={digest} life={life} cache_epoch={cache_epoch}"
        )
    arrays = frames[3:]
    if start == -1 and stop == -1:
        if not arrays or len(arrays[0]) != (length + 7) // 8:
            raise MalformedMessage(f"Packed mask frame must hold {(length + 7) // 8} bytes")
        mask = np.zeros(length, dtype=np.bool_)
        mask[:] = np.unpackbits(np.frombuffer(arrays[0], dtype=np.uint8), count=length)
        mask.flags.writeable = False
        total = int(np.count_nonzero(mask))
        arrays = arrays[1:]
    elif 0 <= start <= stop <= length:
        mask = _span_mask(length, start, stop)
        total = stop - start
    else:
        raise MalformedMessage(f"Mask span [{start}, {stop}) is not within {length} tokens")
    runs = None
    if plan >= 0:
        if len(arrays) != 1:
            raise MalformedMessage(f"{op.name} with a plan needs one plan frame")
        if defer is None:
            runs = _decode_runs(plan, arrays[0])
        else:
            runs = _runs_array(arrays[0])
            defer.append((plan, arrays[0]))
        if (plan == 0) != (total == 0) or (plan and total % plan):
            raise MalformedMessage(f"Mask of {total} tokens cannot cover {plan} plan blocks")
    elif plan != -1 or arrays:
        raise MalformedMessage(f"{op.name} has plan count {plan} and {len(arrays)} extra frames")
    direction = Direction.STORE if op is Op.PUT else Direction.LOAD
    return Decision(direction, rid, n, task_id, mask, runs, error if flags else None, digest,
                    life, cache_epoch)


def plan_runs(plan: TransferPlan) -> npt.NDArray[np.int64]:
    """A plan as runs of consecutive blocks: rows ``(tier code, start, count)``."""
    if not plan.blocks:
        return np.zeros((0, 3), dtype=np.int64)
    codes = np.fromiter((_TIER_CODES[b.tier] for b in plan.blocks), np.int64, len(plan.blocks))
    idx = np.fromiter((b.index for b in plan.blocks), np.int64, len(plan.blocks))
    brk = np.flatnonzero((np.diff(idx) != 1) | (np.diff(codes) != 0)) + 1
    starts = np.concatenate(([0], brk))
    counts = np.diff(np.concatenate((starts, [len(idx)])))
    return np.stack([codes[starts], idx[starts], counts], axis=1).astype(np.int64)


def encode(env: Envelope, body: Body) -> list[bytes]:
    """Encode a message as the one ZeroMQ frame sent (see :func:`pack`)."""
    return [pack(encode_sections(env, body))]


def decode(frames: list[bytes]) -> Message:
    """Decode a received message; raises :class:`MalformedMessage`."""
    if len(frames) != 1:
        raise MalformedMessage(f"A message is one frame, got {len(frames)}")
    return decode_sections(unpack(frames[0]))


_COUNT = struct.Struct("<B")
_MAX_SECTIONS = 16
_LENGTHS = [struct.Struct(f"<{n}I") for n in range(_MAX_SECTIONS + 1)]


def pack(sections: list[bytes]) -> bytes:
    """Sections in one buffer: count (u8), each length (u32), then the bytes.

    One frame per message keeps the per-message cost of ZeroMQ and Curve low.
    """
    if len(sections) > _MAX_SECTIONS:
        raise ValueError(f"A message holds at most {_MAX_SECTIONS} sections")
    lengths = _LENGTHS[len(sections)].pack(*map(len, sections))
    return b"".join([_COUNT.pack(len(sections)), lengths, *sections])


def unpack(data: bytes) -> list[bytes]:
    """Inverse of :func:`pack`; raises :class:`MalformedMessage` on any overrun."""
    if not data:
        raise MalformedMessage("Empty message")
    n = data[0]
    if not 3 <= n <= _MAX_SECTIONS or len(data) < 1 + 4 * n:
        raise MalformedMessage(f"Message declares {n} sections in {len(data)} bytes")
    lengths = _LENGTHS[n].unpack_from(data, 1)
    if 1 + 4 * n + sum(lengths) != len(data):
        raise MalformedMessage(
            f"Section lengths {list(lengths)} do not add up to the {len(data)}-byte message"
        )
    out, pos = [], 1 + 4 * n
    for ln in lengths:
        out.append(data[pos:pos + ln])
        pos += ln
    return out


# A batch frame: marker byte 0 (a message frame starts with its section count,
# 3..16), magic, message count (u32), each message's length (u32), then the
# messages, each exactly the one frame :func:`encode` makes.
_BATCH_HEAD = struct.Struct("<B4sI")
_BATCH_MAGIC = b"FKVB"
MAX_BATCH = 4096


def is_batch(data: bytes) -> bool:
    """True when ``data`` is a batch frame (:func:`pack_batch`), not one message."""
    return len(data) > 0 and data[0] == 0


def pack_batch(messages: list[bytes]) -> bytes:
    """Several encoded messages (one frame each) in one frame, in order.

    The receiver decodes and handles each message on its own, exactly as if it
    had arrived alone; batching only saves per-frame transport costs.
    """
    if not 1 <= len(messages) <= MAX_BATCH:
        raise ValueError(f"A batch holds 1..{MAX_BATCH} messages, got {len(messages)}")
    lengths = struct.pack(f"<{len(messages)}I", *map(len, messages))
    return b"".join([_BATCH_HEAD.pack(0, _BATCH_MAGIC, len(messages)), lengths, *messages])


def unpack_batch(data: bytes) -> list[bytes]:
    """Inverse of :func:`pack_batch`: the message frames, in order.

    Raises :class:`MalformedMessage` on a bad head, count or length table; the
    messages themselves are checked by :func:`decode`.
    """
    if len(data) < _BATCH_HEAD.size:
        raise MalformedMessage(f"Batch frame of {len(data)} bytes is shorter than its head")
    marker, magic, count = _BATCH_HEAD.unpack_from(data)
    if marker != 0 or magic != _BATCH_MAGIC or not 1 <= count <= MAX_BATCH:
        raise MalformedMessage(f"Bad batch head: magic {magic!r}, count {count}")
    pos = _BATCH_HEAD.size + 4 * count
    if len(data) < pos:
        raise MalformedMessage(f"Batch of {count} messages has no room for its length table")
    lengths = struct.unpack_from(f"<{count}I", data, _BATCH_HEAD.size)
    if pos + sum(lengths) != len(data):
        raise MalformedMessage(
            f"Batch lengths add up to {pos + sum(lengths)} bytes, the frame has {len(data)}"
        )
    out = []
    for ln in lengths:
        out.append(data[pos:pos + ln])
        pos += ln
    return out


def encode_sections(env: Envelope, body: Body) -> list[bytes]:
    """Encode a message as its logical sections. Raises ``ValueError`` for a body that does not
    match ``env.op`` or a group name that is empty or too long."""
    g = env.group.encode()
    if not g or len(g) > _MAX_GROUP_LEN:
        raise ValueError(f"Fan-out group name {env.group!r} must be 1..{_MAX_GROUP_LEN} bytes")
    op = env.op
    arrays: list[bytes] = []
    wire: _Body
    if op in (Op.PUT, Op.GET) and isinstance(body, Decision):
        want = Direction.STORE if op is Op.PUT else Direction.LOAD
        if body.direction is not want:
            raise ValueError(f"{op.name} message cannot carry a {body.direction.value} decision")
        header = _HEADER.pack(MAGIC, int(op), WIRE_VERSION, env.epoch, env.seq, env.sent_at,
                              env.incarnation)
        return [header, g, *_encode_decision(body)]
    elif op is Op.MOVES and isinstance(body, Moves):
        # Per move: source tier, index low and high 64 bits, then the same for the
        # destination; a REMOTE index is a 128-bit block digest (docs/remote.md).
        rows = [
            (
                _TIER_CODES[m.src.tier],
                m.src.index & _U64, m.src.index >> 64,
                _NO_TIER if m.dst is None else _TIER_CODES[m.dst.tier],
                0 if m.dst is None else m.dst.index & _U64,
                0 if m.dst is None else m.dst.index >> 64,
            )
            for m in body.moves
        ]
        wire = _MovesHead(len(rows), body.cache_epoch)
        arrays.append(np.array(rows, dtype="<u8").reshape(-1, 6).tobytes())
    elif type(body) is _BODY_TYPES.get(op):
        wire = body
    else:
        raise ValueError(f"Body {type(body).__name__} does not match op {op.name}")
    header = _HEADER.pack(MAGIC, int(op), WIRE_VERSION, env.epoch, env.seq, env.sent_at,
                          env.incarnation)
    return [header, g, _ENCODER.encode(wire), *arrays]


# -- decoding ----------------------------------------------------------------------


_BODY_TYPES: dict[Op, type[_Body]] = {
    Op.MOVES: _MovesHead, Op.RELEASE: Release, Op.CANCEL: Cancel, Op.RESULT: Result,
    Op.RESET: Reset, Op.SYNC: Sync, Op.HEARTBEAT: Heartbeat, Op.HELLO: Hello, Op.ACK: Ack,
}
"""The body type of every op but PUT and GET."""
_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {op: msgspec.msgpack.Decoder(t) for op, t in _BODY_TYPES.items()}
_EXPECTED = {
    "rid": "str", "reason": "str", "error": "str or null", "kind": "put or get",
    "ok": "bool", "resync": "bool", "task_id": "an integer",
    "cache_epoch": f"an integer >= {NO_CACHE_EPOCH}",
}
"""What a field must be, as the decode error says it (default: an integer >= 0)."""
_AT_INDEX = re.compile(r" - at `\$\[(\d+)\]`$")


def _body_error(op: Op, raw: bytes, exc: msgspec.ValidationError) -> MalformedMessage:
    """The decode error of a body that is valid MessagePack but not the op's
    fields: names the field, what it must be and the value it had."""
    names = _BODY_TYPES[op].__struct_fields__
    at = _AT_INDEX.search(str(exc))
    if at is None or int(at.group(1)) >= len(names):
        return MalformedMessage(
            f"{op.name} body must be an array of {list(names)}: {exc}"
        )
    i = int(at.group(1))
    try:  # the typed decode stops at the bad field, before a truncation after it
        value = msgspec.msgpack.decode(raw)[i]
    except msgspec.DecodeError as bad:
        return MalformedMessage(f"{op.name} body is not valid MessagePack: {bad}")
    want = _EXPECTED.get(names[i], "an integer >= 0")
    return MalformedMessage(f"Field {names[i]!r} of {op.name} must be {want}, got {value!r}")


def _array_length(raw: bytes) -> int | None:
    """The element count a MessagePack array declares at the start of ``raw``
    (None when ``raw`` does not start with an array)."""
    if not raw:
        return None
    b = raw[0]
    if 0x90 <= b <= 0x9F:
        return b & 0x0F
    if b == 0xDC and len(raw) >= 3:
        return int.from_bytes(raw[1:3], "big")
    if b == 0xDD and len(raw) >= 5:
        return int.from_bytes(raw[1:5], "big")
    return None


def _decode_fields(op: Op, raw: bytes) -> _Body:
    """The op's body from its MessagePack section; raises :class:`MalformedMessage`.
    Every field must travel, also one with a default (msgspec would fill an
    omitted trailing field with it)."""
    names = _BODY_TYPES[op].__struct_fields__
    count = _array_length(raw)
    if count is not None and count != len(names):
        raise MalformedMessage(
            f"{op.name} body must be an array of {list(names)}: got {count} elements")
    try:
        return _DECODERS[op].decode(raw)
    except msgspec.ValidationError as exc:
        raise _body_error(op, raw, exc) from None
    except msgspec.DecodeError as exc:
        raise MalformedMessage(f"{op.name} body is not valid MessagePack: {exc}") from None


def _expect_frames(frames: list[bytes], n: int, op: Op) -> None:
    if len(frames) != n:
        raise MalformedMessage(f"{op.name} needs {n} frames, got {len(frames)}")


def _runs_array(frame: bytes) -> npt.NDArray[np.int64]:
    """The runs of a plan frame, unchecked but for the frame length."""
    if len(frame) % 12:
        raise MalformedMessage(f"Plan frame length {len(frame)} is not a multiple of 12")
    return np.frombuffer(frame, dtype="<i4").astype(np.int64).reshape(-1, 3)


def _decode_runs(count: int, frame: bytes) -> npt.NDArray[np.int64]:
    if len(frame) % 12:
        raise MalformedMessage(f"Plan frame length {len(frame)} is not a multiple of 12")
    flat = np.frombuffer(frame, dtype="<i4")
    if flat.size:
        counts = flat[2::3]
        if flat.min() < 0 or flat[0::3].max() >= len(_TIER_BY_CODE) or counts.min() <= 0:
            raise MalformedMessage(
                "Plan runs hold an unknown tier, a negative index or an empty run"
            )
        covered = int(counts.sum())
    else:
        covered = 0
    if covered != count:
        raise MalformedMessage(f"Plan runs cover {covered} blocks, header says {count}")
    return flat.astype(np.int64).reshape(-1, 3)


def _valid_index(tier: int, index: int) -> bool:
    """A tier code and block index of a move: a REMOTE index is a 128-bit digest,
    every other a non-negative int64."""
    if tier not in _TIER_BY_CODE:
        return False
    return index < (1 << (128 if _TIER_BY_CODE[tier] is Tier.REMOTE else 63))


def _decode_body(op: Op, raw: bytes, arrays: list[bytes]) -> Body:
    fields = _decode_fields(op, raw)
    if not isinstance(fields, _MovesHead):
        _expect_frames(arrays, 0, op)
        return fields  # type: ignore[return-value]  # every other body type is a Body
    count = fields.count
    _expect_frames(arrays, 1, op)
    if len(arrays[0]) != count * 48:
        raise MalformedMessage(f"Moves frame must hold {count * 48} bytes")
    rows = np.frombuffer(arrays[0], dtype="<u8").reshape(-1, 6).tolist()
    moves = []
    for s_tier, s_lo, s_hi, d_tier, d_lo, d_hi in rows:
        s_idx = s_lo | s_hi << 64
        if not _valid_index(s_tier, s_idx):
            raise MalformedMessage(f"Move source ({s_tier}, {s_idx}) is invalid")
        src = BlockLocation(_TIER_BY_CODE[s_tier], s_idx)
        d_idx = d_lo | d_hi << 64
        if d_tier == _NO_TIER:
            moves.append(TierMove(src, None))
        elif _valid_index(d_tier, d_idx):
            moves.append(TierMove(src, BlockLocation(_TIER_BY_CODE[d_tier], d_idx)))
        else:
            raise MalformedMessage(f"Move destination ({d_tier}, {d_idx}) is invalid")
    return Moves(tuple(moves), fields.cache_epoch)


def decode_many(frames: list[bytes]) -> list[Message | MalformedMessage]:
    """Decode each frame exactly as :func:`decode` would (one message per frame).

    Each result is the :class:`Message`, or the :class:`MalformedMessage` that
    :func:`decode` would raise for that frame; one bad frame never spoils the
    others. The plan runs' value checks (tier codes, indices, non-empty runs,
    block totals) run once over all frames together, which is what makes a
    batch cheaper to decode than its messages one by one.
    """
    out: list[Message | MalformedMessage] = []
    deferred: list[tuple[int, int, bytes]] = []
    pending: _Deferred = []
    for f in frames:
        try:
            msg = decode_sections(unpack(f), pending)
        except MalformedMessage as exc:
            pending.clear()
            out.append(exc)
            continue
        if pending:
            plan, raw = pending.pop()
            deferred.append((len(out), plan, raw))
        out.append(msg)
    if deferred:
        _check_runs_together(out, deferred)
    return out


def _check_runs_together(out: list[Message | MalformedMessage],
                         deferred: list[tuple[int, int, bytes]]) -> None:
    """The checks of :func:`_decode_runs` over many plan frames at once; a
    message whose runs fail becomes the :class:`MalformedMessage` in ``out``."""
    flat = np.frombuffer(b"".join(raw for _, _, raw in deferred), dtype="<i4")
    counts = flat[2::3]
    valid = not flat.size or (
        flat.min() >= 0 and flat[0::3].max() < len(_TIER_BY_CODE) and counts.min() > 0
    )
    if not valid:  # rare: find the culprits one by one
        for i, plan, raw in deferred:
            try:
                _decode_runs(plan, raw)
            except MalformedMessage as exc:
                out[i] = exc
        return
    rows = np.fromiter((len(raw) // 12 for _, _, raw in deferred), np.int64, len(deferred))
    starts = np.cumsum(rows) - rows
    covered = np.zeros(len(deferred), dtype=np.int64)
    nonempty = rows > 0
    if nonempty.any():
        covered[nonempty] = np.add.reduceat(counts, starts[nonempty], dtype=np.int64)
    for (i, plan, _), c in zip(deferred, covered.tolist(), strict=True):
        if c != plan:
            out[i] = MalformedMessage(f"Plan runs cover {c} blocks, header says {plan}")


def decode_sections(frames: list[bytes], defer: _Deferred | None = None) -> Message:
    """Decode sections into a :class:`Message`; raises :class:`MalformedMessage`.
    ``defer``: see :func:`_decode_decision`."""
    if len(frames) < 3:
        raise MalformedMessage(f"A message has at least 3 frames, got {len(frames)}")
    if len(frames[0]) != _HEADER.size:
        raise MalformedMessage(f"Header frame must be {_HEADER.size} bytes, got {len(frames[0])}")
    magic, code, version, epoch, seq, sent_at, incarnation = _HEADER.unpack(frames[0])
    if magic != MAGIC:
        raise MalformedMessage(f"Bad magic {magic!r}, expected {MAGIC!r}")
    if version != WIRE_VERSION:
        raise MalformedMessage(
            f"Fan-out wire version {version} is not supported: this agent speaks version "
            f"{WIRE_VERSION}; run the same agent version on every stage of the group"
        )
    op = _OPS.get(code)
    if op is None:
        raise MalformedMessage(f"Unknown op code {code}")
    if epoch < 0 or seq < -1 or incarnation < 0:
        raise MalformedMessage(
            f"Epoch {epoch}, seq {seq} and incarnation {incarnation} must not be negative")
    try:
        group = frames[1].decode()
    except UnicodeDecodeError:
        raise MalformedMessage("Group name is not valid UTF-8") from None
    if not group or len(frames[1]) > _MAX_GROUP_LEN:
        raise MalformedMessage(f"Group name {group!r} is empty or too long")
    env = Envelope(op, group, epoch, seq, sent_at, incarnation)
    if op is Op.PUT or op is Op.GET:
        return Message(env, _decode_decision(op, frames[2:], defer))
    return Message(env, _decode_body(op, frames[2], frames[3:]))
