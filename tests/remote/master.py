"""A real ``mooncake_master`` on loopback (:class:`Master`, :func:`start_master`)
and the ports Mooncake takes (:func:`store_port`).

The master runs with its built-in HTTP metadata server on free ports.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.ports import free_port


def store_port() -> int:
    """A ``storePort`` p with p and p + 1 free, where Mooncake takes ports (below the
    ephemeral range, so it also never collides with a port the kernel hands out)."""
    rng = random.Random()
    for _ in range(500):
        p = rng.randrange(20000, 32700)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("0.0.0.0", p))
                b.bind(("0.0.0.0", p + 1))
        except OSError:
            continue
        return p
    raise AssertionError("no free pair of ports in 20000..32700")


def master_binary() -> str:
    """The wheel's ``mooncake_master`` (next to this interpreter first)."""
    here = Path(sys.executable).parent / "mooncake_master"
    found = str(here) if here.exists() else shutil.which("mooncake_master")
    if found is None:
        pytest.fail("mooncake_master not found: install the remote extra "
                    "(bash scripts/bootstrap.sh installs it into .venv)")
    return found


class Master:
    """One ``mooncake_master`` process; ``kill`` and ``start`` reuse the same ports."""

    def __init__(self, log: Path, lease_ms: int | None = None) -> None:
        self.rpc, self.http, self.metrics = free_port(), free_port(), free_port()
        self.log = log
        self.lease_ms = lease_ms
        """The objects' read lease (``--default_kv_lease_ttl``): a removal waits until
        the last get's lease ended. None: Mooncake's default (10 s)."""
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http}/metadata"

    def start(self) -> None:
        out = self.log.open("ab")
        try:
            self.proc = subprocess.Popen(
                [master_binary(), f"--rpc_port={self.rpc}", "--rpc_address=127.0.0.1",
                 "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                 f"--http_metadata_server_port={self.http}", "--metrics_host=127.0.0.1",
                 f"--metrics_port={self.metrics}",
                 *([] if self.lease_ms is None else
                   [f"--default_kv_lease_ttl={self.lease_ms}"])],
                stdout=out, stderr=subprocess.STDOUT)
        finally:
            out.close()
        deadline = time.monotonic() + 30
        while True:  # both the RPC port and the metadata server accept connections
            ok = True
            for port in (self.rpc, self.http):
                with socket.socket() as s:
                    s.settimeout(0.5)
                    ok = ok and s.connect_ex(("127.0.0.1", port)) == 0
            if ok:
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"mooncake_master did not start; see {self.log}")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def start_master(log: Path, tries: int = 3, lease_ms: int | None = None) -> Master:
    """A started master on fresh free ports. A port handed out by :func:`free_port`
    can be taken by another process before the master binds it (the master then
    exits at once): such a start is retried on new ports, ``tries`` times at most."""
    for attempt in range(tries):
        m = Master(log, lease_ms)
        try:
            m.start()
            return m
        except AssertionError:
            exited = m.proc is not None and m.proc.poll() is not None
            m.kill()
            if not exited or attempt == tries - 1:
                raise  # still running but not answering, or out of tries
    raise AssertionError("unreachable")
