"""The tier socket (``node_agent.backend.tier_fds``) over a real Unix socket: it
hands a read-only descriptor of a known tier to whoever asks with its id and a
newline; it refuses, with a reason, an unknown id, an id that is not letters and
digits, an over-long request and one without its newline, and serves the next
client afterwards; a client that never sends is cut off after the exchange bound;
``close`` removes the socket file and a new server replaces a stale one."""

from __future__ import annotations

import fcntl
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from node_agent.backend import tier_fds
from node_agent.backend.cpu_tier import CpuTier, read_only_fd
from node_agent.backend.tier_fds import (
    MAX_REQUEST,
    TierFdServer,
    receive_tier_fd,
    tier_socket_path,
)
from tests.backend.backend_helpers import small_layout
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(120)

LAYOUT = small_layout()


@pytest.fixture
def tier() -> Iterator[CpuTier]:
    """A shared tier of this process whose first bytes are known."""
    t = CpuTier(LAYOUT, 4, False, True)
    assert t.tier_id is not None
    t.pool[:8] = torch.frombuffer(bytearray(b"tierdata"), dtype=torch.uint8)
    yield t
    t.close()


@pytest.fixture
def server(tier_server: TierFdServer) -> TierFdServer:
    return tier_server


def served_fd_reads(server: TierFdServer, tier: CpuTier) -> bytes:
    """The first bytes of the tier behind the descriptor ``server`` hands out for it."""
    assert tier.tier_id is not None
    fd = receive_tier_fd(server.path, tier.tier_id)
    try:
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        return os.pread(fd, 8, 0)
    finally:
        os.close(fd)


