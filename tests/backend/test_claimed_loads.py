"""Engine-side loads at the backend: an ``EmbeddedBackend`` whose CPU tier lives in a
shared-memory segment hands an un-launched get to the engine (``claim_rows``), the
engine copies the blocks from a read-only mapping of the segment with the agent's
``BlockCopier``, and ``end_claim`` answers whether the blocks stayed pinned
throughout. Whatever ends a claim first (its lease, a reset, a cancel, the stage
leaving, a shutdown) makes ``end_claim`` answer False; the segment is removed by
``close`` and by a sweep of its prefix; a tier that cannot get a segment falls back
to private memory and hands out no claims."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from node_agent.backend.base import KVResponseStatus, TaskNotFoundError
from node_agent.backend.cpu_tier import (
    SHM_DIR,
    CpuTier,
    map_shared_tier,
    next_segment_name,
    segment_prefix,
    sweep_segments,
)
from node_agent.backend.embedded import EmbeddedBackend
from node_agent.backend.planes import register_buffers
from node_agent.backend.shared import Fingerprint, SharedBackends, SharedStageBackend
from node_agent.backend.transfer import BlockCopier
from node_agent.vocab.placement import BlockLocation, Tier, block_locations
from tests.backend.backend_helpers import (
    TPB,
    config,
    make_buffers,
    small_layout,
    store,
    token_rows,
    tokens,
)

pytestmark = pytest.mark.timeout(120)

LAYOUT = small_layout()
SLOTS = 256
S = KVResponseStatus


@pytest.fixture
def prefix(tmp_path: Path) -> Iterator[str]:
    """A segment prefix of this test's own (as an agent on a socket in tmp_path
    would have); every segment under it is removed afterwards."""
    p = segment_prefix(str(tmp_path / "engine.sock"))
    yield p
    sweep_segments(p)


@pytest.fixture
def shm_name(prefix: str) -> str:
    return next_segment_name(prefix)


def backend_on(name: str | None, cpu_blocks: int = 16,
               clock: Callable[[], float] = time.monotonic,
               **kw: Any) -> tuple[EmbeddedBackend, list[list[torch.Tensor]]]:
    """A started backend with a shared CPU tier named ``name`` and its engine buffers."""
    b = EmbeddedBackend(config(LAYOUT, cpu_blocks, cpu_shared_name=name, **kw), clock=clock)
    b.start()
    bufs = make_buffers(LAYOUT, SLOTS, 1)
    b.register_kv_buffers(0, bufs)
    return b, bufs


def seg_path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def locked(b: EmbeddedBackend) -> int:
    index = b._index
    assert index is not None
    return index.locked()


def engine_copy(b: EmbeddedBackend, blocks: Sequence[int], dst: np.ndarray,
                hook: Callable[[threading.Event | None], None] | None = None,
                ) -> list[list[torch.Tensor]]:
    """What an engine does with a claim: map the backend's tier read-only and copy
    ``blocks`` into ``dst`` of fresh (random) engine buffers of its own."""
    mapped = map_shared_tier(LAYOUT, b.tier_handle())
    try:
        ebufs = make_buffers(LAYOUT, SLOTS, 99)
        copier = BlockCopier(LAYOUT, mapped.tier, None)
        copier.checkpoint_hook = hook
        copier.load({0: register_buffers(LAYOUT, 0, ebufs)},
                    block_locations(Tier.CPU, list(blocks)),
                    torch.as_tensor(dst, dtype=torch.int64))
    finally:
        mapped.close()
    return ebufs


def same(bufs_a: list[list[torch.Tensor]], slots_a: np.ndarray,
         bufs_b: list[list[torch.Tensor]], slots_b: np.ndarray) -> bool:
    return all(x.equal(y) for x, y in zip(token_rows(LAYOUT, bufs_a, slots_a),
                                          token_rows(LAYOUT, bufs_b, slots_b), strict=True))


def fill(b: EmbeddedBackend, prompts: int, blocks_each: int, seed: int) -> int:
    """Store ``prompts`` other prompts, from slots (128...) whose KV differs from
    every prompt the tests claim; returns the blocks they stored."""
    stored = 0
    for i in range(prompts):
        mask = store(b, tokens(blocks_each * TPB, seed=seed + i),
                     np.arange(128, 128 + blocks_each * TPB, dtype=np.int64))
        stored += int(mask.sum()) // TPB
    return stored


def test_a_claim_copies_the_stored_bytes_bit_for_bit_and_unlocks_after(shm_name: str) -> None:
    b, bufs = backend_on(shm_name, cpu_blocks=16)
    try:
        assert os.path.exists(seg_path(shm_name))
        handle = b.tier_handle()
        assert handle is not None and handle["name"] == shm_name
        toks = tokens(6 * TPB)
        src = np.arange(6 * TPB, dtype=np.int64)
        # The prompt's blocks are not consecutive: its first two blocks were stored
        # before another prompt took the next ones.
        store(b, toks[: 2 * TPB], src[: 2 * TPB])
        fill(b, 1, 3, seed=50)
        store(b, toks, src)
        tid, mask = b.get_match(toks)
        assert mask.all()
        blocks = b.claim_rows(tid, lease=60.0)
        assert blocks is not None and len(blocks) == 6
        assert blocks != list(range(blocks[0], blocks[0] + 6))  # not one run
        assert locked(b) == 6
        # Each claimed block is the stored block of that position (token order).
        mapped = map_shared_tier(LAYOUT, handle)
        try:
            for blk in blocks:
                assert mapped.tier.read_block(blk) == b.store.read_block(
                    BlockLocation(Tier.CPU, blk))
        finally:
            mapped.close()
        dst = np.arange(100, 100 + 6 * TPB, dtype=np.int64)
        ebufs = engine_copy(b, blocks, dst)
        assert same(bufs, src, ebufs, dst)
        assert b.end_claim(tid) is True
        assert locked(b) == 0
        # Forgotten: a second end_claim has nothing to end, a launch nothing to run.
        assert b.end_claim(tid) is False
        with pytest.raises(TaskNotFoundError):
            b.launch([tid], [dst])
    finally:
        b.shutdown()


PROMPT = tokens(4 * TPB)
SRC = np.arange(4 * TPB, dtype=np.int64)


def claim_prompt(b: EmbeddedBackend, lease: float) -> tuple[int, list[int]]:
    """Store PROMPT's KV from SRC, match it and claim it: (task id, its blocks)."""
    store(b, PROMPT, SRC)
    tid, _ = b.get_match(PROMPT)
    blocks = b.claim_rows(tid, lease=lease)
    assert blocks is not None and len(blocks) == 4
    return tid, blocks


