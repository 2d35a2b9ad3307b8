"""The only module that imports ``mooncake`` (the ``remote`` extra).

:func:`connect` imports it lazily and joins a Mooncake Store pool; a missing
package or system library becomes a :class:`MooncakeUnavailable` that says what
to install. :class:`MooncakeStore` is the narrow surface the remote tier uses:
``batch_is_exist``, ``batch_put_from``, ``batch_get_into`` on registered memory,
``remove_all`` and ``close``. Return codes are Mooncake's: a non-negative number
is success (bytes for gets), a negative one an error code.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

from node_agent.backend.remote.settings import RemoteSettings

log = logging.getLogger(__name__)

#: Mooncake error codes the tier tells apart (mooncake-store's ErrorCode).
OBJECT_NOT_FOUND = -704
RPC_FAIL = -900
#: Memory Mooncake itself keeps for its non-registered APIs (the tier uses its own
#: registered staging buffer instead).
CLIENT_BUFFER_BYTES = 16 << 20


class MooncakeUnavailable(RuntimeError):
    """``mooncake`` cannot be imported or the pool cannot be joined."""


def master_unreachable(code: int) -> bool:
    """Whether a Mooncake return code says the master (RPC) could not be reached."""
    return -999 <= code <= -900


def pin_ports(store_port: int, timeout_seconds: float | None = None) -> None:
    """Make this process's transfer engine listen on fixed ports, so a NetworkPolicy
    can name them: its handshake / RPC port is ``store_port`` (the port of the
    advertised local hostname) and its TCP data port ``store_port + 1``. Mooncake
    reads the port range when its library loads, so call this before the first
    import; the values always follow ``storePort`` (an inherited environment
    cannot move them elsewhere). Mooncake ignores a range inside the ephemeral
    ports 32768..60999 (the agent's config refuses such a ``storePort``).

    With ``timeout_seconds`` (``tiers.remote.timeoutSeconds``), a TCP transfer to a
    peer that stops answering (a frozen process) ends after about that long
    instead of Mooncake's 30 s default: no status frame, no progress, or no free
    lane to the peer within it fails the transfer."""
    os.environ["MC_LEGACY_RPC_PORT_BINDING"] = "1"
    os.environ["MC_MIN_RPC_PORT"] = str(store_port + 1)
    os.environ["MC_MAX_RPC_PORT"] = str(store_port + 1)
    if timeout_seconds is not None:
        seconds = max(1, math.ceil(timeout_seconds))
        os.environ["MC_TCP_STATUS_TIMEOUT_SEC"] = str(seconds)
        os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] = str(seconds)
        os.environ["MC_TCP_ADMISSION_TIMEOUT_MS"] = str(seconds * 1000)


def _import_store_class() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        native = {"libibverbs": "libibverbs1", "libcurl": "libcurl4", "libnuma": "libnuma1"}
        debs = [deb for lib, deb in native.items() if lib in str(exc)]
        hint = (f"install the Debian package {debs[0]} (apt-get install -y {debs[0]})"
                if debs else
                "install the agent's remote extra: pip install 'flexkv-operator[remote]' "
                "(mooncake-transfer-engine-non-cuda) and Debian's libibverbs1, libcurl4 "
                "and libnuma1")
        raise MooncakeUnavailable(
            f"the remote tier needs Mooncake Store but `import mooncake.store` failed ({exc}); "
            f"{hint}, or remove tiers.remote from agent.yaml"
        ) from exc
    return MooncakeDistributedStore


def check_available(store_port: int | None = None,
                    timeout_seconds: float | None = None) -> None:
    """Raise :class:`MooncakeUnavailable` (saying what to install) unless
    ``mooncake.store`` imports; with ``store_port``, :func:`pin_ports` first."""
    if store_port is not None:
        pin_ports(store_port, timeout_seconds)
    _import_store_class()


class MooncakeStore:
    """One joined Mooncake Store client (see :func:`connect`).

    Puts prefer this client's own segment (``local_segment``): a block is written
    by a local copy while the segment has room, so no put waits on a peer (a
    frozen peer holds a transfer to it for up to the transfer timeout)."""

    def __init__(self, store: Any, local_segment: str = "", put_config: Any = None) -> None:
        self._store = store
        self.local_segment = local_segment
        self._put_config = put_config

    def register_buffer(self, ptr: int, size: int) -> None:
        rc = int(self._store.register_buffer(ptr, size))
        if rc != 0:
            raise MooncakeUnavailable(
                f"Mooncake register_buffer of {size} bytes failed with code {rc}; lower "
                "tiers.remote.mooncake.localBufferSize or check the memory lock limit"
            )

    def unregister_buffer(self, ptr: int) -> None:
        rc = int(self._store.unregister_buffer(ptr))
        if rc != 0:
            log.warning("Mooncake unregister_buffer failed", extra={"code": rc})

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return [int(c) for c in self._store.batch_is_exist(keys)]

    def batch_put_from(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        if self._put_config is None:
            return [int(c) for c in self._store.batch_put_from(keys, ptrs, sizes)]
        return [int(c) for c in self._store.batch_put_from(keys, ptrs, sizes,
                                                            self._put_config)]

    def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        return [int(c) for c in self._store.batch_get_into(keys, ptrs, sizes)]

    def remove_all(self) -> int:
        return int(self._store.remove_all())

    def close(self) -> None:
        try:
            self._store.close()
        except Exception:  # closing a client of a dead master still frees local state
            log.warning("Mooncake client close failed", exc_info=True)


def connect(settings: RemoteSettings) -> MooncakeStore:
    """Join the pool: this agent contributes ``segment_bytes`` of memory and serves
    peers at ``local_hostname``. Raises :class:`MooncakeUnavailable` when
    ``mooncake`` is missing or ``setup`` fails (the master must answer here)."""
    pin_ports(int(settings.local_hostname.rsplit(":", 1)[1]), settings.timeout_seconds)
    cls = _import_store_class()
    store = cls()
    rc = int(store.setup(
        settings.local_hostname, settings.metadata_server, settings.segment_bytes,
        CLIENT_BUFFER_BYTES, settings.protocol, settings.device_name, settings.master_address,
    ))
    if rc != 0:
        raise MooncakeUnavailable(
            f"Mooncake setup failed with code {rc} (master {settings.master_address}, metadata "
            f"{settings.metadata_server}, local {settings.local_hostname}); check that the "
            "master answers and that storePort is free on this node"
        )
    from mooncake.store import ReplicateConfig

    put_config = ReplicateConfig()
    put_config.preferred_segment = settings.local_hostname
    return MooncakeStore(store, settings.local_hostname, put_config)
