"""Engine-side loads at the backend: an ``EmbeddedBackend`` whose CPU tier lives in a
memory file (memfd) hands an un-launched get to the engine (``claim_rows``), the
engine copies the blocks from a read-only mapping of the file with the agent's
``BlockCopier``, and ``end_claim`` answers whether the blocks stayed pinned
throughout. Whatever ends a claim first (its lease, a reset, a cancel, the stage
leaving, a shutdown) makes ``end_claim`` answer False; ``close`` stops handing the
tier out while existing mappings keep its bytes; the received descriptor can
neither write nor resize the tier; a tier that cannot get a memory file falls back
to private memory and hands out no claims."""

from __future__ import annotations

import errno
import mmap
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from node_agent.backend import cpu_tier
from node_agent.backend.base import KVResponseStatus, TaskNotFoundError
from node_agent.backend.cpu_tier import (
    FENCE_BYTES,
    CpuTier,
    MappedTier,
    fence_offset,
    map_tier_fd,
    read_only_fd,
)
from node_agent.backend.embedded import EmbeddedBackend
from node_agent.backend.planes import register_buffers
from node_agent.backend.shared import Fingerprint, SharedBackends, SharedStageBackend
from node_agent.backend.tier_fds import TierFdServer, receive_tier_fd
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


def backend_on(shared: bool = True, cpu_blocks: int = 16,
               clock: Callable[[], float] = time.monotonic,
               **kw: Any) -> tuple[EmbeddedBackend, list[list[torch.Tensor]]]:
    """A started backend (its CPU tier in a memory file when ``shared``) and its
    engine buffers."""
    b = EmbeddedBackend(config(LAYOUT, cpu_blocks, cpu_shared=shared, **kw), clock=clock)
    b.start()
    bufs = make_buffers(LAYOUT, SLOTS, 1)
    b.register_kv_buffers(0, bufs)
    return b, bufs


def map_handle(handle: Any) -> MappedTier:
    """An engine's read-only mapping of the tier ``handle`` names, from a descriptor
    of this process's open tier (what the tier socket hands out)."""
    fd = read_only_fd(handle["id"])
    assert fd is not None, f"no open tier {handle['id']}"
    try:
        return map_tier_fd(LAYOUT, handle, fd)
    finally:
        os.close(fd)


def tier_id_of(b: EmbeddedBackend) -> str:
    handle = b.tier_handle()
    assert handle is not None
    return str(handle["id"])


def locked(b: EmbeddedBackend) -> int:
    index = b._index
    assert index is not None
    return index.locked()


def engine_copy(b: EmbeddedBackend, blocks: Sequence[int], dst: np.ndarray,
                hook: Callable[[threading.Event | None], None] | None = None,
                ) -> list[list[torch.Tensor]]:
    """What an engine does with a claim: map the backend's tier read-only and copy
    ``blocks`` into ``dst`` of fresh (random) engine buffers of its own."""
    mapped = map_handle(b.tier_handle())
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


def test_a_claim_copies_the_stored_bytes_bit_for_bit_and_unlocks_after() -> None:
    b, bufs = backend_on(cpu_blocks=16)
    try:
        handle = b.tier_handle()
        assert handle is not None
        assert handle == {"kind": "memfd", "id": handle["id"], "blocks": 16,
                          "bytes": 16 * LAYOUT.bytes_per_block,
                          "fence": fence_offset(16 * LAYOUT.bytes_per_block)}
        assert len(handle["id"]) == 32 and int(handle["id"], 16) >= 0
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
        mapped = map_handle(handle)
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


def test_claimed_blocks_survive_a_tier_filled_past_its_watermark() -> None:
    b, bufs = backend_on(cpu_blocks=8)
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


def test_an_expired_lease_ends_the_claim_and_frees_its_blocks() -> None:
    now = [0.0]
    b, _ = backend_on(cpu_blocks=4, clock=lambda: now[0])
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


def test_a_lease_ending_while_the_engine_copy_is_paused_answers_false() -> None:
    """The engine's copy is paused mid-way; meanwhile the lease ends and another
    store rewrites the claimed blocks. The copy then completes, but end_claim must
    say False: its slots may hold the other prompt's bytes."""
    now = [0.0]
    b, bufs = backend_on(cpu_blocks=4, clock=lambda: now[0])
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
def test_reset_cancel_and_shutdown_end_a_claim(how: str) -> None:
    b, _ = backend_on()
    try:
        tid, _ = claim_prompt(b, lease=60.0)
        if how == "reset":
            b.reset()
        elif how == "cancel":
            b.cancel([tid])
        else:
            tier_id = tier_id_of(b)
            b.shutdown()
            assert read_only_fd(tier_id) is None  # shutdown stops handing the tier out
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


