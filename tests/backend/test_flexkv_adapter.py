"""FlexKVBackend against the fake ``flexkv`` package (tests/fakes/flexkv).

The fake checks every argument the adapter hands to FlexKV (types, masks, slot
pages, task states) and raises on anything FlexKV would reject or mis-execute,
so each test here also proves the adapter's calls are well-formed.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from node_agent.backend.base import KVBackendError, KVResponseStatus, TaskNotFoundError
from node_agent.backend.flexkv_adapter import (
    FlexKVBackend,
    FlexKVSettings,
    flexkv_block_bytes,
    size_tiers,
)
from node_agent.metrics import AgentMetrics
from node_agent.vocab.layout import KVDtype, KVLayout, LayoutName
from tests.fake_flexkv import load_fake_flexkv
from tests.support.clock import ManualClock

TPB = 4


@pytest.fixture
def fake_flexkv(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The fake package on sys.path, CPU tensors allowed (CI has no GPU)."""
    with load_fake_flexkv(monkeypatch) as fake:
        yield fake




def make_layout(**kw: Any) -> KVLayout:
    args: dict[str, Any] = dict(num_layers=2, num_kv_heads=2, head_size=4, kv_dim=2,
                                dtype=KVDtype.FLOAT32, tokens_per_block=TPB, tp_size=1)
    args.update(kw)
    return KVLayout(**args)


def make_buffers(layout: KVLayout, num_slots: int = 64) -> list[list[torch.Tensor]]:
    """SGLang-style (k_buffer, v_buffer) lists for one rank, random content."""
    gen = torch.Generator().manual_seed(7)
    return [
        [torch.randn(num_slots, layout.heads_per_rank, layout.head_size, generator=gen,
                     dtype=layout.dtype.torch_dtype) for _ in range(layout.num_layers)]
        for _ in range(layout.kv_dim)
    ]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def backend(fake_flexkv: ModuleType, clock: ManualClock) -> Iterator[FlexKVBackend]:
    b = FlexKVBackend(make_layout(), FlexKVSettings(cpu_bytes=1 << 20, unlaunched_match_seconds=5),
                      clock=clock)
    yield b
    b.shutdown()


@pytest.fixture
def ready(backend: FlexKVBackend) -> tuple[FlexKVBackend, list[list[torch.Tensor]], Any]:
    """Started backend with rank 0 registered; returns (backend, buffers, fake manager)."""
    backend.start()
    bufs = make_buffers(backend.layout)
    backend.register_kv_buffers(0, bufs)
    assert backend.is_ready()
    manager = importlib.import_module("flexkv._fake").MANAGERS[-1]
    return backend, bufs, manager


def pages(*page_ids: int) -> np.ndarray:
    return np.concatenate([np.arange(p * TPB, (p + 1) * TPB) for p in page_ids]).astype(np.int64)


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 32000, n).astype(np.int64)


def store(b: FlexKVBackend, ids: np.ndarray, slot_pages: tuple[int, ...]) -> None:
    tid, mask = b.put_match(ids)
    assert tid >= 0 and int(mask.sum()) == len(slot_pages) * TPB
    [tid] = b.launch([tid], [pages(*slot_pages)])
    assert b.wait([tid], timeout=5)[tid].status is KVResponseStatus.SUCCESS


# -- configuration -------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(num_kv_heads=8, tp_size=4), dict(kv_dim=1, num_kv_heads=1, tp_size=2),
     dict(dtype=KVDtype.BFLOAT16, tokens_per_block=16)],
)
def test_block_bytes_match_flexkv_formula_and_layout(kw: dict[str, Any]) -> None:
    layout = make_layout(**kw)
    assert flexkv_block_bytes(layout) == layout.bytes_per_block


