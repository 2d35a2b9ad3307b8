"""The agent's Prometheus metrics, defined once and registered in an injected registry.

Every component (backend, connector, fan-out, engine API) receives one
:class:`AgentMetrics` and records into it; the HTTP app serves the same registry.
Names and labels are the contract in ``docs/contracts.md`` section 6; the Grafana
dashboard depends on them, so renaming one is a breaking change.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Latency buckets from 50 us to 10 s: match calls sit at the low end, SSD
# transfers and fan-out waits at the high end.
_LATENCY_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
    0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)

# Label values the agent can record, exported at 0 from the start so that a
# dashboard rate() over them shows 0 rather than no data while nothing happened.
FANOUT_DROP_REASONS = ("stale_epoch", "future_epoch", "gap", "duplicate", "unauthenticated",
                       "malformed", "unknown_group", "new_incarnation", "stale_incarnation")
FANOUT_MISMATCH_KINDS = ("put", "get")
REMOTE_OPS = ("lookup", "get", "put")
REMOTE_DROP_REASONS = ("queue_full", "error", "overwritten", "flushed", "down", "closed")
REMOTE_DIRECTIONS = ("put", "get")


class AgentMetrics:
    """All agent metrics in one registry (a fresh private one when none is given)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.lookup_tokens = Counter(
            "flexkv_agent_lookup_tokens", "Tokens asked for by engine lookups", registry=r
        )
        self.hit_tokens = Counter(
            "flexkv_agent_hit_tokens", "Looked-up tokens found in a cache tier", ["tier"],
            registry=r,
        )
        self.stored_tokens = Counter(
            "flexkv_agent_stored_tokens", "Tokens whose KV was stored and became visible",
            registry=r,
        )
        self.transfer_bytes = Counter(
            "flexkv_agent_transfer_bytes", "KV bytes moved between engine buffers and tiers",
            ["direction", "tier"], registry=r,
        )
        self.engine_loads = Counter(
            "flexkv_agent_engine_loads", "Loads an engine copied itself from a shared CPU "
            "tier, by how its claim ended", ["outcome"], registry=r,
        )
        self.claim_fence_moves = Counter(
            "flexkv_agent_claim_fence_moves", "Claims of engine-side loads that ended other "
            "than by their engine's commit; each moves the shared CPU tier's claim fence, "
            "and engines copying meanwhile wait for their commit's answer", registry=r,
        )
        self.transfer_seconds = Histogram(
            "flexkv_agent_transfer_seconds", "Duration of one task's transfer", ["direction"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.match_seconds = Histogram(
            "flexkv_agent_match_seconds", "Duration of get_match / put_match", ["op"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.tier_capacity_bytes = Gauge(
            "flexkv_agent_tier_capacity_bytes", "Configured capacity of a cache tier", ["tier"],
            registry=r,
        )
        self.tier_used_bytes = Gauge(
            "flexkv_agent_tier_used_bytes", "Bytes of a cache tier holding blocks", ["tier"],
            registry=r,
        )
        self.evictions = Counter(
            "flexkv_agent_evictions", "Blocks evicted from a tier", ["tier"], registry=r
        )
        self.engine_requests = Counter(
            "flexkv_agent_engine_requests", "Engine API calls by operation and outcome",
            ["op", "outcome"], registry=r,
        )
        self.engine_request_seconds = Histogram(
            "flexkv_agent_engine_request_seconds", "Duration of engine API calls", ["op"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.fanout_lag_seconds = Histogram(
            "flexkv_agent_fanout_lag_seconds",
            "Leader decision sent to applied on this follower", ["group"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.fanout_dropped = Counter(
            "flexkv_agent_fanout_dropped", "Fan-out messages dropped, by reason",
            ["group", "reason"], registry=r,
        )
        self.pp_role = Gauge(
            "flexkv_agent_pp_role", "1 for this agent's current role in a PP group",
            ["group", "role"], registry=r,
        )
        self.pp_epoch = Gauge(
            "flexkv_agent_pp_epoch", "Leader epoch this agent follows in a PP group", ["group"],
            registry=r,
        )
        self.leader_changes = Counter(
            "flexkv_agent_leader_changes", "Leader changes seen in a PP group", ["group"],
            registry=r,
        )
        self.ssd_errors = Counter(
            "flexkv_agent_ssd_errors",
            "Failed SSD tier operations (spill: a CPU block's copy to SSD failed and the "
            "block was dropped instead)", ["op"], registry=r,
        )
        self.recovered_blocks = Counter(
            "flexkv_agent_recovered_blocks",
            "SSD blocks a persistent SSD tier found intact at start and indexed again",
            registry=r,
        )
        self.recovered_dropped_blocks = Counter(
            "flexkv_agent_recovered_dropped_blocks",
            "SSD blocks a persistent SSD tier found at start and did not index (record: "
            "torn or foreign record; checksum: torn or half-written bytes; duplicate; "
            "orphan: its prefix was not recovered)", ["reason"], registry=r,
        )
        self.ready = Gauge("flexkv_agent_ready", "1 when /readyz answers 200", registry=r)
        self.completed_dropped = Counter(
            "flexkv_agent_completed_dropped",
            "Completed store rids dropped unreported (the engine did not poll_completed)",
            ["group"], registry=r,
        )
        self.leader_step_downs = Counter(
            "flexkv_agent_leader_step_downs",
            "Times a leader stopped deciding after seeing a newer epoch", ["group"],
            registry=r,
        )

        self.fanout_mismatch = Counter(
            "flexkv_agent_fanout_mismatch",
            "Follower engine calls that found only leader decisions for other tokens "
            "(never applied; the stage resyncs)", ["group", "kind"], registry=r,
        )
        self.cache_epoch_refused = Counter(
            "flexkv_agent_cache_epoch_refused",
            "Decisions and remote moves a stage refused because they were made under "
            "another cacheEpoch than its own (kind: put, get, fetch, write)",
            ["group", "kind"], registry=r,
        )
        self.pp_degraded = Gauge(
            "flexkv_agent_pp_degraded",
            "1 while this stage cannot serve its PP group (a follower not synced with the "
            "current leader process, a leader with an unsynced follower, no role)",
            ["group"], registry=r,
        )

        # The remote tier (node_agent/backend/remote, docs/remote.md).
        self.remote_up = Gauge(
            "flexkv_agent_remote_up",
            "1 when the remote tier's Mooncake master answers, 0 otherwise", registry=r,
        )
        self.remote_hit_blocks = Counter(
            "flexkv_agent_remote_hit_blocks", "Blocks served from the remote tier", registry=r,
        )
        self.remote_bytes = Counter(
            "flexkv_agent_remote_bytes", "Bytes moved to (put) or from (get) the remote tier",
            ["direction"], registry=r,
        )
        self.remote_queue_depth = Gauge(
            "flexkv_agent_remote_queue_depth",
            "Blocks waiting in the remote tier's write-behind queue", registry=r,
        )
        self.remote_dropped_blocks = Counter(
            "flexkv_agent_remote_dropped_blocks",
            "Blocks not written to the remote tier (queue_full, error, overwritten, flushed, down)",
            ["reason"], registry=r,
        )
        self.remote_errors = Counter(
            "flexkv_agent_remote_errors", "Failed remote tier calls (lookup, get, put)",
            ["op"], registry=r,
        )
        self.remote_rejected_blocks = Counter(
            "flexkv_agent_remote_rejected_blocks",
            "Fetched remote objects refused, never published (size, format, digest, "
            "checksum, writer)",
            ["reason"], registry=r,
        )

        self.replica_requests = Counter(
            "flexkv_agent_replica_requests",
            "Engine calls of one replica's stages on this agent, by operation",
            ["replica", "op"], registry=r,
        )
        self.replica_lookup_tokens = Counter(
            "flexkv_agent_replica_lookup_tokens",
            "Tokens looked up by the engines of one replica on this agent", ["replica"],
            registry=r,
        )
        self.replica_hit_tokens = Counter(
            "flexkv_agent_replica_hit_tokens",
            "Looked-up tokens of one replica that its stage's cache holds", ["replica"],
            registry=r,
        )
        self.replica_cross_hit_tokens = Counter(
            "flexkv_agent_replica_cross_hit_tokens",
            "Hit tokens of one replica on blocks another replica of its model stored "
            "(replicas sharing one backend on this agent)", ["replica"], registry=r,
        )
        # Registered by init_kv_events (only an agent with kvEvents exports them).
        self.kv_events = Counter(
            "flexkv_agent_kv_events", "KV events published for routers", registry=None
        )
        self.kv_events_dropped = Counter(
            "flexkv_agent_kv_events_dropped",
            "KV events dropped (publisher queue full, or a block's chain hash unknown)",
            registry=None,
        )

    def init_group(self, group: str) -> None:
        """Export ``group``'s fan-out drop and mismatch counters at 0 for every
        reason and kind (an alert on their increase then sees the first one)."""
        for reason in FANOUT_DROP_REASONS:
            self.fanout_dropped.labels(group=group, reason=reason)
        for kind in FANOUT_MISMATCH_KINDS:
            self.fanout_mismatch.labels(group=group, kind=kind)

    def init_remote(self) -> None:
        """Export the remote tier's labelled counters at 0 (called when one is configured;
        an agent without a remote tier exports none of them)."""
        for op in REMOTE_OPS:
            self.remote_errors.labels(op=op)
        for reason in REMOTE_DROP_REASONS:
            self.remote_dropped_blocks.labels(reason=reason)
        for direction in REMOTE_DIRECTIONS:
            self.remote_bytes.labels(direction=direction)

    def init_kv_events(self) -> None:
        """Export the KV-event counters (called once when ``kvEvents`` is configured)."""
        self.registry.register(self.kv_events)
        self.registry.register(self.kv_events_dropped)

    def set_role(self, group: str, role: str) -> None:
        """Mark ``role`` (leader or follower) as current for ``group``, the other as 0."""
        for r in ("leader", "follower"):
            self.pp_role.labels(group=group, role=r).set(1 if r == role else 0)