@pytest.mark.parametrize("how", ["commit", "release", "cancel", "lease", "reset", "shutdown"])
def test_the_claim_fence_moves_before_an_early_end_unpins_and_never_on_a_commit(
        how: str) -> None:
    """What an engine's mapping reads after its copy tells whether any claim ended
    other than by its commit since the claim was made: the count moves by one,
    before the blocks unpin, on every such end, and stays on a commit."""
    now = [0.0]
    b, _ = backend_on(clock=lambda: now[0])
    mapped = map_handle(b.tier_handle())
    try:
        cpu = b.store.cpu
        start = cpu.fence_value()
        assert start is not None and mapped.fence_value() == start
        tid, _ = claim_prompt(b, lease=5.0)
        assert b.claim_fence(tid) == start  # recorded when the claim was made
        seen: list[tuple[int | None, int]] = []
        unlock = b._index.unlock  # type: ignore[union-attr]

        def spy(nodes: Any) -> None:  # what the fence read when the blocks unpinned
            seen.append((mapped.fence_value(), int(np.asarray(nodes).size)))
            unlock(nodes)

        b._index.unlock = spy  # type: ignore[method-assign,union-attr]
        if how == "commit":
            assert b.end_claim(tid) is True
        elif how == "release":
            assert b.end_claim(tid, committed=False) is True
        elif how == "cancel":
            b.cancel([tid])
        elif how == "lease":
            now[0] = 6.0
            assert b.end_claim(tid) is False
        elif how == "reset":
            b.reset()
        else:
            b.shutdown()
        moved = 0 if how == "commit" else 1
        assert mapped.fence_value() == start + moved
        assert seen and seen[0] == (start + moved, 4)
        assert b.claim_fence(tid) is None  # the claim is over
        # Stores and the next claim's commit leave it alone.
        if how != "shutdown":
            store(b, tokens(TPB, seed=3), np.arange(TPB, dtype=np.int64))
            assert mapped.fence_value() == start + moved
        if how not in ("reset", "shutdown"):
            again, _ = claim_prompt(b, lease=60.0)
            assert b.claim_fence(again) == start + moved
            assert b.end_claim(again) is True
            assert mapped.fence_value() == start + moved
    finally:
        mapped.close()
        b.shutdown()


def test_a_handle_without_a_fence_maps_without_one() -> None:
    """An agent from before the claim fence names none: the tier maps all the same
    and the engine has no fence to read (it then waits for every commit)."""
    b, _ = backend_on()
    try:
        h = b.tier_handle()
        assert h is not None and h["fence"] == fence_offset(h["bytes"])
        assert h["fence"] % FENCE_BYTES == 0 and 0 <= h["fence"] - h["bytes"] < FENCE_BYTES
        old = {k: v for k, v in h.items() if k != "fence"}
        mapped = map_handle(old)
        try:
            assert mapped.fence is None and mapped.fence_value() is None
            assert mapped.tier.pool.numel() == h["bytes"]
        finally:
            mapped.close()
    finally:
        b.shutdown()


