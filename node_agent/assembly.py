"""The agent's composition root for stages: the coordinator of one PP group member
and the backend under it, built from explicit dependencies.

:func:`default_stage_builder` is the agent's stage builder: it takes a
:class:`StageDeps` (the agent's config, metrics, Mooncake client and cache-epoch
reader; never the agent itself) and serves as the engine API's
:class:`~node_agent.engine_api.service.StageFactory` once the agent binds it:

* the group is ``<pool>-<replica>`` (the KVCacheGroup name);
* a single-stage group (``ppSize`` 1) gets a fixed view naming itself leader at
  epoch 0 and no fan-out endpoint;
* a multi-stage group starts with an empty view (no leader: calls answer "not
  stored" / miss) that the agent's group-view source fills in, binds the fan-out
  server on ``bindAddress:ports.fanout`` and needs the pool's Curve keys;
* the connector's waits are split from ``engineCallSeconds``
  (:mod:`node_agent.vocab.budget`),
  so a call ends before the engine API would answer it with a timeout;
* the leader's backend is an :class:`EmbeddedBackend` with deferred visibility,
  sized by ``tiers``; a follower keeps a :class:`TierStore` of the same size;
  with ``tiers.remote`` each gets a :class:`RemoteTier` over the agent's one
  Mooncake client (docs/remote.md).

A single-stage group on the embedded backend without a remote tier lets the
engine socket's I/O thread answer its ``lookup``, ``store_kv``, ``release`` and
``poll_completed`` itself (``Stage.inline_ops``): they wait on no follower,
copy, timer or network (a store launches its copy and returns). With an SSD
tier ``store_kv`` keeps the workers: a store whose match evicts writes the
evicted blocks to SSD on the calling thread.

Several stages on one agent (``maxStages``): each stage keeps its own
coordinator and group view. The configured tier sizes are the node's budget,
split into ``tierShares`` (absent: ``maxStages``) even shares
(:func:`stage_share`), one per backend (:func:`backend_key` names it; the engine
API refuses a stage that needs a backend beyond them).
Stages of one-stage groups on the embedded backend whose KV is interchangeable
(same model identity, layout and PP shape: :class:`~.backend.shared.Fingerprint`)
share one backend on one share (:mod:`node_agent.backend.shared`): a prefix one
replica stored is a hit for the others. Every other stage (a PP group's, one
without a model identity, ``backend: flexkv``) has a backend of its own on its
own share, so a busy replica can never evict what it stored. The stages of
multi-stage groups share the agent's one fan-out server (:class:`SharedFanout`,
one port), which routes every message by its group.

``backend: flexkv`` serves one-stage groups: FlexKV's ``KVManager`` (through
:class:`FlexKVBackend`) behind :class:`SingleStageBackend`. A group of several
stages is refused with an error that says why: its followers must replay the
leader's physical decisions, which only the embedded backend produces.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from node_agent.backend.config import EmbeddedBackendConfig
from node_agent.backend.embedded import EmbeddedBackend
from node_agent.backend.flexkv_adapter import start_flexkv_backend
from node_agent.backend.remote.keys import KeySpace
from node_agent.backend.remote.objects import HEADER_BYTES
from node_agent.backend.remote.tier import RemotePool, RemoteTier
from node_agent.backend.replication import ReplicatedBackend
from node_agent.backend.shared import Fingerprint, SharedBackends, SharedStageBackend
from node_agent.backend.single_stage import SingleStageBackend
from node_agent.backend.stage_store import TierStore
from node_agent.config import AgentConfig
from node_agent.contract.kube import group_name
from node_agent.coordinator import Coordinator, CoordinatorConfig
from node_agent.engine_api.identity import stage_namespace
from node_agent.engine_api.service import INLINE_CANDIDATES, RankRef, Stage
from node_agent.events import KvEventPublisher
from node_agent.metrics import AgentMetrics
from node_agent.pp.auth import CurveKeys
from node_agent.pp.channel import FanoutServer
from node_agent.pp.group import GroupViewSource
from node_agent.vocab.budget import call_budget
from node_agent.vocab.group_view import GroupMember, GroupView
from node_agent.vocab.layout import KVLayout


class SharedFanout:
    """The agent's one fan-out server, bound on first use at
    ``bindAddress:ports.fanout`` with the pool's Curve keys (from ``curveKeyDir``)
    and shared by the coordinators of every multi-stage group the agent takes part
    in (they register their group on it and never close it); :meth:`close` at
    shutdown, after every stage closed. Thread-safe."""

    def __init__(self, cfg: AgentConfig, metrics: AgentMetrics | None = None) -> None:
        self._endpoint = f"tcp://{cfg.bind_address}:{cfg.ports.fanout}"
        self._key_dir = cfg.curve_key_dir
        self._metrics = metrics
        self._lock = threading.Lock()
        self._server: FanoutServer | None = None

    def get(self) -> FanoutServer:
        """The started server (binds it the first time; raises the bind error, or
        ``ValueError`` when the pool's Curve keys are missing)."""
        with self._lock:
            if self._server is None:
                self._server = FanoutServer(self._endpoint, CurveKeys.load(self._key_dir),
                                            on_drop=self._dropped).start()
            return self._server

    def _dropped(self, group: str, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.fanout_dropped.labels(group=group, reason=reason).inc()

    def close(self) -> None:
        """Stop the server (when it was started). Idempotent."""
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.close()


@dataclass(frozen=True)
class StageDeps:
    """What building a stage needs from the agent process.

    ``remote_pool`` is the agent's one Mooncake client (None without
    ``tiers.remote``); ``key_epoch`` returns the cache epoch remote tier keys carry
    now (the agent switches it before a flush starts)."""

    cfg: AgentConfig
    metrics: AgentMetrics
    remote_pool: RemotePool | None
    key_epoch: Callable[[], int]
    fanout: SharedFanout | None = field(default=None)
    """The agent's shared fan-out server; None: each multi-stage coordinator binds
    its own at ``ports.fanout`` (one such stage per agent)."""
    shared: SharedBackends | None = field(default=None)
    """The agent's backends shared by replicas of one model; None: every stage
    has a backend of its own."""
    events: KvEventPublisher | None = field(default=None)
    """The agent's KV-event publisher (``kvEvents``); None: events off."""
    shared_tiers: bool = field(default=False)
    """Whether single-stage groups keep their CPU tier in a memory file engines map
    to copy claimed loads themselves (the agent serves its tier socket,
    ``node_agent.backend.tier_fds``); False: every CPU tier in private memory."""


StageBuilder = Callable[[StageDeps, RankRef, KVLayout], Stage]
"""Builds and starts the coordinator of a newly registered stage (raises
``ValueError`` naming what is missing)."""


def stage_share(cfg: AgentConfig) -> AgentConfig:
    """``cfg`` with the CPU and SSD tier sizes of one backend: the configured sizes
    divided evenly by ``tierShares`` (absent: ``maxStages``; the sizes are the
    node's budget; with one share the one backend gets all of it)."""
    n = cfg.shares
    if n == 1:
        return cfg
    tiers = cfg.tiers
    cpu = dataclasses.replace(tiers.cpu, size=tiers.cpu.size // n)
    ssd = None if tiers.ssd is None else dataclasses.replace(tiers.ssd,
                                                             size=tiers.ssd.size // n)
    return dataclasses.replace(cfg, tiers=dataclasses.replace(tiers, cpu=cpu, ssd=ssd))


STOP_SPILL_SECONDS = 10.0
"""How long a clean stop may spend spilling CPU tiers to SSD, over all stages."""


def backend_config(cfg: AgentConfig, layout: KVLayout, model: str = "", pp_size: int = 1,
                   cache_epoch: int = 0) -> EmbeddedBackendConfig:
    """The embedded backend's config from agent.yaml ``tiers``/``eviction``/``timeouts``;
    its hash namespace is the stage's ``model`` (a digest, ``""`` for none) with the
    pool's ``modelSalt``. ``tiers.ssd.persist`` applies to single-stage groups with a
    model identity only (docs/pp.md: a PP group's stages cannot prove their surviving
    files agree; without an identity another model's blocks could be recovered);
    ``cache_epoch`` is the epoch the SSD files are written under."""
    namespace = stage_namespace(model, cfg.model_salt)
    ssd = cfg.tiers.ssd
    return EmbeddedBackendConfig(
        layout=layout, cpu_bytes=cfg.tiers.cpu.size, pinned=cfg.tiers.cpu.pinned,
        copy_lanes=cfg.tiers.cpu.copy_lanes,
        ssd_bytes=ssd.size if ssd else 0, ssd_paths=ssd.paths if ssd else (),
        high_watermark=cfg.eviction.high_watermark, low_watermark=cfg.eviction.low_watermark,
        unlaunched_match_seconds=cfg.timeouts.unlaunched_match_seconds,
        deferred_visibility=True,
        namespace=namespace,
        # Persisted only with a model identity (the engine's or the pool's
        # modelSalt): without one, another model of the same layout after a restart
        # could not be told apart from this one.
        ssd_persist=bool(ssd and ssd.persist and pp_size == 1 and namespace is not None),
        pool=cfg.pool,
        # The stages close one after another at a stop: together they spill for at
        # most STOP_SPILL_SECONDS, so the stop fits the pod's grace period.
        stop_spill_seconds=STOP_SPILL_SECONDS / cfg.max_stages,
        cache_epoch=cache_epoch,
        ssd_shares=cfg.shares,
    )


def remote_tier(deps: StageDeps, rank: RankRef, layout: KVLayout) -> RemoteTier | None:
    """The stage's remote tier over the agent's Mooncake pool (None without
    ``tiers.remote``); its keys carry the stage's PP rank, the pool's salt and the
    stage's model namespace."""
    pool = deps.remote_pool
    if pool is None:
        return None
    cfg = deps.cfg
    keyspace = KeySpace(layout=layout, pp_rank=rank.pp_rank, pp_size=rank.pp_size,
                        namespace=cfg.namespace, pool=cfg.pool, cache_epoch=deps.key_epoch(),
                        model=stage_namespace(rank.model, cfg.model_salt))
    return RemoteTier(pool, keyspace, epoch=deps.key_epoch)


def coordinator_config(cfg: AgentConfig, rank: RankRef, layout: KVLayout, group: str,
                     endpoint: str | None) -> CoordinatorConfig:
    """The stage's connector config, its waits split from ``engineCallSeconds`` by
    :func:`node_agent.vocab.budget.call_budget` so that every engine call ends inside it."""
    t = cfg.timeouts
    budget = call_budget(t.engine_call_seconds, t.fanout_wait_seconds)
    return CoordinatorConfig(
        group=group, pp_rank=rank.pp_rank, layout=layout, fanout_endpoint=endpoint,
        engine_call_seconds=t.engine_call_seconds,
        fanout_wait_seconds=budget.fanout_wait_seconds,
        transfer_seconds=budget.transfer_seconds,
        expected_ranks=layout.tp_size,
    )


def default_stage_builder(deps: StageDeps, rank: RankRef, layout: KVLayout) -> Stage:
    """Build and start the connector of ``rank``'s stage (see module docstring)."""
    cfg = stage_share(deps.cfg)
    if cfg.backend == "flexkv" and rank.pp_size > 1:
        raise ValueError(
            f"backend 'flexkv' serves one-stage groups only, but replica {rank.replica!r} has "
            f"ppSize {rank.pp_size}: its followers must replay the leader's physical "
            "decisions, which only the embedded backend makes; set backend: embedded in "
            "the pool for pipeline-parallel engines that span nodes"
        )
    group = group_name(cfg.pool, rank.replica)
    epoch = deps.key_epoch()  # what the stage is built under (Stage.cache_epoch)
    try:  # validates sizes against the layout
        bcfg = backend_config(cfg, layout, rank.model, rank.pp_size, epoch)
    except ValueError as exc:
        if cfg.shares == 1:
            raise
        if cfg.tier_shares is None:
            raise ValueError(f"{exc} (each of the agent's maxStages {cfg.max_stages} stages "
                             "gets 1/maxStages of tiers.cpu.size and tiers.ssd.size; raise the "
                             "sizes or lower maxStages)") from exc
        raise ValueError(f"{exc} (each of the agent's tierShares {cfg.shares} backends gets "
                         "1/tierShares of tiers.cpu.size and tiers.ssd.size; raise the sizes "
                         "or lower tierShares)") from exc
    if rank.pp_size == 1 and cfg.backend == "embedded" and deps.shared_tiers:
        bcfg = dataclasses.replace(bcfg, cpu_shared=True)
    remote = cfg.tiers.remote
    object_bytes = layout.bytes_per_block + HEADER_BYTES
    if remote is not None and remote.mooncake.local_buffer_size < 2 * object_bytes:
        raise ValueError(
            f"tiers.remote.mooncake.localBufferSize {remote.mooncake.local_buffer_size} bytes "
            f"holds less than two {object_bytes}-byte objects of this layout (a block and its "
            f"header; one to fetch, one to write); raise it to at least {2 * object_bytes} "
            "bytes in the agent's config, or register a layout with smaller blocks"
        )
    if rank.pp_size == 1:
        me = GroupMember(node=cfg.node_name, pp_rank=0, fanout_endpoint="")
        views = GroupViewSource(GroupView(group, 0, me, (me,), rank.replica, rank.pp_size))
        endpoint, keys = None, None
    else:
        views = GroupViewSource(GroupView(group, 0, None, (), rank.replica, rank.pp_size))
        endpoint = f"tcp://{cfg.bind_address}:{cfg.ports.fanout}"
        keys = CurveKeys.load(cfg.curve_key_dir)
    server = deps.fanout.get() if deps.fanout is not None and endpoint is not None else None
    ccfg = coordinator_config(cfg, rank, layout, group, endpoint)
    metrics = deps.metrics

    def own_backend() -> EmbeddedBackend:
        events = deps.events.stage(bcfg.tokens_per_block) if deps.events is not None else None
        return EmbeddedBackend(bcfg, metrics=metrics, remote=remote_tier(deps, rank, layout),
                               cache_epoch=deps.key_epoch, events=events)

    fingerprint = sharing_fingerprint(deps, rank, layout, bcfg.namespace)
    joined: list[SharedStageBackend] = []

    def leader_backend() -> ReplicatedBackend:
        if cfg.backend == "flexkv":
            return SingleStageBackend(start_flexkv_backend(cfg, layout, metrics),
                                      namespace=bcfg.namespace)
        if deps.shared is not None and fingerprint is not None:
            view = deps.shared.join(fingerprint, rank.replica, own_backend)
            joined.append(view)
            return view
        return own_backend()

    coordinator = Coordinator(
        ccfg, views,
        backend_factory=leader_backend,
        store_factory=lambda: TierStore(bcfg, remote_tier(deps, rank, layout), metrics),
        keys=keys, metrics=metrics, server=server, cache_epoch=deps.key_epoch,
    ).start()
    # A single-stage group's leader never waits on a follower, and the embedded
    # backend matches in memory: its lookups, stores (which launch their copy
    # and return) and releases take only short locks, so the engine socket's
    # I/O thread answers them without a worker hop. FlexKV's manager may wait
    # on its own server, and a remote tier's lookup fetches over the network
    # (bounded by its timeout, not by a lock): their calls keep the workers.
    # A store whose match evicts spills the evicted blocks to SSD on the calling
    # thread: with an SSD tier ``store_kv`` keeps the workers, so no disk write
    # (unbounded on a hung disk) ever runs on the I/O thread.
    inline = INLINE_CANDIDATES if (rank.pp_size == 1 and cfg.backend != "flexkv"
                                   and remote is None) else frozenset()
    if cfg.tiers.ssd is not None:
        inline = inline - {"store_kv"}
    return Stage(key=rank.stage, pp_size=rank.pp_size, group=group, layout=layout,
                 coordinator=coordinator, views=views, inline_ops=inline, model=rank.model,
                 cache_epoch=epoch, shared=joined[0] if joined else None)


def backend_key(deps: StageDeps, rank: RankRef, layout: KVLayout) -> Hashable:
    """The backend ``rank``'s new stage would use, and so the tier share it holds:
    its :func:`sharing_fingerprint` when it shares one with the other replicas of
    its model, else its own stage key (a backend of its own)."""
    namespace = stage_namespace(rank.model, deps.cfg.model_salt)
    fingerprint = sharing_fingerprint(deps, rank, layout, namespace)
    return rank.stage if fingerprint is None else fingerprint


def sharing_fingerprint(deps: StageDeps, rank: RankRef, layout: KVLayout,
                        namespace: str | None) -> Fingerprint | None:
    """The fingerprint under which ``rank``'s stage shares a backend with the other
    replicas of its model, or None when it keeps its own: the agent serves one
    stage (``maxStages`` 1), the group has several stages (followers replay their
    leader's physical plans on their own tiers, docs/pp.md), the backend is
    ``flexkv``, or the stage has no model identity (``namespace`` None: another
    model of the same layout could not be told apart)."""
    cfg = deps.cfg
    if (deps.shared is None or cfg.max_stages == 1 or rank.pp_size != 1
            or cfg.backend != "embedded" or namespace is None):
        return None
    return Fingerprint(namespace, layout, rank.pp_rank, rank.pp_size)
