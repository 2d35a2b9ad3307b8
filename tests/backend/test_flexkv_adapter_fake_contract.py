"""The fake ``flexkv`` package rejects what FlexKV rejects or would mis-execute.

These tests call the fake directly (no adapter), so a fake that accepted anything
would fail here: they prove the adapter tests run against a real check.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from tests.fake_flexkv import FAKES, drop_flexkv_modules

TPB = 4


@pytest.fixture
def fk(monkeypatch: pytest.MonkeyPatch) -> Iterator[SimpleNamespace]:
    """The fake's public modules, imported from tests/fakes on a temporary sys.path."""
    drop_flexkv_modules()
    monkeypatch.syspath_prepend(str(FAKES))
    ns = SimpleNamespace(
        fake=importlib.import_module("flexkv._fake"),
        config=importlib.import_module("flexkv.common.config"),
        request=importlib.import_module("flexkv.common.request"),
        storage=importlib.import_module("flexkv.common.storage"),
        KVManager=importlib.import_module("flexkv.kvmanager").KVManager,
        KVTPClient=importlib.import_module("flexkv.server.client").KVTPClient,
    )
    ns.fake.reset()
    yield ns
    ns.fake.reset()
    drop_flexkv_modules()


def make_manager(fk: SimpleNamespace, start: bool = True, tp: int = 1) -> Any:
    model = fk.config.ModelConfig(num_layers=2, num_kv_heads=2 * tp, head_size=4, kv_dim=2,
                                  dtype=torch.float32, tp_size=tp)
    cache = fk.config.CacheConfig(tokens_per_block=TPB, num_cpu_blocks=64)
    m = fk.KVManager(model, cache, server_recv_port="ipc:///tmp/fake-s",
                     gpu_register_port="ipc:///tmp/fake-g")
    if start:
        m.start()
    return m


def layout(fk: SimpleNamespace, **kw: Any) -> Any:
    args: dict[str, Any] = dict(type=fk.storage.KVCacheLayoutType.LAYERFIRST, num_layer=2,
                                num_block=16, tokens_per_block=TPB, num_head=2, head_size=4,
                                kv_dim=2, num_kv_heads=2)
    args.update(kw)
    return fk.storage.KVCacheLayout(**args)


def register(fk: SimpleNamespace, rank: int = 0, **kw: Any) -> None:
    fk.fake.Knobs.require_cuda = False
    tensors = [torch.zeros(64, 2, 4) for _ in range(4)]
    fk.KVTPClient("ipc:///tmp/fake-g", dp_client_id=0, device_id=0,
                  intra_client_id=rank).register_to_server(tensors, layout(fk, **kw))


def ids(n: int = 8) -> np.ndarray:
    return np.arange(100, 100 + n, dtype=np.int64)


def pages(*page_ids: int) -> np.ndarray:
    return np.concatenate([np.arange(p * TPB, (p + 1) * TPB) for p in page_ids]).astype(np.int64)


def stored(fk: SimpleNamespace) -> Any:
    """A ready manager holding ids() in its cache."""
    m = make_manager(fk)
    register(fk)
    tid, _ = m.put_match(ids())
    m.launch([tid], [pages(0, 1)])
    assert m.wait([tid])[tid].status.name == "SUCCESS"
    return m


