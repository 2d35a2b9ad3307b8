"""A KVCachePool spec, defaulted from the CRD and checked, as a typed config.

The API server enforces the CRD schema and its CEL rules; this module enforces
the same rules again (an older server, or an emulated one, may not) plus what a
schema cannot say (sizes as positive byte counts). Every problem names the
field, the bad value and the fix.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from flexkv_operator import crds, names
from flexkv_operator.defaults import apply_defaults
from flexkv_operator.host_paths import ssd_path_problem
from flexkv_operator.quantity import parse_bytes, parse_quantity
from node_agent.contract import mooncake as mooncake_bounds

#: Mooncake's bounds, as the agent checks them: its smallest segment, the staging
#: buffer's range, and the storePort values that keep storePort and storePort + 1
#: outside the ephemeral ports it refuses.
MIN_SEGMENT_BYTES = mooncake_bounds.MIN_SEGMENT_BYTES
MIN_LOCAL_BUFFER_BYTES = mooncake_bounds.MIN_LOCAL_BUFFER_BYTES
MAX_LOCAL_BUFFER_BYTES = mooncake_bounds.MAX_LOCAL_BUFFER_BYTES
STORE_PORT_RANGES = mooncake_bounds.STORE_PORT_RANGES


@dataclass(frozen=True)
class ConfigProblem:
    """One invalid field of a pool spec."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"spec.{self.field}: {self.message}"


class ConfigInvalid(ValueError):
    """A pool spec the operator cannot act on; ``problems`` lists every bad field."""

    def __init__(self, problems: list[ConfigProblem]) -> None:
        self.problems = problems
        super().__init__("; ".join(str(p) for p in problems))


@dataclass(frozen=True)
class Timings:
    lease_duration: int
    renew_deadline: int
    retry_period: int


@dataclass(frozen=True)
class RemoteTier:
    """``spec.tiers.remote``, checked. ``managed`` means the operator runs the pool's
    mooncake_master; then ``master_address`` and ``metadata_server`` are empty and the
    agents are pointed at the master's Service (:mod:`flexkv_operator.mooncake`)."""

    write_policy: str
    queue_blocks: int
    timeout_seconds: float
    managed: bool
    master_address: str
    metadata_server: str
    protocol: str
    device_name: str
    segment_bytes: int
    local_buffer_bytes: int
    store_port: int
    master_resources: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class KvEvents:
    """``spec.kvEvents``, checked: the agents' KV-event publisher for routers."""

    port: int
    block_hash: str
    hash_seed: str
    int_block_hashes: bool = True


@dataclass(frozen=True)
class PoolConfig:
    """The checked spec. ``raw`` is the defaulted spec dict (camelCase, as in the CRD)."""

    raw: dict[str, Any]
    backend: str
    tokens_per_block: int
    cpu_bytes: int
    ssd_bytes: int
    ssd_paths: tuple[str, ...]
    http_port: int
    fanout_port: int
    timings: Timings
    cache_epoch: int
    model_salt: str
    """``spec.modelSalt``: folded into every stage's model identity by the agents."""
    expected_ranks: int
    max_stages: int
    """``spec.maxStages``: stages one agent serves at once."""
    tier_shares: int | None
    """``spec.tierShares``: the even shares each node's tiers are split into, one per
    backend (None: not set, the agents use ``maxStages``)."""
    copy_lanes: int | None
    """``spec.tiers.cpu.copyLanes``: threads sharing one large CPU-tier copy in each
    backend (None: not set, the agents' default)."""
    image: str
    agent_user: int
    agent_group: int
    placement: dict[str, Any] = field(default_factory=dict)
    remote: RemoteTier | None = None
    kv_events: KvEvents | None = None
    """``spec.kvEvents`` (None: the agents publish no KV events)."""


Problems = list[ConfigProblem]
"""Where the section parsers append what they find wrong, in the order of the spec."""


