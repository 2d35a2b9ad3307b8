"""Checks an agent makes before it joins the Mooncake pool (no ``mooncake`` import).

Mooncake's ``setup`` cannot be interrupted and, in this version, holds the Python
GIL while it runs: against a master that accepts connections but never answers
(a partition, or ``masterAddress`` naming the master's HTTP port) it stops every
thread of the agent for its own 30 s RPC timeout. A failed ``setup`` also
deletes the metadata entries of its segment name, which may belong to another
agent. So the tier calls ``setup`` only after these bounded, GIL-free checks:

* :func:`store_ports_problem` -- ``storePort`` and ``storePort + 1`` are free on
  this node (another process listening there is refused with the port named);
* :func:`master_problem` -- the master answers Mooncake's RPC protocol (one
  request header for a function it does not have: a real master answers an
  error frame at once);
* :func:`metadata_problem` -- the metadata server answers HTTP;
* :func:`previous_segment` -- whether a segment of this name is still described
  at the metadata server: a previous incarnation of the agent that did not leave
  (killed), whose segment the master keeps mounted until its ``client_ttl``.
"""

from __future__ import annotations

import errno
import socket
import struct
import time
import urllib.error
import urllib.parse
import urllib.request

from node_agent.backend.remote.settings import store_port_problem

#: coro_rpc's request header (magic 21, version 0, struct_pack, request; sequence,
#: function id, body length, attachment length): function id 0 names no function,
#: so a master answers with an error frame and does nothing.
_RPC_PROBE = struct.pack("<BBBBIIII", 21, 0, 0, 0, 1, 0, 0, 0)
_RPC_MAGIC = 21


class StorePortInUse(RuntimeError):
    """Another process listens on this agent's ``storePort`` or ``storePort + 1``."""


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _listening(port: int) -> bool:
    """Whether something accepts TCP connections on ``port`` of this node."""
    for host in ("127.0.0.1", "::1"):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.settimeout(1.0)
                if s.connect_ex((host, port)) == 0:
                    return True
        except OSError:
            continue
    return False


def store_ports_problem(store_port: int) -> str | None:
    """Why Mooncake cannot take ``store_port`` and ``store_port + 1`` now (None when
    both are free). Raises :class:`StorePortInUse` when a process listens on one:
    another agent (or program) on this node uses it, and joining under it would
    delete that agent's segment entry at the metadata server."""
    ports = [(store_port, "RPC / handshake")]
    if store_port_problem(store_port) is None:  # else Mooncake picks its own data port
        ports.append((store_port + 1, "data"))
    for port, role in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("0.0.0.0", port))
                continue
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    return f"port {port} cannot be bound: {exc.strerror}"
        if _listening(port):
            raise StorePortInUse(
                f"tiers.remote.mooncake.storePort {store_port}: port {port} (Mooncake's "
                f"{role} port) is already in use on this node by another process, e.g. "
                "another agent with the same storePort; give every agent of a node its "
                "own storePort (storePort and storePort + 1 must both be free)"
            )
        return (f"port {port} (Mooncake's {role} port) is still held by connections of a "
                "previous process (TIME_WAIT); joining when the kernel frees it")
    return None


def master_problem(address: str, timeout: float) -> str | None:
    """Why the master at ``address`` does not answer Mooncake's RPC within
    ``timeout`` seconds (None when it does)."""
    try:
        host, port = _split(address)
        with socket.create_connection((host, port), timeout=max(timeout, 0.01)) as s:
            s.settimeout(max(timeout, 0.01))
            s.sendall(_RPC_PROBE)
            head = s.recv(1)
    except (OSError, ValueError) as exc:
        return f"master {address} does not answer ({type(exc).__name__}: {exc})"
    if not head:
        return f"master {address} closed the connection without answering Mooncake's RPC"
    if head[0] != _RPC_MAGIC:
        return (f"{address} answers, but not Mooncake's RPC (first byte {head[0]:#x}); "
                "masterAddress must name the master's RPC port (50051), not its HTTP port")
    return None


def _metadata_url(metadata_server: str, key: str) -> str:
    return f"{metadata_server}?key={urllib.parse.quote(key, safe='')}"


def metadata_problem(metadata_server: str, timeout: float) -> str | None:
    """Why the HTTP metadata server does not answer within ``timeout`` (None when it
    does, or for ``P2PHANDSHAKE``, which has none)."""
    if not metadata_server.startswith(("http://", "https://")):
        return None
    try:
        with urllib.request.urlopen(_metadata_url(metadata_server, "flexkv/probe"),
                                    timeout=max(timeout, 0.01)):
            return None
    except urllib.error.HTTPError:
        return None  # it answered (404 for a missing key)
    except (OSError, ValueError) as exc:
        return f"metadata server {metadata_server} does not answer ({exc})"


def previous_segment(metadata_server: str, segment: str, timeout: float) -> bool | None:
    """Whether the metadata server still describes segment ``segment``: a client of
    that name joined and never left (a clean close deletes the entry). None when
    the metadata server did not answer."""
    if not metadata_server.startswith(("http://", "https://")):
        return False
    try:
        url = _metadata_url(metadata_server, f"mooncake/ram/{segment}")
        with urllib.request.urlopen(url, timeout=max(timeout, 0.01)) as r:
            return bool(r.read(1))
    except urllib.error.HTTPError:
        return False  # 404: no such entry
    except (OSError, ValueError):
        return None


class JoinRefused(RuntimeError):
    """A check before ``setup`` failed; the message says which and why."""


def check_before_join(master_address: str, metadata_server: str, local_hostname: str,
                      timeout: float) -> None:
    """Run the checks of this module (each within ``timeout``) before a ``setup``
    under ``local_hostname``. Raises :class:`StorePortInUse` or
    :class:`JoinRefused` naming what failed."""
    start = time.monotonic()
    port = int(local_hostname.rsplit(":", 1)[1])
    for problem in (lambda t: store_ports_problem(port),
                    lambda t: master_problem(master_address, t),
                    lambda t: metadata_problem(metadata_server, t)):
        reason = problem(max(0.0, timeout - (time.monotonic() - start)))
        if reason is not None:
            raise JoinRefused(reason)
