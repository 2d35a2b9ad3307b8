"""In-process stages with a remote tier over a test's real ``mooncake_master``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from node_agent.backend.base import KVResponseStatus
from node_agent.backend.config import EmbeddedBackendConfig
from node_agent.backend.embedded import EmbeddedBackend
from node_agent.backend.remote.keys import KeySpace
from node_agent.backend.remote.objects import HEADER_BYTES
from node_agent.backend.remote.settings import RemoteSettings
from node_agent.backend.remote.tier import RemotePool, RemoteTier
from node_agent.backend.stage_store import TierStore
from node_agent.metrics import AgentMetrics
from node_agent.vocab.layout import KVDtype, KVLayout
from tests.remote.master import Master
from tests.support.ports import free_port

TPB = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=8, dtype=KVDtype.FLOAT16,
                  tokens_per_block=TPB)
NUM_SLOTS = 256


@dataclass
class Node:
    """One agent's Mooncake client and the stages (backends or stores) on it."""

    pool: RemotePool
    metrics: AgentMetrics
    closers: list[object] = field(default_factory=list)

    def close(self) -> None:
        for c in self.closers:
            c.shutdown() if isinstance(c, EmbeddedBackend) else c.close()  # type: ignore[attr-defined]
        self.pool.close()


def node(master: Master, staging_blocks: int = 64, timeout: float = 5.0,
         write_policy: str = "store", layout: KVLayout = LAYOUT) -> Node:
    metrics = AgentMetrics()
    settings = RemoteSettings(
        master_address=master.address, metadata_server=master.metadata,
        local_hostname=f"127.0.0.1:{free_port()}", segment_bytes=32 << 20,
        staging_bytes=2 * staging_blocks * (layout.bytes_per_block + HEADER_BYTES),
        write_policy=write_policy, queue_blocks=256, timeout_seconds=timeout)
    pool = RemotePool(settings, metrics, retry_seconds=0.2)
    pool.start()
    assert pool.health.up, pool.health.reason
    return Node(pool, metrics)


def buffers(layout: KVLayout = LAYOUT) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    shape = (NUM_SLOTS, layout.heads_per_rank, layout.head_size)
    dt = layout.dtype.torch_dtype
    return ([torch.zeros(shape, dtype=dt) for _ in range(layout.num_layers)],
            [torch.zeros(shape, dtype=dt) for _ in range(layout.num_layers)])


def backend(n: Node, layout: KVLayout = LAYOUT, namespace: str = "ns1", pool: str = "tp",
            epoch: int = 0, pp_rank: int = 0, pp_size: int = 1, deferred: bool = False,
            cpu_blocks: int = 128, key_epoch: Callable[[], int] | None = None,
            ssd_blocks: int = 0, ssd_path: str | None = None,
            ) -> tuple[EmbeddedBackend, tuple[list[torch.Tensor], ...]]:
    """A started backend whose remote tier is on node ``n``, with registered buffers.
    ``key_epoch`` (as the agent passes its own) makes the keys follow that epoch;
    ``ssd_blocks`` and ``ssd_path`` add an SSD tier."""
    tier = RemoteTier(n.pool, KeySpace(layout, pp_rank, pp_size, namespace, pool, epoch),
                      epoch=key_epoch)
    b = EmbeddedBackend(EmbeddedBackendConfig(layout=layout,
                                              cpu_bytes=cpu_blocks * layout.bytes_per_block,
                                              ssd_bytes=ssd_blocks * layout.bytes_per_block,
                                              ssd_paths=(ssd_path,) if ssd_path else (),
                                              pinned=False, deferred_visibility=deferred),
                        metrics=n.metrics, remote=tier)
    b.start()
    bufs = buffers(layout)
    b.register_kv_buffers(0, bufs)
    n.closers.append(b)
    return b, bufs


Buffers = tuple[list[torch.Tensor], ...]


def follower(n: Node, layout: KVLayout, pp_rank: int, pp_size: int,
             namespace: str = "ns1", pool: str = "tp") -> tuple[TierStore, Buffers]:
    tier = RemoteTier(n.pool, KeySpace(layout, pp_rank, pp_size, namespace, pool, 0))
    s = TierStore(EmbeddedBackendConfig(layout=layout, cpu_bytes=128 * layout.bytes_per_block,
                                        pinned=False), tier)
    bufs = buffers(layout)
    s.register_kv_buffers(0, bufs)
    n.closers.append(s)
    return s, bufs


def fill(bufs: tuple[list[torch.Tensor], ...], slots: np.ndarray, seed: int) -> None:
    """Random bit patterns (any float16 value, NaN payloads included) at ``slots``."""
    g = torch.Generator().manual_seed(seed)
    for plane in (t for group in bufs for t in group):
        raw = torch.randint(-32768, 32767, (len(slots), *plane.shape[1:]), generator=g,
                            dtype=torch.int16)
        plane.view(torch.int16)[torch.from_numpy(slots)] = raw


def rows(bufs: tuple[list[torch.Tensor], ...], slots: np.ndarray) -> list[torch.Tensor]:
    """The raw bits at ``slots`` of every plane."""
    idx = torch.from_numpy(slots)
    return [t.view(torch.int16)[idx].clone() for group in bufs for t in group]


def store(b: EmbeddedBackend, tokens: np.ndarray, slots: np.ndarray) -> None:
    tid, mask = b.put_match(tokens)
    assert tid >= 0, "nothing to store"
    [tid] = b.launch([tid], [slots[mask]])
    assert b.wait([tid], timeout=20)[tid].status is KVResponseStatus.SUCCESS


def write_through(b: EmbeddedBackend, bufs: tuple[list[torch.Tensor], ...], tokens: np.ndarray,
                  slots: np.ndarray, seed: int) -> RemoteTier:
    """:func:`fill` ``slots`` (pattern ``seed``), :func:`store` ``tokens`` from them and
    wait until ``b``'s remote tier wrote every block it was offered; returns that tier."""
    fill(bufs, slots, seed)
    store(b, tokens, slots)
    assert b.remote is not None and b.remote.drain(30)
    return b.remote


def load(b: EmbeddedBackend, tokens: np.ndarray, slots: np.ndarray) -> int:
    """get_match + launch into ``slots``; returns the tokens loaded (0 on a miss)."""
    tid, mask = b.get_match(tokens)
    if tid < 0:
        return 0
    hit = int(mask.sum())
    [tid] = b.launch([tid], [slots[:hit]])
    assert b.wait([tid], timeout=20)[tid].status is KVResponseStatus.SUCCESS
    return hit