# -- configs -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [(dict(use_mla=True), TypeError, "use_mla"),
     (dict(dtype="bfloat16"), TypeError, "torch.dtype"),
     (dict(kv_dim=3), AssertionError, "kv_dim must be 2"),
     (dict(num_layers=2.0), TypeError, "num_layers must be int"),
     (dict(num_kv_heads=3, tp_size=2), AssertionError, "divide evenly"),
     (dict(kv_dim=1, num_kv_heads=4), AssertionError, "one latent head")],
)
def test_model_config_rejects_bad_fields(fk: SimpleNamespace, kw: dict[str, Any],
                                         exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        fk.config.ModelConfig(**kw)


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [(dict(eviction_policy="random"), AssertionError, "not one of"),
     (dict(enable_cpu=False), AssertionError, "enable_cpu must be True"),
     (dict(num_cpu_blocks=0), AssertionError, "num_cpu_blocks must be >= 1"),
     (dict(enable_ssd=True, ssd_cache_dir=["/a", "/b"], num_ssd_blocks=3), AssertionError,
      "multiple of the number of SSD dirs"),
     (dict(enable_ssd=True, num_ssd_blocks=4), AssertionError, "needs ssd_cache_dir"),
     (dict(enable_ssd=1), TypeError, "enable_ssd must be bool"),
     (dict(cpu_cache_gb=8), TypeError, "cpu_cache_gb")],
)
def test_cache_config_rejects_bad_fields(fk: SimpleNamespace, kw: dict[str, Any],
                                         exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        fk.config.CacheConfig(**kw)


def test_status_values_are_flexkvs_own(fk: SimpleNamespace) -> None:
    assert fk.request.KVResponseStatus.NOTFOUND.value == "not_found"


# -- lifecycle ---------------------------------------------------------------------------


def test_calls_before_start_and_after_shutdown_are_rejected(fk: SimpleNamespace) -> None:
    m = make_manager(fk, start=False)
    assert m.is_ready() is False
    with pytest.raises(AssertionError, match="before start"):
        m.get_match(ids())
    m.start()
    with pytest.raises(AssertionError, match="start\\(\\) called twice"):
        m.start()
    m.shutdown()
    with pytest.raises(AssertionError, match="after shutdown"):
        m.put_match(ids())


def test_is_ready_needs_every_gpu(fk: SimpleNamespace) -> None:
    m = make_manager(fk, tp=2)
    register(fk, rank=0)
    assert not m.is_ready()
    register(fk, rank=1)
    assert m.is_ready()
    with pytest.raises(AssertionError, match="registered twice"):
        register(fk, rank=1)


# -- registration --------------------------------------------------------------------------


def test_registration_rules(fk: SimpleNamespace) -> None:
    client = fk.KVTPClient("ipc:///tmp/fake-g", dp_client_id=0, device_id=0)
    with pytest.raises(ValueError, match="GPU blocks must be CUDA tensors"):
        client.register_to_server([torch.zeros(64, 2, 4)] * 4, layout(fk))
    fk.fake.Knobs.require_cuda = False
    with pytest.raises(AssertionError, match="no started KVManager"):
        client.register_to_server([torch.zeros(64, 2, 4)] * 4, layout(fk))
    make_manager(fk)
    with pytest.raises(AssertionError, match="num_head=1 does not match"):
        register(fk, num_head=1)
    with pytest.raises(AssertionError, match="expected 4 tensors"):
        client.register_to_server([torch.zeros(64, 2, 4)] * 3, layout(fk))
    with pytest.raises(AssertionError, match=r"dtype torch\.float16"):
        client.register_to_server([torch.zeros(64, 2, 4, dtype=torch.float16)] * 4, layout(fk))
    with pytest.raises(TypeError, match="dp_client_id must be int"):
        fk.KVTPClient("ipc:///tmp/fake-g", dp_client_id="0", device_id=0)


# -- matching ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "exc", "match"),
    [(dict(token_ids=ids().astype(np.int32)), AssertionError, "int64"),
     (dict(token_ids=ids().reshape(2, 4)), AssertionError, "1-D"),
     (dict(token_ids=list(range(8))), TypeError, "numpy array"),
     (dict(token_ids=ids(), token_mask=np.ones(8, dtype=np.int64)), AssertionError, "bool array"),
     (dict(token_ids=ids(), token_mask=np.ones(7, dtype=bool)), AssertionError, "shape"),
     (dict(token_ids=ids(), token_mask=np.array([1, 1, 0, 1, 1, 1, 1, 1], dtype=bool)),
      AssertionError, "one contiguous span"),
     (dict(token_ids=ids(), namespace="tenant"), TypeError, "list of str")],
)
def test_match_arguments_are_checked(fk: SimpleNamespace, args: dict[str, Any],
                                     exc: type[Exception], match: str) -> None:
    m = make_manager(fk)
    for call in (m.get_match, m.put_match):
        with pytest.raises(exc, match=match):
            call(**args)


def test_put_mask_must_start_in_block_zero(fk: SimpleNamespace) -> None:
    m = make_manager(fk)
    with pytest.raises(AssertionError, match="start in block 0"):
        m.put_match(ids(), token_mask=np.array([False] * 4 + [True] * 4))


