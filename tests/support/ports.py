"""Free loopback ports for the servers a test starts."""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

#: Lowest port handed out; the ports below the kernel's ephemeral range are used.
LOWEST = 20000
_handed: set[int] = set()
_lock = threading.Lock()
_pick = random.SystemRandom()


def _ephemeral_start() -> int:
    """First port of the kernel's ephemeral range (what a bind to port 0 or an
    outgoing connection gets); 0 when it cannot be read."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _any_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, for a server the caller starts.

    Taken below the kernel's ephemeral range where it can be read: a port from
    that range can be handed to any socket bound to port 0 (an engine's own
    distributed set-up, a client's outgoing connection) between this call and
    the server's bind, which happens late for some servers (an agent binds its
    fan-out port when the first engine registers). Never one this process
    handed out before, and even with the next port free too (Mooncake's
    transfer engine takes ``storePort + 1``). Where the range cannot be read,
    any free port (another process may then take it before the caller binds)."""
    top = _ephemeral_start()
    if top - LOWEST >= 2000:
        for _ in range(500):
            port = _pick.randrange(LOWEST, top - 1, 2)
            with _lock:
                if port in _handed:
                    continue
                if _bindable(port) and _bindable(port + 1):
                    _handed.add(port)
                    return port
    return _any_port()