def raw_exchange(path: str, request: bytes, end_request: bool = False) -> tuple[bytes, int]:
    """Send ``request`` as it is (``end_request``: then shut the sending side) and
    return the reply and the number of descriptors that came with it. The end of
    the reply is the end of the stream, or a reset after it: the server closes
    with the rest of an over-long request unread."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(path)
        sock.sendall(request)
        if end_request:
            sock.shutdown(socket.SHUT_WR)
        reply = b""
        count = 0
        while True:
            try:
                msg, fds, _, _ = socket.recv_fds(sock, 512, 1)
            except ConnectionResetError:
                assert reply, "reset before any reply"
                return reply, count
            for fd in fds:
                os.close(fd)
            count += len(fds)
            if not msg:
                return reply, count
            reply += msg


def test_tier_socket_path_is_beside_the_engine_socket() -> None:
    assert tier_socket_path("/run/flexkv/engine.sock") == "/run/flexkv/engine.sock.tier"
    assert tier_socket_path("ipc:///run/e.sock") == "/run/e.sock.tier"


def test_a_known_tier_is_handed_out_read_only(server: TierFdServer, tier: CpuTier) -> None:
    assert server.alive
    assert served_fd_reads(server, tier) == b"tierdata"
    assert served_fd_reads(server, tier) == b"tierdata"
    # Counted after the send returned, so possibly after the client got it.
    wait_for(lambda: server.served == 2, "both descriptors counted", 30)
    assert server.refused == 0


@pytest.mark.parametrize(("request_bytes", "end_request", "named"), [
    (b"0" * 32 + b"\n", False, b"0" * 32),                        # unknown id
    (b"../etc/passwd\n", False, b"../etc/passwd"),                 # not letters and digits
    (b"ab cd\n", False, b"ab cd"),
    (b"\n", False, b""),                                           # empty id
    (b"a" * (MAX_REQUEST + 1), False, b"a" * MAX_REQUEST),         # over-long
    (b"b" * (4 * MAX_REQUEST) + b"\n", False, b"b" * MAX_REQUEST),
    (b"abc", True, b"abc"),                                        # no newline
])
def test_bad_requests_are_refused_with_a_reason_and_the_next_client_is_served(
        server: TierFdServer, tier: CpuTier, request_bytes: bytes, end_request: bool,
        named: bytes) -> None:
    reply, fds = raw_exchange(server.path, request_bytes, end_request)
    assert fds == 0
    assert reply.startswith(b"0no shared CPU tier " + named), reply
    assert b"ask for the current tier" in reply
    assert server.refused == 1
    assert served_fd_reads(server, tier) == b"tierdata"
    assert server.alive
    wait_for(lambda: server.served == 1, "the descriptor counted", 30)


def test_receive_tier_fd_raises_the_agents_reason(server: TierFdServer, tier: CpuTier) -> None:
    assert tier.tier_id is not None
    gone = "f" * 32
    with pytest.raises(ValueError, match=f"{server.path} refused tier {gone}: no shared CPU "
                                         f"tier {gone} on this agent"):
        receive_tier_fd(server.path, gone)
    with pytest.raises(ValueError, match=f"no shared CPU tier {'c' * MAX_REQUEST} on"):
        receive_tier_fd(server.path, "c" * (4 * MAX_REQUEST))  # over-long
    closed_id = tier.tier_id
    tier.close()
    with pytest.raises(ValueError, match=f"refused tier {closed_id}"):
        receive_tier_fd(server.path, closed_id)
    assert (server.served, server.refused) == (0, 3)


def test_a_silent_client_is_cut_off_and_the_next_one_served(
        monkeypatch: pytest.MonkeyPatch, server: TierFdServer, tier: CpuTier) -> None:
    monkeypatch.setattr(tier_fds, "EXCHANGE_SECONDS", 0.2)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.settimeout(60)
        silent.connect(server.path)
        got: list[bytes] = []
        # The next client waits behind the silent one, then is served.
        th = threading.Thread(target=lambda: got.append(served_fd_reads(server, tier)))
        th.start()
        # The silent client is disconnected without a reply (end of stream).
        assert silent.recv(64) == b""
        th.join(60)
        assert got == [b"tierdata"]
    assert server.alive
    wait_for(lambda: server.served == 1, "the descriptor counted", 30)


def test_a_client_dripping_its_request_is_cut_off_at_the_exchange_bound(
        monkeypatch: pytest.MonkeyPatch, server: TierFdServer, tier: CpuTier) -> None:
    """The bound is on the whole request, not on each receive: a client sending a
    byte at a time, each within the bound, is still cut off, and a client that is
    served meanwhile is not held up by it."""
    monkeypatch.setattr(tier_fds, "EXCHANGE_SECONDS", 0.3)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as slow:
        slow.settimeout(60)
        slow.connect(server.path)
        # Meanwhile another engine is served on a thread of its own.
        assert served_fd_reads(server, tier) == b"tierdata"
        request = (tier.tier_id or "").encode() + b"\n"
        sent = 0
        reply = b""
        for byte in request:  # one byte per 0.1 s: each gap is within the bound
            try:
                slow.sendall(bytes([byte]))
            except OSError:  # the server already closed its side
                break
            sent += 1
            slow.settimeout(0.1)
            try:
                reply = slow.recv(512)
            except TimeoutError:
                continue
            except OSError:  # reset: the server closed with this request unread
                pass
            break
        # Cut off (a refusal without a descriptor, or end of stream) before the
        # whole request reached the server.
        assert sent < len(request)
        assert not reply.startswith(b"1")
    assert server.alive


def test_close_removes_the_socket_and_a_new_server_replaces_a_stale_one(
        sock_dir: Path, tier: CpuTier) -> None:
    path = str(sock_dir / "e.sock.tier")
    # A socket file left by a killed agent: bound, never removed.
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()
    assert os.path.exists(path)
    with pytest.raises(OSError):
        receive_tier_fd(path, "a" * 32)  # nobody listens there
    server = serve_once(path, tier)
    assert not os.path.exists(path) and not server.alive
    server.close()  # twice is fine
    with pytest.raises(OSError):
        receive_tier_fd(path, "a" * 32)
    serve_once(path, tier)  # restarted on the same path, it serves again


def serve_once(path: str, tier: CpuTier) -> TierFdServer:
    """Start a server on ``path``, have it hand out ``tier`` once, close it."""
    server = TierFdServer(path, read_only_fd)
    server.start()
    try:
        assert served_fd_reads(server, tier) == b"tierdata"
    finally:
        server.close()
    return server


def test_receive_tier_fd_on_a_missing_socket_raises_oserror(sock_dir: Path) -> None:
    with pytest.raises(OSError):
        receive_tier_fd(str(sock_dir / "nobody.sock.tier"), "a" * 32)
