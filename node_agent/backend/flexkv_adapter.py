"""The ``flexkv`` backend: :class:`~node_agent.backend.base.KVBackend` on FlexKV's ``KVManager``.

FlexKV (github.com/taco-project/FlexKV) is built from source against CUDA and is
not on the package index, so this module never imports it at module import:
:class:`FlexKVBackend` imports it in its constructor and raises
:class:`FlexKVUnavailableError` (what failed, how to install FlexKV, that
``backend: embedded`` needs none of it) when it is missing.

What the adapter adds on top of passing calls through (docs/flexkv.md has the
FlexKV facts, with the FlexKV source files they come from):

* **Conversions.** Token ids become int64 1-D CPU numpy arrays, masks bool
  copies (FlexKV writes into the mask it is given), a namespace string becomes
  FlexKV's ``List[str]``; FlexKV's ``KVResponse`` becomes ours, mapped by status
  *name* (FlexKV's ``NOTFOUND`` value is ``"not_found"``).
* **Configuration.** :class:`~node_agent.vocab.layout.KVLayout` becomes
  FlexKV's ``ModelConfig``; tier sizes in bytes become ``CacheConfig`` block
  counts using the bytes per block of one PP stage, rounded down so a tier
  never exceeds its configured size.
* **Validation FlexKV does not do.** Slot mappings are checked before
  ``launch`` (length equal to the mask's True count, in range of the registered
  buffers, no duplicates, whole aligned GPU pages: FlexKV reads only
  ``slot_mapping[::tokens_per_block] // tokens_per_block``), so a bad mapping
  raises ``ValueError`` and nothing is launched.
* **Put spans.** FlexKV's put needs its mask to start in block 0; a put span
  starting at a later block is matched from block 0 and accepted only when the
  blocks before it are cached (the embedded backend's rule).
* **Task hygiene.** A match with nothing to move returns task id -1 (FlexKV
  allocates an already-finished task; it is reaped at once). Un-launched matches
  expire after ``unlaunched_match_seconds`` and are cancelled, which unlocks
  their index nodes (FlexKV's own task table only forgets them after 30 min
  without unlocking). Launched tasks are never passed to FlexKV's ``cancel``
  (FlexKV would forget them while their transfer still runs). The task table is
  bounded by ``max_tasks``.
* **Non-blocking waits.** ``wait`` polls FlexKV with ``timeout=0.0`` outside
  the adapter's lock, so other threads' matches never queue behind a wait.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from node_agent.backend.base import (
    BackendStats,
    BoolMask,
    KVBackend,
    KVBackendError,
    KVResponse,
    KVResponseStatus,
    MatchOp,
    SlotArray,
    TaskNotFoundError,
    TierStats,
    TokenArray,
    task_id,
)
from node_agent.backend.planes import register_buffers
from node_agent.vocab.layout import KVLayout, LayoutName

if TYPE_CHECKING:
    import torch

    from node_agent.config import AgentConfig
    from node_agent.metrics import AgentMetrics

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "FlexKV is built from source against CUDA and is not on the package index: on a GPU "
    "node image run `apt-get install -y liburing-dev libxxhash-dev && git clone "
    "https://github.com/taco-project/FlexKV && cd FlexKV && ./build.sh --release && "
    "pip install -e .` (README, \"Adding FlexKV to an agent\"), or set `backend: embedded` "
    "in the KVCachePool, which needs no FlexKV"
)

_EVICTION_POLICIES = ("lru", "lfu", "slru", "fifo", "mru", "filo")
_CANCELLED_MEMO = 4096
# The longest socket FlexKV derives from the IPC directory (KVTPClient adds "_control").
_LONGEST_SOCKET = "/gpu_register_control"


class FlexKVUnavailableError(KVBackendError):
    """``backend: flexkv`` was asked for but ``import flexkv`` fails."""


@dataclass(frozen=True)
class FlexKVSettings:
    """Pool-level settings of the FlexKV backend (sizes in bytes, as in ``agent.yaml``).

    ``high_watermark`` becomes FlexKV's ``evict_start_threshold`` (evict when a
    tier is fuller than this fraction) and ``high - low`` its ``evict_ratio``
    (the least fraction evicted at once). ``ipc_dir`` holds FlexKV's two IPC
    sockets; ``None`` creates a private temporary directory at ``start``.
    """

    cpu_bytes: int
    ssd_bytes: int = 0
    ssd_paths: tuple[str, ...] = ()
    eviction_policy: str = "lru"
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    unlaunched_match_seconds: float = 30.0
    max_tasks: int = 65536
    ipc_dir: str | None = None
    poll_seconds: float = 0.002

    @classmethod
    def from_agent_config(cls, config: AgentConfig) -> FlexKVSettings:
        """Settings from ``agent.yaml``: tiers, eviction and the un-launched match timeout."""
        ssd = config.tiers.ssd
        with_ssd = ssd is not None and ssd.size > 0
        return cls(
            cpu_bytes=config.tiers.cpu.size,
            ssd_bytes=ssd.size if ssd is not None and with_ssd else 0,
            ssd_paths=ssd.paths if ssd is not None and with_ssd else (),
            eviction_policy=config.eviction.policy,
            high_watermark=config.eviction.high_watermark,
            low_watermark=config.eviction.low_watermark,
            unlaunched_match_seconds=config.timeouts.unlaunched_match_seconds,
        )

    def __post_init__(self) -> None:
        for key in ("cpu_bytes", "ssd_bytes", "max_tasks"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"FlexKVSettings.{key}={value!r} is invalid; use an int >= 0")
        if self.cpu_bytes == 0 or self.max_tasks == 0:
            raise ValueError(
                f"FlexKVSettings: cpu_bytes={self.cpu_bytes} and max_tasks={self.max_tasks} "
                "must be > 0 (FlexKV always needs a CPU tier)"
            )
        if self.ssd_bytes and not self.ssd_paths:
            raise ValueError(
                f"FlexKVSettings.ssd_bytes={self.ssd_bytes} needs ssd_paths; list at least one "
                "directory or set ssd_bytes=0"
            )
        if self.eviction_policy not in _EVICTION_POLICIES:
            raise ValueError(
                f"FlexKVSettings.eviction_policy={self.eviction_policy!r} is not a FlexKV "
                f"policy; use one of {', '.join(_EVICTION_POLICIES)}"
            )
        if not 0.0 < self.low_watermark <= self.high_watermark <= 1.0:
            raise ValueError(
                f"FlexKVSettings watermarks low={self.low_watermark}, high={self.high_watermark} "
                "are invalid; use 0 < low <= high <= 1"
            )
        if self.ipc_dir is not None and len(self.ipc_dir) + len(_LONGEST_SOCKET) > 107:
            raise ValueError(
                f"FlexKVSettings.ipc_dir={self.ipc_dir!r} is too long: FlexKV binds "
                f"<ipc_dir>{_LONGEST_SOCKET}, and a Unix socket path holds at most 107 bytes; "
                "use a shorter directory"
            )
        for key in ("unlaunched_match_seconds", "poll_seconds"):
            value = getattr(self, key)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"FlexKVSettings.{key}={value!r} is invalid; use a number > 0")


@dataclass(frozen=True)
class FlexKVSizing:
    """How tier bytes became FlexKV block counts for one PP stage."""

    bytes_per_block: int
    num_cpu_blocks: int
    num_ssd_blocks: int


def flexkv_block_bytes(layout: KVLayout) -> int:
    """Bytes of one FlexKV CPU/SSD block of this stage, computed as FlexKV does.

    FlexKV: ``num_layers_per_pp_stage * num_kv_heads * head_size * kv_dim *
    dtype.itemsize * tokens_per_block`` (``RankInfo.token_size_in_bytes_per_pp_stage``
    in flexkv/common/config.py), with ``num_kv_heads`` the whole model's count.
    """
    return (layout.num_layers * layout.num_kv_heads * layout.head_size * layout.kv_dim
            * layout.dtype.itemsize * layout.tokens_per_block)


def size_tiers(layout: KVLayout, settings: FlexKVSettings) -> FlexKVSizing:
    """Turn tier bytes into block counts, rounding down (a tier never exceeds its size).

    The SSD count is also rounded down to a multiple of the number of SSD paths
    (FlexKV's SSD allocator requires it; FlexKV itself rounds *up*).
    """
    per_block = flexkv_block_bytes(layout)
    cpu = settings.cpu_bytes // per_block
    if cpu < 1:
        raise ValueError(
            f"tiers.cpu.size={settings.cpu_bytes} bytes holds no FlexKV block of {per_block} "
            f"bytes ({layout.tokens_per_block} tokens x {layout.num_layers} layers); raise it"
        )
    ssd = 0
    if settings.ssd_bytes:
        ssd = settings.ssd_bytes // per_block // len(settings.ssd_paths) * len(settings.ssd_paths)
        if ssd < 1:
            raise ValueError(
                f"tiers.ssd.size={settings.ssd_bytes} bytes holds no FlexKV block of {per_block} "
                f"bytes on each of {len(settings.ssd_paths)} paths; raise it or remove the SSD tier"
            )
    return FlexKVSizing(per_block, cpu, ssd)


class _FlexKV:
    """The FlexKV names the adapter uses, imported on demand."""

    def __init__(self) -> None:
        try:
            kvmanager = importlib.import_module("flexkv.kvmanager")
            config = importlib.import_module("flexkv.common.config")
            storage = importlib.import_module("flexkv.common.storage")
            client = importlib.import_module("flexkv.server.client")
        except ImportError as exc:
            raise FlexKVUnavailableError(
                f"The flexkv backend cannot start: importing FlexKV failed ({exc}). "
                + INSTALL_HINT
            ) from exc
        self.KVManager: Any = kvmanager.KVManager
        self.ModelConfig: Any = config.ModelConfig
        self.CacheConfig: Any = config.CacheConfig
        self.env_config: Any = config.GLOBAL_CONFIG_FROM_ENV
        self.KVCacheLayout: Any = storage.KVCacheLayout
        self.LAYERFIRST: Any = storage.KVCacheLayoutType.LAYERFIRST
        self.KVTPClient: Any = client.KVTPClient


@dataclass
class _Entry:
    """One live task: its kind, mask, and whether it was launched."""

    op: str
    mask: BoolMask
    created: float
    launched: bool = False


class FlexKVBackend(KVBackend):
    """One PP stage's KV cache held by FlexKV (``backend: flexkv``).

    Construction imports FlexKV and builds its configs; :meth:`start` creates
    and starts the ``KVManager`` (FlexKV allocates its tiers and transfer
    processes then). The manager is a single-stage one (``pp_size=1``): PP groups
    across nodes are coordinated by the agent, not by FlexKV's multi-node mode.
    """

    def __init__(
        self,
        layout: KVLayout,
        settings: FlexKVSettings,
        metrics: AgentMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fk = _FlexKV()
        self.layout = layout
        self.settings = settings
        self.tokens_per_block = layout.tokens_per_block
        self.sizing = size_tiers(layout, settings)
        self._metrics = metrics
        self._clock = clock
        self._lock = threading.RLock()
        self._manager: Any = None
        self._stopped = False
        self._ipc_dir: str | None = None
        self._own_ipc_dir = False
        self._tasks: dict[int, _Entry] = {}
        self._cancelled: OrderedDict[int, int] = OrderedDict()
        self._registered: dict[int, int] = {}
        self.model_config: Any = self._fk.ModelConfig(
            num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads,
            head_size=layout.head_size,
            kv_dim=layout.kv_dim,
            dtype=layout.dtype.torch_dtype,
            tp_size=layout.tp_size,
            pp_size=1,
            dp_size=1,
        )
        self.cache_config: Any = self._fk.CacheConfig(
            tokens_per_block=layout.tokens_per_block,
            eviction_policy=settings.eviction_policy,
            enable_cpu=True,
            enable_ssd=self.sizing.num_ssd_blocks > 0,
            num_cpu_blocks=self.sizing.num_cpu_blocks,
            num_ssd_blocks=self.sizing.num_ssd_blocks,
            ssd_cache_dir=list(settings.ssd_paths) if settings.ssd_paths else None,
        )

    # -- lifecycle ---------------------------------------------------------

    @property
    def gpu_register_port(self) -> str:
        """FlexKV's GPU registration endpoint (``ipc://...``), known after :meth:`start`.

        Engine processes on GPU nodes may register with FlexKV directly through
        ``flexkv.server.client.KVTPClient`` on this port.
        """
        self._require_started("gpu_register_port")
        assert self._ipc_dir is not None
        return f"ipc://{self._ipc_dir}/gpu_register"

    def start(self) -> None:
        with self._lock:
            if self._manager is not None:
                return
            if self._stopped:
                raise KVBackendError(
                    "The flexkv backend was shut down and cannot start again; construct a new one"
                )
            if self.settings.ipc_dir is None:
                self._ipc_dir = tempfile.mkdtemp(prefix="flexkv-")
                self._own_ipc_dir = True
            else:
                self._ipc_dir = self.settings.ipc_dir
            env = self._fk.env_config
            # FlexKV's cache engine reads eviction settings from this process-wide
            # namespace (filled from FLEXKV_* variables), not from CacheConfig.
            env.eviction_policy = self.settings.eviction_policy
            env.evict_start_threshold = self.settings.high_watermark
            env.evict_ratio = self.settings.high_watermark - self.settings.low_watermark
            manager = None
            try:
                manager = self._fk.KVManager(
                    model_config=self.model_config,
                    cache_config=self.cache_config,
                    server_recv_port=f"ipc://{self._ipc_dir}/server",
                    gpu_register_port=f"ipc://{self._ipc_dir}/gpu_register",
                )
                manager.start()
            except Exception as exc:
                if manager is not None:
                    # Stop whatever the half-started manager spawned; its own error
                    # is secondary to the one being raised.
                    with contextlib.suppress(Exception):
                        manager.shutdown()
                self._drop_ipc_dir()
                raise KVBackendError(
                    f"FlexKV's KVManager failed to start ({exc}); check the FlexKV build "
                    "(CUDA, liburing) and the tier paths, or use backend: embedded"
                ) from exc
            self._manager = manager
            log.info(
                "FlexKV manager started",
                extra={"cpu_blocks": self.sizing.num_cpu_blocks,
                       "ssd_blocks": self.sizing.num_ssd_blocks,
                       "bytes_per_block": self.sizing.bytes_per_block,
                       "ipc_dir": self._ipc_dir},
            )
            if self._metrics is not None:
                for tier, stats in self._tier_stats().items():
                    self._metrics.tier_capacity_bytes.labels(tier=tier).set(stats.capacity_bytes)

    def is_ready(self) -> bool:
        with self._lock:
            return self._manager is not None and bool(self._manager.is_ready())

    def shutdown(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            manager, self._manager = self._manager, None
            self._tasks.clear()
            if manager is not None:
                try:
                    manager.shutdown()
                finally:
                    self._drop_ipc_dir()
            log.info("FlexKV manager shut down")

    def reset(self) -> None:
        with self._lock:
            manager = self._require_started("reset")
            manager.reset()
            unlaunched = [tid for tid, e in self._tasks.items() if not e.launched]
            if unlaunched:
                manager.cancel(unlaunched)
            for tid in unlaunched:
                self._forget_cancelled(tid)
            log.info("FlexKV cache reset", extra={"cancelled_matches": len(unlaunched)})

    def register_kv_buffers(
        self, rank: int, buffers: Sequence[Sequence[torch.Tensor]]
    ) -> None:
        """Register one engine rank's KV buffers with FlexKV (``KVTPClient.register_to_server``).

        The buffers are checked against the layout first (``ValueError``, nothing
        registered). FlexKV takes CUDA tensors only; on a CPU-only node its
        refusal becomes a ``ValueError`` that points to ``backend: embedded``.
        FlexKV keeps a rank's CUDA mappings for the life of its transfer
        manager, so registering a rank twice raises ``KVBackendError``.
        """
        if self.layout.name.paged:
            raise ValueError(
                f"rank {rank}: layout {self.layout.name.value} (vLLM's CPU KV cache) is not "
                "one FlexKV registers; on a node without GPUs use backend: embedded"
            )
        registered = register_buffers(self.layout, rank, buffers)
        tensors = self._flexkv_tensors(buffers)
        num_block = registered.num_slots // self.tokens_per_block
        if num_block < 1:
            raise ValueError(
                f"rank {rank}: buffers hold {registered.num_slots} slots, less than one page of "
                f"{self.tokens_per_block} tokens; FlexKV moves whole pages"
            )
        with self._lock:
            self._require_started("register_kv_buffers")
            if rank in self._registered:
                raise KVBackendError(
                    f"rank {rank} is already registered with FlexKV, which keeps a rank's CUDA "
                    "mappings until its transfer manager stops; restart the agent to replace them"
                )
            fk_layout = self._fk.KVCacheLayout(
                type=self._fk.LAYERFIRST,
                num_layer=self.layout.num_layers,
                num_block=num_block,
                tokens_per_block=self.tokens_per_block,
                num_head=self.layout.heads_per_rank,
                head_size=self.layout.head_size,
                kv_dim=self.layout.kv_dim,
                num_kv_heads=self.layout.heads_per_rank,
            )
            device = registered.device
            client = self._fk.KVTPClient(
                self.gpu_register_port,
                dp_client_id=0,
                device_id=(device.index or 0) if device.type == "cuda" else 0,
                pp_rank=0,
                intra_client_id=rank,
            )
            try:
                client.register_to_server(
                    kv_caches=[t[: num_block * self.tokens_per_block] if t.dim() == 3 else t
                               for t in tensors],
                    kv_layout=fk_layout,
                )
            except ValueError as exc:
                raise ValueError(
                    f"rank {rank}: FlexKV rejected the KV buffers on {device} ({exc}); FlexKV "
                    "copies with CUDA and registers CUDA tensors only, so on a node without "
                    "GPUs use backend: embedded"
                ) from exc
            self._registered[rank] = num_block * self.tokens_per_block
            log.info("Engine rank registered with FlexKV",
                     extra={"rank": rank, "device": str(device), "num_block": num_block})

    def _flexkv_tensors(self, buffers: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
        """FlexKV's LAYERFIRST tensor list for one rank (views, never copies).

        ``layer_slot_head``: every layer's K then every layer's V (or the MLA
        latents), each ``(slots, heads, head_size)`` as FlexKV's SGLang connector
        registers them. ``layer_kv_slot_head``: one ``(kv_dim, num_block,
        tokens_per_block, heads, head_size)`` view per layer, FlexKV's vLLM form;
        MLA latents use the SGLang form.
        """
        lay, tpb = self.layout, self.tokens_per_block
        if lay.name is LayoutName.LAYER_SLOT_HEAD:
            return [t for group in buffers for t in group]
        layers = list(buffers[0])
        num_block = layers[0].shape[1] // tpb
        if lay.is_mla:
            return [t[0] for t in layers]
        return [t[:, : num_block * tpb].view(lay.kv_dim, num_block, tpb, lay.heads_per_rank,
                                            lay.head_size) for t in layers]

    # -- matching -----------------------------------------------------------

    def _match(self, op: MatchOp, ids: TokenArray, token_mask: BoolMask | None,
               namespace: str | None) -> tuple[int, BoolMask]:
        n = len(ids)
        mask = _input_mask(token_mask, n)
        ns = _namespace(namespace)
        aligned = n // self.tokens_per_block * self.tokens_per_block
        wanted = mask[:aligned] if mask is not None else np.ones(aligned, dtype=np.bool_)
        # FlexKV's put needs its mask to start in block 0 (cache_engine.put asserts it).
        # A put span starting at block k > 0 is asked for as [0, end) and accepted only
        # if FlexKV already holds blocks 0..k-1, the embedded backend's rule.
        span_start, fk_mask = 0, mask
        if op == "put" and mask is not None and wanted.any():
            span_start = int(np.argmax(wanted))
            if span_start % self.tokens_per_block:
                raise ValueError(
                    f"put_match: token_mask starts at token {span_start}, not a multiple of "
                    f"tokens_per_block={self.tokens_per_block}; start the span at a block "
                    "boundary"
                )
            fk_mask = np.zeros(n, dtype=np.bool_)
            fk_mask[: int(np.flatnonzero(wanted)[-1]) + 1] = True
        empty = np.zeros(n, dtype=np.bool_)
        if not wanted.any():
            return -1, empty
        with self._lock:
            manager = self._require_started(f"{op}_match")
            self._expire_unlaunched()
            if len(self._tasks) >= self.settings.max_tasks:
                raise KVBackendError(
                    f"{op}_match: {len(self._tasks)} live tasks reached max_tasks="
                    f"{self.settings.max_tasks}; wait on finished tasks or cancel un-launched ones"
                )
            started = time.perf_counter()
            call = manager.get_match if op == "get" else manager.put_match
            tid, raw = call(ids, token_mask=None if fk_mask is None else fk_mask.copy(),
                            namespace=ns)
            if self._metrics is not None:
                self._metrics.match_seconds.labels(op=op).observe(time.perf_counter() - started)
            try:
                result = self._check_result_mask(op, int(tid), raw, n)
            except KVBackendError:
                # FlexKV allocated the task and locked its index nodes: roll it back.
                self._cancel_quietly(int(tid), op)
                raise
            if not result.any():
                self._reap_empty(int(tid))
                return -1, empty
            if int(np.argmax(result)) < span_start:
                # Blocks before the caller's span are not cached: a block without its
                # parent would be unreachable, so nothing is stored.
                self._manager.cancel([int(tid)])
                return -1, empty
            self._tasks[int(tid)] = _Entry(op, result, self._clock())
            return int(tid), result.copy()

    def _check_result_mask(self, op: str, tid: int, raw: Any, n: int) -> BoolMask:
        """FlexKV's mask, checked: bool, ``n`` long, one contiguous block-aligned span."""
        result = np.asarray(raw)
        if result.shape != (n,) or result.dtype != np.bool_:
            raise KVBackendError(
                f"FlexKV {op}_match returned task {tid} with a mask of dtype {result.dtype} and "
                f"shape {result.shape}, expected bool ({n},); the FlexKV build does not match "
                "the API this adapter was written for (docs/flexkv.md)"
            )
        idx = np.flatnonzero(result)
        tpb = self.tokens_per_block
        if len(idx) and (idx[-1] - idx[0] + 1 != len(idx) or idx[0] % tpb or len(idx) % tpb):
            raise KVBackendError(
                f"FlexKV {op}_match returned task {tid} with a mask that is not one contiguous "
                f"span of whole {tpb}-token blocks (True at {idx[0]}..{idx[-1]}, {len(idx)} tokens)"
            )
        return result.copy()

    def _cancel_quietly(self, tid: int, op: str) -> None:
        """Cancel ``tid`` on the way out of a failed match; a failing cancel is logged,
        never raised over the match's own error."""
        assert self._manager is not None
        try:
            self._manager.cancel([tid])
        except Exception as exc:
            log.warning("FlexKV cancel of a refused match failed",
                        extra={"op": op, "task_id": tid, "error": str(exc)})

    def _reap_empty(self, tid: int) -> None:
        """Release a task FlexKV allocated for a match with nothing to move."""
        assert self._manager is not None
        answered = self._manager.try_wait([tid])
        if tid not in answered or _status_name(answered[tid]) != "SUCCESS":
            self._manager.cancel([tid])

    # -- execution ----------------------------------------------------------

    def _launch(self, ids: list[int], slot_mappings: Sequence[SlotArray],
                as_batch: bool) -> list[int]:
        with self._lock:
            manager = self._require_started("launch")
            self._expire_unlaunched()
            entries = []
            for tid in ids:
                entry = self._tasks.get(tid)
                if entry is None or entry.launched:
                    raise TaskNotFoundError(
                        f"launch: task {tid} is not a live, un-launched task (unknown, expired, "
                        "cancelled, reset, already launched or reaped); match again"
                    )
                entries.append(entry)
            limit = self._slot_limit()
            slots = [
                self._check_slots(tid, sm, int(e.mask.sum()), limit)
                for tid, sm, e in zip(ids, slot_mappings, entries, strict=True)
            ]
            try:
                returned = [int(t) for t in manager.launch(
                    task_ids=ids, slot_mappings=slots, as_batch=as_batch)]
            except Exception as exc:
                raise KVBackendError(f"FlexKV launch of tasks {ids} failed: {exc}") from exc
            if returned == ids:
                for e in entries:
                    e.launched = True
            elif as_batch and len(returned) == 1 and len(ids) > 1:
                for tid in ids:
                    del self._tasks[tid]
                self._tasks[returned[0]] = _Entry(
                    entries[0].op, np.concatenate([e.mask for e in entries]), self._clock(),
                    launched=True)
            else:
                raise KVBackendError(
                    f"FlexKV launch of tasks {ids} returned {returned}, neither the same ids nor "
                    "one batch id"
                )
            return returned

    def _slot_limit(self) -> int | None:
        """Slots every adapter-registered rank holds (None: ranks registered outside).

        Raises ``KVBackendError`` until FlexKV reports ready (every rank's buffers
        received): a transfer launched earlier would have no GPU to copy from.
        """
        assert self._manager is not None
        if not self._manager.is_ready():
            raise KVBackendError(
                f"launch: FlexKV is not ready; {len(self._registered)} of "
                f"{self.layout.tp_size} engine ranks registered through this agent. Register "
                "every rank's KV buffers before launching transfers"
            )
        return min(self._registered.values()) if self._registered else None

    def _check_slots(self, tid: int, mapping: Any, want: int, limit: int | None) -> np.ndarray:
        """One task's slot mapping as int64, or ``ValueError`` naming the bad value."""
        arr = np.asarray(mapping.cpu() if hasattr(mapping, "cpu") else mapping)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise ValueError(
                f"launch: task {tid}'s slot mapping must be a 1-D integer array, got dtype "
                f"{arr.dtype} shape {arr.shape}"
            )
        if len(arr) != want:
            raise ValueError(
                f"launch: task {tid}'s slot mapping has {len(arr)} slots but its mask has "
                f"{want} True tokens; pass one slot per masked token"
            )
        arr = arr.astype(np.int64)
        if arr.min() < 0:
            raise ValueError(f"launch: task {tid}'s slot mapping has negative slot {arr.min()}")
        if limit is not None and arr.max() >= limit:
            raise ValueError(
                f"launch: task {tid}'s slot mapping has slot {arr.max()}, outside the {limit} "
                "slots every registered rank holds"
            )
        if len(np.unique(arr)) != len(arr):
            raise ValueError(f"launch: task {tid}'s slot mapping repeats a slot")
        tpb = self.tokens_per_block
        pages = arr.reshape(-1, tpb)
        bad = np.flatnonzero((pages[:, 0] % tpb != 0)
                             | np.any(pages != pages[:, :1] + np.arange(tpb), axis=1))
        if len(bad):
            b = int(bad[0])
            raise ValueError(
                f"launch: task {tid}'s slot mapping block {b} holds slots "
                f"{pages[b].tolist()}, not one whole aligned page of {tpb} slots; FlexKV moves "
                "whole GPU pages (engine page size must equal tokensPerBlock)"
            )
        return arr

    def _wait(self, ids: list[int], timeout: float, completely: bool) -> dict[int, KVResponse]:
        """Poll FlexKV until every task is terminal or ``timeout`` passes.

        ``completely`` is passed to FlexKV, where it means "the task's whole
        transfer graph finished" rather than only its end op; in both modes this
        waits for every id (the base contract allows that).
        """
        if not (isinstance(timeout, int | float) and math.isfinite(timeout) and timeout >= 0):
            raise ValueError(f"wait: timeout={timeout!r} is invalid; use a finite number >= 0")
        deadline = time.monotonic() + timeout
        done: dict[int, KVResponse] = {}
        pending = list(dict.fromkeys(ids))
        while True:
            with self._lock:
                self._require_started("wait")
                pending = self._poll(pending, done, completely, include_unready=True)
            remaining = deadline - time.monotonic()
            if not pending or remaining <= 0:
                break
            time.sleep(min(self.settings.poll_seconds, remaining))
        with self._lock:
            for tid in pending:
                entry = self._tasks.get(tid)
                done[tid] = KVResponse(KVResponseStatus.TIMEOUT, tid, _zeros(entry))
        return {tid: done[tid] for tid in dict.fromkeys(ids)}

    def try_wait(self, task_ids: Sequence[int]) -> dict[int, KVResponse]:
        ids = [task_id(t) for t in task_ids]
        done: dict[int, KVResponse] = {}
        with self._lock:
            self._require_started("try_wait")
            self._poll(list(dict.fromkeys(ids)), done, False, include_unready=False)
        return done

    def _poll(self, pending: list[int], done: dict[int, KVResponse], completely: bool,
              include_unready: bool) -> list[int]:
        """Answer what can be answered now; return the ids still running."""
        assert self._manager is not None
        self._expire_unlaunched()
        running = []
        for tid in pending:
            entry = self._tasks.get(tid)
            if entry is None:
                length = self._cancelled.pop(tid, None)
                if length is None:
                    done[tid] = KVResponse(KVResponseStatus.NOTFOUND, tid, None)
                else:
                    done[tid] = KVResponse(KVResponseStatus.CANCELLED, tid,
                                           np.zeros(length, dtype=np.bool_))
            elif not entry.launched:
                if include_unready:
                    done[tid] = KVResponse(KVResponseStatus.UNREADY, tid, _zeros(entry))
            else:
                running.append(tid)
        if not running:
            return []
        answers = self._manager.wait(running, timeout=0.0, completely=completely)
        still = []
        for tid in running:
            answer = answers.get(tid)
            status = _convert_status(answer) if answer is not None else KVResponseStatus.TIMEOUT
            if not status.terminal:
                still.append(tid)
                continue
            entry = self._tasks.pop(tid)
            if status is KVResponseStatus.SUCCESS:
                done[tid] = KVResponse(status, tid, entry.mask.copy())
            else:
                error = ("FlexKV reported the transfer failed" if status is KVResponseStatus.FAILED
                         else None)
                done[tid] = KVResponse(status, tid, _zeros(entry), error=error)
                if status is KVResponseStatus.FAILED:
                    log.warning("FlexKV task failed", extra={"task_id": tid, "op": entry.op})
        return still

    def cancel(self, task_ids: Sequence[int]) -> None:
        """Roll back un-launched tasks through FlexKV's ``cancel``. Unlike the embedded
        backend, launched tasks are not stopped: they run to their end in FlexKV's
        transfer engine (see :meth:`KVBackend.cancel`)."""
        ids = [task_id(t) for t in task_ids]
        with self._lock:
            manager = self._require_started("cancel")
            victims = [t for t in dict.fromkeys(ids)
                       if t in self._tasks and not self._tasks[t].launched]
            if victims:
                manager.cancel(victims)
            for tid in victims:
                self._forget_cancelled(tid)

    # -- bookkeeping --------------------------------------------------------

    def _require_started(self, what: str) -> Any:
        if self._manager is None:
            state = "was shut down" if self._stopped else "is not started; call start() first"
            raise KVBackendError(f"{what}: the flexkv backend {state}")
        return self._manager

    def _forget_cancelled(self, tid: int) -> None:
        entry = self._tasks.pop(tid)
        self._cancelled[tid] = len(entry.mask)
        while len(self._cancelled) > _CANCELLED_MEMO:
            self._cancelled.popitem(last=False)

    def _expire_unlaunched(self) -> None:
        """Cancel matches left un-launched for ``unlaunched_match_seconds`` (unlocks them)."""
        cutoff = self._clock() - self.settings.unlaunched_match_seconds
        stale = [t for t, e in self._tasks.items() if not e.launched and e.created <= cutoff]
        if not stale:
            return
        assert self._manager is not None
        self._manager.cancel(stale)
        for tid in stale:
            self._forget_cancelled(tid)
        log.warning("Expired un-launched FlexKV matches",
                    extra={"task_ids": stale,
                           "unlaunched_match_seconds": self.settings.unlaunched_match_seconds})

    def _drop_ipc_dir(self) -> None:
        if self._own_ipc_dir and self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._own_ipc_dir = False

    def _tier_stats(self) -> dict[str, TierStats]:
        per_block = self.sizing.bytes_per_block
        tiers = {"cpu": TierStats(self.sizing.num_cpu_blocks * per_block, 0,
                                  self.sizing.num_cpu_blocks, 0)}
        if self.sizing.num_ssd_blocks:
            tiers["ssd"] = TierStats(self.sizing.num_ssd_blocks * per_block, 0,
                                     self.sizing.num_ssd_blocks, 0)
        return tiers

    def stats(self) -> BackendStats:
        """Tier capacities and task counts. FlexKV does not expose tier use to its
        caller, so ``used_*`` stay 0 (FlexKV's own metrics server reports them)."""
        with self._lock:
            launched = sum(1 for e in self._tasks.values() if e.launched)
            return BackendStats(
                tiers=self._tier_stats(),
                tasks={"matched": len(self._tasks) - launched, "launched": launched},
                registered_ranks=tuple(sorted(self._registered)),
                expected_ranks=self.layout.tp_size,
            )


def _input_mask(token_mask: Any, n: int) -> BoolMask | None:
    """The caller's mask as a private bool copy; True entries must form one span."""
    if token_mask is None:
        return None
    if hasattr(token_mask, "detach"):
        token_mask = token_mask.detach().cpu().numpy()
    arr = np.asarray(token_mask)
    if arr.dtype != np.bool_ or arr.shape != (n,):
        raise ValueError(
            f"token_mask must be a bool array of shape ({n},) like token_ids, got dtype "
            f"{arr.dtype} shape {arr.shape}"
        )
    idx = np.flatnonzero(arr)
    if len(idx) and idx[-1] - idx[0] + 1 != len(idx):
        raise ValueError(
            f"token_mask must be True over one contiguous span, got True at {idx.tolist()[:8]}..."
        )
    return arr.copy()


def _namespace(namespace: str | None) -> list[str] | None:
    """FlexKV's namespace is a list of strings (hashed joined by NUL); ours is one string."""
    if namespace is None or namespace == "":
        return None
    if not isinstance(namespace, str):
        raise ValueError(f"namespace must be a string or None, got {namespace!r}")
    return [namespace]


def _status_name(answer: Any) -> str:
    return str(getattr(getattr(answer, "status", None), "name", ""))


def _convert_status(answer: Any) -> KVResponseStatus:
    """FlexKV's status mapped by *name* onto ours."""
    name = _status_name(answer)
    try:
        return KVResponseStatus[name]
    except KeyError:
        raise KVBackendError(
            f"FlexKV answered status {name or answer!r}, which this adapter does not know; "
            f"expected one of {[s.name for s in KVResponseStatus]}"
        ) from None


def _zeros(entry: _Entry | None) -> BoolMask | None:
    return None if entry is None else np.zeros(len(entry.mask), dtype=np.bool_)


def start_flexkv_backend(
    config: AgentConfig, layout: KVLayout, metrics: AgentMetrics | None = None
) -> FlexKVBackend:
    """A started FlexKV backend for one stage of an agent (``backend: flexkv``).

    For the agent's stage builder. Raises :class:`FlexKVUnavailableError` when
    FlexKV is not installed and ``ValueError`` when ``tokensPerBlock`` and the
    layout disagree or a tier holds no block.
    """
    if layout.tokens_per_block != config.tokens_per_block:
        raise ValueError(
            f"layout.tokens_per_block={layout.tokens_per_block} differs from tokensPerBlock="
            f"{config.tokens_per_block}; FlexKV's blocks and the engine's pages must match"
        )
    backend = FlexKVBackend(layout, FlexKVSettings.from_agent_config(config), metrics=metrics)
    backend.start()
    return backend