def cpu_bytes(b: EmbeddedBackend, blocks: Sequence[int]) -> list[bytes]:
    return [b.store.read_block(BlockLocation(Tier.CPU, k)) for k in blocks]


def test_claimed_blocks_survive_a_tier_filled_past_its_watermark(shm_name: str) -> None:
    b, bufs = backend_on(shm_name, cpu_blocks=8)
    try:
        tid, blocks = claim_prompt(b, lease=60.0)
        before = cpu_bytes(b, blocks)
        # Three times the free room in other prompts: every unclaimed block is
        # evicted and rewritten, again and again.
        assert fill(b, 6, 2, seed=100) >= 8
        assert cpu_bytes(b, blocks) == before
        dst = np.arange(200, 200 + 4 * TPB, dtype=np.int64)
        ebufs = engine_copy(b, blocks, dst)
        assert b.end_claim(tid) is True
        assert same(bufs, SRC, ebufs, dst)
    finally:
        b.shutdown()


def test_an_expired_lease_ends_the_claim_and_frees_its_blocks(shm_name: str) -> None:
    now = [0.0]
    b, _ = backend_on(shm_name, cpu_blocks=4, clock=lambda: now[0])
    try:
        tid, blocks = claim_prompt(b, lease=5.0)
        before = cpu_bytes(b, blocks)
        assert b.put_match(tokens(4 * TPB, seed=7))[0] == -1  # all 4 pinned by the claim
        now[0] = 5.0
        # The full tier takes another prompt now: the claim no longer pins anything.
        assert fill(b, 1, 4, seed=7) == 4
        assert locked(b) == 0
        assert b.get_match(PROMPT)[0] == -1
        assert cpu_bytes(b, blocks) != before
        assert b.end_claim(tid) is False
    finally:
        b.shutdown()


