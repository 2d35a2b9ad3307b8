"""The store completion path: a finished copy wakes the leader at once (the
backend's completion listener), and ``Coordinator.wait_completed`` is woken by
the rid being queued rather than polling for it."""

from __future__ import annotations

import threading

import numpy as np
import torch

from node_agent.backend.config import EmbeddedBackendConfig
from node_agent.backend.embedded import EmbeddedBackend
from node_agent.coordinator.tracking import CompletedRids
from node_agent.vocab.layout import KVDtype, KVLayout
from tests.coordinator.harness import (
    kv_content,
    write_slots,
)


def test_a_waiter_is_woken_by_the_store_it_waits_for(single) -> None:  # type: ignore[no-untyped-def]
    conn, bufs = single
    got: list[list[str]] = []
    waiting = threading.Event()

    def waiter() -> None:
        waiting.set()
        got.append(conn.wait_completed(30.0))

    t = threading.Thread(target=waiter)
    t.start()
    assert waiting.wait(10)
    tokens = np.arange(100, 132)
    slots = np.arange(32)
    write_slots(bufs, slots, kv_content(0, tokens))
    assert conn.store_kv("r1", tokens, torch.as_tensor(slots)) >= 0
    t.join(30)
    assert not t.is_alive()
    assert got == [["r1"]]  # woken with the rid, not by its 30 s timeout
    assert conn.poll_completed() == []  # reported once


def test_wait_completed_returns_queued_rids_at_once_and_empty_after_its_timeout(
        single) -> None:  # type: ignore[no-untyped-def]
    conn, bufs = single
    assert conn.wait_completed(0.0) == []
    assert conn.wait_completed(0.05) == []
    tokens = np.arange(7, 23)
    write_slots(bufs, np.arange(16), kv_content(0, tokens))
    assert conn.store_kv("a", tokens, torch.arange(16)) >= 0
    done: list[str] = []
    for _ in range(100):  # bounded: each call waits at most 0.2 s
        done += conn.wait_completed(0.2)
        if done:
            break
    assert done == ["a"]


def test_completed_rids_notify_only_when_something_was_queued() -> None:
    calls: list[int] = []
    rids = CompletedRids(4, on_add=lambda: calls.append(len(rids)))
    rids.add([])
    assert calls == []
    rids.add(["a", "b"])
    assert calls == [2]
    assert rids.drain() == ["a", "b"]


def test_backend_listener_runs_after_the_task_is_terminal() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_size=4, dtype=KVDtype.FLOAT32,
                      tokens_per_block=4)
    backend = EmbeddedBackend(EmbeddedBackendConfig(layout=layout,
                                                    cpu_bytes=8 * layout.bytes_per_block,
                                                    pinned=False))
    backend.start()
    try:
        backend.register_kv_buffers(0, [[torch.zeros(16, 2, 4) for _ in range(2)]
                                         for _ in range(2)])
        seen: list[str] = []
        heard = threading.Event()
        tid, mask = backend.put_match(np.arange(8))

        def listener() -> None:
            # The task's outcome is recorded before the listener runs.
            seen.extend(r.status.value for r in backend.try_wait([tid]).values())
            heard.set()

        backend.set_completion_listener(listener)
        backend.launch([tid], [np.arange(8)[mask]])
        assert heard.wait(10)
        assert seen == ["success"]
        backend.set_completion_listener(None)
    finally:
        backend.shutdown()