def parse_pool_spec(
    spec: dict[str, Any] | None, default_image: str, *, name: str | None = None
) -> PoolConfig:
    """Default ``spec`` from the CRD and check it; raise ConfigInvalid listing every problem.
    ``name`` (the pool's) is checked against what the spec asks to create from it.

    One parser per section of the spec, each appending its problems in the spec's
    order; every problem of every section is reported at once."""
    full = apply_defaults({"spec": dict(spec or {})}, crds.schema(crds.POOL_PLURAL))
    raw: dict[str, Any] = full["spec"]
    problems: Problems = []
    backend = _backend(raw, problems)
    tokens_per_block = _tokens_per_block(raw, problems)
    tiers = raw.get("tiers") or {}
    cpu_bytes = _cpu_tier(tiers, backend, problems)
    copy_lanes = _copy_lanes(tiers, backend, problems)
    ssd_bytes, ssd_paths = _ssd_tier(tiers, problems)
    _check_eviction(raw, problems)
    http, fanout = _agent_ports(raw, problems)
    timings = _leader_election(raw, problems)
    engine_call_seconds = _timeouts(raw, problems)
    cache_epoch, model_salt, expected_ranks = _cache_identity(raw, problems)
    max_stages = _max_stages(raw, problems)
    tier_shares = _tier_shares(raw, max_stages, problems)
    _check_max_unavailable(raw, problems)
    image = _agent_image(raw, default_image, problems)
    ids = _agent_ids(raw, problems)
    remote = _remote_section(tiers, engine_call_seconds, (http, fanout), name, problems)
    kv_events = _kv_events(raw, (http, fanout), remote, problems)
    if problems:
        raise ConfigInvalid(problems)
    return PoolConfig(
        raw=raw,
        backend=str(backend),
        tokens_per_block=tokens_per_block,
        cpu_bytes=cpu_bytes,
        ssd_bytes=ssd_bytes,
        ssd_paths=ssd_paths,
        http_port=int(http),
        fanout_port=int(fanout),
        timings=timings,
        cache_epoch=cache_epoch,
        model_salt=model_salt,
        expected_ranks=expected_ranks,
        max_stages=max_stages,
        tier_shares=tier_shares,
        copy_lanes=copy_lanes,
        image=image,
        agent_user=ids["runAsUser"],
        agent_group=ids["runAsGroup"],
        placement=dict(raw.get("placement") or {}),
        remote=remote,
        kv_events=kv_events,
    )


def _bytes_of(path: str, value: object, problems: Problems) -> int:
    """``spec.<path>`` as whole bytes; 0 (and a problem) when it is not a size."""
    try:
        return parse_bytes(value, f"spec.{path}")
    except ValueError as exc:
        problems.append(ConfigProblem(path, str(exc).split(": ", 1)[1]))
        return 0


def _backend(raw: dict[str, Any], problems: Problems) -> object:
    """``spec.backend``: flexkv or embedded."""
    backend = raw.get("backend")
    if backend not in ("flexkv", "embedded"):
        problems.append(
            ConfigProblem("backend", f"{backend!r} is not a backend; use flexkv or embedded")
        )
    return backend


def _tokens_per_block(raw: dict[str, Any], problems: Problems) -> int:
    """``spec.tokensPerBlock``: the engines' page size, 1..4096."""
    tpb = raw.get("tokensPerBlock")
    if not isinstance(tpb, int) or isinstance(tpb, bool) or not 1 <= tpb <= 4096:
        problems.append(
            ConfigProblem("tokensPerBlock", f"{tpb!r} must be an integer in 1..4096 (page size)")
        )
        return 16
    return tpb


def _cpu_tier(tiers: dict[str, Any], backend: object, problems: Problems) -> int:
    """``spec.tiers.cpu``: its size in bytes (required); ``pinned`` must stay true
    with backend flexkv."""
    cpu = tiers.get("cpu")
    if not isinstance(cpu, dict) or "size" not in cpu:
        problems.append(ConfigProblem("tiers.cpu.size", "is required, e.g. 8Gi"))
        cpu_bytes, pinned = 0, True
    else:
        cpu_bytes = _bytes_of("tiers.cpu.size", cpu["size"], problems)
        pinned = bool(cpu.get("pinned", True))
    if backend == "flexkv" and not pinned:
        problems.append(
            ConfigProblem(
                "tiers.cpu.pinned",
                "backend flexkv needs pinned: true (FlexKV registers pinned host buffers); "
                "set pinned: true or use backend: embedded",
            )
        )
    return cpu_bytes


