"""A random workload (hypothesis, stateful) never exceeds capacity, loses or duplicates a
block, leaves an orphan, or loads bytes other than the ones stored."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from node_agent.backend.base import KVResponseStatus
from node_agent.backend.embedded import EmbeddedBackend
from node_agent.backend.hashing import BlockHasher
from node_agent.backend.planes import register_buffers
from node_agent.vocab.placement import Tier
from tests.backend.backend_helpers import TPB, config, small_layout

LAYOUT = small_layout()
PROMPTS = 6
MAX_BLOCKS = 6
REGION = MAX_BLOCKS * TPB
SCRATCH = PROMPTS * REGION
SLOTS = SCRATCH + REGION


def _prompts() -> list[np.ndarray]:
    """Prompts sharing prefixes (a small radix tree) of 2..6 blocks."""
    rng = np.random.default_rng(3)
    base = rng.integers(0, 1000, MAX_BLOCKS * TPB, dtype=np.int64)
    out = []
    for i in range(PROMPTS):
        shared = int(rng.integers(0, 4)) * TPB
        n = int(rng.integers(2, MAX_BLOCKS + 1)) * TPB
        own = rng.integers(0, 1000, n, dtype=np.int64) + 1000 * (i + 1)
        p = np.concatenate([base[:shared], own])[:n]
        out.append(p)
    return out


class Workload(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.tmp = tempfile.TemporaryDirectory()
        cfg = config(LAYOUT, cpu_blocks=6, ssd_blocks=5, ssd_dir=Path(self.tmp.name),
                     high_watermark=0.9, low_watermark=0.6, unlaunched_match_seconds=10.0)
        self.b = EmbeddedBackend(cfg, clock=lambda: self.now)
        self.b.start()
        self.bufs = [[torch.zeros(SLOTS, LAYOUT.heads_per_rank, LAYOUT.head_size,
                                  dtype=torch.bfloat16) for _ in range(LAYOUT.num_layers)]
                     for _ in range(2)]
        self.b.register_kv_buffers(0, self.bufs)
        self.planes = register_buffers(LAYOUT, 0, self.bufs).planes
        self.prompts = _prompts()
        hasher = BlockHasher(TPB)
        self.hashes = [hasher.hashes(p) for p in self.prompts]
        for i, hs in enumerate(self.hashes):  # the KV of a block is a function of its prefix
            for blk, h in enumerate(hs):
                g = torch.Generator().manual_seed(h % (2**31))
                rows = slice(i * REGION + blk * TPB, i * REGION + (blk + 1) * TPB)
                for plane in self.planes:
                    plane[rows] = torch.randn(TPB, plane.shape[1], generator=g).to(plane.dtype)
        self.reference = [plane.clone() for plane in self.planes]
        self.dangling: list[int] = []

    def teardown(self) -> None:
        self.b.shutdown()
        self.tmp.cleanup()

    def _src(self, i: int, mask: np.ndarray) -> np.ndarray:
        return np.arange(i * REGION, i * REGION + len(mask), dtype=np.int64)[mask]

    @rule(i=st.integers(0, PROMPTS - 1), launch=st.booleans())
    def put(self, i: int, launch: bool) -> None:
        tid, mask = self.b.put_match(self.prompts[i])
        if tid < 0:
            return
        if not launch:
            self.b.cancel([tid])
            return
        [w] = self.b.launch([tid], [self._src(i, mask)])
        assert self.b.wait([w], timeout=10)[w].status is KVResponseStatus.SUCCESS

    @rule(i=st.integers(0, PROMPTS - 1))
    def get(self, i: int) -> None:
        tid, mask = self.b.get_match(self.prompts[i])
        if tid < 0:
            return
        n = int(mask.sum())
        assert mask[:n].all()  # the loadable span is the prefix
        dst = np.arange(SCRATCH, SCRATCH + n, dtype=np.int64)
        [w] = self.b.launch([tid], [dst])
        assert self.b.wait([w], timeout=10)[w].status is KVResponseStatus.SUCCESS
        src = torch.as_tensor(self._src(i, mask))
        for plane, ref in zip(self.planes, self.reference, strict=True):
            assert plane[SCRATCH : SCRATCH + n].view(torch.uint8).equal(
                ref.index_select(0, src).view(torch.uint8))

    @rule(i=st.integers(0, PROMPTS - 1), put=st.booleans())
    def match_and_abandon(self, i: int, put: bool) -> None:
        tid, _ = (self.b.put_match if put else self.b.get_match)(self.prompts[i])
        if tid > 0:
            self.dangling.append(tid)

    @precondition(lambda self: self.dangling)
    @rule()
    def expire(self) -> None:
        self.now += 11.0
        for tid in self.dangling:
            assert self.b.wait([tid], timeout=1)[tid].status is KVResponseStatus.CANCELLED
        self.dangling.clear()

    @invariant()
    def tiers_consistent(self) -> None:
        index = self.b._index
        assert index is not None
        index.check_consistency()  # capacity, no block lost or duplicated, no orphan
        for tier in (Tier.CPU, Tier.SSD):
            assert index.used(tier) <= index.capacity[tier]


Workload.TestCase.settings = settings(
    max_examples=25, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestWorkload = Workload.TestCase