def two_stages() -> tuple[SharedStageBackend, SharedStageBackend, EmbeddedBackend]:
    """Two replicas' stages on one shared backend (its CPU tier in a memory file),
    with their own buffers; stage ``a`` stored two blocks, published."""
    shared = SharedBackends(lambda: 0)
    fp = Fingerprint("model-x", LAYOUT, 0, 1)
    built: list[EmbeddedBackend] = []

    def build() -> EmbeddedBackend:
        built.append(EmbeddedBackend(config(LAYOUT, 16, cpu_shared=True,
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
def test_a_stage_leaving_a_shared_backend_ends_its_claims(how: str) -> None:
    a, c, backend = two_stages()
    try:
        assert a.tier_handle() == c.tier_handle() is not None
        tier_id = tier_id_of(backend)
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
    assert read_only_fd(tier_id) is None  # the last stage closed the tier


def test_a_stage_cannot_claim_another_stages_task() -> None:
    a, c, _ = two_stages()
    try:
        ta, _ = a.get_match(TWO_BLOCKS)
        with pytest.raises(TaskNotFoundError):
            c.claim_rows(ta, lease=60.0)
        assert a.claim_rows(ta, lease=60.0) is not None
        assert a.end_claim(ta) is True
    finally:
        a.shutdown()
        c.shutdown()


def test_claims_of_what_is_not_a_live_unlaunched_get_are_refused() -> None:
    b, _ = backend_on()
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
        tmp_path: Path) -> None:
    b, bufs = backend_on(cpu_blocks=4, ssd_blocks=32, ssd_dir=tmp_path / "ssd")
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
    b, bufs = backend_on(False)
    try:
        hands_out_nothing(b, bufs)
    finally:
        b.shutdown()


ROOT = Path(__file__).resolve().parents[2]


def test_a_write_through_the_engines_mapping_faults(tier_server: TierFdServer) -> None:
    """An engine process receives the tier's descriptor over the tier socket and maps
    it: writing through the mapping kills the writer; re-opening the descriptor
    read-write through /proc neither writes, resizes nor maps it writable (its
    seals), and no read-only mapping can be made writable (mprotect).
    The agent's block is unchanged."""
    b, _ = backend_on()
    try:
        toks = tokens(2 * TPB)
        store(b, toks, np.arange(2 * TPB, dtype=np.int64))
        before = b.store.read_block(BlockLocation(Tier.CPU, 0))
        handle = b.tier_handle()
        assert handle is not None
        code = textwrap.dedent(f"""
            import ctypes, mmap, os
            from node_agent.backend.cpu_tier import FENCE_BYTES, map_tier_fd
            from node_agent.backend.tier_fds import receive_tier_fd
            from tests.backend.backend_helpers import small_layout
            handle = {handle!r}
            fd = receive_tier_fd({tier_server.path!r}, handle["id"])
            m = map_tier_fd(small_layout(), handle, fd)
            assert int(m.tier.pool[0]) == {before[0]}
            rw = os.open(f"/proc/self/fd/{{fd}}", os.O_RDWR)
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                  ctypes.c_int, ctypes.c_int, ctypes.c_long]
            libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

            def make_writable(f):
                addr = libc.mmap(None, 4096, mmap.PROT_READ, mmap.MAP_SHARED, f, 0)
                assert addr not in (None, ctypes.c_void_p(-1).value)
                if libc.mprotect(addr, 4096, mmap.PROT_READ | mmap.PROT_WRITE) != 0:
                    raise PermissionError(ctypes.get_errno(), "mprotect")

            for name, attempt in [
                    ("write", lambda: os.pwrite(rw, b"x" * 64, 0)),
                    ("shrink", lambda: os.ftruncate(rw, 0)),
                    ("grow", lambda: os.ftruncate(rw, handle["bytes"] * 2)),
                    ("writable mapping", lambda: mmap.mmap(
                        rw, handle["bytes"], mmap.MAP_SHARED,
                        mmap.PROT_READ | mmap.PROT_WRITE)),
                    ("mprotect of a mapping", lambda: make_writable(fd)),
                    ("mprotect of a re-opened mapping", lambda: make_writable(rw))]:
                try:
                    attempt()
                except PermissionError:
                    continue
                print("changed by", name, flush=True)
            assert os.fstat(fd).st_size == handle["fence"] + FENCE_BYTES
            print("mapped", flush=True)
            m.tier.pool[0] = {(before[0] + 1) % 256}
            m.tier.pool.fill_(7)
            print("wrote", flush=True)
        """)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60,
                           cwd=ROOT)
        assert b"changed by" not in r.stdout, r.stdout
        assert b"mapped" in r.stdout, r.stderr.decode()
        assert b"wrote" not in r.stdout
        assert r.returncode in (-signal.SIGSEGV, -signal.SIGBUS), (r.returncode, r.stderr)
        assert b.store.read_block(BlockLocation(Tier.CPU, 0)) == before
        assert tier_server.served == 1
    finally:
        b.shutdown()


def test_the_received_descriptor_is_read_only(tier_server: TierFdServer) -> None:
    b, _ = backend_on()
    try:
        handle = b.tier_handle()
        assert handle is not None
        fd = receive_tier_fd(tier_server.path, handle["id"])
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(fd, handle["bytes"], mmap.MAP_SHARED,
                          mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(OSError) as err:
                os.write(fd, b"x")
            assert err.value.errno == errno.EBADF
            with pytest.raises(OSError):
                os.ftruncate(fd, 0)
            assert os.fstat(fd).st_size == handle["fence"] + FENCE_BYTES
            # Readable: it is the tier's memory (zero-filled, nothing stored yet).
            assert os.pread(fd, 16, 0) == bytes(16)
        finally:
            os.close(fd)
    finally:
        b.shutdown()


def test_map_tier_fd_refuses_bad_handles() -> None:
    b, _ = backend_on()
    try:
        h = b.tier_handle()
        assert h is not None
        fd = read_only_fd(h["id"])
        assert fd is not None
        try:
            for bad, fragment in [
                (None, "not a CPU tier handle"),
                ({**h, "kind": "shm"}, "not a CPU tier handle"),
                ({**h, "id": "../etc/passwd"}, "is not a tier id"),
                ({**h, "id": ""}, "is not a tier id"),
                ({**h, "id": "a" * 65}, "is not a tier id"),
                ({**h, "id": 7}, "is not a tier id"),
                ({**h, "blocks": 0}, "'blocks' is 0"),
                ({**h, "bytes": True}, "'bytes' is True"),
                ({**h, "blocks": h["blocks"] + 1}, "register the same layout"),
                ({**h, "blocks": h["blocks"] * 2, "bytes": h["bytes"] * 2,
                  "fence": fence_offset(h["bytes"] * 2)}, "ask the agent again"),
                ({**h, "fence": 8}, "'fence' is 8; it must be .* first page boundary"),
                ({**h, "fence": str(h["bytes"])}, "'fence' is '"),
            ]:
                with pytest.raises(ValueError, match=fragment):
                    map_tier_fd(LAYOUT, bad, fd)
        finally:
            os.close(fd)
        # An id no open tier of this process has: nothing to hand out.
        assert read_only_fd("0" * 32) is None
        assert read_only_fd(h["id"].upper()) is None
    finally:
        b.shutdown()


def test_close_stops_handing_out_the_tier_and_mappings_keep_its_bytes() -> None:
    tiers = [CpuTier(LAYOUT, 4, False, True) for _ in range(2)]
    try:
        ids = [t.tier_id for t in tiers]
        assert all(i is not None for i in ids) and ids[0] != ids[1]
        tiers[0].pool.copy_(torch.randint(0, 256, tiers[0].pool.shape, dtype=torch.uint8))
        written = tiers[0].read_block(3)
        mapped = map_handle(tiers[0].handle())
        try:
            tiers[0].close()
            assert tiers[0].tier_id is None and tiers[0].handle() is None
            assert read_only_fd(str(ids[0])) is None
            assert tiers[0].read_only_fd() is None
            tiers[0].close()  # twice is fine
            # The engine's mapping still reads what the agent wrote.
            assert mapped.tier.read_block(3) == written
            # The other tier is untouched.
            fd = read_only_fd(str(ids[1]))
            assert fd is not None
            os.close(fd)
        finally:
            mapped.close()
    finally:
        for t in tiers:
            t.close()


def test_a_tier_without_a_memory_file_stays_private(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(name: str, flags: int = 0) -> int:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(cpu_tier.os, "memfd_create", refuse)
    tier = CpuTier(LAYOUT, 4, False, True)
    assert tier.tier_id is None and tier.handle() is None and tier.read_only_fd() is None
    assert tier.pool.numel() == 4 * LAYOUT.bytes_per_block
    tier.close()
    # Through the backend: no handle, and claims are not handed out.
    b, bufs = backend_on()
    try:
        hands_out_nothing(b, bufs)
    finally:
        b.shutdown()


def test_a_memory_file_that_does_not_fit_leaves_the_tier_private() -> None:
    """A memory limit, as a file-size limit in a child process: reserving the
    file's pages fails and the tier is in private memory."""
    code = textwrap.dedent("""
        import resource, signal
        from node_agent.backend.cpu_tier import CpuTier
        from tests.backend.backend_helpers import small_layout
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        layout = small_layout()
        t = CpuTier(layout, 1024, False, True)
        assert t.tier_id is None and t.handle() is None, t.tier_id
        assert t.pool.numel() == 1024 * layout.bytes_per_block
        t.pool.fill_(1)
        print("private", flush=True)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0 and b"private" in r.stdout, r.stderr.decode()
    assert b"does not fit" in r.stderr