def _copy_lanes(tiers: dict[str, Any], backend: object, problems: Problems) -> int | None:
    """``spec.tiers.cpu.copyLanes`` (1..64; None when not set): the threads that
    share one large copy between the CPU tier and an engine's buffers (backend
    embedded only: FlexKV runs its own transfers)."""
    cpu = tiers.get("cpu")
    if not isinstance(cpu, dict) or "copyLanes" not in cpu:
        return None
    lanes = cpu["copyLanes"]
    if backend == "flexkv":
        problems.append(ConfigProblem(
            "tiers.cpu.copyLanes", "applies to backend embedded (FlexKV runs its own "
            "transfers); remove copyLanes or use backend: embedded"))
        return None
    if not isinstance(lanes, int) or isinstance(lanes, bool) or not 1 <= lanes <= 64:
        problems.append(ConfigProblem(
            "tiers.cpu.copyLanes", f"{lanes!r} must be an integer in 1..64 (threads per "
            "large copy: at most the cores the agent pod may use; leave it out for 2)"))
        return None
    return int(lanes)


def _ssd_tier(tiers: dict[str, Any], problems: Problems) -> tuple[int, tuple[str, ...]]:
    """``spec.tiers.ssd`` (optional): its size in bytes and its host directories,
    absolute, distinct and each one a path a pool may hand to the agent."""
    ssd = tiers.get("ssd")
    if not isinstance(ssd, dict):
        return 0, ()
    ssd_bytes = _bytes_of("tiers.ssd.size", ssd.get("size"), problems)
    paths = ssd.get("paths") or []
    if not paths or not all(isinstance(p, str) and p.startswith("/") for p in paths):
        problems.append(
            ConfigProblem("tiers.ssd.paths", f"{paths!r} must list absolute host directories")
        )
    elif len(set(paths)) != len(paths):
        problems.append(ConfigProblem("tiers.ssd.paths", f"{paths!r} lists a path twice"))
    else:
        for i, path in enumerate(paths):
            problem = ssd_path_problem(path)
            if problem:
                problems.append(ConfigProblem(f"tiers.ssd.paths[{i}]", problem))
    return ssd_bytes, tuple(str(p) for p in paths)


def _check_eviction(raw: dict[str, Any], problems: Problems) -> None:
    """``spec.eviction``: 0 <= lowWatermark < highWatermark <= 1."""
    eviction = raw.get("eviction") or {}
    low, high = eviction.get("lowWatermark", 0.85), eviction.get("highWatermark", 0.95)
    if not (
        isinstance(low, int | float) and isinstance(high, int | float) and 0 <= low < high <= 1
    ):
        problems.append(
            ConfigProblem(
                "eviction",
                f"lowWatermark {low!r} must be below highWatermark {high!r}, both in [0, 1]",
            )
        )


def _agent_ports(raw: dict[str, Any], problems: Problems) -> tuple[Any, Any]:
    """``spec.agent.ports``: the http and fanout ports, each 1..65535, not equal."""
    ports = (raw.get("agent") or {}).get("ports") or {}
    http, fanout = ports.get("http", 8080), ports.get("fanout", 5557)
    for name, port in (("http", http), ("fanout", fanout)):
        if not isinstance(port, int) or not 1 <= port <= 65535:
            problems.append(
                ConfigProblem(f"agent.ports.{name}", f"{port!r} is not a port 1..65535")
            )
    if http == fanout:
        problems.append(
            ConfigProblem(
                "agent.ports", f"http and fanout are both {http}; give them different ports"
            )
        )
    return http, fanout


