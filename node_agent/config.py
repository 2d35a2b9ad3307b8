"""The agent's configuration: ``agent.yaml`` (docs/contracts.md section 1) plus
environment overrides, parsed into frozen dataclasses and validated.

Contract:

* Keys are camelCase as in the CRD; an unknown key anywhere is an error.
* ``NODE_NAME``, ``POD_NAME`` and ``POD_IP`` (set by the operator's DaemonSet
  through the downward API) fill ``nodeName``, ``podName`` and
  ``advertiseAddress`` when the file does not set them.
* ``FLEXKV_<UPPER_SNAKE_PATH>`` overrides one leaf (``FLEXKV_PORTS_HTTP=9090``,
  ``FLEXKV_TIMEOUTS_ENGINE_CALL_SECONDS=3``). Values are read as YAML scalars, so
  numbers, booleans and ``[a, b]`` lists work. ``FLEXKV_*`` variables that name no
  leaf (``FLEXKV_CURVE_PUBLIC_KEY``) are not configuration and are left alone.
* Byte sizes accept integers or Kubernetes quantities (``8Gi``, ``500M``, ``1e9``).
* Every error is a :class:`ConfigError` whose message names the key, the bad value
  and the fix.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from node_agent.backend.remote.settings import (
    MAX_LOCAL_BUFFER_BYTES,
    MIN_LOCAL_BUFFER_BYTES,
    MIN_SEGMENT_BYTES,
    store_port_problem,
)
from node_agent.backend.tier_fds import TIER_SOCKET_SUFFIX
from node_agent.contract import files, quantity
from node_agent.vocab.budget import call_budget

ENV_PREFIX = "FLEXKV_"
# Unix domain socket paths are limited to sizeof(sun_path) - 1 bytes on Linux.
_MAX_SOCKET_PATH = 107


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key, the value and the fix."""


#: The suffixes an unknown-suffix error suggests: binary, then decimal, no milli.
_SIZE_SUFFIXES = ", ".join(
    [*quantity.BINARY_SUFFIXES, *(s for s in quantity.DECIMAL_SUFFIXES if s != "m")]
)


