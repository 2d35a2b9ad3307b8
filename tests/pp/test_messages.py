"""Wire encoding: every op round-trips, and malformed input is refused, never applied."""

from __future__ import annotations

import contextlib
import json
import pickle
import struct
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node_agent.pp.messages import (
    WIRE_VERSION,
    Ack,
    Cancel,
    Decision,
    Envelope,
    Heartbeat,
    Hello,
    Kind,
    MalformedMessage,
    Message,
    Moves,
    Op,
    Release,
    Reset,
    Result,
    Sync,
    decode,
    decode_many,
    decode_sections,
    encode,
    encode_sections,
    is_batch,
    pack,
    pack_batch,
    unpack,
    unpack_batch,
)
from node_agent.vocab.placement import BlockLocation, Direction, Tier, TierMove, TransferPlan


def _decision(direction: Direction, blocks: list[int], tpb: int = 4, skip: int = 1) -> Decision:
    n_tokens = (skip + len(blocks) + 1) * tpb
    mask = np.zeros(n_tokens, dtype=bool)
    mask[skip * tpb:(skip + len(blocks)) * tpb] = True
    plan = TransferPlan(direction, tuple(BlockLocation(Tier.CPU, b) for b in blocks))
    return Decision.build(direction, "req-1", 2, 17, mask, plan)


def _roundtrip(op: Op, body: object, epoch: int = 3, seq: int = 9) -> object:
    env = Envelope(op, "grp", epoch, seq)
    msg = decode(encode(env, body))  # type: ignore[arg-type]
    assert (msg.env.op, msg.env.group, msg.env.epoch, msg.env.seq) == (op, "grp", epoch, seq)
    return msg.body


def test_put_decision_round_trips_with_plan_runs() -> None:
    d = _decision(Direction.STORE, [5, 6, 7, 2, 9, 10])
    out = _roundtrip(Op.PUT, d)
    assert isinstance(out, Decision)
    assert out.plan == d.plan
    assert np.array_equal(out.mask, d.mask)
    assert (out.rid, out.n, out.task_id, out.error, out.active) == ("req-1", 2, 17, None, True)
    # Runs of consecutive blocks travel compactly: (5..7), (2), (9..10).
    assert out.runs is not None and out.runs.tolist() == [[0, 5, 3], [0, 2, 1], [0, 9, 2]]


def test_a_decision_carries_the_life_of_its_rid_and_its_cache_epoch() -> None:
    mask = np.zeros(12, dtype=bool)
    mask[4:8] = True
    plan = TransferPlan(Direction.LOAD, (BlockLocation(Tier.CPU, 3),))
    d = Decision.build(Direction.LOAD, "r", 5, 9, mask, plan, digest=77, life=3,
                       cache_epoch=12)
    out = _roundtrip(Op.GET, d)
    assert isinstance(out, Decision)
    assert (out.life, out.cache_epoch, out.digest) == (3, 12, 77)


def test_a_message_of_the_previous_wire_version_is_refused_naming_both_versions() -> None:
    frames = _frames(Op.PUT, _decision(Direction.STORE, [1, 2]))
    old = frames[0][:5] + bytes([WIRE_VERSION - 1]) + frames[0][6:]
    with pytest.raises(MalformedMessage,
                       match=f"wire version {WIRE_VERSION - 1} is not supported: this agent "
                             f"speaks version {WIRE_VERSION}"):
        decode_sections([old, *frames[1:]])
    assert WIRE_VERSION == 6


def test_a_version_5_json_body_is_refused_by_its_version_and_never_read_as_msgpack() -> None:
    """Version 5 sent control bodies as JSON objects: such a message is refused
    for its version; the same JSON under this version's header is malformed."""
    frames = _frames(Op.RELEASE, Release("r", 2))
    v5 = frames[0][:5] + bytes([5]) + frames[0][6:]
    json_body = json.dumps({"rid": "r", "life": 2}).encode()
    with pytest.raises(MalformedMessage, match="wire version 5 is not supported"):
        decode_sections([v5, frames[1], json_body])
    with pytest.raises(MalformedMessage, match="RELEASE body"):
        decode_sections([frames[0], frames[1], json_body])


def test_non_contiguous_mask_falls_back_to_packed_bits() -> None:
    mask = np.array([True, False, True, True, False, False, True, False, True])
    d = Decision(Direction.LOAD, "r", 0, -1, mask, None, "manager failed: boom")
    out = _roundtrip(Op.GET, d)
    assert isinstance(out, Decision)
    assert np.array_equal(out.mask, mask) and out.plan is None and out.error == d.error
    assert not out.active