def _leader_election(raw: dict[str, Any], problems: Problems) -> Timings:
    """``spec.leaderElection``: whole seconds with leaseDuration > renewDeadline >
    retryPeriod >= 1 (the defaults, and a problem, when they are not)."""
    election = raw.get("leaderElection") or {}
    lease = election.get("leaseDurationSeconds", 15)
    renew = election.get("renewDeadlineSeconds", 10)
    retry = election.get("retryPeriodSeconds", 2)
    if not all(isinstance(v, int) and v >= 1 for v in (lease, renew, retry)) or not (
        lease > renew > retry
    ):
        problems.append(
            ConfigProblem(
                "leaderElection",
                f"needs leaseDurationSeconds ({lease}) > renewDeadlineSeconds ({renew}) > "
                f"retryPeriodSeconds ({retry}); e.g. 15 > 10 > 2",
            )
        )
        return DEFAULT_TIMINGS
    return Timings(int(lease), int(renew), int(retry))


def _timeouts(raw: dict[str, Any], problems: Problems) -> Any:
    """``spec.timeouts``: fanoutWaitSeconds below engineCallSeconds, which is returned
    (the remote tier's timeout must fit inside it too)."""
    timeouts = raw.get("timeouts") or {}
    call = timeouts.get("engineCallSeconds", 10)
    wait = timeouts.get("fanoutWaitSeconds", 5)
    if isinstance(call, int | float) and isinstance(wait, int | float) and not wait < call:
        problems.append(
            ConfigProblem(
                "timeouts",
                f"fanoutWaitSeconds ({wait}) must be below engineCallSeconds ({call}): a "
                "follower's wait for the leader is part of every engine call; e.g. 5 < 10",
            )
        )
    return call


def _cache_identity(raw: dict[str, Any], problems: Problems) -> tuple[int, str, int]:
    """``spec.cacheEpoch`` (>= 0), ``spec.modelSalt`` (at most 253 characters) and
    ``spec.expectedRanks`` (0..64): what the agents fold into their caches."""
    epoch = raw.get("cacheEpoch", 0)
    if not isinstance(epoch, int) or epoch < 0:
        problems.append(ConfigProblem("cacheEpoch", f"{epoch!r} must be an integer >= 0"))
        epoch = 0
    salt = raw.get("modelSalt", "")
    if not isinstance(salt, str) or len(salt) > 253:
        problems.append(ConfigProblem(
            "modelSalt", f"{salt!r} must be a string of at most 253 characters, e.g. weights-v2"))
        salt = ""
    ranks = raw.get("expectedRanks", 1)
    if not isinstance(ranks, int) or not 0 <= ranks <= 64:
        problems.append(ConfigProblem("expectedRanks", f"{ranks!r} must be an integer in 0..64"))
        ranks = 1
    return int(epoch), salt, int(ranks)


def _max_stages(raw: dict[str, Any], problems: Problems) -> int:
    """``spec.maxStages`` (1..64): the engine stages (replica, PP rank) one agent
    serves at once; the tier sizes are each node's budget, split among them."""
    stages = raw.get("maxStages", 1)
    if not isinstance(stages, int) or isinstance(stages, bool) or not 1 <= stages <= 64:
        problems.append(ConfigProblem(
            "maxStages", f"{stages!r} must be an integer in 1..64 (the engine replicas and PP "
            "stages one node runs, e.g. 8 for eight single-GPU replicas)"))
        stages = 1
    return int(stages)


def _tier_shares(raw: dict[str, Any], max_stages: int, problems: Problems) -> int | None:
    """``spec.tierShares`` (1..64, at most ``maxStages``; None when not set): the
    even shares each node's tier sizes are split into, one per backend (replicas
    of one model share one)."""
    if "tierShares" not in raw:
        return None
    shares = raw["tierShares"]
    if not isinstance(shares, int) or isinstance(shares, bool) or not 1 <= shares <= 64:
        problems.append(ConfigProblem(
            "tierShares", f"{shares!r} must be an integer in 1..64 (the backends one node "
            "holds: 1 for replicas of one model, more for several models or PP stages)"))
        return None
    if shares > max_stages:
        problems.append(ConfigProblem(
            "tierShares", f"{shares} is above maxStages {max_stages}: an agent serves at "
            "most maxStages stages, so at most that many backends; lower tierShares or "
            f"raise maxStages to at least {shares}"))
        return None
    return int(shares)


_KV_EVENT_HASHES = ("vllm-sha256", "agent")