def test_a_lease_ending_while_the_engine_copy_is_paused_answers_false(shm_name: str) -> None:
    """The engine's copy is paused mid-way; meanwhile the lease ends and another
    store rewrites the claimed blocks. The copy then completes, but end_claim must
    say False: its slots may hold the other prompt's bytes."""
    now = [0.0]
    b, bufs = backend_on(shm_name, cpu_blocks=4, clock=lambda: now[0])
    try:
        tid, blocks = claim_prompt(b, lease=5.0)
        paused, resume = threading.Event(), threading.Event()
        seen = [0]

        def hook(abort: threading.Event | None) -> None:
            seen[0] += 1
            if seen[0] == 2:  # after the first plane was copied
                paused.set()
                assert resume.wait(30)

        dst = np.arange(64, 64 + 4 * TPB, dtype=np.int64)
        out: list[list[list[torch.Tensor]]] = []
        th = threading.Thread(target=lambda: out.append(engine_copy(b, blocks, dst, hook)))
        th.start()
        try:
            assert paused.wait(30)
            now[0] = 10.0
            assert fill(b, 1, 4, seed=9) == 4  # reuses the claimed blocks
        finally:
            resume.set()
            th.join(30)
        assert out, "the engine copy did not finish"
        assert b.end_claim(tid) is False
        # What it copied is not (all) the stored KV: reporting it loaded would be wrong.
        assert not same(bufs, SRC, out[0], dst)
    finally:
        b.shutdown()


def _claimed(b: EmbeddedBackend, toks: np.ndarray) -> int:
    tid, _ = b.get_match(toks)
    assert b.claim_rows(tid, lease=60.0) is not None
    assert locked(b) > 0
    return tid


@pytest.mark.parametrize("how", ["reset", "cancel", "shutdown"])
def test_reset_cancel_and_shutdown_end_a_claim(shm_name: str, how: str) -> None:
    b, _ = backend_on(shm_name)
    try:
        tid, _ = claim_prompt(b, lease=60.0)
        if how == "reset":
            b.reset()
        elif how == "cancel":
            b.cancel([tid])
        else:
            b.shutdown()
            assert not os.path.exists(seg_path(shm_name))  # shutdown unlinks the tier
        if how != "shutdown":
            assert locked(b) == 0  # unpinned at once: the blocks may be reused
        assert b.end_claim(tid) is False
        assert b.end_claim(tid) is False  # forgotten
        if how != "shutdown":
            with pytest.raises(TaskNotFoundError):
                b.claim_rows(tid, lease=60.0)
            assert (b.get_match(PROMPT)[0] == -1) is (how == "reset")
    finally:
        b.shutdown()


def two_stages(name: str) -> tuple[SharedStageBackend, SharedStageBackend, EmbeddedBackend]:
    """Two replicas' stages on one shared backend (its CPU tier in segment
    ``name``), with their own buffers; stage ``a`` stored two blocks, published."""
    shared = SharedBackends(lambda: 0)
    fp = Fingerprint("model-x", LAYOUT, 0, 1)
    built: list[EmbeddedBackend] = []

    def build() -> EmbeddedBackend:
        built.append(EmbeddedBackend(config(LAYOUT, 16, cpu_shared_name=name,
                                            deferred_visibility=True)))
        return built[-1]

    a = shared.join(fp, "rep-a", build)
    c = shared.join(fp, "rep-c", build)
    a.register_kv_buffers(0, make_buffers(LAYOUT, SLOTS, 1))
    c.register_kv_buffers(0, make_buffers(LAYOUT, SLOTS, 2))
    tid, _ = a.put_match(TWO_BLOCKS)
    a.launch([tid], [np.arange(2 * TPB, dtype=np.int64)])
    assert a.wait([tid], timeout=30, completely=True)[tid].status is S.SUCCESS
    a.publish(tid)
    return a, c, built[0]


TWO_BLOCKS = tokens(2 * TPB)


@pytest.mark.parametrize("how", ["end_tenant_tasks", "remove_tenant", "stage_reset"])
def test_a_stage_leaving_a_shared_backend_ends_its_claims(shm_name: str, how: str) -> None:
    a, c, backend = two_stages(shm_name)
    try:
        assert a.tier_handle() == c.tier_handle() is not None
        ta, _ = a.get_match(TWO_BLOCKS)
        tc, _ = c.get_match(TWO_BLOCKS)
        assert a.claim_rows(ta, lease=60.0) is not None
        assert c.claim_rows(tc, lease=60.0) is not None
        if how == "end_tenant_tasks":
            backend.end_tenant_tasks(a.tenant, "test")
        elif how == "remove_tenant":
            a.shutdown()  # the stage leaves: remove_tenant
        else:
            a.reset()
        assert backend.end_claim(ta) is False
        assert c.end_claim(tc) is True  # the other stage's claim held
        assert locked(backend) == 0
    finally:
        if how != "remove_tenant":
            a.shutdown()
        c.shutdown()
    assert not os.path.exists(seg_path(shm_name))  # the last stage closed the tier