def parse_quantity(value: object, key: str = "size") -> int:
    """Parse a byte size: a non-negative integer or a Kubernetes quantity string.

    Strings follow the API server's grammar (:mod:`node_agent.contract.quantity`,
    the one the operator reads a pool's sizes with), surrounding whitespace
    ignored, so a size means the same number of bytes to both. Fractions and
    milli-units are allowed when the result is a whole number of bytes
    (``1.5Gi``, ``2000m``); negative sizes and unknown suffixes are rejected.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{key}: {value!r} is not a byte size; use bytes or a quantity like 8Gi")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{key}: {value} is negative; use a size >= 0 such as 8Gi")
        return value
    if not isinstance(value, str):
        raise ConfigError(
            f"{key}: {value!r} is not a byte size; use bytes or a quantity like 8Gi"
        )
    number = quantity.parse_quantity(value.strip())
    if number is None:
        suffix = quantity.unknown_suffix(value.strip())
        if suffix is not None:
            raise ConfigError(
                f"{key}: {value!r} has unknown suffix {suffix!r}; use one of {_SIZE_SUFFIXES}"
            )
        raise ConfigError(f"{key}: {value!r} is not a quantity; write it like 8Gi, 512Mi or 1e9")
    if number < 0:
        raise ConfigError(f"{key}: {value!r} is negative; use a size >= 0 such as 8Gi")
    if number != number.to_integral_value():
        raise ConfigError(f"{key}: {value!r} is not a whole number of bytes; round it")
    return int(number)


# ---------------------------------------------------------------------------
# Schema: frozen dataclasses; field metadata carries the camelCase key and a
# converter. A dataclass-typed field is a nested section.

T = TypeVar("T")
Converter = Callable[[object, str], Any]


def _key(name: str, conv: Converter | None = None, **kw: Any) -> Any:
    return field(metadata={"key": name, "conv": conv}, **kw)


def _int(lo: int, hi: int | None = None) -> Converter:
    def conv(v: object, key: str) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{key}: {v!r} is not an integer; write a whole number >= {lo}")
        if v < lo or (hi is not None and v > hi):
            rng = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
            raise ConfigError(f"{key}: {v} is out of range; use a value {rng}")
        return v

    return conv


def _float(lo: float, hi: float | None = None, strict_lo: bool = False) -> Converter:
    def conv(v: object, key: str) -> float:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ConfigError(f"{key}: {v!r} is not a number; write a number like 2 or 0.5")
        f = float(v)
        bad_lo = f <= lo if strict_lo else f < lo
        if bad_lo or (hi is not None and f > hi) or not math.isfinite(f):
            op = ">" if strict_lo else ">="
            rng = f"{op} {lo}" + (f" and <= {hi}" if hi is not None else "")
            raise ConfigError(f"{key}: {v} is out of range; use a value {rng}")
        return f

    return conv


def _str(nonempty: bool = True) -> Converter:
    def conv(v: object, key: str) -> str:
        if not isinstance(v, str) or (nonempty and not v.strip()):
            raise ConfigError(f"{key}: {v!r} is not a non-empty string; set it to a name or path")
        return v

    return conv


def _opt_str(v: object, key: str) -> str | None:
    return None if v is None or v == "" else _str()(v, key)


def _choice(*allowed: str) -> Converter:
    def conv(v: object, key: str) -> str:
        if v not in allowed:
            raise ConfigError(f"{key}: {v!r} is not allowed; use one of {', '.join(allowed)}")
        return str(v)

    return conv


def _bool(v: object, key: str) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"{key}: {v!r} is not a boolean; write true or false")
    return v


def _paths(v: object, key: str) -> tuple[str, ...]:
    if not isinstance(v, list | tuple) or not v or not all(isinstance(p, str) and p for p in v):
        raise ConfigError(f"{key}: {v!r} is not a list of paths; write e.g. [/var/lib/flexkv/ssd]")
    return tuple(v)


def _quantity(v: object, key: str) -> int:
    return parse_quantity(v, key)


@dataclass(frozen=True)
class CpuTier:
    size: int = _key("size", _quantity, default=8 * 2**30)
    pinned: bool = _key("pinned", _bool, default=True)
    # Threads sharing one large copy between the tier and an engine's buffers
    # (node_agent/backend/lanes.py).
    copy_lanes: int = _key("copyLanes", _int(1, 64), default=2)


@dataclass(frozen=True)
class SsdTier:
    size: int = _key("size", _quantity, default=0)
    paths: tuple[str, ...] = _key("paths", _paths, default=("/var/lib/flexkv/ssd",))
    persist: bool = _key("persist", _bool, default=True)


_HOST_PORT = re.compile(r"^\[?[A-Za-z0-9_.:-]+\]?:[0-9]{1,5}$")


def _host_port(v: object, key: str) -> str:
    ok = isinstance(v, str) and _HOST_PORT.match(v) is not None
    if not ok or not 0 < int(str(v).rsplit(":", 1)[1]) < 65536:
        raise ConfigError(
            f"{key}: {v!r} is not a host:port address; write it like "
            "flexkv-mooncake-master.ns.svc:50051"
        )
    return str(v)


def _metadata_server(v: object, key: str) -> str:
    if v == "P2PHANDSHAKE":
        return v
    if not isinstance(v, str) or not re.match(r"^https?://[^/\s]+(/\S*)?$", v):
        raise ConfigError(
            f"{key}: {v!r} is not an http(s) URL; write it like "
            "http://flexkv-mooncake-master.ns.svc:8080/metadata (or P2PHANDSHAKE)"
        )
    return v


@dataclass(frozen=True)
class Mooncake:
    """``tiers.remote.mooncake``: how this agent joins the Mooncake Store pool."""

    master_address: str = _key("masterAddress", _host_port, default="")
    metadata_server: str = _key("metadataServer", _metadata_server, default="")
    protocol: str = _key("protocol", _choice("tcp", "rdma"), default="tcp")
    device_name: str = _key("deviceName", _str(nonempty=False), default="")
    segment_size: int = _key("segmentSize", _quantity, default=4 * 2**30)
    local_buffer_size: int = _key("localBufferSize", _quantity, default=512 * 2**20)
    store_port: int = _key("storePort", _int(1, 65534), default=17500)


@dataclass(frozen=True)
class RemoteTier:
    """``tiers.remote``: the shared tier on Mooncake Store (docs/remote.md)."""

    write_policy: str = _key("writePolicy", _choice("store", "evict"), default="store")
    queue_blocks: int = _key("queueBlocks", _int(1, 1 << 20), default=1024)
    timeout_seconds: float = _key("timeoutSeconds", _float(0, strict_lo=True), default=2.0)
    mooncake: Mooncake = field(default_factory=Mooncake, metadata={"key": "mooncake"})


@dataclass(frozen=True)
class Tiers:
    cpu: CpuTier = field(default_factory=CpuTier, metadata={"key": "cpu"})
    ssd: SsdTier | None = field(default=None, metadata={"key": "ssd"})
    remote: RemoteTier | None = field(default=None, metadata={"key": "remote"})


@dataclass(frozen=True)
class Eviction:
    policy: str = _key("policy", _choice("lru"), default="lru")
    high_watermark: float = _key("highWatermark", _float(0.0, 1.0, strict_lo=True), default=0.95)
    low_watermark: float = _key("lowWatermark", _float(0.0, 1.0), default=0.85)


@dataclass(frozen=True)
class Ports:
    http: int = _key("http", _int(0, 65535), default=8080)
    fanout: int = _key("fanout", _int(0, 65535), default=5557)


@dataclass(frozen=True)
class Timeouts:
    engine_call_seconds: float = _key("engineCallSeconds", _float(0, strict_lo=True), default=10.0)
    fanout_wait_seconds: float = _key("fanoutWaitSeconds", _float(0, strict_lo=True), default=5.0)
    unlaunched_match_seconds: float = _key(
        "unlaunchedMatchSeconds", _float(0, strict_lo=True), default=30.0
    )


@dataclass(frozen=True)
class Heartbeat:
    lease_duration_seconds: float = _key(
        "leaseDurationSeconds", _float(0, strict_lo=True), default=15.0
    )
    renew_deadline_seconds: float = _key(
        "renewDeadlineSeconds", _float(0, strict_lo=True), default=10.0
    )
    retry_period_seconds: float = _key("retryPeriodSeconds", _float(0, strict_lo=True), default=2.0)


def _bind_endpoint(v: object, key: str) -> str:
    ok = isinstance(v, str) and (
        re.match(r"^tcp://(\*|[A-Za-z0-9_.:\[\]-]+):[0-9]{1,5}$", v) is not None
        or (v.startswith("ipc://") and len(v) > len("ipc://")))
    if not ok:
        raise ConfigError(
            f"{key}: {v!r} is not a ZMQ endpoint to bind; write it like tcp://*:5558 "
            "or ipc:///run/flexkv/events.sock"
        )
    return str(v)


@dataclass(frozen=True)
class KvEvents:
    """``kvEvents``: the KV-event publisher for routers (docs/operations.md)."""

    endpoint: str = _key("endpoint", _bind_endpoint, default="tcp://*:5558")
    topic: str = _key("topic", _str(nonempty=False), default="")
    queue_size: int = _key("queueSize", _int(1, 1 << 22), default=10_000)
    block_hash: str = _key("blockHash", _choice("vllm-sha256", "agent"), default="vllm-sha256")
    hash_seed: str = _key("hashSeed", _str(nonempty=False), default="vllm-none-hash")
    # vLLM's default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): a hash's low 64 bits.
    int_block_hashes: bool = _key("intBlockHashes", _bool, default=True)


@dataclass(frozen=True)
class AgentConfig:
    """One agent's configuration (docs/contracts.md section 1 plus the agent-local keys
    ``nodeName``, ``podName``, ``podUid``, ``advertiseAddress``, ``bindAddress``,
    ``kubernetes`` and ``groupViewFile`` documented in docs/agent.md)."""

    pool: str = _key("pool", _str(), default="default")
    namespace: str = _key("namespace", _str(), default="default")
    backend: str = _key("backend", _choice("embedded", "flexkv"), default="embedded")
    tokens_per_block: int = _key("tokensPerBlock", _int(1, 1 << 16), default=16)
    cache_epoch: int = _key("cacheEpoch", _int(0), default=0)
    # Folded into every stage's model namespace (engine_api/identity.py): bump it when
    # the weights behind one model name and revision change.
    model_salt: str = _key("modelSalt", _str(nonempty=False), default="")
    tiers: Tiers = field(default_factory=Tiers, metadata={"key": "tiers"})
    eviction: Eviction = field(default_factory=Eviction, metadata={"key": "eviction"})
    ports: Ports = field(default_factory=Ports, metadata={"key": "ports"})
    engine_socket: str = _key("engineSocket", _str(), default=files.ENGINE_SOCKET)
    timeouts: Timeouts = field(default_factory=Timeouts, metadata={"key": "timeouts"})
    heartbeat: Heartbeat = field(default_factory=Heartbeat, metadata={"key": "heartbeat"})
    curve_key_dir: str = _key("curveKeyDir", _str(), default=files.CURVE_MOUNT)
    expected_ranks: int = _key("expectedRanks", _int(0, 1024), default=1)
    # Stages (replica, PP rank) served at once; the tier sizes are the node's budget,
    # split into that many even shares, one per backend (node_agent/assembly.py
    # ``stage_share``; replicas of one model share one backend).
    max_stages: int = _key("maxStages", _int(1, 64), default=1)
    # The even shares the tier sizes are split into, one per backend (absent:
    # maxStages); at most maxStages. A stage that needs a backend beyond them is
    # refused (node_agent/engine_api/service.py).
    tier_shares: int | None = _key("tierShares", _int(1, 64), default=None)
    # Off unless the section is present (docs/operations.md "KV events for routers").
    kv_events: KvEvents | None = field(default=None, metadata={"key": "kvEvents"})
    # Agent-local keys (not rendered by the operator; usually set from the environment).
    node_name: str = _key("nodeName", _str(), default="local")
    pod_name: str | None = _key("podName", _opt_str, default=None)
    # The agent pod's uid (downward API ``metadata.uid``): its Lease is owned by the pod,
    # so Kubernetes' garbage collector deletes the Lease with the pod (and its pool).
    pod_uid: str | None = _key("podUid", _opt_str, default=None)
    advertise_address: str = _key("advertiseAddress", _str(), default="127.0.0.1")
    bind_address: str = _key("bindAddress", _str(), default="0.0.0.0")
    kubernetes: str = _key("kubernetes", _choice("auto", "on", "off"), default="auto")
    group_view_file: str | None = _key("groupViewFile", _opt_str, default=None)

    @property
    def shares(self) -> int:
        """The even shares of the tier sizes, one per backend: ``tierShares``, or
        ``maxStages`` when it is not set."""
        return self.max_stages if self.tier_shares is None else self.tier_shares

    @property
    def engine_endpoint(self) -> str:
        """The ``ipc://`` endpoint engines connect to."""
        return f"ipc://{self.engine_socket}"

    @property
    def holder_identity(self) -> str:
        """The Lease holder: the pod name, or the node name outside Kubernetes."""
        return self.pod_name or self.node_name