def _kv_events(raw: dict[str, Any], agent_ports: tuple[Any, Any], remote: RemoteTier | None,
               problems: Problems) -> KvEvents | None:
    """``spec.kvEvents``: absent (off), or a port 1..65535 that no other agent port
    uses, the block hash (``vllm-sha256`` or ``agent``) and vLLM's hash seed."""
    section = raw.get("kvEvents")
    if section is None:
        return None
    if not isinstance(section, dict):
        problems.append(ConfigProblem("kvEvents", f"{section!r} must be an object such as "
                                      "{port: 5558}"))
        return None
    port = section.get("port")
    taken = {"agent.ports.http": agent_ports[0], "agent.ports.fanout": agent_ports[1]}
    if remote is not None:
        taken["tiers.remote.mooncake.storePort"] = remote.store_port
        taken["tiers.remote.mooncake.storePort + 1"] = remote.store_port + 1
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        problems.append(ConfigProblem("kvEvents.port", f"{port!r} is not a port 1..65535; "
                                      "set the port routers subscribe to, e.g. 5558"))
    else:
        clash = [k for k, v in taken.items() if v == port]
        if clash:
            problems.append(ConfigProblem("kvEvents.port", f"{port} is already {clash[0]}; "
                                          "give the KV events their own port"))
    block_hash = section.get("blockHash", "vllm-sha256")
    if block_hash not in _KV_EVENT_HASHES:
        problems.append(ConfigProblem("kvEvents.blockHash", f"{block_hash!r} must be one of "
                                      f"{', '.join(_KV_EVENT_HASHES)}"))
    seed = section.get("hashSeed", "vllm-none-hash")
    if not isinstance(seed, str):
        problems.append(ConfigProblem("kvEvents.hashSeed", f"{seed!r} must be a string: the "
                                      "engines' PYTHONHASHSEED, or vllm-none-hash when unset"))
    int_hashes = section.get("intBlockHashes", True)
    if not isinstance(int_hashes, bool):
        problems.append(ConfigProblem("kvEvents.intBlockHashes", f"{int_hashes!r} must be true "
                                      "or false: the engines' VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"))
    return KvEvents(port=port if isinstance(port, int) else 0, block_hash=str(block_hash),
                    hash_seed=str(seed), int_block_hashes=bool(int_hashes))


def _check_max_unavailable(raw: dict[str, Any], problems: Problems) -> None:
    """``spec.agent.maxUnavailable``: an integer >= 1 or a percentage 1%..100%."""
    unavailable = (raw.get("agent") or {}).get("maxUnavailable", 1)
    if not _valid_max_unavailable(unavailable):
        problems.append(
            ConfigProblem(
                "agent.maxUnavailable",
                f"{unavailable!r} must be an integer of at least 1 or a percentage from 1% to "
                "100%, e.g. 1 or 10%",
            )
        )


def _agent_image(raw: dict[str, Any], default_image: str, problems: Problems) -> str:
    """``spec.agent.image``, else the operator's default; one of them must be set."""
    image = (raw.get("agent") or {}).get("image") or default_image
    if not image:
        problems.append(
            ConfigProblem(
                "agent.image",
                "is empty and the operator has no FLEXKV_AGENT_IMAGE; set one of them",
            )
        )
    return str(image)


def _agent_ids(raw: dict[str, Any], problems: Problems) -> dict[str, int]:
    """``spec.agent.securityContext``: runAsUser and runAsGroup, non-root ids."""
    context = (raw.get("agent") or {}).get("securityContext") or {}
    ids: dict[str, int] = {}
    for key in ("runAsUser", "runAsGroup"):
        # The CRD default (the image's user) is filled in by apply_defaults.
        value = context.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value < 2**31:
            problems.append(
                ConfigProblem(
                    f"agent.securityContext.{key}",
                    f"{value!r} must be a non-root id in 1..2147483647 matching the agent "
                    "image's user; leave it out for the project image's default",
                )
            )
            continue
        ids[key] = value
    return ids


