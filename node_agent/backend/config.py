"""Configuration of the embedded backend and its tiers, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from node_agent.backend.hashing import HashAlgorithm
from node_agent.vocab.layout import KVLayout


@dataclass(frozen=True)
class EmbeddedBackendConfig:
    """Everything :class:`~node_agent.backend.embedded.EmbeddedBackend` needs.

    Sizes are bytes; tier capacities in blocks follow from
    ``layout.bytes_per_block`` (all stored ranks of this stage). ``ssd_bytes``
    is split evenly across ``ssd_paths`` (directories; one preallocated file in
    each). ``expected_ranks`` (0: ``layout.tp_size``) must equal ``layout.tp_size``.
    """

    layout: KVLayout
    cpu_bytes: int
    pinned: bool = True
    ssd_bytes: int = 0
    ssd_paths: tuple[str, ...] = field(default_factory=tuple)
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    unlaunched_match_seconds: float = 30.0
    max_tasks: int = 4096
    worker_threads: int = 2
    copy_lanes: int = 2
    """Threads sharing the planes of one large CPU copy (``transfer.LANE_MIN_BYTES``)."""
    hash_algorithm: HashAlgorithm = HashAlgorithm.XXH3_64
    deferred_visibility: bool = False
    expected_ranks: int = 0
    namespace: str | None = None
    """Namespace of every block hash when a call names none: the stage's model
    (``node_agent.engine_api.identity.stage_namespace``), so that the blocks of two
    models never share an id in any tier."""
    ssd_persist: bool = False
    """Keep the SSD tier's blocks across restarts (``tiers.ssd.persist``; docs/backend.md):
    a backend starting with the same identity recovers the verified blocks."""
    pool: str = ""
    """The pool whose agent runs this stage: it owns the SSD directories
    (``node_agent.backend.ssd_owner``) and names a persistent tier's files."""
    cache_epoch: int = 0
    """The ``cacheEpoch`` a persistent SSD tier's files are written under."""
    ssd_shares: int = 1
    """How many tiers the node's SSD budget is split into (``tierShares``; 1: this
    backend's ``ssd_bytes`` is all of it): the SSD slots a tier prefers
    (``node_agent.backend.ssd_tier``)."""
    stop_spill_seconds: float = 10.0
    """How long ``shutdown`` may spill the CPU tier to a persistent SSD tier."""
    cpu_shared: bool = False
    """Keep an unpinned CPU tier in a memory file engines map read-only to copy
    claimed loads themselves (``cpu_tier``, docs/agent.md "Engine-side loads");
    False: private memory, no engine-side loads."""

    def __post_init__(self) -> None:
        if not isinstance(self.layout, KVLayout):
            raise ValueError(
                f"layout={self.layout!r} is invalid; pass a node_agent.vocab.layout.KVLayout"
            )
        bpb = self.layout.bytes_per_block
        _int_at_least("cpu_bytes", self.cpu_bytes, bpb,
                      f"one block of this layout takes {bpb} bytes; raise tiers.cpu.size")
        _int_at_least("ssd_bytes", self.ssd_bytes, 0, "use 0 to disable the SSD tier")
        object.__setattr__(self, "ssd_paths", tuple(str(p) for p in self.ssd_paths))
        if self.ssd_bytes and not self.ssd_paths:
            raise ValueError(
                f"ssd_bytes={self.ssd_bytes} needs at least one directory in ssd_paths; "
                "set tiers.ssd.paths or set ssd_bytes to 0"
            )
        if self.ssd_bytes and self.ssd_bytes < bpb * len(self.ssd_paths):
            raise ValueError(
                f"ssd_bytes={self.ssd_bytes} holds less than one {bpb}-byte block per path "
                f"({len(self.ssd_paths)} paths); raise tiers.ssd.size or set it to 0"
            )
        for key in ("high_watermark", "low_watermark"):
            value = getattr(self, key)
            if not isinstance(value, int | float) or not 0.0 < value <= 1.0:
                raise ValueError(f"{key}={value!r} is invalid; it must be a fraction in (0, 1]")
        if self.low_watermark > self.high_watermark:
            raise ValueError(
                f"low_watermark={self.low_watermark} is above high_watermark="
                f"{self.high_watermark}; eviction runs from high down to low, so low <= high"
            )
        if not isinstance(self.unlaunched_match_seconds, int | float) or not (
            self.unlaunched_match_seconds > 0
        ):
            raise ValueError(
                f"unlaunched_match_seconds={self.unlaunched_match_seconds!r} is invalid; it "
                "must be > 0 (un-launched matches must expire or they leak capacity)"
            )
        _int_at_least("max_tasks", self.max_tasks, 1, "use a positive task table size")
        _int_at_least("worker_threads", self.worker_threads, 1, "use at least 1 worker")
        _int_at_least("copy_lanes", self.copy_lanes, 1,
                      "use 1 to copy plane after plane, more to spread a copy over threads")
        try:
            object.__setattr__(self, "hash_algorithm", HashAlgorithm(self.hash_algorithm))
        except ValueError:
            raise ValueError(
                f"hash_algorithm={self.hash_algorithm!r} is unknown; use one of "
                f"{[a.value for a in HashAlgorithm]}"
            ) from None
        if self.ssd_persist and not self.ssd_bytes:
            raise ValueError(
                "ssd_persist=True without an SSD tier (ssd_bytes=0); set tiers.ssd.size or "
                "drop tiers.ssd.persist"
            )
        if self.expected_ranks == 0:
            object.__setattr__(self, "expected_ranks", self.layout.tp_size)
        elif self.expected_ranks != self.layout.tp_size:
            raise ValueError(
                f"expected_ranks={self.expected_ranks} differs from layout.tp_size="
                f"{self.layout.tp_size}; every TP rank of the stage registers its own buffers"
            )

    @property
    def tokens_per_block(self) -> int:
        """Tokens per block (from the layout)."""
        return self.layout.tokens_per_block

    @property
    def cpu_blocks(self) -> int:
        """CPU tier capacity in blocks."""
        return self.cpu_bytes // self.layout.bytes_per_block

    @property
    def ssd_blocks(self) -> int:
        """SSD tier capacity in blocks (a whole number per path)."""
        if not self.ssd_bytes:
            return 0
        per_path = self.ssd_bytes // len(self.ssd_paths) // self.layout.bytes_per_block
        return per_path * len(self.ssd_paths)


def _int_at_least(key: str, value: object, minimum: int, fix: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{key}={value!r} is invalid; it must be an int >= {minimum} ({fix})")