def test_matches_write_into_the_callers_mask(fk: SimpleNamespace) -> None:
    m = make_manager(fk)
    mask = np.ones(10, dtype=bool)
    m.put_match(ids(10), token_mask=mask)
    assert mask.tolist() == [True] * 8 + [False] * 2  # as FlexKV does


def test_empty_match_still_allocates_a_finished_task(fk: SimpleNamespace) -> None:
    m = make_manager(fk)
    tid, mask = m.get_match(ids())
    assert not mask.any() and tid in m.live_task_ids()
    assert m.try_wait([tid])[tid].status.name == "SUCCESS"
    assert tid not in m.live_task_ids()


# -- launch ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("slots", "match"),
    [(pages(0)[:3], "has 3 slots but its mask has 8"),
     (pages(0, 1).astype(np.int32), "1-D int64"),
     (np.arange(1, 9, dtype=np.int64), "not made of whole GPU pages"),
     (np.array([0, 1, 3, 2, 4, 5, 6, 7], dtype=np.int64), "not made of whole GPU pages"),
     (pages(0, 0), "repeats a GPU page"),
     (pages(0, 16), "outside \\[0, 64\\)")],
)
def test_launch_rejects_bad_slot_mappings(fk: SimpleNamespace, slots: np.ndarray,
                                          match: str) -> None:
    m = make_manager(fk)
    register(fk)
    tid, _ = m.put_match(ids())
    with pytest.raises(AssertionError, match=match):
        m.launch([tid], [slots])


def test_launch_only_matched_unlaunched_ids(fk: SimpleNamespace) -> None:
    m = make_manager(fk)
    tid, _ = m.put_match(ids())
    with pytest.raises(AssertionError, match="before every GPU registered"):
        m.launch([tid], [pages(0, 1)])
    register(fk)
    with pytest.raises(AssertionError, match="unknown task id 99"):
        m.launch([99], [pages(0, 1)])
    with pytest.raises(AssertionError, match="1 task ids but 2 slot mappings"):
        m.launch([tid], [pages(0, 1), pages(2, 3)])
    m.launch([tid], [pages(0, 1)])
    with pytest.raises(AssertionError, match="in state"):
        m.launch([tid], [pages(2, 3)])
    empty, _ = m.get_match(ids(8) + 1000)
    with pytest.raises(AssertionError, match="in state completed"):
        m.launch([empty], [np.zeros(0, dtype=np.int64)])


def test_as_batch_replaces_ids(fk: SimpleNamespace) -> None:
    m = stored(fk)
    t1, _ = m.get_match(ids())
    t2, _ = m.get_match(ids())
    [batch] = m.launch([t1, t2], [pages(2, 3), pages(4, 5)], as_batch=True)
    assert batch not in (t1, t2)
    got = m.wait([t1, batch])
    assert got[t1].status.name == "NOTFOUND"
    assert isinstance(got[batch].return_mask, list) and len(got[batch].return_mask) == 2


# -- wait / cancel / reset ----------------------------------------------------------------------


def test_wait_and_try_wait_semantics(fk: SimpleNamespace) -> None:
    m = stored(fk)
    m.transfer_seconds = 60.0
    unlaunched, _ = m.get_match(ids())
    running, _ = m.get_match(ids())
    m.launch([running], [pages(2, 3)])
    got = m.wait([unlaunched, running, 42], timeout=0.0)
    assert [got[t].status.name for t in (unlaunched, running, 42)] == [
        "UNREADY", "TIMEOUT", "NOTFOUND"]
    polled = m.try_wait([unlaunched, running, 42])
    assert set(polled) == {unlaunched, 42}  # running tasks are left out
    with pytest.raises(AssertionError, match="finite and >= 0"):
        m.wait([running], timeout=float("inf"))
    with pytest.raises(TypeError, match="task_ids must be int or list"):
        m.wait((running,))


def test_cancel_unlocks_unlaunched_and_reset_cancels(fk: SimpleNamespace) -> None:
    m = stored(fk)
    tid, _ = m.get_match(ids())
    assert m.locked_blocks() == 2
    m.cancel([tid, 12345])
    assert m.locked_blocks() == 0 and tid not in m.live_task_ids()
    pid, _ = m.put_match(ids(16))
    m.reset()
    assert m.wait([pid], timeout=0.0)[pid].status.name == "CANCELLED"
    assert m.cached_blocks() == 0