def _remote_section(
    tiers: dict[str, Any],
    engine_call_seconds: object,
    agent_ports: tuple[object, object],
    pool_name: str | None,
    problems: Problems,
) -> RemoteTier | None:
    """``spec.tiers.remote`` (optional), and a managed master's name: the pool's name
    must leave room for ``<name>-mooncake-master``."""
    if tiers.get("remote") is None:
        return None
    remote = parse_remote_tier(tiers["remote"], engine_call_seconds, agent_ports, problems)
    limit = names.MAX_MANAGED_MASTER_POOL_NAME
    if remote is not None and remote.managed and pool_name is not None and (
        len(pool_name) > limit
    ):
        problems.append(
            ConfigProblem(
                "tiers.remote.mooncake.managed",
                f"the pool name {pool_name!r} has {len(pool_name)} characters; a managed "
                f"master's Service <name>-mooncake-master needs a name of at most {limit}: "
                "use a shorter pool name or an existing master (masterAddress, "
                "metadataServer)",
            )
        )
    return remote


_PORT = r"([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"
_MASTER_ADDRESS = re.compile(
    r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?):" + _PORT + "$"
)
_METADATA_SERVER = re.compile(r"^(P2PHANDSHAKE|https?://[^\s/]+(/\S*)?)$")


BadField = Callable[[str, str], None]
"""Reports one problem of ``spec.tiers.remote``: the path under it and the message."""


def parse_remote_tier(
    remote: object,
    engine_call_seconds: object,
    agent_ports: tuple[object, object],
    problems: list[ConfigProblem],
) -> RemoteTier | None:
    """Check a defaulted ``spec.tiers.remote``, appending every problem to ``problems``
    (the CRD's schema and CEL rules, again); None when it is unusable."""
    base = "tiers.remote"
    if not isinstance(remote, dict):
        problems.append(ConfigProblem(base, f"{remote!r} must be an object with a mooncake key"))
        return None
    before = len(problems)

    def bad(path: str, message: str) -> None:
        problems.append(ConfigProblem(f"{base}.{path}", message))

    policy, queue, timeout = _remote_writes(remote, engine_call_seconds, bad)
    mooncake = remote.get("mooncake")
    if not isinstance(mooncake, dict):
        bad("mooncake", "is required: set managed: true, or masterAddress and metadataServer")
        return None
    managed, address, metadata = _mooncake_master(mooncake, bad)
    protocol, device = _mooncake_transport(mooncake, bad)
    segment, buffer = _mooncake_sizes(mooncake, bad)
    store_port = _store_port(mooncake, agent_ports, bad)
    resources = _master_resources(mooncake, managed, bad)
    if len(problems) > before:
        return None
    return RemoteTier(
        write_policy=str(policy),
        queue_blocks=int(queue),
        timeout_seconds=float(timeout),
        managed=managed,
        master_address="" if managed else str(address),
        metadata_server="" if managed else str(metadata),
        protocol=str(protocol),
        device_name=device,
        segment_bytes=segment,
        local_buffer_bytes=buffer,
        store_port=int(store_port),
        master_resources=resources,
    )


def _remote_writes(
    remote: dict[str, Any], engine_call_seconds: object, bad: BadField
) -> tuple[Any, Any, Any]:
    """``writePolicy`` (store or evict), ``queueBlocks`` (1..1048576) and
    ``timeoutSeconds`` (above 0, below ``timeouts.engineCallSeconds``)."""
    policy = remote.get("writePolicy", "store")
    if policy not in ("store", "evict"):
        bad("writePolicy", f"{policy!r} is not a write policy; use store or evict")
    queue = remote.get("queueBlocks", 1024)
    if not isinstance(queue, int) or isinstance(queue, bool) or not 1 <= queue <= 1048576:
        bad("queueBlocks", f"{queue!r} must be an integer in 1..1048576 (blocks), e.g. 1024")
    timeout = remote.get("timeoutSeconds", 2)
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not timeout > 0:
        bad("timeoutSeconds", f"{timeout!r} must be a number of seconds above 0, e.g. 2")
    elif isinstance(engine_call_seconds, int | float) and not timeout < engine_call_seconds:
        bad(
            "timeoutSeconds",
            f"{timeout} must be below timeouts.engineCallSeconds ({engine_call_seconds}): a "
            "remote call is part of an engine call; e.g. 2 < 10",
        )
    return policy, queue, timeout