def _camel_to_snake_upper(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper()


def _section_type(f: Any) -> type | None:
    """The dataclass type of a nested section field, or None for a leaf."""
    hint = f.type if not isinstance(f.type, str) else f.type.split("|")[0].strip()
    resolved = _SECTIONS.get(hint) if isinstance(hint, str) else hint
    return resolved if resolved is not None and is_dataclass(resolved) else None


_SECTIONS: dict[str, type] = {
    c.__name__: c for c in (CpuTier, SsdTier, Tiers, Eviction, Ports, Timeouts, Heartbeat,
                            RemoteTier, Mooncake, KvEvents)
}


def _build(cls: type[T], data: object, path: str) -> T:
    where = path or "the top level"
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: {data!r} is not a mapping; write it as key: value lines")
    by_key = {f.metadata["key"]: f for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(by_key))
    if unknown:
        bad = f"{path}.{unknown[0]}" if path else str(unknown[0])
        raise ConfigError(
            f"{bad}: unknown key; allowed keys under {where} are {', '.join(sorted(by_key))}"
        )
    kwargs: dict[str, Any] = {}
    for key, f in by_key.items():
        if key not in data:
            continue
        full = f"{path}.{key}" if path else key
        section = _section_type(f)
        if section is not None:
            kwargs[f.name] = _build(section, data[key], full)
        else:
            kwargs[f.name] = f.metadata["conv"](data[key], full)
    return cls(**kwargs)


def _env_leaves(cls: type, prefix: tuple[str, ...] = ()) -> dict[str, tuple[str, ...]]:
    """Map ``FLEXKV_...`` variable names to the camelCase key path of each leaf."""
    out: dict[str, tuple[str, ...]] = {}
    for f in fields(cls):
        path = (*prefix, f.metadata["key"])
        section = _section_type(f)
        if section is not None:
            out.update(_env_leaves(section, path))
        else:
            out[ENV_PREFIX + "_".join(_camel_to_snake_upper(p) for p in path)] = path
    return out


def _apply_env(raw: dict[str, Any], env: Mapping[str, str]) -> None:
    for var, path in _env_leaves(AgentConfig).items():
        if var not in env:
            continue
        try:
            value = yaml.safe_load(env[var]) if env[var] != "" else None
        except yaml.YAMLError as exc:
            raise ConfigError(
                f"{var}: {env[var]!r} is not a YAML scalar ({exc}); quote it"
            ) from exc
        node = raw
        for part in path[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[path[-1]] = value


#: Downward-API variables the operator's DaemonSet sets; they fill agent-local keys
#: the file leaves out (a FLEXKV_* override still wins).
_DOWNWARD = files.DOWNWARD_ENV


def _apply_downward(raw: dict[str, Any], env: Mapping[str, str]) -> None:
    for var, key in _DOWNWARD.items():
        if key not in raw and env.get(var):
            raw[key] = env[var]


def _check(cfg: AgentConfig) -> None:
    hb = cfg.heartbeat
    if not hb.lease_duration_seconds > hb.renew_deadline_seconds > hb.retry_period_seconds:
        raise ConfigError(
            "heartbeat: leaseDurationSeconds > renewDeadlineSeconds > retryPeriodSeconds must "
            f"hold, got {hb.lease_duration_seconds} / {hb.renew_deadline_seconds} / "
            f"{hb.retry_period_seconds}; for example use 15 / 10 / 2"
        )
    to = cfg.timeouts
    if not to.fanout_wait_seconds < to.engine_call_seconds:
        raise ConfigError(
            f"timeouts.fanoutWaitSeconds: {to.fanout_wait_seconds:g} is not below "
            f"timeouts.engineCallSeconds {to.engine_call_seconds:g}; a follower's wait must fit "
            "inside the engine call: use about half of engineCallSeconds (e.g. 5 with 10)"
        )
    try:
        call_budget(to.engine_call_seconds, to.fanout_wait_seconds)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    ev = cfg.eviction
    if not ev.low_watermark < ev.high_watermark:
        raise ConfigError(
            f"eviction.lowWatermark: {ev.low_watermark} is not below highWatermark "
            f"{ev.high_watermark}; use e.g. 0.85 and 0.95"
        )
    limit = _MAX_SOCKET_PATH - len(TIER_SOCKET_SUFFIX)
    if len(cfg.engine_socket.encode()) > limit:
        raise ConfigError(
            f"engineSocket: {cfg.engine_socket!r} is {len(cfg.engine_socket.encode())} bytes; "
            f"Unix socket paths are limited to {_MAX_SOCKET_PATH}, and the tier socket beside "
            f"it adds {TIER_SOCKET_SUFFIX!r}, so it may have at most {limit}: use a shorter path"
        )
    if cfg.tier_shares is not None and cfg.tier_shares > cfg.max_stages:
        raise ConfigError(
            f"tierShares: {cfg.tier_shares} is above maxStages {cfg.max_stages}; the tier "
            "sizes are split into one share per backend and the agent serves at most "
            "maxStages of them: lower tierShares, or raise maxStages to at least "
            f"{cfg.tier_shares}"
        )
    if cfg.tiers.remote is not None:
        _check_remote(cfg.tiers.remote, to.engine_call_seconds)
    if cfg.tiers.ssd is not None and cfg.tiers.ssd.size == 0:
        raise ConfigError("tiers.ssd.size: 0 with an ssd section; set a size like 100Gi or "
                          "remove the ssd section")


def _check_remote(rt: RemoteTier, engine_call_seconds: float) -> None:
    mc = rt.mooncake
    where = "tiers.remote.mooncake"
    if not mc.master_address:
        raise ConfigError(f"{where}.masterAddress: missing; set the mooncake_master RPC address "
                          "(host:port, e.g. pool-mooncake-master.ns.svc:50051)")
    if not mc.metadata_server:
        raise ConfigError(f"{where}.metadataServer: missing; set Mooncake's metadata server URL "
                          "(e.g. http://pool-mooncake-master.ns.svc:8080/metadata)")
    if mc.device_name and mc.protocol != "rdma":
        raise ConfigError(f"{where}.deviceName: {mc.device_name!r} is set with protocol "
                          f"{mc.protocol!r}; RDMA devices need protocol rdma, or clear deviceName")
    if mc.segment_size < MIN_SEGMENT_BYTES:
        raise ConfigError(f"{where}.segmentSize: {mc.segment_size} bytes is below 16Mi "
                          f"({MIN_SEGMENT_BYTES}), the smallest segment Mooncake accepts; give "
                          "the pool a segment like 4Gi")
    if mc.local_buffer_size < MIN_LOCAL_BUFFER_BYTES:
        raise ConfigError(f"{where}.localBufferSize: {mc.local_buffer_size} bytes is below 1Mi; "
                          "the staging buffer must hold whole blocks: use e.g. 512Mi")
    if mc.local_buffer_size > MAX_LOCAL_BUFFER_BYTES:
        raise ConfigError(f"{where}.localBufferSize: {mc.local_buffer_size} bytes is above 64Gi "
                          f"({MAX_LOCAL_BUFFER_BYTES}); every stage allocates and registers one "
                          "staging buffer of this size: use e.g. 512Mi")
    problem = store_port_problem(mc.store_port)
    if problem is not None:
        raise ConfigError(f"{where}.storePort: {problem}")
    if not rt.timeout_seconds < engine_call_seconds:
        raise ConfigError(
            f"tiers.remote.timeoutSeconds: {rt.timeout_seconds:g} is not below "
            f"timeouts.engineCallSeconds {engine_call_seconds:g}; a remote call must fit inside "
            "an engine call: use about a fifth of it (e.g. 2 with 10)"
        )


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> AgentConfig:
    """Read ``path`` (YAML; optional), apply ``FLEXKV_*`` overrides from ``env``
    (default ``os.environ``) and validate. Raises :class:`ConfigError`."""
    raw: Any = {}
    if path is not None:
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as exc:
            raise ConfigError(
                f"config file {str(p)!r} cannot be read ({exc.strerror}); "
                "pass --config with the path of agent.yaml"
            ) from exc
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {exc}") from exc
        if not isinstance(raw, dict):
            raise ConfigError(
                f"config file {str(p)!r}: top level is {type(raw).__name__}, not a mapping; "
                "write it as key: value lines"
            )
    env = os.environ if env is None else env
    _apply_downward(raw, env)
    _apply_env(raw, env)
    cfg = _build(AgentConfig, raw, "")
    _check(cfg)
    return cfg


def config_from_mapping(data: Mapping[str, Any]) -> AgentConfig:
    """Validate an in-memory ``agent.yaml`` mapping (no environment overrides)."""
    cfg = _build(AgentConfig, dict(data), "")
    _check(cfg)
    return cfg
