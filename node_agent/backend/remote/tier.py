"""The remote tier of a stage: lookup, fetch into the CPU tier, write-behind.

:class:`RemotePool` is one agent's membership of the Mooncake Store pool: one
client (one ``storePort``), its health, and one bounded call lane per operation
(``lookup``, ``get``, ``put``) so a slow write never delays a lookup.
:class:`RemoteTier` is one PP stage's view of it: its :class:`~.keys.KeySpace`,
its CPU tier and a registered staging buffer (``localBufferSize``), split in a
fetch half and a write half.

Objects are a header (:mod:`.objects`: format, block digest, writer, checksum)
and the whole block in *region order* (the SSD on-disk order:
``segments(0)[b] + segments(1)[b] + ...``), so a fetch is one ``batch_get_into``
per chunk (:data:`FETCH_CHUNK_BYTES`, two staging areas: the next chunk arrives
while this one is checked and copied) into the staging buffer, a check of every
header, then one numpy copy per region into the CPU blocks. A lookup asks
``batch_is_exist`` for the first :data:`LOOKUP_HEAD` blocks, and for the rest
only when those all exist. Objects are not fetched straight into CPU rows
(``batch_get_into_multi_buffers``): a get that overran its timeout still writes
into its destination, and the rows of a failed fetch are released at once.

Guarantees:

* every call ends within its timeout (:class:`~.calls.BoundedCaller`); a master
  that does not answer is a miss, never a hang;
* a fetch uses only the contiguous prefix of blocks that arrived whole and are
  this block's bytes (the header names the digest the key came from, the checksum
  matches the bytes) from one writer: the first block that failed, timed out or
  was refused ends it (refusals are counted in
  ``flexkv_agent_remote_rejected_blocks_total{reason}``), and nothing after it is
  copied;
* a fetch reads every block under the key epoch of its start, and writes no CPU
  block once :meth:`RemoteTier.invalidate` (a stage reset) returned: blocks the
  reset freed may hold new content at once;
* a write takes a block's bytes only if no store, move or fetch wrote that CPU
  block between the offer and the end of the copy-out (a generation check on both
  sides of the copy), so a block reused for other content is never written under
  the old key; and nothing is copied into the write area while a put that overran
  its timeout may still be reading it (the batch is dropped);
* a write lands only under the cache epoch its bytes were written into the CPU
  tier under (recorded on every bump): a block cached before a ``cacheEpoch``
  flush and written after the key epoch switched is dropped (``flushed``), never
  stored under the new epoch's key.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from node_agent.backend.cpu_tier import CpuTier
from node_agent.backend.remote.calls import (
    BoundedCaller,
    PendingCall,
    RemoteBusy,
    RemoteCallError,
    RemoteTimeout,
)
from node_agent.backend.remote.health import RemoteHealth
from node_agent.backend.remote.join import JoinRefused, check_before_join, previous_segment
from node_agent.backend.remote.keys import KeySpace
from node_agent.backend.remote.mooncake_client import (
    MooncakeStore,
    connect,
    master_unreachable,
)
from node_agent.backend.remote.objects import (
    HEADER_BYTES,
    new_writer_id,
    verify,
    write_headers,
)
from node_agent.backend.remote.settings import RemoteSettings
from node_agent.backend.remote.writer import Pending, WriteBehind
from node_agent.metrics import AgentMetrics

log = logging.getLogger(__name__)

#: How long :meth:`RemotePool.start` waits for the first join (Mooncake's setup).
JOIN_SECONDS = 10.0
#: How long a restarted agent waits before its first join when the metadata server
#: still describes its segment (a previous incarnation was killed): the master
#: keeps that segment mounted, at the old process's addresses, until its
#: ``client_ttl`` (Mooncake's default and the operator's master: 10 s) runs out,
#: and a client joining under the same name would serve its objects.
PREVIOUS_SEGMENT_WAIT = 15.0

#: Checks before a ``setup`` (``master_address, metadata_server, local_hostname,
#: timeout``); raises to refuse the join (:func:`.join.check_before_join`).
PreJoin = Callable[[str, str, str, float], None]

#: Most bytes of objects one ``batch_get_into`` of a fetch brings. The checks and
#: the copy into the CPU tier of one chunk run while the next chunk arrives, so
#: only the last chunk's checks and copy add to the fetch's time; a chunk this
#: small is still in the CPU's cache when it is checked and copied.
FETCH_CHUNK_BYTES = 8 << 20
#: Blocks the first ``batch_is_exist`` of a lookup asks for: the hit is the run
#: of existing objects from the first, so the rest is asked for (one more call)
#: only when all of these exist. A prompt the pool does not hold costs a call
#: of this many keys, not one of every block of the prompt.
LOOKUP_HEAD = 32


class RemotePool:
    """One agent's Mooncake Store client, shared by its stages (see module docstring).

    Joining is retried lazily: when ``setup`` fails (the master is down at start)
    the pool stays down and the next due probe (``retry_seconds``) joins again.
    Before every ``setup``, ``prejoin`` checks (bounded, without holding the GIL)
    that the store ports are free and that the master and metadata server answer:
    ``setup`` itself holds the GIL and would stop every thread of the agent while
    it waits for a silent master. The first join waits up to
    :data:`PREVIOUS_SEGMENT_WAIT` when a previous incarnation's segment of the same
    name is still described at the metadata server."""

    def __init__(self, settings: RemoteSettings, metrics: AgentMetrics | None = None,
                 connector: Callable[[RemoteSettings], MooncakeStore] = connect,
                 retry_seconds: float = 1.0,
                 prejoin: PreJoin | None = check_before_join,
                 previous_segment_wait: float = PREVIOUS_SEGMENT_WAIT) -> None:
        self.settings = settings
        self.metrics = metrics
        self.health = RemoteHealth(metrics, retry_seconds)
        self._connector = connector
        self._prejoin = prejoin
        self._client: MooncakeStore | None = None
        self._lock = threading.Lock()
        self._lanes = {op: BoundedCaller(op) for op in ("connect", "lookup", "get", "put")}
        self._registered: list[tuple[int, int]] = []
        self._created = time.monotonic()
        self._previous_wait = previous_segment_wait
        self._not_before: float | None = None  # decided by the first join attempt
        self.closed = False

    def start(self, timeout: float = JOIN_SECONDS) -> None:
        """Try to join, waiting up to ``timeout`` (and, first, until a previous
        incarnation's segment is gone); the pool stays usable (down) when the master
        is unreachable, and joins on a later call."""
        self._connect(timeout)
        not_before = self._not_before
        if self._client is None and not_before is not None and not self.closed:
            left = not_before - time.monotonic()
            if left > 0:
                time.sleep(left)
                self._connect(timeout)

    def _join_allowed(self, timeout: float) -> None:
        """Raise :class:`~.join.JoinRefused` while the first join must wait for a
        previous incarnation's segment to be unmounted by the master."""
        s = self.settings
        if self._not_before is None:
            stale = previous_segment(s.metadata_server, s.local_hostname, timeout)
            if stale is None:
                raise JoinRefused(f"metadata server {s.metadata_server} does not answer")
            self._not_before = self._created + (self._previous_wait if stale else 0.0)
            if stale:
                log.warning("Remote tier waits for the segment of a previous incarnation to "
                            "be unmounted before joining", extra={
                                "segment": s.local_hostname, "seconds": self._previous_wait})
        left = self._not_before - time.monotonic()
        if left > 0:
            raise JoinRefused(
                f"segment {s.local_hostname} of a previous incarnation of this agent may "
                "still be mounted at the master (until its client_ttl runs out); joining in "
                f"{left:.1f} s")

    def _join(self, timeout: float = JOIN_SECONDS) -> MooncakeStore:
        """Lane ``connect``: join and install the client, even when the caller that
        started the join stopped waiting (a late join must not leave a client with
        its ports bound and no owner). A caller that waited for another's join
        takes the client that join installed."""
        s = self.settings
        with self._lock:
            if self._client is not None:
                return self._client
        if self._prejoin is not None:
            # The checks get most of the budget, so that their reason (not the lane's
            # timeout) is what the tier reports.
            deadline = time.monotonic() + 0.8 * timeout
            self._join_allowed(0.4 * timeout)
            self._prejoin(s.master_address, s.metadata_server, s.local_hostname,
                          max(0.0, deadline - time.monotonic()))
        client = self._connector(s)
        with self._lock:
            if self.closed:
                client.close()
                raise RuntimeError("the remote pool was closed while joining")
            self._client = client
            for ptr, size in self._registered:
                client.register_buffer(ptr, size)
        self.health.succeeded()
        log.info("Remote tier joined the Mooncake pool", extra={
            "master": s.master_address, "local": s.local_hostname,
            "segment_bytes": s.segment_bytes})
        return client

    def _connect(self, timeout: float, wait_turn: bool = True) -> MooncakeStore | None:
        """Join within ``timeout``. ``wait_turn=False`` (remote calls on the engine's
        path) answers None at once while another join is still running."""
        lane = self._lanes["connect"]
        try:
            if wait_turn:
                return lane.call(lambda: self._join(timeout), timeout, "remote join")
            pending = lane.submit(lambda: self._join(timeout), "remote join")
            return lane.wait(pending, timeout, "remote join", budget=timeout)
        except RemoteCallError as exc:
            self.health.failed(str(exc))
            log.warning("Remote tier cannot join the Mooncake pool yet",
                        extra={"master": self.settings.master_address, "error": str(exc)})
            return None

    def register(self, buf: torch.Tensor) -> None:
        """Register ``buf`` (host memory) for transfers, now and after every (re)join."""
        ptr, size = buf.data_ptr(), buf.numel() * buf.element_size()
        with self._lock:
            self._registered.append((ptr, size))
            client = self._client
        if client is not None:
            client.register_buffer(ptr, size)

    def unregister(self, buf: torch.Tensor) -> None:
        """Stop using ``buf`` for transfers (before it is freed)."""
        ptr = buf.data_ptr()
        with self._lock:
            self._registered = [r for r in self._registered if r[0] != ptr]
            client = self._client
        if client is not None:
            client.unregister_buffer(ptr)

    def client(self) -> MooncakeStore | None:
        """The joined client, joining now if a probe is due; None while unreachable."""
        if self.closed:
            return None
        client = self._client
        if client is None and self.health.should_try():
            client = self._connect(self.settings.timeout_seconds)
        return client

    def call(self, op: str, fn: Callable[[MooncakeStore], Any], timeout: float) -> Any:
        """Run ``fn(client)`` on ``op``'s lane within ``timeout``; None when the tier is down
        (no probe due) or the call failed (counted in ``remote_errors_total{op}``)."""
        if self.closed or (not self.health.up and not self.health.should_try()):
            return None
        client = self._client or self._connect(timeout, wait_turn=False)
        if client is None:
            return None
        try:
            return self._lanes[op].call(lambda: fn(client), timeout, f"remote {op}")
        except RemoteCallError as exc:
            self._failed(op, exc)
            return None

    def submit(self, op: str, fn: Callable[[MooncakeStore], Any],
               turn: float = 0.0) -> PendingCall[Any] | None:
        """Start ``fn(client)`` on ``op``'s lane without waiting for it (see
        :meth:`finish`), after up to ``turn`` seconds for another caller's call; None
        when the tier is down or the lane is busy."""
        if self.closed or (not self.health.up and not self.health.should_try()):
            return None
        client = self._client or self._connect(self.settings.timeout_seconds, wait_turn=False)
        if client is None:
            return None
        try:
            return self._lanes[op].submit(lambda: fn(client), f"remote {op}", turn)
        except RemoteCallError as exc:
            self._failed(op, exc)
            return None

    def finish(self, op: str, call: PendingCall[Any], timeout: float) -> Any:
        r"""The result of a :meth:`submit`\ ted call within ``timeout``; None on failure."""
        try:
            return self._lanes[op].wait(call, timeout, f"remote {op}")
        except RemoteCallError as exc:
            self._failed(op, exc)
            return None

    def overrunning(self, op: str) -> bool:
        """Whether a call on ``op``'s lane overran its timeout and still runs."""
        return self._lanes[op].overrunning()

    def _failed(self, op: str, exc: RemoteCallError) -> None:
        """A failed call on ``op``'s lane: a get or put that timed out (or found its
        lane held by one that did) waits on a peer, not on the master, so it does
        not mark the tier down; anything else does."""
        peer = op in ("get", "put") and isinstance(exc, RemoteTimeout | RemoteBusy)
        self.error(op, str(exc), down=not peer)

    def error(self, op: str, reason: str, down: bool = True) -> None:
        """Count a failed ``op``; ``down`` marks the tier down until a call succeeds."""
        if self.metrics is not None:
            self.metrics.remote_errors.labels(op=op).inc()
        if down:
            self.health.failed(f"{op}: {reason}")

    def status(self) -> dict[str, Any]:
        return {"up": self.health.up, "reason": self.health.reason,
                "masterAddress": self.settings.master_address,
                "localHostname": self.settings.local_hostname,
                "segmentBytes": self.settings.segment_bytes,
                "writePolicy": self.settings.write_policy}

    def close(self) -> None:
        """Leave the pool. A native call still running (one that overran its timeout,
        e.g. a transfer to a frozen peer) would use the client after it is freed:
        the client is closed only once every lane is quiet (waiting up to twice
        ``timeoutSeconds``), and otherwise left to the process's exit."""
        self.closed = True
        with self._lock:
            client, self._client = self._client, None
        for lane in self._lanes.values():
            lane.close()
        if client is None:
            return
        deadline = time.monotonic() + 2 * self.settings.timeout_seconds
        if all(lane.quiet(deadline - time.monotonic()) for lane in self._lanes.values()):
            client.close()
        else:
            log.warning("Remote tier left a Mooncake client open: a call to it still runs",
                        extra={"local": self.settings.local_hostname})


def _wide(a: np.ndarray) -> np.ndarray:
    """``a`` (bytes, contiguous last dimension) viewed with the widest integer type
    that tiles its rows (fewer, wider element copies). Only bytes are reinterpreted."""
    for dtype, size in ((np.int64, 8), (np.int32, 4), (np.int16, 2)):
        if a.shape[-1] % size == 0:
            return a.view(dtype)
    return a


def _consecutive(blocks: Sequence[int]) -> tuple[int, int] | None:
    """``(first, last + 1)`` when ``blocks`` are consecutive ascending, else None."""
    n = len(blocks)
    if n and int(blocks[-1]) - int(blocks[0]) == n - 1:
        arr = np.asarray(blocks, dtype=np.int64)
        if n == 1 or bool((np.diff(arr) == 1).all()):
            return int(arr[0]), int(arr[-1]) + 1
    return None


def _block_rows(cpu_blocks: Sequence[int],
                num_blocks: int) -> tuple[tuple[int, int] | None, np.ndarray]:
    """How to address ``cpu_blocks`` in a region of ``num_blocks`` blocks:
    ``(start, stop)`` when they are consecutive (a slice), else ``None`` and their
    indices. ``IndexError`` naming them when one is outside the region (numpy
    would read a negative index from the end, and cut a slice short)."""
    run = _consecutive(cpu_blocks)
    idx = np.empty(0, dtype=np.int64) if run is not None else np.asarray(cpu_blocks, np.int64)
    if run is not None:
        lo, hi = run
    elif len(idx):
        lo, hi = int(idx.min()), int(idx.max()) + 1
    else:
        lo = hi = 0
    if lo < 0 or hi > num_blocks:
        raise IndexError(f"CPU blocks {list(cpu_blocks)!r} are outside 0..{num_blocks - 1}")
    return run, idx


def _getter(keys: list[str], ptrs: list[int],
            sizes: list[int]) -> Callable[[MooncakeStore], list[int]]:
    return lambda c: c.batch_get_into(keys, ptrs, sizes)


class RemoteTier:
    """One stage's remote tier over a :class:`RemotePool` (see module docstring)."""

    def __init__(self, pool: RemotePool, keyspace: KeySpace,
                 epoch: Callable[[], int] | None = None) -> None:
        self.pool = pool
        self._base = keyspace
        self._epoch = epoch
        self.settings = pool.settings
        self.bytes_per_block = keyspace.layout.bytes_per_block
        #: Bytes of one object: the header, then the block.
        self.object_bytes = HEADER_BYTES + self.bytes_per_block
        #: This stage tier's writer id, in the header of every object it writes.
        self.writer_id = new_writer_id()
        # Writer of each CPU block's bytes: the writer of the objects a fetch put
        # there, this tier's own id for bytes written here (a store, a move).
        self._writers: np.ndarray = np.zeros(0, dtype=np.uint64)
        self._cpu: CpuTier | None = None
        self._gens: np.ndarray = np.zeros(0, dtype=np.int64)
        self._epochs: np.ndarray = np.zeros(0, dtype=np.int64)  # key epoch of each block
        self._fetch_lock = threading.Lock()
        self._scatter_lock = threading.Lock()  # a reset waits for a scatter in progress
        self._resets = 0
        self._writer: WriteBehind | None = None
        self._staging: torch.Tensor | None = None
        self._fetch_area: torch.Tensor | None = None
        self._write_area: torch.Tensor | None = None
        self.half_blocks = 0
        self.fetched_blocks = 0
        self.written_blocks = 0
        self.rejected_blocks = 0

    @property
    def keyspace(self) -> KeySpace:
        """The stage's key space under the current ``cacheEpoch`` (a bump changes every
        key, so blocks written before it are never found again)."""
        if self._epoch is not None:
            e = self._epoch()
            if e != self._base.cache_epoch:
                self._base = replace(self._base, cache_epoch=e)
        return self._base

    @property
    def write_policy(self) -> str:
        return self.settings.write_policy

    # -- set-up ----------------------------------------------------------------

    def attach(self, cpu: CpuTier) -> None:
        """Bind to the stage's CPU tier: allocate and register the staging buffer and
        start the writer. Raises ``ValueError`` when staging cannot hold 2 objects."""
        obs = self.object_bytes
        half = self.settings.staging_bytes // 2 // obs
        if half < 1:
            raise ValueError(
                f"tiers.remote.mooncake.localBufferSize {self.settings.staging_bytes} bytes holds "
                f"less than two {obs}-byte objects (a {HEADER_BYTES}-byte header and a "
                f"{self.bytes_per_block}-byte block; one to fetch, one to write); raise it to "
                f"at least {2 * obs}"
            )
        self.half_blocks = half
        staging = torch.zeros(2 * half * obs, dtype=torch.uint8)  # faulted in now
        self._staging = staging
        self._fetch_area = staging[: half * obs]
        self._write_area = staging[half * obs:]
        self._cpu = cpu
        self._writers = np.zeros(cpu.num_blocks, dtype=np.uint64)
        self._gens = np.zeros(cpu.num_blocks, dtype=np.int64)
        self._epochs = np.full(cpu.num_blocks, self.keyspace.cache_epoch, dtype=np.int64)
        self.pool.register(staging)
        self._writer = WriteBehind(self.settings.queue_blocks, half, self.write_batch,
                                   self.pool.metrics)

    # -- generations -------------------------------------------------------------

    def bump(self, cpu_blocks: Sequence[int] | np.ndarray) -> None:
        """Record that ``cpu_blocks`` are about to be overwritten (before the write),
        with bytes of the current key epoch."""
        if len(self._gens) and len(cpu_blocks):
            idx = np.asarray(cpu_blocks, dtype=np.int64)
            self._epochs[idx] = self.keyspace.cache_epoch
            self._gens[idx] += 1
            self._writers[idx] = self.writer_id

    def writer_of(self, cpu_block: int) -> int | None:
        """The writer of the objects a fetch put in ``cpu_block``; None when its bytes
        were written here (a store or a move) or it was never written."""
        if not len(self._writers):
            return None
        w = int(self._writers[cpu_block])
        return None if w in (0, self.writer_id) else w

    def invalidate(self) -> None:
        """The stage was reset: every CPU block may be reused right away. Voids the
        queued writes (every block's generation moves) and stops fetches in flight:
        no fetch writes a CPU block after this returns."""
        with self._scatter_lock:
            self._resets += 1
            self.bump(np.arange(len(self._gens)))

    # -- read path -----------------------------------------------------------------

    def lookup(self, digests: Sequence[int], timeout: float) -> int:
        """How many of the blocks ``digests``, from the first, exist in the pool: one
        ``batch_is_exist`` of the first :data:`LOOKUP_HEAD` blocks and, when all of
        them exist, one of the rest (both under the key epoch of the call's start);
        0 when the tier is down or the first call fails, the head when the second
        one does."""
        n = len(digests)
        if not n:
            return 0
        deadline = time.monotonic() + timeout
        ks = self.keyspace  # one epoch for both calls
        head = min(n, LOOKUP_HEAD)
        found = self._exist(ks.keys(digests[:head]), timeout)
        if found == head < n:
            left = deadline - time.monotonic()
            if left > 0:
                found += self._exist(ks.keys(digests[head:]), left)
        return found

    def _exist(self, keys: list[str], timeout: float) -> int:
        """How many of ``keys``, from the first, exist (one ``batch_is_exist``)."""
        codes = self.pool.call("lookup", lambda c: c.batch_is_exist(keys), timeout)
        if codes is None:
            return 0
        arr = np.asarray(codes, dtype=np.int64)
        bad = arr < 0
        if bad.any():
            code = int(arr[bad][0])
            self.pool.error("lookup", f"batch_is_exist answered {code}",
                            down=master_unreachable(code))
            if master_unreachable(code):
                return 0
        else:
            self.pool.health.succeeded()
        miss = np.flatnonzero(arr != 1)
        return int(miss[0]) if len(miss) else len(arr)

    @property
    def resets(self) -> int:
        """How many times :meth:`invalidate` ran (pass it to :meth:`fetch`)."""
        return self._resets

    def fetch(self, digests: Sequence[int], cpu_blocks: Sequence[int], timeout: float,
              between_chunks: Callable[[int], None] | None = None,
              resets: int | None = None, writer: int | None = None) -> int:
        """Copy the remote blocks ``digests`` into CPU blocks ``cpu_blocks`` (same
        order); returns how many, from the first, arrived whole, passed
        :func:`.objects.verify` and were copied.

        Stops at the first block that failed, was refused (not this block's bytes,
        or another writer's than the run's: ``writer``, default the first block's)
        or when ``timeout`` runs out; CPU blocks from the returned count on hold
        undefined bytes. ``between_chunks`` (tests) is called with the blocks
        copied so far before every chunk after the first. ``resets`` is
        :attr:`resets` read when ``cpu_blocks`` were reserved (default: now): after
        a later reset nothing is copied. ``IndexError`` naming them, before any
        block changes, when a CPU block is outside the tier."""
        assert self._cpu is not None and self._fetch_area is not None
        n = min(len(digests), len(cpu_blocks))
        if n == 0:
            return 0
        deadline = time.monotonic() + timeout
        obs, cpu = self.object_bytes, self._cpu
        _block_rows(cpu_blocks[:n], cpu.num_blocks)  # IndexError before anything changes
        ks = self.keyspace  # one epoch for the whole prefix
        if resets is None:
            resets = self._resets
        elif resets != self._resets:
            return 0  # reset since the blocks were reserved: they may hold new content
        self.bump(cpu_blocks[:n])
        done = 0
        with self._fetch_lock:
            # Two staging areas: the next chunk's get runs while this chunk is copied
            # into the CPU tier (one area when the fetch half holds a single block:
            # then the next get starts only after the copy).
            nareas = 2 if self.half_blocks >= 2 else 1
            q = max(1, min(self.half_blocks // nareas, FETCH_CHUNK_BYTES // obs))
            areas = [self._fetch_area[i * q * obs:(i + 1) * q * obs] for i in range(nareas)]
            chunks = [(s, min(q, n - s)) for s in range(0, n, q)]

            def start(i: int) -> PendingCall[Any] | None:
                s, k = chunks[i]
                base = areas[i % nareas].data_ptr()
                return self.pool.submit("get", _getter(
                    ks.keys(digests[s:s + k]),
                    [base + j * obs for j in range(k)], [obs] * k),
                    max(0.0, deadline - time.monotonic()))

            pending = start(0)
            for i, (s, k) in enumerate(chunks):
                if pending is None:
                    break
                codes = self.pool.finish("get", pending, deadline - time.monotonic())
                pending = None
                if codes is None:
                    break
                ok, refused = 0, False
                while ok < k and codes[ok] == obs:
                    ok += 1
                if ok < k and int(codes[ok]) >= 0:  # an object of another size
                    self._rejected("size", ks.keys(digests[s + ok:s + ok + 1])[0])
                    refused = True
                elif ok < k:
                    code = int(codes[ok])
                    self.pool.error("get", f"batch_get_into answered {code}",
                                    down=master_unreachable(code))
                if ok:
                    good, reason, writer = verify(areas[i % nareas].numpy(), ok, obs,
                                                  digests[s:s + ok], writer)
                    if reason is not None:  # nothing from a refused block on is used
                        self._rejected(reason, ks.keys(digests[s + good:s + good + 1])[0])
                        ok, refused = good, True
                if ok == k:
                    self.pool.health.succeeded()
                more = ok == k and i + 1 < len(chunks)
                if more and nareas == 2:  # the next get fills the other area meanwhile
                    if between_chunks is not None:
                        between_chunks(done + ok)
                    pending = start(i + 1)
                if ok:
                    with self._scatter_lock:
                        if self._resets != resets:
                            break  # the stage was reset: these CPU blocks are not ours now
                        self._scatter(cpu, areas[i % nareas], cpu_blocks[s:s + ok])
                        if writer is not None:
                            self._writers[np.asarray(cpu_blocks[s:s + ok], np.int64)] = writer
                    done += ok
                if more and nareas == 1:
                    # One area: the next get may start only once the objects checked
                    # in it were copied out, or it overwrites them under the copy.
                    if between_chunks is not None:
                        between_chunks(done)
                    pending = start(i + 1)
                if ok < k or refused:
                    break
            if pending is not None:  # let a get still running finish before the area is reused
                self.pool.finish("get", pending, deadline - time.monotonic())
        self.fetched_blocks += done
        m = self.pool.metrics
        if m is not None and done:
            m.remote_hit_blocks.inc(done)
            m.remote_bytes.labels(direction="get").inc(done * self.bytes_per_block)
        return done

    def _rejected(self, reason: str, key: str) -> None:
        """A fetched object was refused (never published); count and log it."""
        self.rejected_blocks += 1
        m = self.pool.metrics
        if m is not None:
            m.remote_rejected_blocks.labels(reason=reason).inc()
        log.warning("Remote block refused; the hit ends before it",
                    extra={"reason": reason, "key": key})

    # -- write path ----------------------------------------------------------------

    def offer(self, block_ids: Sequence[int], cpu_blocks: Sequence[int]) -> int:
        """Queue blocks for the write-behind (never blocks); returns how many were taken."""
        if self._writer is None or not len(block_ids):
            return 0
        gens = self._gens[np.asarray(cpu_blocks, dtype=np.int64)].tolist()
        return self._writer.offer(list(zip((int(b) for b in block_ids),
                                           (int(c) for c in cpu_blocks), gens, strict=True)))

    def write_batch(self, batch: list[Pending]) -> None:
        """Writer: copy the still-valid blocks of ``batch`` out and put them."""
        assert self._cpu is not None and self._write_area is not None
        m = self.pool.metrics
        ks = self.keyspace  # keys of this batch; a later epoch switch cannot move them
        gens, epochs = self._gens, self._epochs
        current = [p for p in batch if epochs[p[1]] == ks.cache_epoch]
        if len(current) < len(batch) and m is not None:
            m.remote_dropped_blocks.labels(reason="flushed").inc(len(batch) - len(current))
        valid = [p for p in current if gens[p[1]] == p[2]]
        if len(valid) < len(current) and m is not None:
            m.remote_dropped_blocks.labels(reason="overwritten").inc(len(current) - len(valid))
        if not valid:
            return
        if self.pool.overrunning("put"):
            # A put that overran may still be reading a write area (this stage's):
            # copying this batch in now would send its bytes under the late put's keys.
            if m is not None:
                m.remote_dropped_blocks.labels(reason="error").inc(len(valid))
            return
        obs = self.object_bytes
        self._gather(self._cpu, self._write_area, [p[1] for p in valid])
        still = [i for i, p in enumerate(valid) if gens[p[1]] == p[2]]
        if len(still) < len(valid) and m is not None:
            m.remote_dropped_blocks.labels(reason="overwritten").inc(len(valid) - len(still))
        if not still:
            return
        digests = [valid[i][0] for i in still]
        write_headers(self._write_area.numpy(), still, obs, digests, self.writer_id)
        base = self._write_area.data_ptr()
        keys = ks.keys(digests)
        ptrs = [base + i * obs for i in still]
        codes = self.pool.call("put", lambda c: c.batch_put_from(keys, ptrs, [obs] * len(keys)),
                               self.settings.timeout_seconds)
        if codes is None:
            if m is not None:
                reason = "error" if self.pool.health.up else "down"
                m.remote_dropped_blocks.labels(reason=reason).inc(len(keys))
            return
        failed = [int(c) for c in codes if c < 0]
        put = len(keys) - len(failed)
        if failed:
            self.pool.error("put", f"batch_put_from answered {failed[0]} for {len(failed)} "
                            "blocks", down=master_unreachable(failed[0]))
            if m is not None:
                m.remote_dropped_blocks.labels(reason="error").inc(len(failed))
        else:
            self.pool.health.succeeded()
        self.written_blocks += put
        if m is not None and put:
            m.remote_bytes.labels(direction="put").inc(put * self.bytes_per_block)

    def drain(self, timeout: float) -> bool:
        """Wait until the write-behind queue is empty (tests, benchmarks, shutdown)."""
        return self._writer is None or self._writer.drain(timeout)

    @property
    def queue_depth(self) -> int:
        return 0 if self._writer is None else self._writer.depth

    # -- copies --------------------------------------------------------------------

    # Copies between staging and the CPU tier are numpy copies: one thread each,
    # without the GIL. torch splits a large copy over its intra-op threads, and
    # while Mooncake's transfer threads (or another process) hold a core, every
    # such copy waits for its slowest part: on two busy cores a 256 MiB scatter
    # ran at a tenth of the speed of one thread.

    def _regions(self, area: torch.Tensor, n: int, cpu: CpuTier) -> np.ndarray:
        """The block bytes of the first ``n`` objects of ``area`` (after each header),
        as a ``(object, region, segment)`` view of ``area`` (writes go to it)."""
        seg, obs = self.keyspace.layout.segment_bytes, self.object_bytes
        buf = area[: max(1, n) * obs].numpy()  # the view's offset must lie inside it
        view = np.ndarray((n, cpu.num_regions, seg), dtype=np.uint8, buffer=buf,
                          offset=HEADER_BYTES, strides=(obs, seg, 1))
        return _wide(view)

    def _scatter(self, cpu: CpuTier, area: torch.Tensor, cpu_blocks: Sequence[int]) -> None:
        """Staged blocks (region order) into CPU blocks ``cpu_blocks``: one slice copy
        per region when the blocks are consecutive, else one indexed copy.
        ``IndexError`` before any byte moves when a block is outside the tier."""
        staged = self._regions(area, len(cpu_blocks), cpu)
        run, idx = _block_rows(cpu_blocks, cpu.num_blocks)
        for k in range(cpu.num_regions):
            segs = _wide(cpu.segments(k).numpy())
            if run is not None:
                np.copyto(segs[run[0]:run[1]], staged[:, k])
            else:
                segs[idx] = staged[:, k]

    def _gather(self, cpu: CpuTier, area: torch.Tensor, cpu_blocks: Sequence[int]) -> None:
        """CPU blocks ``cpu_blocks`` into the staging ``area`` (region order, after
        each object's header)."""
        staged = self._regions(area, len(cpu_blocks), cpu)
        run, idx = _block_rows(cpu_blocks, cpu.num_blocks)
        for k in range(cpu.num_regions):
            segs = _wide(cpu.segments(k).numpy())
            if run is not None:
                np.copyto(staged[:, k], segs[run[0]:run[1]])
            else:  # "clip" copies without a temporary; the bounds are checked above
                np.take(segs, idx, axis=0, out=staged[:, k], mode="clip")

    def status(self) -> dict[str, Any]:
        return {**self.pool.status(), "fingerprint": self.keyspace.fingerprint,
                "queueDepth": self.queue_depth, "fetchedBlocks": self.fetched_blocks,
                "writtenBlocks": self.written_blocks}

    def close(self) -> None:
        """Stop the writer (queued blocks are dropped) and release the staging buffer."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._staging is not None and not self.pool.closed:
            with self._fetch_lock:
                self.pool.unregister(self._staging)
        self._staging = self._fetch_area = self._write_area = None
