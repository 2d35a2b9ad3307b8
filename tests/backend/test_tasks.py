"""Two-phase tasks: masks, prefix skipping, namespaces, statuses, batching, expiry, cancel."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from node_agent.backend.base import KVBackendError, KVResponseStatus, TaskNotFoundError
from node_agent.backend.embedded import EmbeddedBackend
from tests.backend.backend_helpers import (
    TPB,
    config,
    load,
    make_buffers,
    same_rows,
    small_layout,
    started,
    store,
    tokens,
)
from tests.support.waiting import wait_for

S = KVResponseStatus


@pytest.fixture
def backend() -> EmbeddedBackend:
    b, _ = started(config(small_layout(), cpu_blocks=64))
    yield b  # type: ignore[misc]
    b.shutdown()


def test_put_skips_cached_prefix_and_get_covers_it(backend: EmbeddedBackend) -> None:
    toks = tokens(12 * TPB)
    slots = np.arange(len(toks), dtype=np.int64)
    first = store(backend, toks[: 5 * TPB], slots)
    assert first.sum() == 5 * TPB
    tid, mask = backend.put_match(toks)
    assert tid > 0 and np.flatnonzero(mask).tolist() == list(range(5 * TPB, 12 * TPB))
    backend.cancel([tid])
    gid, gmask = backend.get_match(toks)
    assert np.flatnonzero(gmask).tolist() == list(range(5 * TPB))
    backend.cancel([gid])


def test_fully_cached_put_and_uncached_get_return_minus_one(backend: EmbeddedBackend) -> None:
    toks = tokens(4 * TPB + 2)
    store(backend, toks, np.arange(len(toks), dtype=np.int64))
    tid, mask = backend.put_match(toks)
    assert tid == -1 and not mask.any() and len(mask) == len(toks)
    tid, mask = backend.get_match(tokens(4 * TPB, seed=9))
    assert tid == -1 and not mask.any()


def test_partial_block_never_matched(backend: EmbeddedBackend) -> None:
    tid, mask = backend.put_match(tokens(TPB - 1))
    assert tid == -1 and not mask.any()


def test_namespaces_are_isolated(backend: EmbeddedBackend) -> None:
    toks = tokens(4 * TPB)
    store(backend, toks, np.arange(len(toks), dtype=np.int64), namespace="lora-a")
    assert backend.get_match(toks)[0] == -1
    assert backend.get_match(toks, namespace="lora-b")[0] == -1
    tid, mask = backend.get_match(toks, namespace="lora-a")
    assert mask.all()
    backend.cancel([tid])


def test_token_mask_selects_the_loaded_span(backend: EmbeddedBackend) -> None:
    toks = tokens(6 * TPB)
    store(backend, toks, np.arange(len(toks), dtype=np.int64))
    want = np.zeros(len(toks), dtype=bool)
    want[2 * TPB : 5 * TPB + 1] = True  # ends inside block 5: that block is not loadable
    tid, mask = backend.get_match(toks, token_mask=want)
    assert np.flatnonzero(mask).tolist() == list(range(2 * TPB, 5 * TPB))
    backend.cancel([tid])


def test_token_mask_put_needs_cached_prefix(backend: EmbeddedBackend) -> None:
    toks = tokens(6 * TPB)
    want = np.zeros(len(toks), dtype=bool)
    want[2 * TPB :] = True
    assert backend.put_match(toks, token_mask=want)[0] == -1  # blocks 0-1 not cached
    store(backend, toks[: 2 * TPB], np.arange(2 * TPB, dtype=np.int64))
    tid, mask = backend.put_match(toks, token_mask=want)
    assert np.flatnonzero(mask).tolist() == list(range(2 * TPB, 6 * TPB))
    backend.cancel([tid])


def test_pending_put_is_invisible_and_blocks_a_second_put(backend: EmbeddedBackend) -> None:
    toks = tokens(3 * TPB)
    tid, _ = backend.put_match(toks)
    assert backend.get_match(toks)[0] == -1
    assert backend.put_match(toks)[0] == -1  # another put is storing these blocks
    [w] = backend.launch([tid], [np.arange(3 * TPB, dtype=np.int64)])
    assert backend.wait([w])[w].status is S.SUCCESS
    gid, mask = backend.get_match(toks)
    assert mask.all()
    backend.cancel([gid])


def test_wait_reaps_and_statuses(backend: EmbeddedBackend) -> None:
    toks = tokens(2 * TPB)
    tid, mask = backend.put_match(toks)
    assert backend.try_wait([tid]) == {}  # matched, not terminal
    r = backend.wait([tid], timeout=0.05)[tid]
    assert r.status is S.TIMEOUT  # un-launched: waits out the timeout, stays live
    [w] = backend.launch([tid], [np.arange(2 * TPB, dtype=np.int64)])
    r = backend.wait([w])[w]
    assert r.status is S.SUCCESS and r.return_mask is not None
    assert (r.return_mask == mask).all()
    assert backend.wait([w], timeout=0.01)[w].status is S.NOTFOUND
    assert backend.try_wait([12345])[12345].status is S.NOTFOUND


def test_as_batch_returns_one_new_id(backend: EmbeddedBackend) -> None:
    a, b = tokens(2 * TPB, seed=1), tokens(3 * TPB, seed=2)
    ta, _ = backend.put_match(a)
    tb, _ = backend.put_match(b)
    ids = backend.launch(
        [ta, tb], [np.arange(8, dtype=np.int64), np.arange(8, 20, dtype=np.int64)], as_batch=True
    )
    assert len(ids) == 1 and ids[0] not in (ta, tb)
    assert backend.wait(ids)[ids[0]].status is S.SUCCESS
    assert backend.get_match(a)[1].all() and backend.get_match(b)[1].all()


def test_cancel_rolls_back_and_unknown_launch_fails(backend: EmbeddedBackend) -> None:
    toks = tokens(2 * TPB)
    tid, _ = backend.put_match(toks)
    used = backend.stats().tiers["cpu"].used_blocks
    backend.cancel([tid, 999])  # unknown ids ignored
    assert backend.stats().tiers["cpu"].used_blocks == used - 2
    with pytest.raises(TaskNotFoundError, match=f"task {tid} is not a live"):
        backend.launch([tid], [np.arange(2 * TPB, dtype=np.int64)])
    assert backend.put_match(toks)[0] > 0  # the span is free to store again


def test_unlaunched_match_expires_and_unlocks() -> None:
    now = [0.0]
    layout = small_layout()
    b = EmbeddedBackend(config(layout, cpu_blocks=4, unlaunched_match_seconds=5.0),
                        clock=lambda: now[0])
    b.start()
    b.register_kv_buffers(0, make_buffers(layout, 64, 0))
    try:
        toks = tokens(4 * TPB)
        store(b, toks, np.arange(4 * TPB, dtype=np.int64))
        gid, _ = b.get_match(toks)  # locks all 4 blocks of the full tier
        assert b.put_match(tokens(4 * TPB, seed=5))[0] == -1  # nothing evictable
        now[0] = 5.0
        r = b.wait([gid], timeout=1)[gid]
        assert r.status is S.CANCELLED and "not launched within 5.0 s" in (r.error or "")
        with pytest.raises(TaskNotFoundError):
            b.launch([gid], [np.arange(4 * TPB, dtype=np.int64)])
        tid, mask = b.put_match(tokens(4 * TPB, seed=5))  # evicts the unlocked blocks
        assert mask.all()
        b.cancel([tid])
    finally:
        b.shutdown()


def test_task_table_is_bounded() -> None:
    b, _ = started(config(small_layout(), cpu_blocks=16, max_tasks=3))
    try:
        toks = tokens(TPB)
        store(b, toks, np.arange(TPB, dtype=np.int64))
        ids = [b.get_match(toks)[0] for _ in range(3)]
        with pytest.raises(KVBackendError, match=r"task table full: 3 live.*max_tasks=3"):
            b.get_match(toks)
        b.cancel(ids[:1])
        assert b.get_match(toks)[0] > 0
    finally:
        b.shutdown()


def test_concurrent_threads_round_trip_their_own_prompts() -> None:
    layout = small_layout()
    b, [bufs] = started(config(layout, cpu_blocks=256, worker_threads=3), num_slots=8 * 64)
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for it in range(5):
                toks = tokens(4 * TPB, seed=100 * k + it)
                src = np.arange(64 * k, 64 * k + 4 * TPB, dtype=np.int64)
                store(b, toks, src)
                dst = src + 32
                got = load(b, toks, dst)
                assert got.all()
                assert same_rows(layout, bufs, src, dst)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    b.shutdown()
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)


def test_calls_before_start_and_after_shutdown_fail_clearly() -> None:
    b = EmbeddedBackend(config(small_layout(), cpu_blocks=4))
    with pytest.raises(KVBackendError, match="call start"):
        b.get_match(tokens(TPB))
    b.start()
    b.start()  # idempotent
    b.shutdown()
    b.shutdown()
    with pytest.raises(KVBackendError, match="shut down"):
        b.put_match(tokens(TPB))


def test_reset_drops_blocks_and_cancels_tasks(backend: EmbeddedBackend) -> None:
    toks = tokens(2 * TPB)
    store(backend, toks, np.arange(2 * TPB, dtype=np.int64))
    gid, _ = backend.get_match(toks)
    backend.reset()
    assert backend.wait([gid], timeout=1)[gid].status is S.CANCELLED
    assert backend.get_match(toks)[0] == -1
    assert backend.stats().tiers["cpu"].used_blocks == 0
    assert backend.is_ready()


def test_finished_tasks_nobody_waits_for_are_purged() -> None:
    now = [0.0]
    layout = small_layout()
    b = EmbeddedBackend(config(layout, cpu_blocks=8, unlaunched_match_seconds=2.0),
                        clock=lambda: now[0])
    b.start()
    b.register_kv_buffers(0, make_buffers(layout, 64, 0))
    try:
        tid, _ = b.put_match(tokens(TPB))
        [w] = b.launch([tid], [np.arange(TPB, dtype=np.int64)])
        wait_for(lambda: b.stats().tasks["done"] == 1, "the copy finished")
        now[0] = 3.0  # finished longer ago than the expiry: the caller is gone
        wait_for(lambda: b.stats().tasks["done"] == 0, "the expired task forgotten",
                 interval=0.05)
        assert b.wait([w], timeout=0.01)[w].status is S.NOTFOUND
    finally:
        b.shutdown()


def test_shutdown_cancels_unlaunched_tasks() -> None:
    b, _ = started(config(small_layout(), cpu_blocks=8))
    tid, _ = b.put_match(tokens(TPB))
    b.shutdown()
    r = b.wait([tid], timeout=1)[tid]
    assert r.status is S.CANCELLED


def test_reset_refuses_while_a_copy_ignores_its_abort(monkeypatch: pytest.MonkeyPatch,
                                                      ) -> None:
    """A copy that does not stop (a hung device) makes reset raise with nothing
    cleared: a block must never be reused under a live write."""
    import node_agent.backend.embedded as embedded

    monkeypatch.setattr(embedded, "STOP_SECONDS", 0.05)
    b, _ = started(config(small_layout(), cpu_blocks=8))
    release, entered = threading.Event(), threading.Event()

    def stuck(abort: threading.Event | None) -> None:
        entered.set()
        release.wait(10)  # ignores the abort

    try:
        cached = tokens(2 * TPB, seed=3)
        store(b, cached, np.arange(2 * TPB, dtype=np.int64))
        b.store.copier.checkpoint_hook = stuck
        tid, _ = b.put_match(tokens(2 * TPB, seed=1))
        [w] = b.launch([tid], [np.arange(10, 10 + 2 * TPB, dtype=np.int64)])
        assert entered.wait(5)
        with pytest.raises(KVBackendError, match=rf"copies of tasks \[{w}\] did not stop"):
            b.reset()
        gid, mask = b.get_match(cached)  # nothing was cleared
        assert mask.all()
        b.cancel([gid])
        release.set()
        assert b.wait([w], timeout=5)[w].status is S.CANCELLED
        b.store.copier.checkpoint_hook = None
        b.reset()
        assert b.get_match(cached)[0] == -1
        index = b._index
        assert index is not None
        index.check_consistency()
        assert index.locked() == 0
    finally:
        release.set()
        b.shutdown()


def test_consistency_check_names_a_broken_invariant() -> None:
    from node_agent.backend.index import BlockIndex

    index = BlockIndex(4, 0, 1.0, 1.0)
    [a, _] = index.add_pending(None, [11, 12], [])
    index.check_consistency()
    index._children[a] += 1
    with pytest.raises(AssertionError, match=r"node 0 counts 2/1 children, has 1/1"):
        index.check_consistency()
