"""Settings of the remote tier (agent.yaml ``tiers.remote``), validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from node_agent.contract import mooncake as mooncake_bounds

WRITE_POLICIES = ("store", "evict")

# Mooncake's bounds are checked by the operator too: written once, in the contract.
MIN_SEGMENT_BYTES = mooncake_bounds.MIN_SEGMENT_BYTES
MIN_LOCAL_BUFFER_BYTES = mooncake_bounds.MIN_LOCAL_BUFFER_BYTES
MAX_LOCAL_BUFFER_BYTES = mooncake_bounds.MAX_LOCAL_BUFFER_BYTES
PORT_RANGES = mooncake_bounds.PORT_RANGES
STORE_PORT_RANGES = mooncake_bounds.STORE_PORT_RANGES


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