def test_a_stage_cannot_claim_another_stages_task(shm_name: str) -> None:
    a, c, _ = two_stages(shm_name)
    try:
        ta, _ = a.get_match(TWO_BLOCKS)
        with pytest.raises(TaskNotFoundError):
            c.claim_rows(ta, lease=60.0)
        assert a.claim_rows(ta, lease=60.0) is not None
        assert a.end_claim(ta) is True
    finally:
        a.shutdown()
        c.shutdown()


def test_claims_of_what_is_not_a_live_unlaunched_get_are_refused(shm_name: str) -> None:
    b, _ = backend_on(shm_name)
    try:
        toks = tokens(2 * TPB)
        slots = np.arange(2 * TPB, dtype=np.int64)
        store(b, toks, slots)
        put_id, _ = b.put_match(tokens(2 * TPB, seed=3))
        with pytest.raises(TaskNotFoundError, match=f"task {put_id} is not a live"):
            b.claim_rows(put_id, lease=60.0)
        b.cancel([put_id])
        with pytest.raises(TaskNotFoundError):
            b.claim_rows(123456, lease=60.0)
        launched, _ = b.get_match(toks)
        b.launch([launched], [slots])
        with pytest.raises(TaskNotFoundError):
            b.claim_rows(launched, lease=60.0)
        assert b.wait([launched], timeout=30)[launched].status is S.SUCCESS
        claimed = _claimed(b, toks)
        with pytest.raises(TaskNotFoundError):
            b.claim_rows(claimed, lease=60.0)
        with pytest.raises(TaskNotFoundError):  # a claimed get is the engine's to copy
            b.launch([claimed], [slots])
        assert b.end_claim(claimed) is True
        # end_claim of a get that was never claimed names it.
        unclaimed, _ = b.get_match(toks)
        with pytest.raises(TaskNotFoundError, match="was not claimed"):
            b.end_claim(unclaimed)
        b.cancel([unclaimed])
        assert locked(b) == 0
    finally:
        b.shutdown()


def test_a_plan_with_an_ssd_block_is_not_handed_out_and_still_launches(
        shm_name: str, tmp_path: Path) -> None:
    b, bufs = backend_on(shm_name, cpu_blocks=4, ssd_blocks=32, ssd_dir=tmp_path / "ssd")
    try:
        toks = tokens(4 * TPB)
        src = np.arange(4 * TPB, dtype=np.int64)
        store(b, toks, src)
        fill(b, 4, 4, seed=200)  # pushes the prompt's blocks off the CPU tier
        tid, mask = b.get_match(toks)
        assert mask.all()
        assert any(loc.tier is Tier.SSD for loc in b.plan_of(tid).blocks)
        assert b.claim_rows(tid, lease=60.0) is None
        dst = np.arange(64, 64 + 4 * TPB, dtype=np.int64)
        b.launch([tid], [dst])
        assert b.wait([tid], timeout=30)[tid].status is S.SUCCESS
        assert same(bufs, src, bufs, dst)
        assert locked(b) == 0
    finally:
        b.shutdown()


def hands_out_nothing(b: EmbeddedBackend, bufs: list[list[torch.Tensor]]) -> None:
    """``b`` has no shared tier: no handle, no claims, and its gets launch as always."""
    assert b.tier_handle() is None
    store(b, PROMPT, SRC)
    tid, _ = b.get_match(PROMPT)
    assert b.claim_rows(tid, lease=60.0) is None
    dst = np.arange(64, 64 + len(PROMPT), dtype=np.int64)
    b.launch([tid], [dst])  # still an ordinary, launchable get
    assert b.wait([tid], timeout=30)[tid].status is S.SUCCESS
    assert same(bufs, SRC, bufs, dst)


def test_a_backend_without_a_shared_tier_hands_out_nothing() -> None:
    b, bufs = backend_on(None)
    try:
        hands_out_nothing(b, bufs)
    finally:
        b.shutdown()


def test_a_write_through_the_engines_mapping_faults(shm_name: str) -> None:
    """The engine's mapping is read-only: writing through it kills the writer (in a
    child process), and the agent's block is unchanged."""
    b, _ = backend_on(shm_name)
    try:
        toks = tokens(2 * TPB)
        store(b, toks, np.arange(2 * TPB, dtype=np.int64))
        before = b.store.read_block(BlockLocation(Tier.CPU, 0))
        code = textwrap.dedent(f"""
            import sys
            from node_agent.backend.cpu_tier import map_shared_tier
            from tests.backend.backend_helpers import small_layout
            m = map_shared_tier(small_layout(), {b.tier_handle()!r})
            assert int(m.tier.pool[0]) == {before[0]}
            print("mapped", flush=True)
            m.tier.pool[0] = {(before[0] + 1) % 256}
            m.tier.pool.fill_(7)
            print("wrote", flush=True)
        """)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60,
                           cwd=Path(__file__).resolve().parents[2])
        assert b"mapped" in r.stdout, r.stderr.decode()
        assert b"wrote" not in r.stdout
        assert r.returncode in (-signal.SIGSEGV, -signal.SIGBUS), (r.returncode, r.stderr)
        assert b.store.read_block(BlockLocation(Tier.CPU, 0)) == before
    finally:
        b.shutdown()


