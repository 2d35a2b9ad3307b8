"""Handing engines a read-only descriptor of a shared CPU tier over a Unix socket.

The agent listens on ``<engineSocket>.tier`` (:func:`tier_socket_path`, in the
directory engines already share for the engine socket). An engine connects,
sends the tier id its ``claim_load`` or ``tier`` reply named and one newline,
and gets back one status byte: ``1`` with a read-only descriptor of the tier's
memory file attached (``SCM_RIGHTS``), or ``0`` followed by the reason. The id
(128 random bits) is handed only to engines registered with the stage, and the
descriptor cannot be used to write. Linux only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

TIER_SOCKET_SUFFIX = ".tier"
#: Longest request line (a tier id is 32 hex digits).
MAX_REQUEST = 80
#: Bound on one exchange, either side.
EXCHANGE_SECONDS = 5.0
#: Exchanges served at once, each on its own thread; more are refused as busy.
MAX_EXCHANGES = 8


def tier_socket_path(engine_socket: str) -> str:
    """The tier socket of the agent whose engine socket is ``engine_socket``."""
    return engine_socket.removeprefix("ipc://") + TIER_SOCKET_SUFFIX


class TierFdServer:
    """Serves read-only tier descriptors on ``path``: one accepting thread, each
    exchange on a thread of its own (at most :data:`MAX_EXCHANGES`).

    ``provider(tier_id)`` returns a new descriptor (closed here after sending) or
    None for an unknown tier (``node_agent.backend.cpu_tier.read_only_fd``)."""

    name = "tier_fds"

    def __init__(self, path: str, provider: Callable[[str], int | None]) -> None:
        self.path = path
        self._provider = provider
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._slots = threading.BoundedSemaphore(MAX_EXCHANGES)
        self.served = 0
        self.refused = 0

    def start(self) -> None:
        """Bind (replacing a socket file a killed agent left) and serve."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.path)
            os.chmod(self.path, 0o660)  # as the engine socket: the agent's UID or GID
            sock.listen(16)
            sock.settimeout(0.5)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self._thread = threading.Thread(target=self._loop, name="flexkv-tier-fds", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """True while the serving thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        sock = self._sock
        assert sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                log.exception("Tier socket accept failed", extra={"path": self.path})
                continue
            if not self._slots.acquire(blocking=False):
                # Every exchange thread is taken (clients that send nothing hold one
                # each for up to EXCHANGE_SECONDS): this one is answered here.
                self._serve(conn, busy=True)
                continue
            threading.Thread(target=self._serve, args=(conn,), name="flexkv-tier-fd",
                             daemon=True).start()

    def _serve(self, conn: socket.socket, busy: bool = False) -> None:
        """One exchange on its own thread, so a client that sends nothing delays no
        other engine; ``busy``: refused at once instead (no exchange thread free)."""
        try:
            with conn:
                if busy:
                    self.refused += 1
                    conn.sendall(b"0the tier socket is busy; ask again")
                    return
                self._answer(conn)
        except OSError as exc:  # the engine went away mid-exchange
            log.debug("Tier descriptor not delivered", extra={"error": str(exc)})
        finally:
            if not busy:
                self._slots.release()

    def _answer(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + EXCHANGE_SECONDS  # for the whole request, not per recv
        request = b""
        while not request.endswith(b"\n") and len(request) <= MAX_REQUEST:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            conn.settimeout(left)
            chunk = conn.recv(MAX_REQUEST + 1 - len(request))
            if not chunk:
                break
            request += chunk
        conn.settimeout(EXCHANGE_SECONDS)
        tier_id = request.strip().decode("ascii", "replace")
        fd = self._provider(tier_id) if request.endswith(b"\n") and tier_id.isalnum() else None
        if fd is None:
            self.refused += 1
            conn.sendall(b"0no shared CPU tier " + tier_id[:MAX_REQUEST].encode()
                         + b" on this agent; ask for the current tier (tier or claim_load)")
            return
        try:
            socket.send_fds(conn, [b"1"], [fd])
            self.served += 1
        finally:
            os.close(fd)

    def close(self) -> None:
        """Stop serving and remove the socket file (idempotent)."""
        self._stop.set()
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def receive_tier_fd(path: str, tier_id: str, timeout: float = EXCHANGE_SECONDS) -> int:
    """A read-only descriptor of tier ``tier_id`` from the agent's tier socket
    ``path`` (the caller closes it). Raises ``OSError`` when the socket cannot be
    reached (the engine does not share the agent's socket directory), ``ValueError``
    with the agent's reason when it refuses."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(tier_id.encode("ascii") + b"\n")
        msg, fds, _, _ = socket.recv_fds(sock, 512, 1)
        if msg[:1] == b"1" and len(fds) == 1:
            return fds[0]
        for fd in fds:
            os.close(fd)
        reason = msg[1:].decode("utf-8", "replace") or "the agent closed the connection"
        raise ValueError(f"tier socket {path} refused tier {tier_id}: {reason}")