def _mooncake_master(mooncake: dict[str, Any], bad: BadField) -> tuple[bool, Any, Any]:
    """``managed``, or an existing master's ``masterAddress`` (host:port) and
    ``metadataServer`` (an http(s) URL or P2PHANDSHAKE): one or the other."""
    managed = mooncake.get("managed", False)
    if not isinstance(managed, bool):
        bad("mooncake.managed", f"{managed!r} must be true or false")
        managed = False
    address = mooncake.get("masterAddress")
    metadata = mooncake.get("metadataServer")
    if managed and (address is not None or metadata is not None):
        bad(
            "mooncake",
            "managed: true runs the pool's own master, so masterAddress and metadataServer "
            f"must be left out (got {address!r}, {metadata!r}); remove them or set "
            "managed: false",
        )
    elif not managed and (address is None or metadata is None):
        bad(
            "mooncake",
            "needs managed: true (the operator runs the master) or both masterAddress and "
            f"metadataServer of an existing master (got {address!r}, {metadata!r})",
        )
    if address is not None and not (
        isinstance(address, str) and len(address) <= 261 and _MASTER_ADDRESS.match(address)
    ):
        bad(
            "mooncake.masterAddress",
            f"{address!r} must be host:port with a port in 1..65535, e.g. 10.0.0.5:50051",
        )
    if metadata is not None and not (
        isinstance(metadata, str) and len(metadata) <= 512 and _METADATA_SERVER.match(metadata)
    ):
        bad(
            "mooncake.metadataServer",
            f"{metadata!r} must be an http(s) URL such as http://10.0.0.5:8080/metadata, or "
            "P2PHANDSHAKE",
        )
    return managed, address, metadata


def _mooncake_transport(mooncake: dict[str, Any], bad: BadField) -> tuple[Any, str]:
    """``protocol`` (tcp or rdma) and ``deviceName`` (RDMA devices, rdma only)."""
    protocol = mooncake.get("protocol", "tcp")
    if protocol not in ("tcp", "rdma"):
        bad("mooncake.protocol", f"{protocol!r} is not a protocol; use tcp or rdma")
    device = mooncake.get("deviceName", "")
    if not isinstance(device, str):
        bad("mooncake.deviceName", f"{device!r} must be a string, e.g. mlx5_0")
        device = ""
    elif device and protocol != "rdma":
        bad(
            "mooncake.deviceName",
            f"{device!r} names RDMA devices and is allowed only with protocol: rdma (protocol "
            f"is {protocol!r}); clear it or set protocol: rdma",
        )
    return protocol, device


def _mooncake_sizes(mooncake: dict[str, Any], bad: BadField) -> tuple[int, int]:
    """``segmentSize`` (at least Mooncake's smallest segment) and ``localBufferSize``
    (1Mi..64Gi), in bytes; 0 for one that is not a size."""

    def size(key: str, default: str) -> int:
        try:
            return parse_bytes(mooncake.get(key, default), f"spec.tiers.remote.mooncake.{key}")
        except ValueError as exc:
            bad(f"mooncake.{key}", str(exc).split(": ", 1)[1])
            return 0

    segment = size("segmentSize", "4Gi")
    if 0 < segment < MIN_SEGMENT_BYTES:
        bad(
            "mooncake.segmentSize",
            f"{segment} bytes is below 16Mi ({MIN_SEGMENT_BYTES}), the smallest segment "
            "Mooncake accepts; use e.g. 4Gi",
        )
    buffer = size("localBufferSize", "512Mi")
    if buffer and not MIN_LOCAL_BUFFER_BYTES <= buffer <= MAX_LOCAL_BUFFER_BYTES:
        bad(
            "mooncake.localBufferSize",
            f"{buffer} bytes is not between 1Mi and 64Gi ({MAX_LOCAL_BUFFER_BYTES}): every PP "
            "stage of an agent allocates and registers a staging buffer of this size; use "
            "e.g. 512Mi",
        )
    return segment, buffer


