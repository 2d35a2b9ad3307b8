"""Fake of ``flexkv/kvmanager.py``: ``KVManager`` with FlexKV's signatures and rules.

Semantics copied from FlexKV's ``kvtask.py`` / ``cache/cache_engine.py`` (see
docs/flexkv.md for file references):

* ``get_match`` / ``put_match`` always allocate a task id. A match with nothing
  to move is an empty graph, COMPLETED at once; it stays in the task table until
  a ``wait``/``try_wait`` reaps it or ``cancel`` releases it.
* Both matches write ``token_mask[aligned_length:] = False`` into the caller's
  array (FlexKV mutates its input), so callers must pass a copy.
* ``put_match``'s token mask must start in block 0 (``assert block_start_idx == 0``).
* ``launch`` binds slot mappings late. FlexKV turns a slot mapping into GPU block
  ids as ``slot_mapping[::tokens_per_block] // tokens_per_block``: only the first
  slot of each block is read, so a mapping that is not made of whole, aligned
  GPU pages would silently move the wrong KV. The fake rejects it.
* ``launch(as_batch=True)`` with more than one task of one kind merges them into a
  new task id (the old ids are gone); otherwise the ids are returned unchanged.
* ``wait`` answers NOTFOUND for unknown ids, UNREADY for un-launched ones,
  TIMEOUT for unfinished ones (``timeout=0.0`` is a poll); finished tasks are
  reaped. ``try_wait`` is the same poll without waiting, and leaves running
  tasks out of its answer.
* ``cancel`` ignores unknown ids, rolls back un-launched tasks and forgets
  launched ones (their transfer still lands, as in FlexKV).
* ``reset`` drops the index; every unfinished task ends CANCELLED.

Beyond FlexKV, the fake rejects calls before ``start()`` and after
``shutdown()``, and records every call in :attr:`KVManager.calls`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from flexkv import _fake
from flexkv._checks import (
    as_cpu_numpy,
    check_bool,
    check_int,
    check_namespace,
    check_str,
    check_task_ids,
    check_timeout,
    check_token_ids,
    check_token_mask,
)
from flexkv.common.config import CacheConfig, ModelConfig
from flexkv.common.request import KVResponse, KVResponseStatus
from flexkv.common.storage import KVCacheLayout, KVCacheLayoutType

_TERMINAL = {"completed": KVResponseStatus.SUCCESS, "failed": KVResponseStatus.FAILED,
             "cancelled": KVResponseStatus.CANCELLED}


@dataclass
class _Block:
    ready: bool
    locks: int = 0


@dataclass
class _Task:
    task_id: int
    kind: str  # get | put | batch_get | batch_put
    mask: np.ndarray
    hashes: list[int]
    status: str  # unready | running | completed | failed | cancelled
    slot_mapping: np.ndarray | None = None
    done_at: float = 0.0
    will_fail: bool = False
    children: list[_Task] = field(default_factory=list)


@dataclass
class _Registration:
    planes: list[torch.Tensor]  # (slots, heads, head_size) views of the rank's buffers
    layout: KVCacheLayout


class KVManager:
    def __init__(self,
                 model_config: ModelConfig,
                 cache_config: CacheConfig,
                 dp_client_id: int = 0,
                 server_recv_port: str = "",
                 gpu_register_port: str = "",
                 event_collector: Any = None) -> None:
        if not isinstance(model_config, ModelConfig):
            raise TypeError(
                "fake flexkv: model_config must be ModelConfig, "
                f"got {type(model_config).__name__}"
            )
        if not isinstance(cache_config, CacheConfig):
            raise TypeError(
                "fake flexkv: cache_config must be CacheConfig, "
                f"got {type(cache_config).__name__}"
            )
        check_int("dp_client_id", dp_client_id, minimum=0)
        check_str("server_recv_port", server_recv_port)
        check_str("gpu_register_port", gpu_register_port)
        if model_config.pp_size != 1 or model_config.nnodes != 1:
            raise AssertionError(
                "fake flexkv: only single-stage managers are modelled (pp_size=1, nnodes=1); "
                f"got pp_size={model_config.pp_size}, nnodes={model_config.nnodes}"
            )
        self.model_config = model_config
        self.cache_config = cache_config
        self.server_recv_port = server_recv_port or "ipc:///tmp/flexkv_server"
        self.gpu_register_port = gpu_register_port or self.server_recv_port + "_gpu_register"
        self.calls: list[tuple[str, dict[str, Any]]] = []
        #: Seconds a launched transfer takes (tests raise it to observe TIMEOUT).
        self.transfer_seconds = 0.0
        #: The next N launched tasks end FAILED (fault injection).
        self.fail_next_launches = 0
        self.started = False
        self.stopped = False
        self.registrations: dict[tuple[int, int], _Registration] = {}
        self._tasks: dict[int, _Task] = {}
        self._orphans: list[_Task] = []
        self._index: OrderedDict[int, _Block] = OrderedDict()
        self._data: dict[int, dict[tuple[int, int], torch.Tensor]] = {}
        self._next_id = 0
        _fake.MANAGERS.append(self)

    # -- bookkeeping --------------------------------------------------------

    def _record(self, name: str, **kwargs: Any) -> None:
        self.calls.append((name, kwargs))

    def _require_running(self, what: str) -> None:
        if self.stopped:
            raise AssertionError(f"fake flexkv: {what} called after shutdown()")
        if not self.started:
            raise AssertionError(f"fake flexkv: {what} called before start()")

    def _new_id(self) -> int:
        tid = self._next_id
        self._next_id += 1
        return tid

    @property
    def tokens_per_block(self) -> int:
        return self.cache_config.tokens_per_block

    def call_names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def live_task_ids(self) -> list[int]:
        return sorted(self._tasks)

    def locked_blocks(self) -> int:
        return sum(1 for b in self._index.values() if b.locks > 0)

    def cached_blocks(self) -> int:
        return sum(1 for b in self._index.values() if b.ready)

    # -- lifecycle ------------------------------------------------------------

    def start(self) -> None:
        self._record("start")
        if self.started:
            raise AssertionError("fake flexkv: start() called twice")
        if self.stopped:
            raise AssertionError("fake flexkv: start() called after shutdown()")
        if self.gpu_register_port in _fake.BY_REGISTER_PORT:
            raise AssertionError(
                f"fake flexkv: gpu_register_port {self.gpu_register_port!r} is already bound "
                "by another KVManager"
            )
        self.started = True
        _fake.BY_REGISTER_PORT[self.gpu_register_port] = self

    def is_ready(self) -> bool:
        self._record("is_ready")
        return self._ready()

    def _ready(self) -> bool:
        return (self.started and not self.stopped
                and len(self.registrations) == self.model_config.total_gpus)

    def shutdown(self) -> None:
        self._record("shutdown")
        self._require_running("shutdown()")
        self.stopped = True
        _fake.BY_REGISTER_PORT.pop(self.gpu_register_port, None)
        for task in self._tasks.values():
            if task.status in ("unready", "running"):
                task.status = "cancelled"

    def reset(self) -> None:
        self._record("reset")
        self._require_running("reset()")
        for task in self._tasks.values():
            if task.status in ("unready", "running"):
                task.status = "cancelled"
        self._orphans.clear()
        self._index.clear()
        self._data.clear()

    # -- GPU registration (called by the fake KVTPClient) -----------------------

    def _register(self, key: tuple[int, int], pp_rank: int, tensors: list[torch.Tensor],
                  layout: KVCacheLayout) -> None:
        self._record("register", key=key, pp_rank=pp_rank, num_tensors=len(tensors), layout=layout)
        self._require_running("register_to_server()")
        m, c = self.model_config, self.cache_config
        if key in self.registrations:
            raise AssertionError(
                "fake flexkv: GPU (dp_client_id, "
                f"intra_client_id)={key} registered twice"
            )
        if not 0 <= key[1] < m.total_gpus:
            raise AssertionError(
                f"fake flexkv: intra_client_id {key[1]} outside [0, "
                f"{m.total_gpus}) GPUs of the instance"
            )
        if pp_rank >= m.pp_size:
            raise AssertionError(f"fake flexkv: pp_rank {pp_rank} >= pp_size {m.pp_size}")
        if layout.type is not KVCacheLayoutType.LAYERFIRST:
            raise AssertionError(
                "fake flexkv: only the per-layer LAYERFIRST form "
                f"is modelled, got {layout.type}"
            )
        heads = m.num_kv_heads // m.tp_size if m.num_kv_heads > 1 else 1
        expect = {"num_layer": m.num_layers, "kv_dim": m.kv_dim, "head_size": m.head_size,
                  "tokens_per_block": c.tokens_per_block, "num_head": heads}
        for name, want in expect.items():
            got = getattr(layout, name)
            if got != want:
                raise AssertionError(
                    f"fake flexkv: GPU layout {name}={got} does not "
                    f"match the manager's config ({want})"
                )
        planes = self._planes(tensors, layout)
        for i, t in enumerate(tensors):
            if t.dtype != m.dtype:
                raise AssertionError(
                    f"fake flexkv: kv_caches[{i}] dtype {t.dtype} != "
                    f"ModelConfig.dtype {m.dtype}"
                )
            if t.device != tensors[0].device:
                raise AssertionError("fake flexkv: kv_caches of one GPU must share a device")
        self.registrations[key] = _Registration(planes, layout)

    @staticmethod
    def _planes(tensors: list[torch.Tensor], layout: KVCacheLayout) -> list[torch.Tensor]:
        """Views ``(num_block * tokens_per_block, heads, head_size)`` of every layer and K/V.

        Two LAYERFIRST forms exist in FlexKV's integrations: SGLang passes
        ``num_layer * kv_dim`` tensors of shape ``(slots, heads, head_size)`` (K of
        every layer, then V); vLLM passes ``num_layer`` tensors of shape
        ``(kv_dim, num_block, tokens_per_block, heads, head_size)``.
        """
        slots = layout.num_block * layout.tokens_per_block
        per_slot = (layout.num_head, layout.head_size)
        if len(tensors) == layout.num_layer * layout.kv_dim and all(t.dim() == 3 for t in tensors):
            for i, t in enumerate(tensors):
                if tuple(t.shape) != (slots, *per_slot):
                    raise AssertionError(
                        f"fake flexkv: kv_caches[{i}] shape "
                        f"{tuple(t.shape)} != {(slots, *per_slot)}"
                    )
            return list(tensors)
        five = (layout.kv_dim, layout.num_block, layout.tokens_per_block, *per_slot)
        if len(tensors) == layout.num_layer and all(t.dim() == 5 for t in tensors):
            for i, t in enumerate(tensors):
                if tuple(t.shape) != five:
                    raise AssertionError(
                        f"fake flexkv: kv_caches[{i}] shape "
                        f"{tuple(t.shape)} != {five}"
                    )
            return [t[kv].view(slots, *per_slot) for t in tensors for kv in range(layout.kv_dim)]
        raise AssertionError(
            f"fake flexkv: expected {layout.num_layer * layout.kv_dim} tensors of shape "
            f"{(slots, *per_slot)} or {layout.num_layer} of shape {five}, got "
            f"{[tuple(t.shape) for t in tensors]}"
        )

    def _num_gpu_slots(self) -> int:
        return min(r.layout.num_block * r.layout.tokens_per_block
                   for r in self.registrations.values())

    # -- index ------------------------------------------------------------------

    def _hashes(self, token_ids: np.ndarray, n_blocks: int,
                namespace: list[str] | None) -> list[int]:
        tpb = self.tokens_per_block
        out: list[int] = []
        prev = hash(tuple(namespace or ()))
        for b in range(n_blocks):
            prev = hash((prev, token_ids[b * tpb:(b + 1) * tpb].tobytes()))
            out.append(prev)
        return out

    def _evict_for(self, needed: int) -> int:
        """Free space for ``needed`` new blocks; returns how many fit."""
        capacity = self.cache_config.num_cpu_blocks
        for h in list(self._index):
            if len(self._index) + needed <= capacity:
                break
            blk = self._index[h]
            if blk.ready and blk.locks == 0:
                del self._index[h]
                self._data.pop(h, None)
        return max(0, min(needed, capacity - len(self._index)))

    # -- matching ---------------------------------------------------------------

    def _check_match_args(self, what: str, token_ids: Any, token_mask: Any,
                          namespace: Any) -> tuple[np.ndarray, np.ndarray]:
        self._require_running(what)
        ids = check_token_ids(token_ids)
        mask = check_token_mask(token_mask, len(ids))
        check_namespace(namespace)
        aligned = len(ids) // self.tokens_per_block * self.tokens_per_block
        if mask is None:
            mask = np.ones(len(ids), dtype=np.bool_)
        mask[aligned:] = False  # FlexKV writes into the caller's array
        return ids, mask

    def get_match(self, token_ids: Any, token_mask: Any = None, cpu_only: bool = False,
                  namespace: Any = None, swa_aware: bool = False) -> tuple[int, np.ndarray]:
        self._record("get_match", token_ids=token_ids, token_mask=token_mask, namespace=namespace)
        check_bool("cpu_only", cpu_only)
        check_bool("swa_aware", swa_aware)
        ids, mask = self._check_match_args("get_match()", token_ids, token_mask, namespace)
        self._advance()
        tpb = self.tokens_per_block
        n_blocks = len(ids) // tpb
        hashes = self._hashes(ids, n_blocks, namespace)
        hit = 0
        while hit < n_blocks and hashes[hit] in self._index and self._index[hashes[hit]].ready:
            hit += 1
        true_idx = np.flatnonzero(mask)
        start = int(true_idx[0]) // tpb if len(true_idx) else n_blocks
        last = int(true_idx[-1]) // tpb + 1 if len(true_idx) else 0
        end = min(hit, last)
        out = np.zeros(len(ids), dtype=np.bool_)
        tid = self._new_id()
        if end > start:
            out[start * tpb:end * tpb] = True
            span = hashes[start:end]
            for h in hashes[:end]:
                self._index.move_to_end(h)
            for h in span:
                self._index[h].locks += 1
            self._tasks[tid] = _Task(tid, "get", out.copy(), span, "unready")
        else:
            self._tasks[tid] = _Task(tid, "get", out.copy(), [], "completed")
        return tid, out

    def put_match(self, token_ids: Any, token_mask: Any = None,
                  namespace: Any = None) -> tuple[int, np.ndarray]:
        self._record("put_match", token_ids=token_ids, token_mask=token_mask, namespace=namespace)
        ids, mask = self._check_match_args("put_match()", token_ids, token_mask, namespace)
        self._advance()
        tpb = self.tokens_per_block
        true_idx = np.flatnonzero(mask)
        if len(true_idx) and int(true_idx[0]) // tpb != 0:
            raise AssertionError(
                f"fake flexkv: put_match token_mask must start in block 0 "
                f"(cache_engine.put asserts block_start_idx == 0); first True at {int(true_idx[0])}"
            )
        last = int(true_idx[-1]) // tpb + 1 if len(true_idx) else 0
        hashes = self._hashes(ids, last, namespace)
        cached = 0
        while cached < last and hashes[cached] in self._index:
            cached += 1
        fit = self._evict_for(last - cached)
        span = hashes[cached:cached + fit]
        out = np.zeros(len(ids), dtype=np.bool_)
        tid = self._new_id()
        if span:
            out[cached * tpb:(cached + fit) * tpb] = True
            for h in span:
                self._index[h] = _Block(ready=False, locks=1)
            self._tasks[tid] = _Task(tid, "put", out.copy(), span, "unready")
        else:
            self._tasks[tid] = _Task(tid, "put", out.copy(), [], "completed")
        return tid, out

    # -- launch -------------------------------------------------------------------

    def _check_slots(self, task: _Task, slots: np.ndarray, n_slots: int) -> None:
        tpb = self.tokens_per_block
        want = int(task.mask.sum())
        if slots.dtype != np.int64 or slots.ndim != 1:
            raise AssertionError(
                f"fake flexkv: slot mapping of task {task.task_id} must be 1-D int64, "
                f"got {slots.dtype} shape {slots.shape}"
            )
        if len(slots) != want:
            raise AssertionError(
                f"fake flexkv: slot mapping of task {task.task_id} has {len(slots)} slots "
                f"but its mask has {want} True tokens"
            )
        if len(slots) and (slots.min() < 0 or slots.max() >= n_slots):
            raise AssertionError(
                f"fake flexkv: slot mapping of task {task.task_id} has slots outside "
                f"[0, {n_slots}) registered GPU slots: min {slots.min()}, max {slots.max()}"
            )
        pages = slots.reshape(-1, tpb)
        starts = pages[:, 0]
        if np.any(starts % tpb) or np.any(pages != starts[:, None] + np.arange(tpb)):
            raise AssertionError(
                f"fake flexkv: slot mapping of task {task.task_id} is not made of whole GPU pages "
                f"of {tpb} slots; FlexKV reads only slot_mapping[::{tpb}] // {tpb} and would move "
                "the wrong KV"
            )
        if len(np.unique(starts)) != len(starts):
            raise AssertionError(
                "fake flexkv: slot mapping of task "
                f"{task.task_id} repeats a GPU page"
            )

    def launch(self, task_ids: Any, slot_mappings: Any, swa_slot_mappings: Any = None,
               as_batch: bool = False, layerwise_transfer: bool = False,
               counter_id: int = 0) -> list[int]:
        self._record("launch", task_ids=task_ids, slot_mappings=slot_mappings, as_batch=as_batch)
        self._require_running("launch()")
        ids = check_task_ids(task_ids)
        check_bool("as_batch", as_batch)
        check_bool("layerwise_transfer", layerwise_transfer)
        check_int("counter_id", counter_id)
        if swa_slot_mappings is not None:
            raise AssertionError("fake flexkv: swa_slot_mappings are not modelled; pass None")
        if not isinstance(slot_mappings, list):
            slot_mappings = [slot_mappings]
        slots = [as_cpu_numpy("slot_mapping", s) for s in slot_mappings]
        if len(slots) != len(ids):
            raise AssertionError(
                f"fake flexkv: {len(ids)} task ids but {len(slots)} slot mappings"
            )
        if len(set(ids)) != len(ids):
            raise AssertionError(f"fake flexkv: duplicate task ids in one launch: {ids}")
        if not self._ready():
            raise AssertionError(
                "fake flexkv: launch() before every GPU registered (is_ready() is False); "
                "the transfer would never run"
            )
        self._advance()
        n_slots = self._num_gpu_slots()
        tasks = []
        for tid, sm in zip(ids, slots, strict=True):
            task = self._tasks.get(tid)
            if task is None:
                raise AssertionError(f"fake flexkv: launch of unknown task id {tid}")
            if task.status != "unready":
                raise AssertionError(
                    f"fake flexkv: launch of task {tid} in state {task.status}; only matched, "
                    "un-launched tasks with a non-empty mask can be launched"
                )
            self._check_slots(task, sm, n_slots)
            tasks.append((task, sm.copy()))
        done_at = time.monotonic() + self.transfer_seconds
        for task, sm in tasks:
            task.slot_mapping = sm
            task.status = "running"
            task.done_at = done_at
            if self.fail_next_launches > 0:
                self.fail_next_launches -= 1
                task.will_fail = True
        kinds = {t.kind for t, _ in tasks}
        if as_batch and len(tasks) > 1 and len(kinds) == 1:
            batch_id = self._new_id()
            children = [t for t, _ in tasks]
            for t in children:
                del self._tasks[t.task_id]
            self._tasks[batch_id] = _Task(
                batch_id, "batch_" + kinds.pop(), np.zeros(0, dtype=np.bool_), [], "running",
                done_at=done_at, children=children)
            return [batch_id]
        return ids

    # -- completion -----------------------------------------------------------------

    def _finish(self, task: _Task) -> None:
        """Apply a due transfer: copy KV, publish or roll back blocks."""
        parts = task.children or [task]
        failed = task.will_fail or any(p.will_fail for p in parts)
        for part in parts:
            self._apply(part, failed)
        task.status = "failed" if failed else "completed"

    def _apply(self, task: _Task, failed: bool) -> None:
        tpb = self.tokens_per_block
        assert task.slot_mapping is not None
        for j, h in enumerate(task.hashes):
            blk = self._index.get(h)
            if blk is None:
                continue  # dropped by reset
            page = task.slot_mapping[j * tpb:(j + 1) * tpb]
            if task.kind == "put":
                if failed:
                    del self._index[h]
                    continue
                self._data[h] = {k: torch.stack([t[page] for t in r.planes]).clone()
                                 for k, r in self.registrations.items()}
                blk.ready = True
            elif not failed:
                for k, r in self.registrations.items():
                    stored = self._data.get(h, {}).get(k)
                    if stored is not None:
                        for i, t in enumerate(r.planes):
                            t[page] = stored[i]
            blk.locks -= 1

    def _advance(self) -> None:
        now = time.monotonic()
        for task in list(self._tasks.values()) + self._orphans:
            if task.status == "running" and task.done_at <= now:
                self._finish(task)
        self._orphans = [t for t in self._orphans if t.status == "running"]

    # -- wait / cancel ---------------------------------------------------------------

    def _response(self, tid: int) -> KVResponse:
        task = self._tasks.pop(tid)
        mask: np.ndarray | list[np.ndarray] = (
            [c.mask for c in task.children] if task.children else task.mask)
        return KVResponse(status=_TERMINAL[task.status], task_id=tid, return_mask=mask)

    def _wait_impl(self, ids: list[int], timeout: float,
                   only_finished: bool) -> dict[int, KVResponse]:
        deadline = time.monotonic() + timeout
        out: dict[int, KVResponse] = {}
        for tid in ids:
            while True:
                self._advance()
                task = self._tasks.get(tid)
                # As in FlexKV's _wait_impl, try_wait too answers NOTFOUND and UNREADY.
                if task is None:
                    out[tid] = KVResponse(KVResponseStatus.NOTFOUND, tid, None)
                    break
                if task.status == "unready":
                    out[tid] = KVResponse(KVResponseStatus.UNREADY, tid, None)
                    break
                if task.status in _TERMINAL:
                    out[tid] = self._response(tid)
                    break
                if only_finished:
                    break
                if timeout == 0.0 or time.monotonic() >= deadline:
                    out[tid] = KVResponse(KVResponseStatus.TIMEOUT, tid, None)
                    break
                time.sleep(min(0.001, max(0.0, deadline - time.monotonic())))
        return out

    def wait(self, task_ids: Any, timeout: float = 20.0,
             completely: bool = False) -> dict[int, KVResponse]:
        self._record("wait", task_ids=task_ids, timeout=timeout, completely=completely)
        self._require_running("wait()")
        ids = check_task_ids(task_ids)
        t = check_timeout(timeout)
        check_bool("completely", completely)
        return self._wait_impl(ids, t, only_finished=False)

    def try_wait(self, task_ids: Any) -> dict[int, KVResponse]:
        self._record("try_wait", task_ids=task_ids)
        self._require_running("try_wait()")
        return self._wait_impl(check_task_ids(task_ids), 0.0, only_finished=True)

    def cancel(self, task_ids: Any) -> None:
        self._record("cancel", task_ids=task_ids)
        self._require_running("cancel()")
        for tid in check_task_ids(task_ids):
            task = self._tasks.pop(tid, None)
            if task is None:
                continue
            if task.status == "unready":
                for h in task.hashes:
                    blk = self._index.get(h)
                    if blk is None:
                        continue
                    blk.locks -= 1
                    if task.kind == "put":
                        del self._index[h]
            elif task.status == "running":
                self._orphans.append(task)
