"""Assembly of the agent process: config -> engine API, stages, group views,
heartbeat, HTTP; one asyncio loop runs uvicorn and the lifespan owns the rest.

Start order (the HTTP lifespan): stages holder, group-view source, engine API
server, cache-epoch watcher, heartbeat. Stop order is the reverse: the Lease is
marked not ready, the engine socket stops taking calls and drains in-flight ones
(bounded by ``engineCallSeconds``), then connectors and backends close. uvicorn
turns SIGTERM / SIGINT into that shutdown.

What survives what (docs/agent.md): an engine restart keeps everything cached
(the engine re-registers its buffers); an agent restart keeps a single-stage
group's SSD tier when ``tiers.ssd.persist`` is on (its verified blocks are
indexed again; a clean stop spills the CPU tier there first) and loses the rest,
because the block index lives in the agent's memory; engines re-register
transparently on their next call. The agent holds its SSD directories for its
pool from the start (``node_agent.backend.ssd_owner``): an agent of another pool
on the same paths is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI

from node_agent import __version__
from node_agent.assembly import SharedFanout, StageBuilder, StageDeps, backend_key
from node_agent.backend.cpu_tier import read_only_fd
from node_agent.backend.remote.join import StorePortInUse, store_ports_problem
from node_agent.backend.remote.mooncake_client import MooncakeUnavailable, check_available
from node_agent.backend.remote.settings import RemoteSettings
from node_agent.backend.remote.tier import RemotePool
from node_agent.backend.shared import SharedBackends
from node_agent.backend.ssd_owner import DirectoryOwner, SsdPathInUse
from node_agent.backend.tier_fds import TierFdServer, tier_socket_path
from node_agent.config import AgentConfig, ConfigError, load_config
from node_agent.engine_api.server import EngineServer
from node_agent.engine_api.service import EngineService, RankRef, Stage, StageKey
from node_agent.events import KvEventPublisher
from node_agent.http.app import create_app
from node_agent.http.lookup import LookupRequest, LookupRequestError
from node_agent.http.state import Service
from node_agent.kube.group_watch import KubeGroupSource
from node_agent.kube.groups import FileGroupSource
from node_agent.kube.heartbeat import LeaseHeartbeat
from node_agent.kube.lookup_window import LookupWindow
from node_agent.metrics import AgentMetrics
from node_agent.vocab.budget import call_budget
from node_agent.vocab.group_view import GroupView, GroupViewError
from node_agent.vocab.layout import KVLayout
from node_agent.vocab.recent_errors import RecentErrors

log = logging.getLogger(__name__)

def build_remote_pool(cfg: AgentConfig, metrics: AgentMetrics) -> RemotePool | None:
    """The agent's Mooncake Store client for ``tiers.remote`` (None without it). It
    joins in the background: a master that is down at start makes the tier down,
    not the agent. Raises ``MooncakeUnavailable`` when the ``remote`` extra or
    ``libibverbs1`` is missing."""
    rt = cfg.tiers.remote
    if rt is None:
        return None
    mc = rt.mooncake
    check_available(mc.store_port, rt.timeout_seconds)
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if mc.segment_size + mc.local_buffer_size > memory:
        raise ConfigError(
            f"tiers.remote.mooncake: segmentSize {mc.segment_size} + localBufferSize "
            f"{mc.local_buffer_size} bytes exceed this node's memory ({memory} bytes); lower "
            "them (e.g. segmentSize 4Gi, localBufferSize 512Mi)")
    try:
        busy = store_ports_problem(mc.store_port)
    except StorePortInUse as exc:
        raise MooncakeUnavailable(str(exc)) from exc
    if busy is not None:
        log.warning("Remote tier joins later", extra={"reason": busy})
    pool = RemotePool(RemoteSettings(
        master_address=mc.master_address, metadata_server=mc.metadata_server,
        local_hostname=f"{cfg.advertise_address}:{mc.store_port}", protocol=mc.protocol,
        device_name=mc.device_name, segment_bytes=mc.segment_size,
        staging_bytes=mc.local_buffer_size, write_policy=rt.write_policy,
        queue_blocks=rt.queue_blocks, timeout_seconds=rt.timeout_seconds,
    ), metrics)
    threading.Thread(target=pool.start, name="flexkv-remote-join", daemon=True).start()
    return pool


def build_kv_events(cfg: AgentConfig, metrics: AgentMetrics) -> KvEventPublisher | None:
    """The agent's KV-event publisher for ``kvEvents`` (None without it); it binds
    its endpoint when the HTTP lifespan starts it."""
    ev = cfg.kv_events
    if ev is None:
        return None
    metrics.init_kv_events()
    return KvEventPublisher(ev.endpoint, topic=ev.topic, queue_size=ev.queue_size,
                            block_hash=ev.block_hash, seed=ev.hash_seed,
                            int_hashes=ev.int_block_hashes, metrics=metrics)


def claim_ssd_paths(cfg: AgentConfig) -> DirectoryOwner | None:
    """Hold ``tiers.ssd.paths`` for the agent's pool (None without an SSD tier); a
    ``ConfigError`` naming the other pool when an agent of another pool holds one."""
    if cfg.tiers.ssd is None:
        return None
    try:
        return DirectoryOwner(cfg.tiers.ssd.paths, cfg.pool)
    except SsdPathInUse as exc:
        raise ConfigError(f"tiers.ssd.paths: {exc}") from exc


class _Stages:
    """Closes every stage last on shutdown (first in start order), then the fan-out
    server the stages of multi-stage groups shared."""

    name = "stages"

    def __init__(self, service: EngineService, fanout: SharedFanout,
                 owner: DirectoryOwner | None = None) -> None:
        self._service = service
        self._fanout = fanout
        self._owner = owner

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        await asyncio.to_thread(self._service.close)
        await asyncio.to_thread(self._fanout.close)
        if self._owner is not None:  # after every tier closed: the paths are free
            self._owner.close()


class _TierFds:
    """The tier socket as a service: started before the engine socket, stopped
    after it (no claim names a tier it cannot hand out)."""

    name = "tier_fds"

    def __init__(self, server: TierFdServer) -> None:
        self._server = server

    async def start(self) -> None:
        await asyncio.to_thread(self._server.start)

    async def stop(self) -> None:
        await asyncio.to_thread(self._server.close)


class _EpochWatcher:
    """Re-reads ``cacheEpoch`` from the config file; a change flushes every stage."""

    name = "cache_epoch"

    def __init__(self, agent: Agent, path: Path | None, period: float) -> None:
        self._agent = agent
        self._path = path
        self._period = period
        self._task: asyncio.Task[None] | None = None

    @property
    def enabled(self) -> bool:
        """True when a config path is watched."""
        return self._path is not None

    async def start(self) -> None:
        if self._path is not None:
            self._task = asyncio.create_task(self._loop(), name="cache-epoch")

    @property
    def alive(self) -> bool:
        """True while the watch loop runs (always True without a config path)."""
        return self._task is None or not self._task.done()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._period)
            try:
                await self._step()
            except ConfigError as exc:
                self._agent.errors.record(self.name, f"config re-read failed: {exc}")
            except Exception as exc:  # keep watching: a flush may work next period
                log.exception("Cache-epoch check failed", extra={"path": str(self._path)})
                self._agent.errors.record(self.name, f"cache-epoch check failed: {exc!r}")

    async def _step(self) -> None:
        cfg = await asyncio.to_thread(load_config, self._path)
        if cfg.cache_epoch != self._agent.cache_epoch:
            await asyncio.to_thread(self._agent.flush, cfg.cache_epoch)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class Agent:
    """One node agent. ``stage_builder`` makes the started connector of a newly
    registered stage from :attr:`stage_deps`
    (:func:`node_agent.assembly.default_stage_builder`);
    ``kube_api`` (a ``kubernetes.client.ApiClient``) enables the Lease heartbeat and
    the KVCacheGroup views; ``config_path`` enables re-reading ``cacheEpoch``."""

    def __init__(self, cfg: AgentConfig, stage_builder: StageBuilder,
                 metrics: AgentMetrics | None = None, kube_api: Any = None,
                 config_path: str | os.PathLike[str] | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics or AgentMetrics()
        self.errors = RecentErrors()
        self.cache_epoch = cfg.cache_epoch
        """The ``cacheEpoch`` whose flush completed (reported in the Lease)."""
        self.key_epoch = cfg.cache_epoch
        """The epoch remote tier keys carry: switched before a flush starts."""
        self.started_at = time.time()
        self.group_views: dict[str, GroupView] = {}
        self._views_lock = threading.RLock()
        self._builder = stage_builder
        # The connector's waits end inside engineCallSeconds (vocab/budget.py);
        # the server's bound is only a last resort behind them.
        budget = call_budget(cfg.timeouts.engine_call_seconds, cfg.timeouts.fanout_wait_seconds)
        self.service = EngineService(self._build_stage, cfg.tokens_per_block, status=self.status,
                                     max_stages=cfg.max_stages,
                                     stale_after=cfg.heartbeat.lease_duration_seconds,
                                     on_stage=self.attach_stage, metrics=self.metrics,
                                     tier_shares=cfg.tier_shares,
                                     backend_of=lambda rank, layout: backend_key(
                                         self.stage_deps, rank, layout),
                                     call_seconds=budget.server_timeout_seconds)
        self.engine = EngineServer(cfg.engine_endpoint, self.service, self.metrics,
                                   budget.server_timeout_seconds, errors=self.errors,
                                   inline_ops=frozenset({"ping"}), inline=self.service.inline,
                                   park=self.service.park)
        self.service.completion_wake = self.engine.wake
        period = cfg.heartbeat.retry_period_seconds
        self.groups: FileGroupSource | KubeGroupSource | None = None
        self.heartbeat: LeaseHeartbeat | None = None
        if cfg.group_view_file:
            self.groups = FileGroupSource(cfg.group_view_file, cfg.pool, self._on_views,
                                          period, self.errors)
        self._lookup_window = LookupWindow()
        if kube_api is not None:
            from kubernetes.client import CoordinationV1Api, CustomObjectsApi

            if self.groups is None:
                self.groups = KubeGroupSource(CustomObjectsApi(kube_api), cfg.namespace,
                                              cfg.pool, self._on_views, period, self.errors)
            self.heartbeat = LeaseHeartbeat(CoordinationV1Api(kube_api), cfg,
                                            self._heartbeat_info, self.errors)
        self._epoch_watcher = _EpochWatcher(
            self, Path(config_path) if config_path else None, period)
        self.ssd_owner = claim_ssd_paths(cfg)
        self.remote_pool = build_remote_pool(cfg, self.metrics)
        self.fanout = SharedFanout(cfg, self.metrics)
        """The one fan-out server of every multi-stage group this agent serves."""
        self.shared = SharedBackends(lambda: self.key_epoch)
        """The backends shared by the single-stage replicas of one model."""
        self.kv_events = build_kv_events(cfg, self.metrics)
        """The KV-event publisher for routers (None unless ``kvEvents`` is set)."""
        self.tier_fds = TierFdServer(tier_socket_path(cfg.engine_socket), read_only_fd)
        """Hands engines read-only descriptors of shared CPU tiers (engine-side loads)."""
        self.stage_deps = StageDeps(cfg=cfg, metrics=self.metrics, remote_pool=self.remote_pool,
                                    key_epoch=lambda: self.key_epoch, fanout=self.fanout,
                                    shared=self.shared, events=self.kv_events,
                                    shared_tiers=True)
        """What the stage builder gets: never the agent itself."""
        if cfg.max_stages > 1:
            self._export_tier_totals()

    # -- wiring ----------------------------------------------------------------

    def _build_stage(self, rank: RankRef, layout: KVLayout) -> Stage:
        return self._builder(self.stage_deps, rank, layout)

    def attach_stage(self, stage: Stage) -> None:
        """Apply a flush the new stage missed, and feed a new multi-stage group the
        view already known for its replica.

        Called after the stage joined ``service.stages``. A flush that switched the
        key epoch while the stage was being built did not reach it (it walked the
        stages before this one joined): the stage is reset here, so no block of the
        old epoch (a recovered SSD block, say) is ever served. A flush that starts
        after this check finds the stage in ``service.stages``.

        The read of ``group_views`` and the push happen under ``_views_lock``, as do
        ``_on_views``' store and walk, so no update is missed (it either finds the
        stage or is the one read here) and an older view is never pushed after a
        newer one (``GroupViewSource.update`` accepts same-epoch views)."""
        if stage.cache_epoch != self.key_epoch:
            log.info("Stage built during a flush, reset for the new epoch", extra={
                "replica": stage.key.replica, "pp_rank": stage.key.pp_rank,
                "built": stage.cache_epoch, "epoch": self.key_epoch})
            self._reset_stage(stage)
        with self._views_lock:
            view = self.group_views.get(stage.key.replica)
            if view is not None:
                self._push_view(stage, view)

    def _push_view(self, stage: Stage, view: GroupView) -> None:
        if stage.pp_size == 1 or stage.views is None:
            return

        try:
            # The stage follows its own group name, whatever the object is called.
            stage.views.update(dataclasses.replace(view, group=stage.group))
        except GroupViewError as exc:
            log.warning("Group view refused", extra={"group": stage.group, "error": str(exc)})
            self.errors.record("group_view", f"{stage.group}: {exc}")

    def _on_views(self, views: dict[str, GroupView]) -> None:
        with self._views_lock:
            self.group_views = views
            for stage in list(self.service.stages.values()):
                view = views.get(stage.key.replica)
                if view is not None:
                    self._push_view(stage, view)

    def _export_tier_totals(self) -> None:
        """With several stages, each stage's backend holds a share of the tiers and
        would set the tier gauges to its own share: export the agent's totals
        instead (what ``/status`` and the Lease show), read at scrape time."""
        def value(tier: str, key: str) -> Callable[[], float]:
            return lambda: float(self._tiers().get(tier, {}).get(key, 0))

        for tier in ("cpu", "ssd"):
            if tier == "ssd" and self.cfg.tiers.ssd is None:
                continue
            self.metrics.tier_capacity_bytes.labels(tier=tier).set_function(
                value(tier, "capacityBytes"))
            self.metrics.tier_used_bytes.labels(tier=tier).set_function(
                value(tier, "usedBytes"))

    def flush(self, epoch: int) -> None:
        """Apply a new ``cacheEpoch``: reset every stage's connector (drops all tiers).
        The remote tier's key epoch is switched first (no lookup after the reset can
        find a block of the old epoch); ``cache_epoch``, which the Lease reports as
        applied, only once every stage is reset."""
        old, self.key_epoch = self.cache_epoch, epoch
        for stage in list(self.service.stages.values()):
            self._reset_stage(stage)
        self.cache_epoch = epoch
        log.info("Cache flushed for new epoch", extra={"old": old, "new": epoch})

    @staticmethod
    def _reset_stage(stage: Stage) -> None:
        # The reset holds the stage's decision lock while copies stop (up to the
        # backend's STOP_SECONDS on a hung device): meanwhile the stage's calls go
        # to worker threads, never block the engine socket's I/O thread.
        inline, stage.inline_ops = stage.inline_ops, frozenset()
        try:
            stage.coordinator.reset()
        finally:
            stage.inline_ops = inline

    def _heartbeat_info(self) -> dict[str, Any]:
        info = {"memberships": self.service.memberships(), "tiers": self._tiers(),
                "ready": self._ready_overall(), "cacheEpoch": self.cache_epoch}
        totals = self._lookup_totals()
        # None removes the Lease annotation (a stage that stopped leading, say):
        # a stale window must not keep counting in the pool's hit rate.
        info["lookups"] = self._lookup_window.sample(totals) if totals else None
        return info

    def _lookup_totals(self) -> dict[Hashable, tuple[int, int]]:
        """Tokens looked up and hit on each stage this agent leads, by source (the
        stage and its backend instance); empty when none of them counts lookups
        (no stage yet, followers only, or a backend that does not count)."""
        out: dict[Hashable, tuple[int, int]] = {}
        for stage in list(self.service.stages.values()):
            try:
                totals = stage.coordinator.lookup_totals()
            except Exception:  # reported by the stage's own status
                continue
            if totals is not None:
                source, looked_up, hit = totals
                out[(stage.key, source)] = (looked_up, hit)
        return out

    def services(self) -> list[Service]:
        """Background services in start order."""
        out: list[Service] = [_Stages(self.service, self.fanout, self.ssd_owner)]
        if self.kv_events is not None:  # stops after the stages: their last events go out
            out.insert(0, self.kv_events)
        if self.groups is not None:
            out.append(self.groups)
        out.append(_TierFds(self.tier_fds))
        out.append(self.engine)
        out.append(self._epoch_watcher)
        if self.heartbeat is not None:
            out.append(self.heartbeat)
        return out

    def app(self) -> FastAPI:
        """The HTTP app whose lifespan runs every service."""
        return create_app(self, self.metrics, self.services(), lookup=self.lookup)

    def lookup(self, req: LookupRequest) -> dict[str, Any]:
        """``POST /v1/lookup`` (node_agent/http/lookup.py): the cached prefix of
        ``req.tokens`` by tier on the stage it names; read-only."""
        stages = list(self.service.stages.values())
        names = sorted(f"{s.key.replica}/pp{s.key.pp_rank}" for s in stages)
        if req.replica is None:
            replicas = {s.key.replica for s in stages}
            if len(replicas) != 1:
                raise LookupRequestError(
                    400 if replicas else 404,
                    f"replica: missing, and this agent serves {len(replicas)} replicas "
                    f"({', '.join(names) or 'none yet'}); name one")
            replica = replicas.pop()
        else:
            replica = req.replica
        stage = self.service.stages.get(StageKey(replica, req.pp_rank))
        if stage is None:
            raise LookupRequestError(
                404, f"replica {replica!r} ppRank {req.pp_rank}: no such stage on this "
                f"agent; known stages: {', '.join(names) or 'none yet'}")
        try:
            tiers = stage.coordinator.peek(req.tokens)
        except ValueError as exc:
            raise LookupRequestError(400, f"tokenIds: {exc}") from None
        except Exception as exc:  # a closed or not yet started backend
            raise LookupRequestError(
                409, f"stage {replica}/pp{req.pp_rank} cannot answer now: {exc}") from None
        if tiers is None:
            raise LookupRequestError(
                409, f"stage {replica}/pp{req.pp_rank} cannot answer lookups here: it is not "
                "its group's leader on this node, or its backend is flexkv; ask the agent "
                "of the group's leader, or use the embedded backend")
        return {"replica": replica, "ppRank": req.pp_rank,
                "tokensPerBlock": self.cfg.tokens_per_block,
                "queriedTokens": len(req.tokens), "cachedTokens": sum(tiers.values()),
                "tiers": tiers}

    # -- probe -----------------------------------------------------------------

    def liveness(self) -> dict[str, bool]:
        comps = {"engine_api": self.engine.alive}
        if self.groups is not None:
            comps["group_view"] = self.groups.alive
        if self.heartbeat is not None:
            comps["heartbeat"] = self.heartbeat.alive
        if self._epoch_watcher.enabled:
            comps["cache_epoch"] = self._epoch_watcher.alive
        if self.kv_events is not None:
            comps["kv_events"] = self.kv_events.alive
        return comps

    def _tiers(self) -> dict[str, dict[str, int]]:
        """Capacity and use of each configured tier, from the own stats of the
        backends of the stages this agent leads (summed over them); a tier no leading
        backend reports shows its configured size, nothing used. With ``maxStages``
        > 1 the capacity is the configured size (the node's budget, whatever number
        of stages holds a share of it now)."""
        own: dict[str, tuple[int, int]] = {}
        for stage in self._one_stage_per_backend():
            try:
                tiers = stage.coordinator.tier_bytes()
            except Exception:  # reported by the stage's own status; /status must answer
                continue
            for name, (cap, used) in (tiers or {}).items():
                c, u = own.get(name, (0, 0))
                own[name] = (c + cap, u + used)
        out: dict[str, dict[str, int]] = {}
        for tier in ("cpu", "ssd"):
            conf = self.cfg.tiers.cpu if tier == "cpu" else self.cfg.tiers.ssd
            if conf is None:
                continue  # not configured
            cap, used = own.get(tier, (conf.size, 0))
            if self.cfg.max_stages > 1:
                cap = conf.size
            out[tier] = {"capacityBytes": int(cap), "usedBytes": int(used)}
        recovered = self._recovered_blocks()
        ssd = self.cfg.tiers.ssd
        if ssd is not None and ssd.persist and "ssd" in out:
            out["ssd"]["recoveredBlocks"] = recovered
        return out

    def _one_stage_per_backend(self) -> list[Stage]:
        """The stages, with only one of those sharing a backend (its tiers counted once)."""
        seen: set[int] = set()
        out = []
        for stage in list(self.service.stages.values()):
            if stage.shared is not None:
                if id(stage.shared.entry) in seen:
                    continue
                seen.add(id(stage.shared.entry))
            out.append(stage)
        return out

    def _recovered_blocks(self) -> int:
        """SSD blocks the backends of this agent's stages recovered at their start."""
        total = 0
        for stage in self._one_stage_per_backend():
            try:
                total += stage.coordinator.recovered_blocks() or 0
            except Exception:  # reported by the stage's own status; /status must answer
                continue
        return total

    def _remote_status(self) -> dict[str, Any] | None:
        """The remote tier as /status shows it (None without ``tiers.remote``)."""
        pool = self.remote_pool
        if pool is None:
            return None
        get = self.metrics.registry.get_sample_value
        return {**pool.status(), "segmentBytes": pool.settings.segment_bytes,
                "hitBlocks": int(get("flexkv_agent_remote_hit_blocks_total") or 0),
                "queueDepth": int(get("flexkv_agent_remote_queue_depth") or 0),
                "bytesPut": int(get("flexkv_agent_remote_bytes_total", {"direction": "put"}) or 0),
                "bytesGet": int(get("flexkv_agent_remote_bytes_total", {"direction": "get"}) or 0)}

    def readiness(self) -> dict[str, dict[str, Any]]:
        stages = list(self.service.stages.values())
        statuses = {}
        for st in stages:
            name = f"{st.key.replica}/pp{st.key.pp_rank}"
            try:
                statuses[name] = (st, st.coordinator.status())
            except Exception as exc:
                statuses[name] = (st, {"role": None, "degraded": True, "error": str(exc)})
                self.errors.record("connector", f"{name}: status() failed: {exc}")
        registered = self.service.ranks_registered()
        comps: dict[str, dict[str, Any]] = {
            "engine_api": {"ready": self.engine.alive},
            "ranks": {"ready": registered >= self.cfg.expected_ranks,
                      "registered": registered, "expected": self.cfg.expected_ranks},
            "backend": {
                "ready": all(s["role"] is not None for _, s in statuses.values())
                and (bool(stages) or self.cfg.expected_ranks == 0),
                "stages": {n: s["role"] for n, (_, s) in statuses.items()}},
        }
        multi = [st for st in stages if st.pp_size > 1]
        views = self.group_views  # one snapshot: _on_views may replace it meanwhile
        mine = {st.key.replica: views.get(st.key.replica) for st in multi}
        missing = [r for r, v in mine.items() if v is None or v.leader is None]
        # Members the operator reports not ready (their agent's Lease expired: peer lost).
        unready = [f"{r}/pp{m.pp_rank}" for r, v in mine.items() if v is not None
                   for m in v.members if not m.ready]
        comps["group_view"] = {
            "ready": not missing and not unready,
            "source": self.groups.source if self.groups is not None else None,
            "known": sorted(views), "missing": missing, "unreadyMembers": unready,
        }
        fanout: dict[str, Any] = {}
        for n, (st, s) in statuses.items():
            fanout[n] = {"ready": bool(st.coordinator.ready()) and not s.get("degraded", True),
                         "peersConnected": s.get("peersConnected", 0),
                         "peersExpected": s.get("peersExpected", 0), "role": s.get("role")}
        comps["fanout"] = {"ready": all(f["ready"] for f in fanout.values()), "stages": fanout}
        if self.remote_pool is not None:
            # Reported, never failing readiness: local tiers keep serving without it.
            comps["remote"] = {"ready": True, "degraded": not self.remote_pool.health.up,
                               **self.remote_pool.status()}
        return comps

    def _ready_overall(self) -> bool:
        return all(c["ready"] for c in self.readiness().values())

    def status(self) -> dict[str, Any]:
        stages = []
        for s in list(self.service.stages.values()):
            try:
                conn = s.coordinator.status()
            except Exception as exc:
                conn = {"error": str(exc)}
            view = self.group_views.get(s.key.replica)
            try:
                tiers = s.coordinator.tier_bytes()
            except Exception:  # reported by the stage's own status
                tiers = None
            stages.append({
                "replica": s.key.replica, "ppRank": s.key.pp_rank, "ppSize": s.pp_size,
                "group": s.group, "role": conn.get("role"), "epoch": conn.get("epoch"),
                "seq": conn.get("lastSeq"),
                "registeredRanks": sorted(s.buffers), "registrations": s.registrations,
                "connector": conn, "view": view.to_json() if view else None,
                "tiers": None if tiers is None else {
                    name: {"capacityBytes": int(cap), "usedBytes": int(used)}
                    for name, (cap, used) in tiers.items()},
                "traffic": s.traffic.to_json() if s.traffic is not None else None,
                "sharedBackend": s.shared.status() if s.shared is not None else None,
            })
        return {
            "version": __version__, "pool": self.cfg.pool, "node": self.cfg.node_name,
            "backend": self.cfg.backend, "cacheEpoch": self.cache_epoch,
            "uptimeSeconds": round(time.time() - self.started_at, 3),
            "engineSocket": self.cfg.engine_endpoint,
            "tiers": self._tiers(), "remoteTier": self._remote_status(), "stages": stages,
            "groups": {k: v.to_json() for k, v in self.group_views.items()},
            "engineApi": {"served": self.engine.served, "inflight": self.engine.inflight,
                          "refusedBusy": self.engine.refused_busy},
            "heartbeat": None if self.heartbeat is None else {
                "lease": self.heartbeat.lease_name, "healthy": self.heartbeat.healthy,
                "renewals": self.heartbeat.renewals},
            "recentErrors": self.errors.snapshot()[-20:],
        }

    # -- running ---------------------------------------------------------------

    def uvicorn_server(self, port: int | None = None, host: str | None = None) -> uvicorn.Server:
        """A uvicorn server for the app (its SIGTERM handling drives shutdown)."""
        config = uvicorn.Config(
            self.app(), host=host or self.cfg.bind_address,
            port=self.cfg.ports.http if port is None else port,
            log_config=None, access_log=False, lifespan="on",
            timeout_graceful_shutdown=int(self.cfg.timeouts.engine_call_seconds) + 1,
        )
        return uvicorn.Server(config)