def _store_port(
    mooncake: dict[str, Any], agent_ports: tuple[object, object], bad: BadField
) -> Any:
    """``storePort``: it and the next port outside the ephemeral range and off the
    agent's own ports."""
    store_port = mooncake.get("storePort", 17500)
    if not isinstance(store_port, int) or isinstance(store_port, bool) or not any(
        lo <= store_port <= hi for lo, hi in STORE_PORT_RANGES
    ):
        bad(
            "mooncake.storePort",
            f"{store_port!r} is not in 1024..32766 or 61000..65534: the agent listens on "
            "storePort and storePort + 1, and Mooncake takes no port in the ephemeral range "
            "32768..60999 (its data port would become a random one); use e.g. 17500",
        )
    elif store_port in agent_ports or store_port + 1 in agent_ports:
        bad(
            "mooncake.storePort",
            f"{store_port} puts Mooncake's RPC port ({store_port}) or data port "
            f"({store_port + 1}) on an agent port (agent.ports http {agent_ports[0]}, fanout "
            f"{agent_ports[1]}); all four listen in the agent pod, so pick a storePort whose "
            "port and next port are both free",
        )
    return store_port


def _master_resources(mooncake: dict[str, Any], managed: bool, bad: BadField) -> dict[str, Any]:
    """``master.resources`` of a managed master (only with ``managed: true``)."""
    master = mooncake.get("master")
    if master is None:
        return {}
    if not managed:
        bad(
            "mooncake.master",
            "configures the operator's master and is allowed only with managed: true",
        )
        return {}
    if not isinstance(master, dict):
        bad("mooncake.master", f"{master!r} must be an object, e.g. {{resources: {{...}}}}")
        return {}
    resources = dict(master.get("resources") or {})
    problem = resources_problem(resources)
    if problem:
        bad("mooncake.master.resources", problem)
    return resources


def resources_problem(resources: dict[str, Any]) -> str | None:
    """What is wrong with a container's ``resources`` (every value a quantity, each
    request at most its limit), or None."""
    parsed: dict[str, dict[str, Decimal]] = {}
    for kind in ("requests", "limits"):
        values = resources.get(kind) or {}
        if not isinstance(values, dict):
            return f"{kind} {values!r} must map resource names to quantities"
        for name, value in values.items():
            quantity = (
                Decimal(value)
                if isinstance(value, int) and not isinstance(value, bool)
                else parse_quantity(value) if isinstance(value, str) else None
            )
            if quantity is None or quantity < 0:
                return f"{kind}.{name} {value!r} is not a quantity, e.g. 100m or 256Mi"
            parsed.setdefault(kind, {})[name] = quantity
    for name, limit in parsed.get("limits", {}).items():
        request = parsed.get("requests", {}).get(name)
        if request is not None and request > limit:
            return (
                f"requests.{name} {resources['requests'][name]!r} is above its limit "
                f"{resources['limits'][name]!r}; lower the request or raise the limit"
            )
    return None


def _valid_max_unavailable(value: object) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value >= 1
    if isinstance(value, str) and value.endswith("%") and value[:-1].isdigit():
        return 1 <= int(value[:-1]) <= 100
    return False


DEFAULT_TIMINGS = Timings(15, 10, 2)


def election_timings(spec: dict[str, Any] | None) -> Timings:
    """The leader-election timings of a spec, whatever else is wrong with it.

    Failover must not stop while a pool's spec is invalid, so the group election
    reads only ``spec.leaderElection``; a missing or inconsistent set of values
    falls back to the CRD defaults (15 > 10 > 2) as a whole. Agents' own
    ``leaseDurationSeconds`` still take precedence when judging their Leases."""
    election = (spec or {}).get("leaderElection")
    if not isinstance(election, dict):
        return DEFAULT_TIMINGS
    values = (
        election.get("leaseDurationSeconds", DEFAULT_TIMINGS.lease_duration),
        election.get("renewDeadlineSeconds", DEFAULT_TIMINGS.renew_deadline),
        election.get("retryPeriodSeconds", DEFAULT_TIMINGS.retry_period),
    )
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
        return DEFAULT_TIMINGS
    lease, renew, retry = (int(v) for v in values)
    if not lease > renew > retry:
        return DEFAULT_TIMINGS
    return Timings(lease, renew, retry)
