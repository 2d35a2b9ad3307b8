"""Several threads storing and loading through tiny tiers (eviction and SSD spills all the
time): every load returns exactly the bytes stored for its prefix, and the tiers stay
consistent."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import torch

from node_agent.backend.base import KVResponseStatus
from node_agent.backend.embedded import EmbeddedBackend
from node_agent.backend.hashing import BlockHasher
from node_agent.backend.planes import register_buffers
from node_agent.vocab.placement import Tier
from tests.backend.backend_helpers import TPB, config, small_layout

THREADS = 4
ROUNDS = 12
REGION = 8 * TPB  # slots per thread for sources, and as many for loads


def test_threads_with_eviction_and_spills_stay_bit_exact(tmp_path: Path) -> None:
    layout = small_layout()
    b = EmbeddedBackend(config(layout, cpu_blocks=6, ssd_blocks=6, ssd_dir=tmp_path,
                               high_watermark=0.9, low_watermark=0.5, worker_threads=3))
    b.start()
    slots = 2 * REGION * THREADS
    bufs = [[torch.zeros(slots, layout.heads_per_rank, layout.head_size, dtype=torch.bfloat16)
             for _ in range(layout.num_layers)] for _ in range(2)]
    b.register_kv_buffers(0, bufs)
    planes = register_buffers(layout, 0, bufs).planes
    hasher = BlockHasher(TPB)
    rng = np.random.default_rng(0)
    base = rng.integers(0, 500, 8 * TPB, dtype=np.int64)
    prompts = [np.concatenate([base[: int(rng.integers(0, 4)) * TPB],
                               rng.integers(0, 500, 4 * TPB, dtype=np.int64) + 1000 * k])
               for k in range(10)]

    def expected(block_hash: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(block_hash % (2**31))
        return [torch.randn(TPB, p.shape[1], generator=g).to(p.dtype) for p in planes]

    errors: list[BaseException] = []

    def worker(k: int) -> None:
        own = np.random.default_rng(100 + k)
        src_lo, dst_lo = 2 * REGION * k, 2 * REGION * k + REGION
        try:
            for _ in range(ROUNDS):
                toks = prompts[int(own.integers(len(prompts)))]
                hashes = hasher.hashes(toks)
                for blk, h in enumerate(hashes):  # this thread's source slots hold the KV
                    rows = slice(src_lo + blk * TPB, src_lo + (blk + 1) * TPB)
                    for plane, data in zip(planes, expected(h), strict=True):
                        plane[rows] = data
                tid, mask = b.put_match(toks)
                if tid > 0:
                    src = np.arange(src_lo, src_lo + len(toks), dtype=np.int64)[mask]
                    [w] = b.launch([tid], [src])
                    assert b.wait([w], timeout=20)[w].status is KVResponseStatus.SUCCESS
                tid, mask = b.get_match(toks)
                if tid < 0:
                    continue
                n = int(mask.sum())
                [w] = b.launch([tid], [np.arange(dst_lo, dst_lo + n, dtype=np.int64)])
                assert b.wait([w], timeout=20)[w].status is KVResponseStatus.SUCCESS
                for blk in range(n // TPB):
                    rows = slice(dst_lo + blk * TPB, dst_lo + (blk + 1) * TPB)
                    for plane, data in zip(planes, expected(hashes[blk]), strict=True):
                        assert plane[rows].view(torch.uint8).equal(data.view(torch.uint8))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    try:
        assert not any(t.is_alive() for t in threads)
        assert not errors, errors
        st = b.stats()
        assert st.tiers["cpu"].evictions > 0  # the workload did evict
        index = b._index
        assert index is not None
        index.check_consistency()
        assert all(index.used(t) <= index.capacity[t] for t in (Tier.CPU, Tier.SSD))
        assert index.locked() == 0  # every task released its pins
    finally:
        b.shutdown()
