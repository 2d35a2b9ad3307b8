"""One TP rank of a one-stage SGLang replica, in its own process: a real gloo
group (torch.distributed on loopback) stands in for SGLang's TP CPU group, whose
``broadcast_object`` the plugin uses in SGLang (``GroupCoordinator``,
sglang/srt/distributed/parallel_state.py: ``broadcast_object_list`` on the
group's gloo ``cpu_group``)."""

from __future__ import annotations

import json
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from node_agent.client import EngineClient, RankInfo, SharedKVBuffers
from node_agent.demo.workload import kv_values
from node_agent.engine_api.protocol import parse_layout
from node_agent.integrations.sglang.connector import AgentKVConnector
from tests.sglang.stage import Handle


def _broadcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def tp_main(socket: str, layout_wire: str, tp_rank: int, tp_size: int, port: int,
            pipe: Connection) -> None:
    """Run the scenario of tests/sglang/test_tensor_parallel.py on this rank; send
    ``("ok", report)`` or ``("err", traceback)``."""
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=tp_rank, world_size=tp_size)
        layout = parse_layout(json.loads(layout_wire))
        bufs = SharedKVBuffers.for_layout(layout, 256)
        client = EngineClient(socket, RankInfo(replica="tp-0", tp_rank=tp_rank,
                                               tp_size=tp_size), timeout=10)
        conn = AgentKVConnector(client, layout, bufs.handles, page_size=layout.tokens_per_block,
                                tp_rank=tp_rank, tp_size=tp_size, tp_broadcast=_broadcast)
        report: dict[str, Any] = {"connected": conn.connect()}
        planes = [t for g in bufs.tensors for t in g]
        tokens = np.arange(3000, 3032, dtype=np.int64)
        src = torch.arange(32)
        for p, t in enumerate(planes):  # each rank holds its own heads' KV
            t.view(t.shape[0], -1)[src] = kv_values(tokens, 0, p + 100 * tp_rank,
                                                     t.dtype).view(-1, 1)
        # Every rank registered and wrote its KV before rank 0's store reads it: in
        # SGLang the forward pass's TP all-reduce orders each rank's KV writes before
        # the scheduler's store_kv; here this collective stands in for it.
        _broadcast(None)
        report["task"] = conn.store_kv(Handle("tp-store", 0), tokens.tolist(), src)
        done: list[str] = []
        for _ in range(2000):  # same count on every rank: rank 0's answers decide
            done += [h.rid for h in conn.check_completed_stores()]
            if conn.stores_in_flight() == 0:
                break
            time.sleep(0.01)
        report["completed"] = done
        report["lookup"] = list(conn.lookup_kv(tokens, None, Handle("tp-load", 0)))
        dst = torch.arange(128, 160)
        report["loaded"] = conn.retrieve_kv(Handle("tp-load", 0), dst)
        report["exact"] = all(
            torch.equal(t.view(t.shape[0], -1)[dst],
                        kv_values(tokens, 0, p + 100 * tp_rank, t.dtype).view(-1, 1)
                        .expand(-1, t[0].numel()))
            for p, t in enumerate(planes))
        try:
            conn.store_kv(Handle("tp-bad", 0), [1, 2, 3], torch.arange(2))
        except ValueError as exc:
            report["length_error"] = str(exc)
        report["miss"] = list(conn.lookup_kv(np.arange(9000, 9016), None, Handle("tp-m", 0)))
        conn.shutdown()
        bufs.close()
        dist.destroy_process_group()
        pipe.send(("ok", report))
    except Exception:
        pipe.send(("err", traceback.format_exc()))
