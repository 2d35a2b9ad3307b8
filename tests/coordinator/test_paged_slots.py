"""A paged layout (``layer_block_head_token_kv``) is copied by whole pages only:
``store_kv`` and ``retrieve`` refuse slots that are not whole, aligned pages with a
``ValueError`` naming the page size, the position and the slot, before anything
is decided or loaded. On a follower the refused store leaves the fan-out stream as
if it had not been made; a refused retrieve loads nothing on any stage.

Two connectors of one PP group in this process, real fan-out sockets on
loopback, the real embedded leader backend and TierStore follower, each stage's
engine calls on its own thread; every page loaded is compared byte for byte.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from node_agent.backend.config import EmbeddedBackendConfig
from node_agent.backend.embedded import EmbeddedBackend
from node_agent.backend.slots import check_whole_pages
from node_agent.backend.stage_store import TierStore
from node_agent.coordinator import Coordinator, CoordinatorConfig
from node_agent.coordinator.inputs import prepare_slots, prepare_store
from node_agent.pp.group import GroupViewSource
from node_agent.vocab.group_view import GroupView
from node_agent.vocab.layout import KVDtype, KVLayout, LayoutName
from tests.coordinator.harness import group_status
from tests.coordinator.pairs import StageThread
from tests.support.group_views import update_status
from tests.support.waiting import wait_for

TPB = 4
LAYERS, HEADS, HEAD = 2, 2, 4
NUM_BLOCKS = 32
LAYOUT = KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_size=HEAD, kv_dim=2,
                  dtype=KVDtype.FLOAT32, tokens_per_block=TPB,
                  name=LayoutName.LAYER_BLOCK_HEAD_TOKEN_KV)
GROUP = "pool-paged-0"
A = np.arange(100, 100 + 3 * TPB)
B = np.arange(900, 900 + 3 * TPB)
SENTINEL = -7.0


def pages(blocks: list[int]) -> np.ndarray:
    """The slots of whole pages ``blocks``, in order."""
    b = np.asarray(blocks, dtype=np.int64)
    return (b[:, None] * TPB + np.arange(TPB)).reshape(-1)


def swapped(slots: np.ndarray, i: int, j: int) -> np.ndarray:
    out = slots.copy()
    out[[i, j]] = out[[j, i]]
    return out


# Every slot of whole pages 1..3, but not in page order; the first page shifted by
# one slot; a page with two of its slots swapped.
BAD_SLOTS: list[tuple[str, np.ndarray, str]] = [
    ("pages reversed", pages([1, 2, 3])[::-1].copy(),
     r"position 0 starts a page with slot 15, not a multiple of the page size 4"),
    ("pages shifted by one slot", pages([1, 2, 3]) + 1,
     r"position 0 starts a page with slot 5, not a multiple of the page size 4"),
    ("two slots of one page swapped", swapped(pages([1, 2, 3]), 5, 6),
     r"position 5 holds slot 10 but page 2 continues with slot 9"),
]


class PagedGroup:
    """Two stages of one group, paged buffers with per-stage page content."""

    def __init__(self) -> None:
        self.views = [GroupViewSource(GroupView(GROUP, 0, None, ())) for _ in range(2)]
        self.conns: list[Coordinator] = []
        self.bufs: list[list[torch.Tensor]] = []
        self.threads: list[StageThread] = []
        cfg = EmbeddedBackendConfig(layout=LAYOUT, cpu_bytes=16 * LAYOUT.bytes_per_block,
                                    pinned=False, deferred_visibility=True,
                                    unlaunched_match_seconds=5.0, worker_threads=1)
        try:
            for r in range(2):
                c = Coordinator(
                    CoordinatorConfig(group=GROUP, pp_rank=r, layout=LAYOUT,
                                    fanout_endpoint="tcp://127.0.0.1:0",
                                    engine_call_seconds=6.0, fanout_wait_seconds=2.5,
                                    transfer_seconds=1.1),
                    self.views[r],
                    backend_factory=lambda: EmbeddedBackend(cfg),
                    store_factory=lambda: TierStore(cfg),
                )
                c.start()
                gen = torch.Generator().manual_seed(r)
                layers = [torch.randn(NUM_BLOCKS, HEADS, TPB, 2 * HEAD, generator=gen)
                          for _ in range(LAYERS)]
                c.register_kv_buffers(0, [layers])
                self.conns.append(c)
                self.bufs.append(layers)
                self.threads.append(StageThread(r))
            endpoints = {r: c.fanout_endpoint or "" for r, c in enumerate(self.conns)}
            for v in self.views:
                update_status(v, group_status(1, 0, endpoints))
            wait_for(lambda: all(c.ready() for c in self.conns), "every stage ready", 15.0)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for t in self.threads:
            t.stop()
        for c in reversed(self.conns):
            c.close()

    def call(self, rank: int, fn: Any) -> Any:
        conn = self.conns[rank]
        return self.threads[rank].submit(lambda: fn(conn))

    def page_bytes(self, rank: int, slots: np.ndarray) -> list[torch.Tensor]:
        blocks = torch.as_tensor(np.asarray(slots)[::TPB] // TPB)
        return [layer[blocks].clone() for layer in self.bufs[rank]]

    def poison(self, rank: int, slots: np.ndarray) -> None:
        blocks = torch.as_tensor(np.unique(np.asarray(slots) // TPB))
        for layer in self.bufs[rank]:
            layer[blocks] = SENTINEL

    def poisoned(self, rank: int, slots: np.ndarray) -> bool:
        blocks = torch.as_tensor(np.unique(np.asarray(slots) // TPB))
        return all(bool((layer[blocks] == SENTINEL).all()) for layer in self.bufs[rank])

    def retrieve(self, rank: int, rid: str, slots: np.ndarray) -> Any:
        """Poison the pages of ``slots``, then ``retrieve`` into them."""
        def call(c: Coordinator) -> int:
            self.poison(rank, slots)
            return c.retrieve(rid, torch.as_tensor(slots))
        return self.call(rank, call)

    def settle(self) -> None:
        leader = self.conns[0]
        wait_for(lambda: leader.status().get("inflightStores", 0) == 0,
                 "every store terminal on the leader", 20.0)

    def store_everywhere(self, rid: str, tokens: np.ndarray, slots: np.ndarray) -> int:
        tasks = [self.call(r, lambda c: c.store_kv(rid, tokens, torch.as_tensor(slots)))
                 for r in (0, 1)]
        [task] = {t.result(30) for t in tasks}
        assert task >= 0
        self.settle()
        return int(task)

    def load_everywhere(self, rid: str, tokens: np.ndarray, dst: np.ndarray) -> list[int]:
        hits = [self.call(r, lambda c: c.lookup(rid, tokens)) for r in (0, 1)]
        assert [h.result(30) for h in hits] == [len(tokens)] * 2
        return [f.result(30) for f in [self.retrieve(r, rid, dst) for r in (0, 1)]]


@pytest.fixture
def group() -> Iterator[PagedGroup]:
    g = PagedGroup()
    try:
        yield g
    finally:
        g.close()


@pytest.mark.parametrize("what, bad, message", BAD_SLOTS, ids=[b[0] for b in BAD_SLOTS])
def test_inputs_refuse_slots_that_are_not_whole_aligned_pages(
        what: str, bad: np.ndarray, message: str) -> None:
    with pytest.raises(ValueError, match=r"^store_kv: kv_indices does not form whole, aligned "
                                         r"pages of page size 4: " + message):
        prepare_store(A, bad, TPB, NUM_BLOCKS * TPB, TPB)
    with pytest.raises(ValueError, match=r"^retrieve: slot_mapping does not form whole, "
                                         r"aligned pages of page size 4: " + message):
        prepare_slots(bad, len(bad), NUM_BLOCKS * TPB, TPB)
    # The same slots are fine for a layout copied slot by slot.
    assert prepare_store(A, bad, TPB, NUM_BLOCKS * TPB).aligned == len(A)
    assert len(prepare_slots(bad, len(bad), NUM_BLOCKS * TPB)) == len(bad)


def test_a_count_of_slots_that_is_not_whole_pages_is_named() -> None:
    with pytest.raises(ValueError, match=r"^kv: has 6 slots, not a multiple of the page size 4"):
        check_whole_pages(np.arange(6), TPB, "kv:")
    check_whole_pages(pages([7, 0, 3]), TPB)  # whole pages, in any page order


@pytest.mark.parametrize("what, bad, message", BAD_SLOTS, ids=[b[0] for b in BAD_SLOTS])
def test_a_follower_store_of_slots_that_are_not_whole_pages_is_refused_before_pairing(
        group: PagedGroup, what: str, bad: np.ndarray, message: str) -> None:
    src = pages([1, 2, 3])
    task_a = group.call(0, lambda c: c.store_kv("r", A, torch.as_tensor(src))).result(30)
    with pytest.raises(ValueError, match=r"page size 4: " + message):
        group.call(1, lambda c: c.store_kv("r", A, torch.as_tensor(bad))).result(30)
    task_b = group.call(0, lambda c: c.store_kv("r", B, torch.as_tensor(src))).result(30)
    assert task_a >= 0 and task_b >= 0
    # The follower's next store is for B: it takes B's decision, never A's.
    assert group.call(1, lambda c: c.store_kv("r", B, torch.as_tensor(src))).result(30) == task_b
    group.settle()
    dst = pages([20, 21, 22])
    assert group.load_everywhere("qb", B, dst) == [len(B), len(B)]
    assert all(a.equal(b) for r in (0, 1)
               for a, b in zip(group.page_bytes(r, src), group.page_bytes(r, dst), strict=True))
    # A was never stored on the follower: not visible on any stage.
    assert [group.call(r, lambda c: c.lookup("qa", A)).result(30) for r in (0, 1)] == [0, 0]
    counters = group.conns[1].status()["counters"]
    assert counters["decisions_unpaired"] == 1 and counters["mismatches"] == 0


def test_a_leader_store_of_slots_that_are_not_whole_pages_decides_nothing(
        group: PagedGroup) -> None:
    seq = group.conns[0].status()["lastSeq"]
    for _, bad, message in BAD_SLOTS:
        with pytest.raises(ValueError, match=r"page size 4: " + message):
            group.call(0, lambda c, bad=bad: c.store_kv("r", A, torch.as_tensor(bad))).result(30)
    status = group.conns[0].status()
    assert status["lastSeq"] == seq  # nothing went out on the stream
    assert status["counters"]["stores"] == 0
    assert [group.call(r, lambda c: c.lookup("q", A)).result(30) for r in (0, 1)] == [0, 0]


@pytest.mark.parametrize("stage", [0, 1], ids=["leader", "follower"])
def test_a_retrieve_into_slots_that_are_not_whole_pages_loads_nothing_anywhere(
        group: PagedGroup, stage: int) -> None:
    src = pages([1, 2, 3])
    group.store_everywhere("s", A, src)
    # Two slots of a page swapped, in pages other than the source's.
    bad = swapped(pages([24, 25, 26]), 5, 6)
    message = r"position 5 holds slot 102 but page 25 continues with slot 101"
    good = pages([20, 21, 22])
    hits = [group.call(r, lambda c: c.lookup("q", A)) for r in (0, 1)]
    assert [h.result(30) for h in hits] == [len(A), len(A)]
    dst = {stage: bad, 1 - stage: good}
    loads = {r: group.retrieve(r, "q", dst[r]) for r in (0, 1)}
    with pytest.raises(ValueError, match=r"^retrieve: slot_mapping does not form whole, aligned "
                                         r"pages of page size 4: " + message):
        loads[stage].result(30)
    assert loads[1 - stage].result(30) == 0  # the other stage's load is a miss
    assert group.poisoned(stage, bad)  # nothing written into the refused slots
    # The refused load was ended on the leader: the next lookup loads on every stage.
    assert group.load_everywhere("q2", A, good) == [len(A), len(A)]
    assert all(a.equal(b) for r in (0, 1)
               for a, b in zip(group.page_bytes(r, src), group.page_bytes(r, good), strict=True))
