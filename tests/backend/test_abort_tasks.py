"""Stoppable backend tasks: cancel, discard and reset of launched copies.

A cancelled / discarded / reset copy ends CANCELLED and writes nothing once
``wait`` answered it or ``reset`` returned. Copies are paused mid-way with the
copier's checkpoint hook; nothing here synchronises by sleeping.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from node_agent.backend.base import KVResponseStatus
from node_agent.backend.embedded import EmbeddedBackend
from node_agent.vocab.placement import Tier
from tests.backend.backend_helpers import (
    TPB,
    PauseAt,
    config,
    planes,
    small_layout,
    started,
    store,
    tokens,
)

S = KVResponseStatus


def launched_get(b: EmbeddedBackend, hook: PauseAt) -> tuple[int, np.ndarray, np.ndarray]:
    toks = tokens(2 * TPB, seed=5)
    store(b, toks, np.arange(2 * TPB, dtype=np.int64))
    gid, mask = b.get_match(toks)
    assert mask.all()
    target = np.arange(100, 100 + 2 * TPB, dtype=np.int64)
    b.store.copier.checkpoint_hook = hook
    [w] = b.launch([gid], [target])
    assert hook.entered.wait(5)
    return w, toks, target


def test_cancel_of_a_launched_get_ends_cancelled_and_stops_writing() -> None:
    b, [bufs] = started(config(small_layout(), cpu_blocks=8))
    try:
        hook = PauseAt(2)
        before = planes(bufs, np.arange(100, 100 + 2 * TPB))
        source = planes(bufs, np.arange(2 * TPB))
        w, toks, target = launched_get(b, hook)
        b.cancel([w])
        r = b.wait([w], timeout=5)[w]
        assert r.status is S.CANCELLED and "undefined data" in (r.error or "")
        assert r.return_mask is not None and not r.return_mask.any()
        after = planes(bufs, target)
        assert torch.equal(after[0], source[0])
        assert all(torch.equal(a, c) for a, c in zip(after[1:], before[1:], strict=True))
        assert hook.calls == 2  # no checkpoint (no copy) after the abort
        index = b._index
        assert index is not None and index.locked() == 0  # the get unlocked its blocks
        b.store.copier.checkpoint_hook = None
        gid, mask = b.get_match(toks)  # the cached blocks are untouched
        assert mask.all()
        b.cancel([gid])
    finally:
        b.shutdown()


def test_cancel_of_a_launched_put_frees_its_blocks() -> None:
    b, _ = started(config(small_layout(), cpu_blocks=8))
    try:
        toks = tokens(3 * TPB, seed=9)
        hook = PauseAt(1)
        b.store.copier.checkpoint_hook = hook
        tid, _ = b.put_match(toks)
        [w] = b.launch([tid], [np.arange(3 * TPB, dtype=np.int64)])
        assert hook.entered.wait(5)
        b.cancel([w])
        r = b.wait([w], timeout=5)[w]
        assert r.status is S.CANCELLED and "not stored" in (r.error or "")
        assert b.stats().tiers["cpu"].used_blocks == 0
        b.store.copier.checkpoint_hook = None
        assert b.get_match(toks)[0] == -1
        store(b, toks, np.arange(3 * TPB, dtype=np.int64))  # storable again
        gid, mask = b.get_match(toks)
        assert mask.all()
        b.cancel([gid])
    finally:
        b.shutdown()


def test_cancel_of_a_launched_batch_cancels_every_member() -> None:
    # One worker: the second member is queued behind the paused first one.
    b, _ = started(config(small_layout(), cpu_blocks=8, worker_threads=1))
    try:
        hook = PauseAt(1)
        b.store.copier.checkpoint_hook = hook
        t1, _ = b.put_match(tokens(TPB, seed=1))
        t2, _ = b.put_match(tokens(TPB, seed=2))
        [w] = b.launch([t1, t2], [np.arange(TPB), np.arange(TPB, 2 * TPB)], as_batch=True)
        assert hook.entered.wait(5)
        b.cancel([w])
        assert b.wait([w], timeout=5)[w].status is S.CANCELLED
        assert b.stats().tiers["cpu"].used_blocks == 0
    finally:
        b.shutdown()


def test_discarding_a_running_put_frees_it_when_the_copy_ends() -> None:
    """The leader's reaper shape: wait times out, discard, the copy ends later."""
    b, _ = started(config(small_layout(), cpu_blocks=16, deferred_visibility=True))
    try:
        toks = np.arange(8, dtype=np.int64)
        hook = PauseAt(1)
        b.store.copier.checkpoint_hook = hook
        tid, mask = b.put_match(toks)
        assert mask.sum() == 8
        b.launch([tid], [np.arange(8, dtype=np.int64)])
        assert hook.entered.wait(5)
        assert b.wait([tid], timeout=0.01, completely=True)[tid].status is S.TIMEOUT
        b.discard(tid)
        assert b.wait([tid], timeout=5)[tid].status is S.CANCELLED
        st = b.stats()
        assert st.tasks["unpublished"] == 0 and st.tiers["cpu"].used_blocks == 0
        b.store.copier.checkpoint_hook = None
        again, mask = b.put_match(toks)
        assert again > 0 and mask.all()
        assert b.get_match(toks)[0] == -1
        b.cancel([again])
    finally:
        b.shutdown()


def test_discard_wins_over_a_copy_that_finishes_anyway() -> None:
    """A copy past its last checkpoint when discarded still never lands unpublished."""
    b, _ = started(config(small_layout(), cpu_blocks=16, deferred_visibility=True))
    release, entered = threading.Event(), threading.Event()
    calls: list[int] = []

    def last_checkpoint_then_block(abort: threading.Event | None) -> None:
        calls.append(1)
        if len(calls) == 6:  # the last plane's checkpoint: it has been passed
            entered.set()
            release.wait(5)

    try:
        toks = np.arange(4, dtype=np.int64)
        b.store.copier.checkpoint_hook = last_checkpoint_then_block
        tid, _ = b.put_match(toks)
        b.launch([tid], [np.arange(4, dtype=np.int64)])
        assert entered.wait(5)
        b.discard(tid)
        release.set()
        assert b.wait([tid], timeout=5)[tid].status is S.CANCELLED
        assert b.stats().tasks["unpublished"] == 0
        assert b.stats().tiers["cpu"].used_blocks == 0
    finally:
        release.set()
        b.shutdown()


def test_reset_stops_running_copies_before_it_returns() -> None:
    b, _ = started(config(small_layout(), cpu_blocks=8))
    try:
        cached = tokens(2 * TPB, seed=4)
        store(b, cached, np.arange(2 * TPB, dtype=np.int64))
        hook = PauseAt(1)
        b.store.copier.checkpoint_hook = hook
        tid, _ = b.put_match(tokens(2 * TPB, seed=8))
        [w] = b.launch([tid], [np.arange(20, 20 + 2 * TPB, dtype=np.int64)])
        assert hook.entered.wait(5)
        b.reset()
        assert hook.calls == 1  # the copy stopped at its first checkpoint, before reset returned
        assert b.wait([w], timeout=0.01)[w].status is S.CANCELLED
        assert b.get_match(cached)[0] == -1
        index = b._index
        assert index is not None
        index.check_consistency()
        assert index.used(Tier.CPU) == 0 and index.locked() == 0
        b.store.copier.checkpoint_hook = None
        fresh = tokens(4 * TPB, seed=2)
        store(b, fresh, np.arange(40, 40 + 4 * TPB, dtype=np.int64))
        gid, mask = b.get_match(fresh)
        assert mask.all()
        b.cancel([gid])
    finally:
        b.shutdown()