def test_control_bodies_round_trip() -> None:
    moves = Moves((TierMove(BlockLocation(Tier.CPU, 3), BlockLocation(Tier.SSD, 8)),
                   TierMove(BlockLocation(Tier.SSD, 1), None)), cache_epoch=4)
    cases: list[tuple[Op, object]] = [
        (Op.MOVES, moves),
        (Op.MOVES, Moves((TierMove(BlockLocation(Tier.REMOTE, 7), BlockLocation(Tier.CPU, 1)),),
                         cache_epoch=-1)),
        (Op.RELEASE, Release("r", 6)),
        (Op.CANCEL, Cancel("r", Kind.PUT, 1, 4)),
        (Op.RESULT, Result("r", Kind.GET, 0, 5, True)),
        (Op.RESET, Reset("flush")),
        (Op.SYNC, Sync(2, 1)),
        (Op.HEARTBEAT, Heartbeat()),
        (Op.HELLO, Hello(1, 12345, 0, True)),
        (Op.ACK, Ack(1, "r", Kind.PUT, 0, 4, False, "copy timed out")),
    ]
    for op, body in cases:
        assert _roundtrip(op, body) == body


def test_remote_moves_carry_the_whole_128_bit_block_digest() -> None:
    digest = (1 << 128) - 3  # more than 64 bits: it must not be cut to an int64
    moves = Moves((TierMove(BlockLocation(Tier.REMOTE, digest), BlockLocation(Tier.CPU, 7)),
                   TierMove(BlockLocation(Tier.CPU, 2), BlockLocation(Tier.REMOTE, 1 << 100))))
    assert _roundtrip(Op.MOVES, moves) == moves


def test_encode_refuses_body_of_another_op() -> None:
    with pytest.raises(ValueError, match="does not match op"):
        encode(Envelope(Op.RESET, "g", 0, 1), Release("r"))
    with pytest.raises(ValueError, match="cannot carry a load decision"):
        encode(Envelope(Op.PUT, "g", 0, 1), _decision(Direction.LOAD, [1]))


def _frames(op: Op, body: object) -> list[bytes]:
    """The logical sections of a message (packed into one frame on the wire)."""
    return encode_sections(Envelope(op, "grp", 1, 1), body)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda f: f[:2], "at least 3 frames"),
        (lambda f: [b"XXXX" + f[0][4:], *f[1:]], "Bad magic"),
        (lambda f: [f[0][:4] + bytes([200]) + f[0][5:], *f[1:]], "Unknown op"),
        (lambda f: [f[0], b"", *f[2:]], "empty or too long"),
        (lambda f: [f[0], f[1], f[2][:-1], *f[3:]], "byte body"),
        (lambda f: [f[0], f[1], f[2], b"\xff\xfe", *f[4:]], "not UTF-8"),
        (lambda f: [*f, b"extra"], "one plan frame"),
        (lambda f: [*f[:5], f[5][:-1]], "multiple of 12"),
        (lambda f: [*f[:5]], "one plan frame"),
    ],
)
def test_malformed_frames_are_refused(mutate: object, reason: str) -> None:
    frames = _frames(Op.PUT, _decision(Direction.STORE, [1, 2]))
    with pytest.raises(MalformedMessage, match=reason):
        decode_sections(mutate(frames))  # type: ignore[operator]


_BODY = struct.Struct("<qqqqqqqqqB")


@pytest.mark.parametrize(
    "index, value, reason",
    [
        (0, -1, "out of range"),  # n
        (1, -5, "out of range"),  # task id below -1
        (2, 1 << 30, "out of range"),  # mask length
        (3, 13, "not within"),  # span start after stop
        (4, 10**6, "not within"),  # span beyond the mask
        (5, 3, "header says 3"),  # plan block count
        (6, -1, "out of range"),  # token digest
        (7, -1, "out of range"),  # life of the rid
        (8, -2, "out of range"),  # cache epoch
        (9, 2, "out of range"),  # flags
    ],
)
def test_decision_fields_are_range_checked(index: int, value: int, reason: str) -> None:
    frames = _frames(Op.PUT, _decision(Direction.STORE, [1, 2]))
    fields = list(_BODY.unpack(frames[2]))
    fields[index] = value
    with pytest.raises(MalformedMessage, match=reason):
        decode_sections([frames[0], frames[1], _BODY.pack(*fields), *frames[3:]])


@pytest.mark.parametrize(
    "field, value, reason",
    [
        ("task_id", True, "must be an integer"),
        ("task_id", "7", "must be an integer"),
        ("n", -1, ">= 0"),
        ("rid", 5, "must be str"),
        ("ok", 1, "must be bool"),
        ("kind", "evict", "put or get"),
    ],
)
def test_body_fields_are_type_checked(field: str, value: object, reason: str) -> None:
    frames = _frames(Op.ACK, Ack(1, "r", Kind.PUT, 0, 4, True))
    body = msgspec.msgpack.decode(frames[2])
    body[Ack.__struct_fields__.index(field)] = value
    with pytest.raises(MalformedMessage, match=reason):
        decode_sections([frames[0], frames[1], msgspec.msgpack.encode(body)])