def test_config_maps_layout_and_tier_bytes(fake_flexkv: ModuleType) -> None:
    layout = make_layout(num_kv_heads=8, tp_size=2, dtype=KVDtype.BFLOAT16)
    per_block = flexkv_block_bytes(layout)
    settings = FlexKVSettings(cpu_bytes=10 * per_block + per_block // 2,
                              ssd_bytes=7 * per_block, ssd_paths=("/a", "/b", "/c"),
                              eviction_policy="lfu")
    b = FlexKVBackend(layout, settings)
    m, c = b.model_config, b.cache_config
    assert (m.num_layers, m.num_kv_heads, m.head_size, m.kv_dim, m.dtype, m.tp_size,
            m.pp_size, m.dp_size) == (2, 8, 4, 2, torch.bfloat16, 2, 1, 1)
    assert c.num_cpu_blocks == 10  # rounded down: a tier never exceeds its bytes
    assert c.num_ssd_blocks == 6 and c.enable_ssd  # multiple of the 3 SSD paths
    assert c.ssd_cache_dir == ["/a", "/b", "/c"] and c.tokens_per_block == TPB
    assert c.eviction_policy == "lfu"


def test_tier_smaller_than_one_block_is_rejected() -> None:
    layout = make_layout()
    with pytest.raises(ValueError, match=r"tiers.cpu.size=10 bytes holds no FlexKV block"):
        size_tiers(layout, FlexKVSettings(cpu_bytes=10))


