"""Settings of the remote tier (agent.yaml ``tiers.remote``), validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

WRITE_POLICIES = ("store", "evict")

#: The smallest segment Mooncake accepts (its setup fails below: "Total size must
#: be at least 16777216").
MIN_SEGMENT_BYTES = 16 << 20
#: Bounds of ``localBufferSize``: the staging buffer is allocated and registered per
#: stage when an engine registers, so it must hold two blocks (checked then, against
#: the layout) and stay a fraction of a node's memory (checked at start).
MIN_LOCAL_BUFFER_BYTES = 1 << 20
MAX_LOCAL_BUFFER_BYTES = 64 << 30
#: Ports Mooncake takes for its transfer engine: 1024..65535 outside Linux's
#: ephemeral range 32768..60999. Any other MC_MIN_RPC_PORT / MC_MAX_RPC_PORT makes
#: it fall back to a random port in 15000..17000 ("Invalid port range"), so both
#: ``storePort`` and ``storePort + 1`` must lie in one of these.
PORT_RANGES = ((1024, 32767), (61000, 65535))
#: The ``storePort`` values that keep both ports in :data:`PORT_RANGES`.
STORE_PORT_RANGES = ((1024, 32766), (61000, 65534))


def store_port_problem(port: object) -> str | None:
    """Why ``port`` cannot be a ``storePort`` (None when it can)."""
    if not isinstance(port, int) or isinstance(port, bool) or not any(
            lo <= port <= hi for lo, hi in STORE_PORT_RANGES):
        return (f"{port!r} is not in 1024..32766 or 61000..65534: Mooncake listens on "
                "storePort and storePort + 1 and takes only ports outside the ephemeral "
                "range 32768..60999 (any other data port becomes a random one in "
                "15000..17000); use e.g. 17500")
    return None


@dataclass(frozen=True)
class RemoteSettings:
    """What :class:`~.tier.RemoteTier` needs to join a Mooncake Store pool.

    ``local_hostname`` is ``<advertiseAddress>:<storePort>``: the address peers
    reach this agent's transfer engine at. Sizes are bytes.
    """

    master_address: str
    metadata_server: str
    local_hostname: str
    protocol: str = "tcp"
    device_name: str = ""
    segment_bytes: int = 4 << 30
    staging_bytes: int = 512 << 20
    write_policy: str = "store"
    queue_blocks: int = 1024
    timeout_seconds: float = 2.0

    def __post_init__(self) -> None:
        for key in ("master_address", "metadata_server", "local_hostname"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                raise ValueError(f"{key}={getattr(self, key)!r} is invalid; set a non-empty "
                                 "address (tiers.remote.mooncake in agent.yaml)")
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"protocol={self.protocol!r} is invalid; use tcp or rdma")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy={self.write_policy!r} is invalid; use one of "
                             f"{', '.join(WRITE_POLICIES)}")
        for key in ("segment_bytes", "staging_bytes", "queue_blocks"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{key}={v!r} is invalid; it must be a positive int")
        if self.segment_bytes < MIN_SEGMENT_BYTES:
            raise ValueError(f"segment_bytes={self.segment_bytes} is below Mooncake's minimum "
                             f"segment of {MIN_SEGMENT_BYTES} bytes (16Mi)")
        if not isinstance(self.timeout_seconds, int | float) or not self.timeout_seconds > 0:
            raise ValueError(f"timeout_seconds={self.timeout_seconds!r} is invalid; use a "
                             "number of seconds > 0 such as 2")