def test_a_body_of_the_wrong_arity_is_refused_naming_the_fields() -> None:
    frames = _frames(Op.CANCEL, Cancel("r", Kind.PUT, 1, 4))
    body = msgspec.msgpack.decode(frames[2])
    for bad in (body[:-1], [*body, 5]):
        with pytest.raises(MalformedMessage, match=r"CANCEL body must be an array of \['rid'"):
            decode_sections([frames[0], frames[1], msgspec.msgpack.encode(bad)])


def test_pickle_in_a_body_is_refused() -> None:
    frames = _frames(Op.RELEASE, Release("r"))
    with pytest.raises(MalformedMessage, match="RELEASE body must be an array"):
        decode_sections([frames[0], frames[1], pickle.dumps({"rid": "r"})])
    with pytest.raises(MalformedMessage, match="RELEASE body is not valid MessagePack"):
        decode_sections([frames[0], frames[1], b"\xc1"])


def test_plan_with_unknown_tier_or_negative_index_is_refused() -> None:
    frames = _frames(Op.PUT, _decision(Direction.STORE, [1, 2]))
    for row in ([7, 1, 2], [0, -1, 2], [0, 1, 0]):
        bad = np.array([row], dtype="<i8").tobytes()
        with pytest.raises(MalformedMessage):
            decode_sections([*frames[:5], bad])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=0, max_size=6))
def test_random_sections_never_decode_to_anything_but_malformed(frames: list[bytes]) -> None:
    with contextlib.suppress(MalformedMessage):
        decode_sections(frames)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 2))
def test_random_or_truncated_frames_are_malformed(noise: bytes, how: int) -> None:
    good = encode(Envelope(Op.PUT, "g", 1, 1), _decision(Direction.STORE, [1, 2]))[0]
    data = [noise, good[: len(noise) % len(good)], good + noise[:1] if noise else good[:-1]][how]
    with pytest.raises(MalformedMessage):
        decode([data])


def test_a_message_is_exactly_one_frame() -> None:
    frames = encode(Envelope(Op.RESET, "g", 1, 1), Reset("x"))
    assert len(frames) == 1
    with pytest.raises(MalformedMessage, match="one frame"):
        decode([frames[0], b""])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 5000), min_size=0, max_size=40, unique=True),
       st.integers(0, 3))
def test_any_plan_round_trips(blocks: list[int], skip: int) -> None:
    d = _decision(Direction.STORE, blocks, skip=skip)
    out = _roundtrip(Op.PUT, d)
    assert isinstance(out, Decision)
    assert out.plan == d.plan and np.array_equal(out.mask, d.mask)


def test_batch_round_trips_in_order_and_is_told_apart_from_a_message() -> None:
    frames = [encode(Envelope(Op.RELEASE, "g", 1, i), Release(f"r{i}"))[0] for i in range(1, 6)]
    batch = pack_batch(frames)
    assert is_batch(batch) and not any(is_batch(f) for f in frames)
    assert unpack_batch(batch) == frames
    assert [decode([f]).env.seq for f in unpack_batch(batch)] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda b: b[:-1], "add up to"),
        (lambda b: b + b"x", "add up to"),
        (lambda b: b[:5], "shorter than its head"),
        (lambda b: b[:1] + b"XXXX" + b[5:], "Bad batch head"),
        (lambda b: b[:5] + (0).to_bytes(4, "little") + b[9:], "Bad batch head"),
        (lambda b: b[:5] + (1000).to_bytes(4, "little") + b[9:], "length table"),
    ],
)
def test_malformed_batch_frames_are_refused(mutate: Any, reason: str) -> None:
    frames = [encode(Envelope(Op.RELEASE, "g", 1, i), Release("r"))[0] for i in (1, 2)]
    with pytest.raises(MalformedMessage, match=reason):
        unpack_batch(mutate(pack_batch(frames)))


def test_batch_size_is_bounded() -> None:
    with pytest.raises(ValueError, match=r"1\.\.4096"):
        pack_batch([])


def test_plan_index_beyond_the_wire_limit_is_refused_at_encode() -> None:
    mask = np.zeros(8, dtype=np.bool_)
    mask[:4] = True
    runs = np.array([[0, 1 << 31, 1]], dtype=np.int64)
    d = Decision(Direction.STORE, "big", 0, 1, mask, runs)
    with pytest.raises(ValueError, match="above 2147483647, the wire limit"):
        encode(Envelope(Op.PUT, "g", 1, 1), d)