@pytest.mark.parametrize(
    ("kw", "match"),
    [(dict(cpu_bytes=0), "cpu_bytes=0"), (dict(ssd_bytes=10), "needs ssd_paths"),
     (dict(eviction_policy="random"), "eviction_policy='random'"),
     (dict(low_watermark=0.9, high_watermark=0.8), "watermarks")],
)
def test_bad_settings_name_the_value(kw: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = dict(cpu_bytes=1 << 20)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        FlexKVSettings(**args)


def test_start_applies_eviction_settings_to_flexkv_env(fake_flexkv: ModuleType) -> None:
    b = FlexKVBackend(make_layout(), FlexKVSettings(cpu_bytes=1 << 20, eviction_policy="fifo",
                                                    high_watermark=0.9, low_watermark=0.6))
    b.start()
    env = importlib.import_module("flexkv.common.config").GLOBAL_CONFIG_FROM_ENV
    assert env.eviction_policy == "fifo" and env.evict_start_threshold == 0.9
    assert env.evict_ratio == pytest.approx(0.3)
    b.shutdown()


# -- lifecycle -------------------------------------------------------------------


def test_calls_before_start_raise(backend: FlexKVBackend) -> None:
    assert not backend.is_ready()
    with pytest.raises(KVBackendError, match="not started; call start"):
        backend.get_match(tokens(8))
    with pytest.raises(KVBackendError, match="not started"):
        backend.register_kv_buffers(0, make_buffers(backend.layout))


def test_start_is_idempotent_and_ready_needs_every_rank(fake_flexkv: ModuleType) -> None:
    layout = make_layout(num_kv_heads=4, tp_size=2)
    b = FlexKVBackend(layout, FlexKVSettings(cpu_bytes=1 << 20))
    b.start()
    b.start()
    manager = fake_flexkv.MANAGERS[-1]
    assert manager.call_names().count("start") == 1
    assert manager.gpu_register_port == b.gpu_register_port
    b.register_kv_buffers(0, make_buffers(layout))
    assert not b.is_ready()
    b.register_kv_buffers(1, make_buffers(layout))
    assert b.is_ready()
    assert b.stats().registered_ranks == (0, 1) and b.stats().expected_ranks == 2
    b.shutdown()
    b.shutdown()
    assert manager.call_names().count("shutdown") == 1
    assert not b.is_ready()
    with pytest.raises(KVBackendError, match="shut down and cannot start again"):
        b.start()
    with pytest.raises(KVBackendError, match="was shut down"):
        b.put_match(tokens(8))


# -- registration ------------------------------------------------------------------


def test_cpu_tensors_rejected_by_real_rule_point_to_embedded(
        backend: FlexKVBackend, fake_flexkv: ModuleType) -> None:
    fake_flexkv.Knobs.require_cuda = True
    backend.start()
    with pytest.raises(ValueError, match=r"rank 0: FlexKV rejected.*use backend: embedded"):
        backend.register_kv_buffers(0, make_buffers(backend.layout))
    assert not fake_flexkv.MANAGERS[-1].registrations
    fake_flexkv.Knobs.require_cuda = False
    backend.register_kv_buffers(0, make_buffers(backend.layout))  # nothing was half-registered
    assert backend.is_ready()


def test_registration_passes_flexkv_layout(ready: tuple[FlexKVBackend, Any, Any]) -> None:
    _, _, manager = ready
    (_, args), = [c for c in manager.calls if c[0] == "register"]
    lay = args["layout"]
    assert args["key"] == (0, 0) and args["num_tensors"] == 4  # K of 2 layers, then V
    assert (lay.type.name, lay.num_layer, lay.num_block, lay.tokens_per_block, lay.num_head,
            lay.head_size, lay.kv_dim) == ("LAYERFIRST", 2, 64 // TPB, TPB, 2, 4, 2)


def test_bad_buffers_and_double_registration(ready: tuple[FlexKVBackend, Any, Any]) -> None:
    b, bufs, manager = ready
    with pytest.raises(ValueError, match=r"rank 0: buffer list 0 holds 1 tensors"):
        b.register_kv_buffers(0, [bufs[0][:1], bufs[1]])
    with pytest.raises(KVBackendError, match="rank 0 is already registered"):
        b.register_kv_buffers(0, bufs)
    assert len(manager.registrations) == 1


def test_layer_kv_slot_head_layout_registers_views(fake_flexkv: ModuleType) -> None:
    layout = make_layout(name=LayoutName.LAYER_KV_SLOT_HEAD)
    b = FlexKVBackend(layout, FlexKVSettings(cpu_bytes=1 << 20))
    b.start()
    layers = [torch.randn(2, 66, 2, 4) for _ in range(2)]  # 66 slots: 16 whole pages
    b.register_kv_buffers(0, [layers])
    ids = tokens(8)
    tid, _ = b.put_match(ids)
    [tid] = b.launch([tid], [pages(3, 9)])
    assert b.wait([tid], timeout=5)[tid].status is KVResponseStatus.SUCCESS
    want = [t[:, pages(3, 9)].clone() for t in layers]
    for t in layers:
        t.zero_()
    tid, mask = b.get_match(ids)
    assert mask.tolist() == [True] * 8
    [tid] = b.launch([tid], [pages(0, 1)])
    assert b.wait([tid], timeout=5)[tid].status is KVResponseStatus.SUCCESS
    for t, w in zip(layers, want, strict=True):
        assert torch.equal(t[:, pages(0, 1)], w)  # written through the views
    b.shutdown()


# -- round trip, masks, conversions -------------------------------------------------------


def test_store_then_load_round_trip_is_bit_exact(ready: tuple[FlexKVBackend, Any, Any]) -> None:
    b, bufs, manager = ready
    ids = tokens(10)  # two whole blocks and a partial one
    tid, mask = b.put_match(ids)
    assert mask.tolist() == [True] * 8 + [False] * 2
    [tid] = b.launch([tid], [pages(2, 5)])
    resp = b.wait([tid], timeout=5)[tid]
    assert resp.status is KVResponseStatus.SUCCESS and resp.return_mask is not None
    assert resp.return_mask.tolist() == mask.tolist()
    want = [[t[pages(2, 5)].clone() for t in group] for group in bufs]
    for group in bufs:
        for t in group:
            t.zero_()
    gid, gmask = b.get_match(ids)
    assert gmask.tolist() == mask.tolist()
    [gid] = b.launch([gid], [pages(7, 0)])
    assert b.wait([gid], timeout=5)[gid].status is KVResponseStatus.SUCCESS
    for group, wgroup in zip(bufs, want, strict=True):
        for t, w in zip(group, wgroup, strict=True):
            assert torch.equal(t[pages(7, 0)], w)
    assert manager.locked_blocks() == 0 and not manager.live_task_ids()


def test_second_put_skips_cached_prefix(ready: tuple[FlexKVBackend, Any, Any]) -> None:
    b, _, _ = ready
    ids = tokens(16)
    store(b, ids[:8], (1, 2))
    _, mask = b.put_match(ids)
    assert mask.tolist() == [False] * 8 + [True] * 8


def test_nothing_to_move_returns_minus_one_and_leaves_no_flexkv_task(
        ready: tuple[FlexKVBackend, Any, Any]) -> None:
    b, _, manager = ready
    assert b.get_match(tokens(8))[0] == -1  # miss: FlexKV's empty task is reaped
    assert not manager.live_task_ids()
    n_calls = len(manager.calls)
    tid, mask = b.get_match(tokens(3))  # shorter than one block: FlexKV is not asked
    assert tid == -1 and mask.tolist() == [False] * 3 and len(manager.calls) == n_calls
    store(b, tokens(8), (0, 1))
    assert b.put_match(tokens(8))[0] == -1  # fully cached
    assert not manager.live_task_ids()


def test_put_span_after_the_first_block_needs_its_prefix_cached(
        ready: tuple[FlexKVBackend, Any, Any]) -> None:
    b, _, manager = ready
    ids = tokens(12)
    later = np.array([False] * 4 + [True] * 8)
    assert b.put_match(ids, token_mask=later)[0] == -1  # block 0 is not cached
    assert not manager.live_task_ids() and manager.locked_blocks() == 0
    store(b, ids[:4], (0,))
    tid, mask = b.put_match(ids, token_mask=later)
    assert mask.tolist() == later.tolist()
    (_, args), = [c for c in manager.calls if c[0] == "put_match"][-1:]
    assert args["token_mask"].all()  # FlexKV is asked from block 0
    b.cancel([tid])


def test_get_mask_starts_at_first_wanted_block(ready: tuple[FlexKVBackend, Any, Any]) -> None:
    b, _, _ = ready
    ids = tokens(12)
    store(b, ids, (0, 1, 2))
    want = np.array([False] * 5 + [True] * 7)
    tid, mask = b.get_match(ids, token_mask=want)
    assert mask.tolist() == [False] * 4 + [True] * 8  # block-aligned: block 1 onwards
    assert want.tolist() == [False] * 5 + [True] * 7  # the caller's mask is untouched
    b.cancel([tid])


def test_caller_mask_is_not_mutated_by_flexkv(ready: tuple[FlexKVBackend, Any, Any]) -> None:
    b, _, manager = ready
    ids = tokens(10)
    mask_in = np.ones(10, dtype=bool)
    b.put_match(ids, token_mask=mask_in)
    assert mask_in.all()  # FlexKV zeroes the partial block in the array it receives
    (_, args), = [c for c in manager.calls if c[0] == "put_match"]
    assert args["token_mask"] is not mask_in and not args["token_mask"][8:].any()


def test_conversions_of_token_ids_and_namespace(ready: tuple[FlexKVBackend, Any, Any]) -> None:
    b, _, manager = ready
    b.put_match(list(range(8)), namespace="lora-a")
    b.put_match(torch.arange(8, dtype=torch.int32))
    calls = [args for name, args in manager.calls if name == "put_match"]
    assert all(a["token_ids"].dtype == np.int64 and isinstance(a["token_ids"], np.ndarray)
               for a in calls)
    assert calls[0]["namespace"] == ["lora-a"] and calls[1]["namespace"] is None
    # a namespace salts block identity: the same tokens under another namespace miss
    assert b.put_match(list(range(8)), namespace="lora-b")[0] >= 0


@pytest.mark.parametrize(
    ("call", "match"),
    [(lambda b: b.get_match(np.array([1.5, 2.0])), "1-D sequence of integers"),
     (lambda b: b.get_match(np.zeros((2, 4), dtype=np.int64)), "1-D sequence of integers"),
     (lambda b: b.put_match([1, True, 3, 4]), r"token_ids has dtype bool \(a bool among"),
     (lambda b: b.put_match(np.array([1, 2, 3, 2**63], dtype=np.uint64)), "outside int64"),
     (lambda b: b.get_match(tokens(8), token_mask=np.ones(8, dtype=np.int64)), "bool array"),
     (lambda b: b.get_match(tokens(8), token_mask=np.ones(7, dtype=bool)), r"shape \(8,\)"),
     (lambda b: b.get_match(tokens(8), token_mask=np.array([1, 0, 1, 1, 1, 1, 1, 1], bool)),
      "one contiguous span"),
     (lambda b: b.put_match(tokens(8), token_mask=np.array([0] * 2 + [1] * 6, bool)),
      "starts at token 2, not a multiple of tokens_per_block=4"),
     (lambda b: b.get_match(tokens(8), namespace=3), "namespace must be a string")],
)
def test_bad_match_inputs_raise_before_flexkv(
        ready: tuple[FlexKVBackend, Any, Any], call: Any, match: str) -> None:
    b, _, manager = ready
    n_calls = len(manager.calls)
    with pytest.raises(ValueError, match=match):
        call(b)
    assert len(manager.calls) == n_calls


# -- launch ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("slots", "match"),
    [(pages(1)[:3], r"has 3 slots but its mask has 8 True tokens"),
     (np.concatenate([pages(1), -pages(1) - 1]), "negative slot"),
     (pages(1, 16), r"slot 67, outside the 64 slots"),
     (np.concatenate([pages(1), pages(1)]), "repeats a slot"),
     (np.arange(2, 10, dtype=np.int64), r"block 0 holds slots \[2, 3, 4, 5\], not one whole"),
     (np.array([4, 5, 7, 6, 8, 9, 10, 11]), "not one whole aligned page"),
     (pages(1, 2).astype(np.float64), "1-D integer array")],
)
def test_bad_slot_mapping_launches_nothing(
        ready: tuple[FlexKVBackend, Any, Any], slots: np.ndarray, match: str) -> None:
    b, _, manager = ready
    tid, _ = b.put_match(tokens(8))
    with pytest.raises(ValueError, match=match):
        b.launch([tid], [slots])
    assert "launch" not in manager.call_names()
    [tid] = b.launch([tid], [pages(1, 2)])  # still un-launched: a good mapping works
    assert b.wait([tid], timeout=5)[tid].status is KVResponseStatus.SUCCESS


def test_launch_arity_and_ids_are_checked(ready: tuple[FlexKVBackend, Any, Any]) -> None:
    b, _, _ = ready
    tid, _ = b.put_match(tokens(8))
    with pytest.raises(ValueError, match="1 task ids but 2 slot mappings"):
        b.launch([tid], [pages(0, 1), pages(2, 3)])
    with pytest.raises(ValueError, match="repeat an id"):
        b.launch([tid, tid], [pages(0, 1), pages(2, 3)])
    with pytest.raises(TaskNotFoundError, match="task 999 is not a live, un-launched task"):
        b.launch([999], [pages(0)])
    b.launch([tid], [torch.from_numpy(pages(0, 1))])  # torch slot mappings are converted
    with pytest.raises(TaskNotFoundError, match=f"task {tid} is not a live"):
        b.launch([tid], [pages(0, 1)])


def test_as_batch_returns_new_id_that_replaces_old_ones(
        ready: tuple[FlexKVBackend, Any, Any]) -> None:
    b, _, _ = ready
    a, b_ids = tokens(8, seed=1), tokens(4, seed=2)
    store(b, a, (0, 1))
    store(b, b_ids, (2,))
    t1, m1 = b.get_match(a)
    t2, m2 = b.get_match(b_ids)
    [batch] = b.launch([t1, t2], [pages(4, 5), pages(6)], as_batch=True)
    assert batch not in (t1, t2)
    got = b.wait([batch, t1], timeout=5)
    assert got[batch].status is KVResponseStatus.SUCCESS
    assert got[batch].return_mask is not None
    assert got[batch].return_mask.tolist() == m1.tolist() + m2.tolist()
    assert got[t1].status is KVResponseStatus.NOTFOUND


def test_single_task_as_batch_keeps_its_id(ready: tuple[FlexKVBackend, Any, Any]) -> None:
    b, _, _ = ready
    tid, _ = b.put_match(tokens(8))
    assert b.launch([tid], [pages(0, 1)], as_batch=True) == [tid]


# -- wait, try_wait, cancel, expiry, reset, failure ----------------------------------


def test_wait_statuses(ready: tuple[FlexKVBackend, Any, Any]) -> None:
    b, _, manager = ready
    manager.transfer_seconds = 60.0
    unlaunched, _ = b.put_match(tokens(8, seed=1))
    running, _ = b.put_match(tokens(8, seed=2))
    b.launch([running], [pages(0, 1)])
    got = b.wait([unlaunched, running, 12345], timeout=0.05)
    assert [got[t].status for t in (unlaunched, running, 12345)] == [
        KVResponseStatus.UNREADY, KVResponseStatus.TIMEOUT, KVResponseStatus.NOTFOUND]
    assert got[12345].return_mask is None
    assert b.try_wait([unlaunched, running]) == {}  # nothing terminal yet
    manager.transfer_seconds = 0.0
    for task in manager._tasks.values():
        task.done_at = 0.0
    done = b.try_wait([running])
    assert done[running].status is KVResponseStatus.SUCCESS
    assert b.wait([running], timeout=0)[running].status is KVResponseStatus.NOTFOUND  # reaped
    with pytest.raises(ValueError, match="timeout=-1"):
        b.wait([running], timeout=-1)


def test_wait_does_not_block_other_callers(ready: tuple[FlexKVBackend, Any, Any]) -> None:
    b, _, manager = ready
    manager.transfer_seconds = 60.0
    tid, _ = b.put_match(tokens(8, seed=1))
    b.launch([tid], [pages(0, 1)])
    result: dict[int, Any] = {}
    waiter = threading.Thread(target=lambda: result.update(b.wait([tid], timeout=10)))
    waiter.start()
    try:
        polled = threading.Event()
        for _ in range(10_000):  # until the waiter has polled FlexKV at least once
            if "wait" in manager.call_names():
                polled.set()
                break
            time.sleep(0.001)
        assert polled.is_set()
        other, _ = b.put_match(tokens(8, seed=2))  # runs while the waiter is blocked
        assert other >= 0 and waiter.is_alive()
    finally:
        for task in manager._tasks.values():
            task.done_at = 0.0
        waiter.join(timeout=10)
    assert result[tid].status is KVResponseStatus.SUCCESS


def test_cancel_rolls_back_unlaunched_only(ready: tuple[FlexKVBackend, Any, Any]) -> None:
    b, _, manager = ready
    store(b, tokens(8, seed=3), (0, 1))
    gid, _ = b.get_match(tokens(8, seed=3))
    pid, _ = b.put_match(tokens(8, seed=4))
    launched, _ = b.put_match(tokens(8, seed=5))
    manager.transfer_seconds = 60.0
    b.launch([launched], [pages(2, 3)])
    assert manager.locked_blocks() == 2 + 2 + 2
    b.cancel([gid, pid, launched, 777])
    (_, args), = [c for c in manager.calls if c[0] == "cancel"]
    assert args["task_ids"] == [gid, pid]  # launched and unknown ids never reach FlexKV
    assert manager.locked_blocks() == 2  # only the launched put holds blocks
    got = b.wait([gid, pid], timeout=0)
    assert {r.status for r in got.values()} == {KVResponseStatus.CANCELLED}
    assert b.wait([gid], timeout=0)[gid].status is KVResponseStatus.NOTFOUND


def test_unlaunched_match_expires_and_unlocks(
        ready: tuple[FlexKVBackend, Any, Any], clock: ManualClock) -> None:
    b, _, manager = ready
    store(b, tokens(8, seed=3), (0, 1))
    gid, _ = b.get_match(tokens(8, seed=3))
    assert manager.locked_blocks() == 2
    clock.now += 5.0  # unlaunched_match_seconds
    with pytest.raises(TaskNotFoundError):
        b.launch([gid], [pages(4, 5)])
    assert manager.locked_blocks() == 0 and gid not in manager.live_task_ids()
    assert b.wait([gid], timeout=0)[gid].status is KVResponseStatus.CANCELLED


def test_reset_drops_cache_and_cancels_tasks(ready: tuple[FlexKVBackend, Any, Any]) -> None:
    b, _, manager = ready
    ids = tokens(8, seed=6)
    store(b, ids, (0, 1))
    pending, _ = b.put_match(tokens(8, seed=7))
    manager.transfer_seconds = 60.0
    running, _ = b.put_match(tokens(8, seed=8))
    b.launch([running], [pages(2, 3)])
    b.reset()
    assert b.get_match(ids)[0] == -1
    got = b.wait([pending, running], timeout=1)
    assert got[pending].status is KVResponseStatus.CANCELLED
    assert got[running].status is KVResponseStatus.CANCELLED
    assert not manager.live_task_ids() and manager.registrations  # buffers stay registered


def test_failed_transfer_reports_failed_and_stores_nothing(
        ready: tuple[FlexKVBackend, Any, Any]) -> None:
    b, _, manager = ready
    ids = tokens(8, seed=9)
    tid, _ = b.put_match(ids)
    manager.fail_next_launches = 1
    [tid] = b.launch([tid], [pages(0, 1)])
    resp = b.wait([tid], timeout=5)[tid]
    assert resp.status is KVResponseStatus.FAILED and resp.error
    assert resp.return_mask is not None and not resp.return_mask.any()
    assert b.get_match(ids)[0] == -1


def test_task_table_is_bounded(fake_flexkv: ModuleType) -> None:
    b = FlexKVBackend(make_layout(), FlexKVSettings(cpu_bytes=1 << 20, max_tasks=2))
    b.start()
    b.register_kv_buffers(0, make_buffers(b.layout))
    b.put_match(tokens(8, seed=1))
    b.put_match(tokens(8, seed=2))
    with pytest.raises(KVBackendError, match="2 live tasks reached max_tasks=2"):
        b.put_match(tokens(8, seed=3))
    b.shutdown()


def test_unknown_flexkv_status_is_an_error(ready: tuple[FlexKVBackend, Any, Any]) -> None:
    b, _, manager = ready
    tid, _ = b.put_match(tokens(8))
    b.launch([tid], [pages(0, 1)])

    class Odd:
        name = "PARTIAL"

    manager.wait = lambda *a, **k: {tid: type("R", (), {"status": Odd(), "task_id": tid})()}
    with pytest.raises(KVBackendError, match="status 'PARTIAL'"):
        b.wait([tid], timeout=0)


def test_metrics_record_matches_and_capacity(fake_flexkv: ModuleType) -> None:
    metrics = AgentMetrics(CollectorRegistry())
    layout = make_layout()
    b = FlexKVBackend(layout, FlexKVSettings(cpu_bytes=1 << 20), metrics=metrics)
    b.start()
    b.register_kv_buffers(0, make_buffers(layout))
    b.get_match(tokens(8))
    reg = metrics.registry
    cap = reg.get_sample_value("flexkv_agent_tier_capacity_bytes", {"tier": "cpu"})
    assert cap == b.sizing.num_cpu_blocks * layout.bytes_per_block
    assert reg.get_sample_value("flexkv_agent_match_seconds_count", {"op": "get"}) == 1
    assert b.stats().tiers["cpu"].capacity_blocks == b.sizing.num_cpu_blocks
    b.shutdown()


def test_settings_from_agent_config() -> None:
    from node_agent.config import config_from_mapping

    cfg = config_from_mapping({
        "backend": "flexkv",
        "tiers": {"cpu": {"size": "1Gi"}, "ssd": {"size": "4Gi", "paths": ["/s0", "/s1"]}},
        "eviction": {"highWatermark": 0.9, "lowWatermark": 0.7},
        "timeouts": {"unlaunchedMatchSeconds": 12},
    })
    s = FlexKVSettings.from_agent_config(cfg)
    assert (s.cpu_bytes, s.ssd_bytes, s.ssd_paths) == (1 << 30, 4 << 30, ("/s0", "/s1"))
    assert (s.eviction_policy, s.high_watermark, s.low_watermark) == ("lru", 0.9, 0.7)
    assert s.unlaunched_match_seconds == 12
    no_ssd = FlexKVSettings.from_agent_config(config_from_mapping({}))
    assert (no_ssd.ssd_bytes, no_ssd.ssd_paths) == (0, ())


def test_launch_before_every_rank_registered_is_refused(fake_flexkv: ModuleType) -> None:
    layout = make_layout(num_kv_heads=4, tp_size=2)
    b = FlexKVBackend(layout, FlexKVSettings(cpu_bytes=1 << 20))
    b.start()
    b.register_kv_buffers(0, make_buffers(layout))
    tid, _ = b.put_match(tokens(8))
    with pytest.raises(KVBackendError, match="1 of 2 engine ranks registered"):
        b.launch([tid], [pages(0, 1)])
    b.register_kv_buffers(1, make_buffers(layout))
    [tid] = b.launch([tid], [pages(0, 1)])  # the match survived the refusal
    assert b.wait([tid], timeout=5)[tid].status is KVResponseStatus.SUCCESS
    b.shutdown()


def test_start_flexkv_backend_for_an_agent_stage(fake_flexkv: ModuleType) -> None:
    from node_agent.backend.flexkv_adapter import start_flexkv_backend
    from node_agent.config import config_from_mapping

    cfg = config_from_mapping({"backend": "flexkv", "tokensPerBlock": TPB,
                               "tiers": {"cpu": {"size": "1Mi"}}})
    b = start_flexkv_backend(cfg, make_layout())
    assert fake_flexkv.MANAGERS[-1].started and b.sizing.num_cpu_blocks > 0
    b.shutdown()
    with pytest.raises(ValueError, match="differs from tokensPerBlock=4"):
        start_flexkv_backend(cfg, make_layout(tokens_per_block=16))


def test_failed_start_is_reported_and_cleaned_up(fake_flexkv: ModuleType, tmp_path: Path) -> None:
    settings = FlexKVSettings(cpu_bytes=1 << 20, ipc_dir=str(tmp_path))
    first = FlexKVBackend(make_layout(), settings)
    first.start()
    second = FlexKVBackend(make_layout(), settings)  # same sockets: FlexKV cannot bind them
    with pytest.raises(KVBackendError, match=r"KVManager failed to start .*already bound"):
        second.start()
    with pytest.raises(KVBackendError, match="not started"):
        second.get_match(tokens(8))
    first.register_kv_buffers(0, make_buffers(first.layout))
    assert first.is_ready()
    first.shutdown()
    with pytest.raises(ValueError, match=r"ipc_dir=.* is too long"):
        FlexKVSettings(cpu_bytes=1 << 20, ipc_dir="/" + "d" * 100)


def test_concurrent_round_trips_are_serialised_safely(
        ready: tuple[FlexKVBackend, Any, Any]) -> None:
    """Threads share one backend; the fake (not thread-safe, like FlexKV's task engine)
    would corrupt its tables if the adapter let calls overlap."""
    b, _, manager = ready
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for i in range(10):
                ids = tokens(8, seed=1000 * w + i)
                tid, mask = b.put_match(ids)
                if tid < 0:
                    continue
                [tid] = b.launch([tid], [pages(2 * w, 2 * w + 1)])
                assert b.wait([tid], timeout=10)[tid].status is KVResponseStatus.SUCCESS
                gid, gmask = b.get_match(ids)
                assert gid >= 0 and gmask.tolist() == mask.tolist()
                [gid] = b.launch([gid], [pages(2 * w + 8, 2 * w + 9)])
                assert b.wait([gid], timeout=10)[gid].status is KVResponseStatus.SUCCESS
        except BaseException as exc:  # reported below, with the thread's context
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    assert manager.locked_blocks() == 0 and not manager.live_task_ids()


@pytest.mark.parametrize("corrupt", [
    lambda m: m.astype(np.int8),                      # wrong dtype
    lambda m: np.concatenate([m, [False]]),           # wrong length
    lambda m: np.where(np.arange(len(m)) == 1, False, m),  # a hole: not one span
])
def test_refused_match_mask_cancels_the_flexkv_task(
        ready: tuple[FlexKVBackend, Any, Any], corrupt: Any) -> None:
    b, _, manager = ready
    ids = tokens(8)
    store(b, ids, (0, 1))
    real = manager.get_match

    def bad_mask(*a: Any, **k: Any) -> tuple[int, np.ndarray]:
        tid, mask = real(*a, **k)
        return tid, corrupt(mask)

    manager.get_match = bad_mask
    with pytest.raises(KVBackendError, match="mask"):
        b.get_match(ids)
    # The task FlexKV allocated (and the index nodes it locked) were rolled back.
    assert manager.locked_blocks() == 0
    assert not manager.live_task_ids()
    assert "cancel" in manager.call_names()