def test_map_shared_tier_refuses_bad_handles(shm_name: str) -> None:
    b, _ = backend_on(shm_name)
    try:
        h = b.tier_handle()
        assert h is not None
        for bad, fragment in [
            (None, "not a shared-memory handle"),
            ({**h, "kind": "cuda"}, "not a shared-memory handle"),
            ({**h, "name": "../etc/passwd"}, "is not an agent's tier segment"),
            ({**h, "name": "flexkv-tier-x/../../etc"}, "is not an agent's tier segment"),
            ({**h, "blocks": 0}, "'blocks' is 0"),
            ({**h, "bytes": True}, "'bytes' is True"),
            ({**h, "blocks": h["blocks"] + 1}, "register the same layout"),
            ({**h, "blocks": h["blocks"] * 2, "bytes": h["bytes"] * 2}, "register again"),
        ]:
            with pytest.raises(ValueError, match=fragment):
                map_shared_tier(LAYOUT, bad)
        with pytest.raises(FileNotFoundError):
            map_shared_tier(LAYOUT, {**h, "name": h["name"] + "-gone"})
    finally:
        b.shutdown()


def test_close_unlinks_and_sweep_removes_only_its_prefix(prefix: str, tmp_path: Path) -> None:
    other_prefix = segment_prefix(str(tmp_path / "other.sock"))
    assert other_prefix != prefix
    mine = [CpuTier(LAYOUT, 4, False, next_segment_name(prefix)) for _ in range(3)]
    decoy = CpuTier(LAYOUT, 4, False, next_segment_name(other_prefix))
    try:
        names = [t.shared_name for t in mine]
        assert all(n is not None and os.path.exists(seg_path(n)) for n in names)
        mine[0].close()
        assert not os.path.exists(seg_path(str(names[0])))
        mine[0].close()  # twice is fine
        assert sweep_segments(prefix) == 2
        assert not any(os.path.exists(seg_path(str(n))) for n in names)
        assert decoy.shared_name is not None and os.path.exists(seg_path(decoy.shared_name))
        assert sweep_segments(prefix) == 0
    finally:
        decoy.close()
    assert decoy.shared_name is not None and not os.path.exists(seg_path(decoy.shared_name))


def test_a_tier_that_cannot_create_its_segment_stays_private(
        shm_name: str, tmp_path: Path) -> None:
    tier = CpuTier(LAYOUT, 4, False, shm_name, shm_dir=str(tmp_path / "no-such-dir"))
    assert tier.shared_name is None and tier.handle() is None
    assert tier.pool.numel() == 4 * LAYOUT.bytes_per_block
    tier.close()
    # Through the backend: a name whose file cannot be created (its directory does
    # not exist) leaves the tier private, and claims are not handed out.
    b, bufs = backend_on(shm_name + "/missing-dir")
    try:
        hands_out_nothing(b, bufs)
    finally:
        b.shutdown()


def test_a_segment_that_does_not_fit_leaves_the_tier_private(tmp_path: Path) -> None:
    """A full /dev/shm, as a file-size limit in a child process: reserving the
    segment's pages fails, the segment is removed and the tier is private."""
    name = next_segment_name(segment_prefix(str(tmp_path / "full.sock")))
    code = textwrap.dedent(f"""
        import os, resource, signal
        from node_agent.backend.cpu_tier import CpuTier, SHM_DIR
        from tests.backend.backend_helpers import small_layout
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        layout = small_layout()
        t = CpuTier(layout, 1024, False, {name!r})
        assert t.shared_name is None and t.handle() is None, t.shared_name
        assert t.pool.numel() == 1024 * layout.bytes_per_block
        assert not os.path.exists(os.path.join(SHM_DIR, {name!r}))
        print("private", flush=True)
    """)
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60,
                           cwd=Path(__file__).resolve().parents[2])
        assert r.returncode == 0 and b"private" in r.stdout, r.stderr.decode()
        assert b"does not fit" in r.stderr
    finally:
        sweep_segments(name)
