"""One SGLang rank of one PP stage, in its own process, driving the plugin's
connector the way SGLang 0.5.23's radix cache does.

:class:`SGLangCallSequence` mirrors the calls SGLang makes on its FlexKV
connector, and the checks SGLang makes on the answers, with a toy slot allocator
in place of SGLang's token pool (SGLang cannot run here):

* ``match`` - ``FlexKVRadixCache._mp_match_prefix``: the key cut to whole pages,
  ``token_mask = [False] * device_len + [True] * rest``, ``lookup_kv`` with the
  request's ``CacheRequestHandle``; a hit is remembered for the load.
* ``load`` - ``FlexKVRadixCache.init_load_back`` / ``_allocate_and_load``: no
  remembered hit -> ``release_pending`` and 0; else allocate ``host_hit_length``
  slots, ``retrieve_kv``, free them on 0; then the check of
  ``SchedulePolicy`` (``sglang/srt/managers/schedule_policy.py``): ``0 < loaded <
  promised`` is SGLang's ``RuntimeError``.
* ``store`` - ``FlexKVRadixCache.checkpoint`` of a finished request: the slots
  hold the request's KV (written here as prefill would), ``store_kv(handle,
  token_ids, kv_indices)``; a task id keeps the slots locked until
  ``check_completed_stores`` returns the handle (``tick``, as
  ``check_hicache_events`` every scheduler tick and ``evict``).
* ``abort`` - ``release_aborted_request``; ``flush`` - ``reset``.

Every stage writes its own content (a function of token, position, plane and
stage), so a load of another stage's layers or into the wrong slots fails the
bit-exact check.
"""

from __future__ import annotations

import json
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from node_agent.client import EngineClient, RankInfo, SharedKVBuffers
from node_agent.demo.workload import kv_values
from node_agent.engine_api.protocol import layout_to_wire, parse_layout
from node_agent.integrations.sglang.connector import AgentKVConnector
from node_agent.vocab.layout import KVLayout


@dataclass(frozen=True)
class Handle:
    """Stands in for SGLang's ``CacheRequestHandle(rid, attempt_id)`` (a frozen
    dataclass with those two fields)."""

    rid: str
    attempt_id: int


