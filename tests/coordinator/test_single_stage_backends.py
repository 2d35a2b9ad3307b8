"""A group of one stage served by a plain FlexKV-shaped backend through
:class:`SingleStageBackend`: the embedded backend without deferred visibility and
the ``flexkv`` adapter (against the checking fake). Round trips are bit-exact and
the replication hooks behave as the one-stage case requires."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from node_agent.backend.base import KVBackend, TaskNotFoundError
from node_agent.backend.embedded import EmbeddedBackend
from node_agent.backend.flexkv_adapter import FlexKVBackend, FlexKVSettings
from node_agent.backend.single_stage import SingleStageBackend
from node_agent.coordinator import Coordinator, CoordinatorConfig
from node_agent.pp.group import GroupViewSource
from node_agent.vocab.group_view import GroupMember, GroupView
from node_agent.vocab.placement import Direction
from tests.coordinator.harness import (
    GROUP,
    LAYOUT,
    backend_config,
    kv_content,
    make_buffers,
    read_slots,
    wait_completed,
    write_slots,
)
from tests.fake_flexkv import load_fake_flexkv

TPB = LAYOUT.tokens_per_block


@pytest.fixture
def fake_flexkv(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with load_fake_flexkv(monkeypatch):
        yield


def _embedded() -> KVBackend:
    return EmbeddedBackend(backend_config(64, deferred=False))


def _flexkv() -> KVBackend:
    return FlexKVBackend(LAYOUT, FlexKVSettings(cpu_bytes=64 * LAYOUT.bytes_per_block,
                                                unlaunched_match_seconds=5))


def _connector(inner: Callable[[], KVBackend]) -> Coordinator:
    me = GroupMember(node="node-0", pp_rank=0, fanout_endpoint="")
    view = GroupViewSource(GroupView(GROUP, 0, me, (me,)))
    cfg = CoordinatorConfig(group=GROUP, pp_rank=0, layout=LAYOUT, fanout_endpoint=None,
                          engine_call_seconds=6.0, fanout_wait_seconds=2.5,
                          transfer_seconds=1.1)
    return Coordinator(cfg, view, backend_factory=lambda: SingleStageBackend(inner()),
                     store_factory=lambda: pytest.fail("a one-stage group has no follower"))


def _pages(*ids: int) -> np.ndarray:
    return np.concatenate([np.arange(p * TPB, (p + 1) * TPB) for p in ids]).astype(np.int64)


@pytest.mark.parametrize("inner", [_embedded, _flexkv], ids=["embedded", "flexkv"])
def test_one_stage_round_trip_is_bit_exact(inner: Callable[[], KVBackend],
                                           fake_flexkv: None) -> None:
    conn = _connector(inner).start()
    try:
        bufs = make_buffers()
        conn.register_kv_buffers(0, bufs)
        tokens = np.random.default_rng(1).integers(0, 30000, 6 * TPB + 2)
        src = _pages(2, 3, 4, 5, 6, 7, 8)[: len(tokens)]
        write_slots(bufs, src, kv_content(0, tokens))
        assert conn.store_kv("a", tokens, torch.as_tensor(src)) >= 0
        wait_completed(conn, "a")

        # The trailing partial block was not stored; the six full ones come back.
        hit = conn.lookup("b", tokens)
        assert hit == 6 * TPB
        dst = _pages(20, 21, 22, 23, 24, 25)
        assert conn.retrieve("b", dst) == hit
        np.testing.assert_array_equal(read_slots(bufs, dst), kv_content(0, tokens[:hit]))
        conn.release("b")

        # Storing the same prompt again writes nothing: the whole prefix is cached.
        assert conn.store_kv("c", tokens, torch.as_tensor(src)) == -1
    finally:
        conn.close()


def test_hooks_plan_empty_and_discard_cancels(fake_flexkv: None) -> None:
    b = SingleStageBackend(_embedded())
    b.start()
    b.register_kv_buffers(0, make_buffers())
    tokens = np.arange(2 * TPB, dtype=np.int64)
    tid, mask = b.put_match(tokens)
    assert mask.all()
    assert b.plan_of(tid).direction is Direction.STORE and b.plan_of(tid).blocks == ()
    assert b.drain_moves() == []
    b.discard(tid)  # un-launched: the match is rolled back, so the span is uncached
    with pytest.raises(TaskNotFoundError, match=f"task {tid}"):
        b.plan_of(tid)
    tid2, mask2 = b.put_match(tokens)
    assert tid2 >= 0 and mask2.all()
    b.shutdown()
