"""Bad inputs are refused with a message naming the bad value, and nothing is written."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from node_agent.backend.base import KVResponseStatus
from node_agent.backend.config import EmbeddedBackendConfig
from node_agent.backend.embedded import EmbeddedBackend
from node_agent.backend.slots import CheckedSlots, validate_slot_mapping
from tests.backend.backend_helpers import TPB, config, small_layout, started, store, tokens


def _snapshot(b: EmbeddedBackend, bufs: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [b.store.cpu.pool.clone()] + [t.clone() for g in bufs for t in g]


def _same(a: list[torch.Tensor], c: list[torch.Tensor]) -> bool:
    return all(x.view(torch.uint8).equal(y.view(torch.uint8)) for x, y in zip(a, c, strict=True))


GOOD = np.arange(2 * TPB, dtype=np.int64)
BAD_MAPPINGS = [
    (GOOD.astype(np.float64), "dtype float64"),
    (GOOD.astype(bool), "dtype bool"),
    (torch.arange(2 * TPB, dtype=torch.float32), "dtype torch.float32"),
    (GOOD.reshape(2, TPB), "2 dimensions"),
    (GOOD[:-1], f"has {2 * TPB - 1} entries but the task's mask selects {2 * TPB}"),
    (np.r_[GOOD[:-1], -3], "negative slot -3 at index 7"),
    (np.r_[GOOD[:-1], 64], "slot 64 at index 7, outside the registered buffers' 64 slots"),
    (np.r_[GOOD[:-1], 2], "slot 2 2 times"),
]


@pytest.mark.parametrize(("direction", "mapping", "needle"),
                         [(d, m, n) for d in ("put", "get") for m, n in BAD_MAPPINGS])
def test_bad_slot_mapping_rejected_nothing_written_task_stays_unlaunched(
    direction: str, mapping: object, needle: str
) -> None:
    b, [bufs] = started(config(small_layout(), cpu_blocks=16), num_slots=64)
    try:
        toks = tokens(2 * TPB)
        if direction == "get":
            store(b, toks, np.arange(10, 10 + 2 * TPB, dtype=np.int64))
            tid, _ = b.get_match(toks)
        else:
            tid, _ = b.put_match(toks)
        before = _snapshot(b, bufs)
        with pytest.raises(ValueError, match=needle):
            b.launch([tid], [mapping])  # type: ignore[list-item]
        assert _same(before, _snapshot(b, bufs))
        [w] = b.launch([tid], [GOOD])  # still launchable with a good mapping
        assert b.wait([w])[w].status is KVResponseStatus.SUCCESS
    finally:
        b.shutdown()


def test_one_bad_mapping_leaves_every_task_of_the_call_unlaunched() -> None:
    b, [bufs] = started(config(small_layout(), cpu_blocks=16), num_slots=64)
    try:
        t1, _ = b.put_match(tokens(2 * TPB, seed=1))
        t2, _ = b.put_match(tokens(2 * TPB, seed=2))
        before = _snapshot(b, bufs)
        with pytest.raises(ValueError, match="slot 3 appears in several slot mappings"):
            b.launch([t1, t2], [GOOD, GOOD + 3])
        with pytest.raises(ValueError, match="2 task ids but 1 slot mappings"):
            b.launch([t1, t2], [GOOD])
        with pytest.raises(ValueError, match="repeat an id"):
            b.launch([t1, t1], [GOOD, GOOD + 20])
        assert _same(before, _snapshot(b, bufs))
        ids = b.launch([t1, t2], [GOOD, GOOD + 20])
        done = b.wait(ids, completely=True)
        assert all(r.status is KVResponseStatus.SUCCESS for r in done.values())
    finally:
        b.shutdown()


@pytest.mark.parametrize(
    ("token_ids", "mask", "needle"),
    [
        (np.zeros((2, 4), dtype=np.int64), None, r"shape \(2, 4\)"),
        (np.zeros(8, dtype=np.float32), None, "dtype float32"),
        (np.zeros(8, dtype=np.int64), np.ones(7, dtype=bool), r"shape \(7,\) but token_ids has 8"),
        (np.zeros(8, dtype=np.int64), np.ones(8, dtype=np.int64), "dtype int64; it must be bool"),
        (np.zeros(8, dtype=np.int64), np.array([1, 1, 0, 0, 1, 1, 1, 1], dtype=bool),
         "not one contiguous span"),
        (np.zeros(8, dtype=np.int64), np.array([0, 1, 1, 1, 1, 1, 1, 1], dtype=bool),
         "starts at token 1, not a multiple of tokens_per_block=4"),
    ],
)
def test_bad_match_inputs_name_the_value(token_ids: np.ndarray, mask: np.ndarray | None,
                                         needle: str) -> None:
    b, _ = started(config(small_layout(), cpu_blocks=4))
    try:
        for call in (b.get_match, b.put_match):
            with pytest.raises(ValueError, match=needle):
                call(token_ids, token_mask=mask)
        assert b.stats().tiers["cpu"].used_blocks == 0
    finally:
        b.shutdown()


@pytest.mark.parametrize(("token_ids", "needle"), [
    ([1, True, 3, 4], r"^token_ids has dtype bool \(a bool among the values\)"),
    (np.array([1, 2, 3, 2**63], dtype=np.uint64), rf"^token_ids .* {2**63} outside int64"),
    (torch.arange(4, dtype=torch.bfloat16), r"^token_ids has dtype torch.bfloat16"),
    (None, r"^token_ids is None"),
])
def test_the_backend_reads_token_ids_by_the_one_rule_set(token_ids: object, needle: str) -> None:
    """A bool among ints or a uint64 beyond int64 is refused, never taken as 1 or
    wrapped into another token (node_agent/vocab/tokens.py)."""
    b, _ = started(config(small_layout(), cpu_blocks=4))
    try:
        for call in (b.get_match, b.put_match):
            with pytest.raises(ValueError, match=needle):
                call(token_ids)  # type: ignore[arg-type]
        assert b.stats().tiers["cpu"].used_blocks == 0
    finally:
        b.shutdown()


def test_tokens_as_list_or_cpu_tensor_are_accepted() -> None:
    b, _ = started(config(small_layout(), cpu_blocks=4))
    try:
        t1, m1 = b.put_match([1, 2, 3, 4])  # type: ignore[arg-type]
        b.cancel([t1])
        t2, m2 = b.put_match(torch.tensor([1, 2, 3, 4]))  # type: ignore[arg-type]
        assert m1.all() and m2.all()
        b.cancel([t2])
    finally:
        b.shutdown()


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"cpu_bytes": 10}, r"cpu_bytes=10 is invalid.*one block of this layout takes"),
        ({"ssd_bytes": 10_000}, r"ssd_bytes=10000 needs at least one directory"),
        ({"high_watermark": 1.5}, r"high_watermark=1.5 is invalid"),
        ({"low_watermark": 0.99, "high_watermark": 0.9}, r"low_watermark=0.99 is above"),
        ({"unlaunched_match_seconds": 0}, r"unlaunched_match_seconds=0 is invalid"),
        ({"max_tasks": 0}, r"max_tasks=0 is invalid"),
        ({"worker_threads": 0}, r"worker_threads=0 is invalid"),
        ({"hash_algorithm": "sha1"}, r"hash_algorithm='sha1' is unknown"),
        ({"expected_ranks": 3}, r"expected_ranks=3 differs from layout.tp_size=1"),
    ],
)
def test_config_errors_name_key_value_and_fix(kw: dict[str, object], needle: str) -> None:
    base: dict[str, object] = {"layout": small_layout(), "cpu_bytes": 1 << 20}
    with pytest.raises(ValueError, match=needle):
        EmbeddedBackendConfig(**{**base, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [True, 1.0, "1"])
def test_wait_refuses_a_task_id_that_is_not_an_integer(bad: object) -> None:
    """Every backend reads task ids alike: a bool, float or string is never taken
    as the task of another id."""
    b, _ = started(config(small_layout(), cpu_blocks=4))
    try:
        tid, _ = b.put_match(tokens(TPB))
        with pytest.raises(ValueError, match=rf"^task id {bad!r} is not an integer$"):
            b.wait([bad], timeout=0)  # type: ignore[list-item]
        b.cancel([tid])
    finally:
        b.shutdown()


def _checked(values: np.ndarray) -> CheckedSlots:
    return CheckedSlots.of(validate_slot_mapping(values, len(values), 1 << 20))


def test_checked_slots_stay_checked_only_through_a_bool_selection() -> None:
    c = _checked(np.arange(100, 100 + 2 * TPB, dtype=np.int64))
    assert c.checked and c.hi == 100 + 2 * TPB - 1
    mask = np.zeros(2 * TPB, dtype=bool)
    mask[TPB:] = True
    sub = c.select(mask)
    assert sub.checked and sub.tolist() == list(range(100 + TPB, 100 + 2 * TPB))
    # Anything else numpy derives may repeat or move a slot: validated in full again.
    assert not c[[0, 0]].checked
    assert not (c + 1).checked
    assert not c[TPB:].checked
    assert not c.select(np.arange(TPB)).checked  # an index array, not a bool mask


@pytest.mark.parametrize(("mapping", "needle"), [
    (_checked(np.arange(60, 60 + 2 * TPB, dtype=np.int64)),
     "outside the registered buffers' 64 slots"),
    (_checked(np.arange(2 * TPB + 1, dtype=np.int64)), f"has {2 * TPB + 1} entries"),
    (_checked(np.arange(2 * TPB, dtype=np.int64))[[0] * (2 * TPB)], f"slot 0 {2 * TPB} times"),
])
def test_a_launch_of_checked_slots_still_checks_count_range_and_derived_arrays(
    mapping: np.ndarray, needle: str
) -> None:
    b, [bufs] = started(config(small_layout(), cpu_blocks=16), num_slots=64)
    try:
        tid, _ = b.put_match(tokens(2 * TPB))
        before = _snapshot(b, bufs)
        with pytest.raises(ValueError, match=needle):
            b.launch([tid], [mapping])
        assert _same(before, _snapshot(b, bufs))
        [w] = b.launch([tid], [_checked(GOOD)])  # a checked mapping in range launches
        assert b.wait([w])[w].status is KVResponseStatus.SUCCESS
    finally:
        b.shutdown()


def test_checked_slots_own_their_memory() -> None:
    mine = np.arange(2 * TPB, dtype=np.int64)
    c = _checked(mine)
    mine[:] = 0  # the caller reuses its array after the check
    assert c.tolist() == list(range(2 * TPB))