class SGLangCallSequence:
    """The radix-cache side of one rank: markers, slot locks, content checks."""

    def __init__(self, conn: AgentKVConnector, bufs: SharedKVBuffers, pp_rank: int,
                 num_slots: int) -> None:
        self.conn = conn
        self.planes = [t for g in bufs.tensors for t in g]
        self.pp_rank = pp_rank
        self.free = list(range(num_slots))
        self.markers: dict[Handle, tuple[np.ndarray, int, int]] = {}
        self.locked: dict[Handle, list[int]] = {}
        self.page = conn.page_size

    def _content(self, tokens: np.ndarray, plane: int, dtype: torch.dtype) -> torch.Tensor:
        return kv_values(tokens, 0, plane + 100 * self.pp_rank, dtype)

    def _alloc(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"toy allocator out of slots ({n} > {len(self.free)})")
        # Scattered, descending slots: a load into the wrong slots cannot pass.
        out, self.free = self.free[-n:][::-1], self.free[:-n]
        return out

    def _release_slots(self, slots: list[int]) -> None:
        self.free.extend(slots)

    def match(self, rid: str, tokens: list[int], device_len: int = 0,
              attempt: int = 0) -> dict[str, Any]:
        handle = Handle(rid, attempt)
        ids = np.asarray(tokens, dtype=np.int64)
        ids = ids[: (len(ids) // self.page) * self.page]
        if device_len >= len(ids):
            return {"task": -1, "hit": 0}
        mask = np.zeros(len(ids), dtype=bool)
        mask[device_len:] = True
        task, hit = self.conn.lookup_kv(ids.tolist(), torch.from_numpy(mask), handle)
        if hit > 0:
            self.markers[handle] = (ids.copy(), device_len, hit)
        return {"task": task, "hit": hit}

    def load(self, rid: str, promised: int | None = None, attempt: int = 0) -> dict[str, Any]:
        handle = Handle(rid, attempt)
        marker = self.markers.pop(handle, None)
        if marker is None:
            self.conn.release_pending(handle)
            return {"loaded": 0, "promised": 0, "exact": None, "runtime_error": False}
        ids, device_len, hit = marker  # host_hit_length = hit
        n = hit if promised is None else int(promised)
        slots = self._alloc(n)
        loaded = self.conn.retrieve_kv(handle, torch.tensor(slots, dtype=torch.int64))
        exact = None
        if loaded == n and n > 0:
            exact = True
            idx = torch.tensor(slots, dtype=torch.int64)
            for p, t in enumerate(self.planes):
                want_kv = self._content(ids, p, t.dtype)[device_len:device_len + n]
                got = t.view(t.shape[0], -1)[idx]
                if not torch.equal(got, want_kv.view(-1, 1).expand_as(got)):
                    exact = False
        self._release_slots(slots)
        return {"loaded": loaded, "promised": n, "exact": exact,
                "runtime_error": 0 < loaded < hit}

    def store(self, rid: str, tokens: list[int], attempt: int = 0) -> dict[str, Any]:
        handle = Handle(rid, attempt)
        ids = np.asarray(tokens, dtype=np.int64)
        slots = self._alloc(len(ids))
        idx = torch.tensor(slots, dtype=torch.int64)
        for p, t in enumerate(self.planes):
            t.view(t.shape[0], -1)[idx] = self._content(ids, p, t.dtype).view(-1, 1)
        task = self.conn.store_kv(handle, list(tokens), idx)
        if task >= 0:
            self.locked[handle] = slots
        else:
            self._release_slots(slots)
        return {"task": task}

    def store_bad(self, tokens: list[int], indices: list[int]) -> dict[str, Any]:
        try:
            self.conn.store_kv(Handle("bad", 0), tokens, torch.tensor(indices))
        except ValueError as exc:
            return {"error": str(exc)}
        return {"error": None}

    def tick(self) -> dict[str, Any]:
        done = self.conn.check_completed_stores()
        for h in done:
            self._release_slots(self.locked.pop(h, []))
        return {"completed": sorted(f"{h.rid}:{h.attempt_id}" for h in done)}

    def wait_stores(self, within: float) -> dict[str, Any]:
        deadline = time.monotonic() + within
        done: list[str] = []
        while self.locked and time.monotonic() < deadline:
            done += self.tick()["completed"]
            if self.locked:
                time.sleep(0.02)
        return {"completed": sorted(done), "locked": sorted(h.rid for h in self.locked)}

    def abort(self, rid: str, attempt: int = 0) -> dict[str, Any]:
        handle = Handle(rid, attempt)
        self.markers.pop(handle, None)
        self.conn.release_pending(handle)
        return {}

    def flush(self) -> dict[str, Any]:
        done = self.conn.reset()
        for h in done:
            self._release_slots(self.locked.pop(h, []))
        self.markers.clear()
        return {"inflight": self.conn.stores_in_flight(), "locked": len(self.locked)}

    def status(self) -> dict[str, Any]:
        return {"connected": self.conn.connected, "inflight": self.conn.stores_in_flight(),
                "free": len(self.free)}


def stage_main(socket: str, replica: str, pp_rank: int, pp_size: int, layout_wire: str,
               num_slots: int, timeouts: dict[str, float], pipe: Connection) -> None:
    """Register with the agent, then serve ``(op, args)`` commands from ``pipe``;
    every answer is ``("ok", result | None, seconds)`` or ``("err", text, seconds)``."""
    layout: KVLayout = parse_layout(json.loads(layout_wire))
    bufs = SharedKVBuffers.for_layout(layout, num_slots)
    client = EngineClient(socket, RankInfo(replica=replica, pp_rank=pp_rank, pp_size=pp_size),
                          timeout=timeouts["client"])
    conn = AgentKVConnector(client, layout, bufs.handles, page_size=layout.tokens_per_block,
                            retry_seconds=timeouts["retry"],
                            orphan_store_seconds=timeouts["orphan"])
    seq = SGLangCallSequence(conn, bufs, pp_rank, num_slots)
    try:
        pipe.send(("ok", conn.connect(), 0.0))
        while True:
            try:
                op, args = pipe.recv()
            except EOFError:
                return
            if op == "exit":
                return
            started = time.monotonic()
            try:
                result = getattr(seq, op)(**args)
                pipe.send(("ok", result, time.monotonic() - started))
            except Exception:
                pipe.send(("err", traceback.format_exc(), time.monotonic() - started))
    finally:
        conn.shutdown()
        bufs.close()


def layout_json(layout: KVLayout) -> str:
    return json.dumps(layout_to_wire(layout))
