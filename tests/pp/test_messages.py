"""Wire encoding: every op round-trips, and malformed input is refused, never applied."""

from __future__ import annotations

import contextlib
import json
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node_agent.backend.replication import BlockLocation, Direction, Tier, TierMove, TransferPlan
from node_agent.pp.messages import (
    Ack,
    Cancel,
    Decision,
    Envelope,
    Heartbeat,
    Hello,
    Kind,
    MalformedMessage,
    Moves,
    Op,
    Release,
    Reset,
    Result,
    Sync,
    decode,
    encode,
)


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


def test_non_contiguous_mask_falls_back_to_packed_bits() -> None:
    mask = np.array([True, False, True, True, False, False, True, False, True])
    d = Decision(Direction.LOAD, "r", 0, -1, mask, None, "manager failed: boom")
    out = _roundtrip(Op.GET, d)
    assert isinstance(out, Decision)
    assert np.array_equal(out.mask, mask) and out.plan is None and out.error == d.error
    assert not out.active


def test_control_bodies_round_trip() -> None:
    moves = Moves((TierMove(BlockLocation(Tier.CPU, 3), BlockLocation(Tier.SSD, 8)),
                   TierMove(BlockLocation(Tier.SSD, 1), None)))
    cases: list[tuple[Op, object]] = [
        (Op.MOVES, moves),
        (Op.RELEASE, Release("r")),
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


def test_encode_refuses_body_of_another_op() -> None:
    with pytest.raises(ValueError, match="does not match op"):
        encode(Envelope(Op.RESET, "g", 0, 1), Release("r"))
    with pytest.raises(ValueError, match="cannot carry a load decision"):
        encode(Envelope(Op.PUT, "g", 0, 1), _decision(Direction.LOAD, [1]))


def _frames(op: Op, body: object) -> list[bytes]:
    return encode(Envelope(op, "grp", 1, 1), body)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda f: f[:2], "at least 3 frames"),
        (lambda f: [b"XXXX" + f[0][4:], *f[1:]], "Bad magic"),
        (lambda f: [f[0][:4] + bytes([200]) + f[0][5:], *f[1:]], "Unknown op"),
        (lambda f: [f[0], b"", *f[2:]], "empty or too long"),
        (lambda f: [f[0], f[1], b"{not json", *f[3:]], "valid UTF-8 / JSON"),
        (lambda f: [f[0], f[1], b"[1, 2]", *f[3:]], "JSON object"),
        (lambda f: [f[0], f[1], pickle.dumps({"rid": "r"}), *f[3:]], "valid UTF-8 / JSON"),
        (lambda f: [*f, b"extra"], "needs"),
        (lambda f: [*f[:3], f[3][:-1]], "multiple of 24"),
    ],
)
def test_malformed_frames_are_refused(mutate: object, reason: str) -> None:
    frames = _frames(Op.PUT, _decision(Direction.STORE, [1, 2]))
    with pytest.raises(MalformedMessage, match=reason):
        decode(mutate(frames))  # type: ignore[operator]


@pytest.mark.parametrize(
    "field, value, reason",
    [
        ("task_id", True, "must be an integer"),
        ("task_id", "7", "must be an integer"),
        ("n", -1, ">= 0"),
        ("rid", 5, "must be str"),
        ("mask_span", [8, 4], "mask_span"),
        ("mask_span", [0, 10**6], "mask_span"),
        ("plan", 3, "header says 3"),
        ("mask_len", 1 << 30, "exceeds"),
    ],
)
def test_body_fields_are_type_checked(field: str, value: object, reason: str) -> None:
    frames = _frames(Op.PUT, _decision(Direction.STORE, [1, 2]))
    body = json.loads(frames[2])
    body[field] = value
    with pytest.raises(MalformedMessage, match=reason):
        decode([frames[0], frames[1], json.dumps(body).encode(), *frames[3:]])


def test_plan_with_unknown_tier_or_negative_index_is_refused() -> None:
    frames = _frames(Op.PUT, _decision(Direction.STORE, [1, 2]))
    for row in ([7, 1, 2], [0, -1, 2], [0, 1, 0]):
        bad = np.array([row], dtype="<i8").tobytes()
        with pytest.raises(MalformedMessage):
            decode([*frames[:3], bad])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=0, max_size=6))
def test_random_frames_never_decode_to_anything_but_malformed(frames: list[bytes]) -> None:
    with contextlib.suppress(MalformedMessage):
        decode(frames)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 5000), min_size=0, max_size=40, unique=True),
       st.integers(0, 3))
def test_any_plan_round_trips(blocks: list[int], skip: int) -> None:
    d = _decision(Direction.STORE, blocks, skip=skip)
    out = _roundtrip(Op.PUT, d)
    assert isinstance(out, Decision)
    assert out.plan == d.plan and np.array_equal(out.mask, d.mask)