def test_decode_many_gives_each_frame_what_decode_gives_it() -> None:
    """The shared plan checks of a batch find exactly the frames decode() refuses."""
    good = [encode(Envelope(Op.PUT, "g", 1, i), _decision(Direction.STORE, [3, 4, 9, 10 + i]))[0]
            for i in range(4)]
    sections = unpack(good[0])
    runs = np.frombuffer(sections[-1], dtype="<i4").copy()
    neg = runs.copy()
    neg[1] = -5  # a negative block index
    short = runs.copy()
    short[2] -= 1  # the runs cover fewer blocks than the header says
    bad_tier = runs.copy()
    bad_tier[0] = 7
    bad = [pack([*sections[:-1], r.tobytes()]) for r in (neg, short, bad_tier)]
    frames = [good[0], bad[0], good[1], bad[1], b"\x03junk", good[2], bad[2], good[3]]
    results = decode_many(frames)
    for frame, got in zip(frames, results, strict=True):
        try:
            want: object = decode([frame])
        except MalformedMessage as exc:
            assert isinstance(got, MalformedMessage), frame[:16]
            assert str(got) == str(exc)
            continue
        assert isinstance(got, Message)
        assert got.env == want.env  # type: ignore[attr-defined]
        assert isinstance(got.body, Decision)
        np.testing.assert_array_equal(got.body.runs, want.body.runs)  # type: ignore[attr-defined]
        np.testing.assert_array_equal(got.body.mask, want.body.mask)  # type: ignore[attr-defined]
    assert [isinstance(r, Message) for r in results] == [True, False, True, False, False,
                                                         True, False, True]


def test_decode_many_with_only_valid_plans_checks_their_totals() -> None:
    frames = [encode(Envelope(Op.PUT, "g", 1, i), _decision(Direction.STORE, list(range(i))))[0]
              for i in range(1, 5)]
    frames.append(encode(Envelope(Op.PUT, "g", 1, 9),
                         Decision(Direction.STORE, "empty", 0, 3, np.zeros(8, np.bool_),
                                  np.zeros((0, 3), np.int64)))[0])
    results = decode_many(frames)
    assert all(isinstance(r, Message) for r in results)
    assert [r.body.num_blocks for r in results] == [1, 2, 3, 4, 0]  # type: ignore[union-attr]


@pytest.mark.parametrize("length, start, stop", [
    (32768, 4096, 32768), (32768, 0, 8192), (32768, 0, 32768), (32768, 0, 0),
    (32768, 32768, 32768), (40, 8, 24), (100_000, 16, 100_000), (3, 0, 3),
])
def test_span_masks_decode_exactly_and_read_only(length: int, start: int, stop: int) -> None:
    """Prefix and suffix spans decode as read-only views of shared arrays; every
    span decodes to exactly its tokens, whatever the length seen before."""
    mask = np.zeros(length, dtype=np.bool_)
    mask[start:stop] = True
    d = Decision(Direction.STORE, "s", 0, 1 if stop > start else -1, mask, None)
    got = decode(encode(Envelope(Op.PUT, "g", 1, 1), d))
    assert isinstance(got.body, Decision)
    np.testing.assert_array_equal(got.body.mask, mask)
    assert got.body.mask.shape == (length,) and got.body.mask.dtype == np.bool_
    with pytest.raises(ValueError):
        got.body.mask[0] = not got.body.mask[0]  # no decoder output can be changed in place


@pytest.mark.parametrize("op, body", [(Op.RELEASE, b"\x92\x05"), (Op.ACK, b"\x97\x01\x05"),
                                      (Op.SYNC, b"\x92\xa1x")])
def test_a_truncated_body_with_a_wrong_first_field_is_malformed(op: Op, body: bytes) -> None:
    """The typed decode stops at the bad field before it sees the truncation: the
    error is still :class:`MalformedMessage` (anything else kills the receiver)."""
    frames = _frames(Op.RELEASE, Release("r", 2))
    header = frames[0][:4] + bytes([int(op)]) + frames[0][5:]
    with pytest.raises(MalformedMessage, match=op.name):
        decode_sections([header, frames[1], body])
    [out] = decode_many([pack([header, frames[1], body])])
    assert isinstance(out, MalformedMessage)


@pytest.mark.parametrize("op, body, dropped", [
    (Op.RELEASE, Release("r", 3), 1),
    (Op.ACK, Ack(1, "r", Kind.PUT, 0, 4, True, "boom"), 1),
])
def test_a_body_missing_a_trailing_field_is_refused_even_when_it_has_a_default(
        op: Op, body: object, dropped: int) -> None:
    """Every field travels: a RELEASE without its life (or an ACK without its
    error) is malformed, not read with the Python default."""
    frames = _frames(op, body)
    fields = msgspec.msgpack.decode(frames[2])
    short = msgspec.msgpack.encode(fields[:-dropped])
    with pytest.raises(MalformedMessage, match=rf"{op.name} body must be an array of"):
        decode_sections([frames[0], frames[1], short])
