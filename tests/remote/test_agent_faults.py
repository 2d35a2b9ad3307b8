"""Faults a real cluster produces, through real agent processes (`python -m node_agent
run`) and a real mooncake_master on loopback: an agent killed and restarted at once
on its storePort, a master that accepts connections but never answers, two agents
on one storePort, the ports an agent listens on, and a staging buffer too small for
the registered layout."""

from __future__ import annotations

import os
import signal
import socket
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml

from node_agent.backend.remote.objects import HEADER_BYTES
from node_agent.client import EngineClient, SharedKVBuffers
from node_agent.vocab.layout import KVDtype, KVLayout
from tests.agent.harness import (
    LAYOUT,
    NUM_SLOTS,
    agent_mapping,
    short_dir,
    start_agent_process,
    stop_process,
    wait_healthy,
)
from tests.remote.master import Master, store_port
from tests.remote.test_two_agents import (
    DST,
    RANK,
    SRC,
    TOKENS,
    holds_prompt,
    remote_status,
    write_prompt,
)
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
BLOCK = LAYOUT.bytes_per_block


@pytest.fixture
def work() -> Iterator[Path]:
    yield short_dir("faults")


class Agent:
    """One agent process and its engine's buffers (closed by :meth:`close`)."""

    def __init__(self, work: Path, node: str, master: Master | None, port: int,
                 layout: KVLayout = LAYOUT, cpu: str = "1Mi", **mooncake: Any) -> None:
        mc: dict[str, Any] = {"segmentSize": "16Mi", "localBufferSize": "1Mi",
                              "storePort": port}
        if master is not None:
            mc.update(masterAddress=master.address, metadataServer=master.metadata)
        mc.update(mooncake)
        self.data = agent_mapping(work, node, tiers={
            "cpu": {"size": cpu, "pinned": False},
            "remote": {"timeoutSeconds": 2, "queueBlocks": 256, "mooncake": mc}})
        self.path = work / f"{node}.yaml"
        self.path.write_text(yaml.safe_dump(self.data))
        self.log = work / f"{node}.log"
        self.url = f"http://127.0.0.1:{self.data['ports']['http']}"
        self.sock = str(self.data["engineSocket"])
        self.layout = layout
        self.bufs = SharedKVBuffers.for_layout(layout, NUM_SLOTS if layout is LAYOUT else 128)
        self.proc = start_agent_process(self.path, self.log)
        self.client: EngineClient | None = None

    def restart(self) -> None:
        """Start the same config again (after the process died)."""
        if self.client is not None:
            self.client.close()
            self.client = None
        self.proc = start_agent_process(self.path, self.log)

    def engine(self) -> EngineClient:
        if self.client is None:
            self.client = EngineClient(self.sock, RANK, timeout=10)
            self.client.register_kv_buffers(self.layout, self.bufs.handles)
        return self.client

    def joined(self) -> None:
        wait_healthy(self.url, self.proc)
        wait_for(lambda: remote_status(self.url)["up"] is True,
                 f"{self.url} joined", 90, interval=0.1)

    def store(self, rid: str, tokens: np.ndarray) -> None:
        """Store ``tokens`` (written into SRC) and wait until the pool holds them."""
        client = self.engine()
        before = int(remote_status(self.url)["bytesPut"])  # type: ignore[call-overload]
        write_prompt(self.bufs, tokens, SRC)
        assert client.store_kv(rid, tokens, SRC) >= 0
        wait_for(lambda: rid in client.poll_completed(), f"{rid} stored", 30, interval=0.1)
        client.release(rid)
        want = before + len(tokens) // 4 * BLOCK
        wait_for(lambda: remote_status(self.url)["bytesPut"] == want,
                 f"{rid} written", 60, interval=0.1)

    def load(self, rid: str, tokens: np.ndarray) -> int:
        """Look up and retrieve ``tokens`` into DST; the hit, whose bytes are checked."""
        client = self.engine()
        self.bufs.tensors[0][0].zero_()
        hit = client.lookup(rid, tokens)
        if hit:
            assert client.retrieve(rid, DST[:hit]) == hit
            assert holds_prompt(self.bufs, tokens[:hit], DST[:hit]), f"{rid}: wrong bytes"
        client.release(rid)
        return hit

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        stop_process(self.proc)
        self.bufs.close()


def metadata_has(master: Master, key: str) -> bool:
    url = f"{master.metadata}?key={urllib.parse.quote(key, safe='')}"
    r = httpx.get(url, timeout=5)
    return r.status_code == 200 and bool(r.content)


def test_an_agent_killed_and_restarted_at_once_on_its_store_port_serves_only_correct_bytes(
        work: Path, master: Master) -> None:
    """The killed agent's segment stays mounted at the master (at the dead process's
    addresses) until the master's client_ttl runs out; the restarted agent joins
    only after that, so it never writes into or serves from the old segment."""
    a = Agent(work, "node-a", master, store_port())
    c: Agent | None = None
    try:
        a.joined()
        prompts = [TOKENS + 1000 * i for i in range(1, 4)]
        for i, tokens in enumerate(prompts):
            a.store(f"a{i}", tokens)  # the only segment yet: all in A's
        c = Agent(work, "node-c", master, store_port())
        c.joined()
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait(timeout=30)
        a.restart()
        a.joined()
        status = remote_status(a.url)
        assert "previous incarnation" not in str(status["reason"])
        for i, tokens in enumerate(prompts):
            a.load(f"ap{i}", tokens)  # the restarted agent's own old blocks: a miss or right
        fresh = [TOKENS + 1000 * i for i in range(5, 9)]
        for i, tokens in enumerate(fresh):
            a.store(f"f{i}", tokens)  # the restarted agent's own writes
        for i, tokens in enumerate(fresh):
            assert c.load(f"cf{i}", tokens) == len(tokens)  # bytes checked inside
        for i, tokens in enumerate(prompts):
            c.load(f"cp{i}", tokens)  # a miss or the right bytes, never garbage
        assert a.proc.poll() is None, f"the restarted agent died: {a.proc.returncode}"
        assert "waits for the segment of a previous incarnation" in a.log.read_text()
    finally:
        a.close()
        if c is not None:
            c.close()


class SilentMaster:
    """A listener that accepts connections and never answers (a partition, or the
    wrong port); records whether a connection it accepted is still open."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self.accepted = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            self.accepted.set()

    def pending(self) -> bool:
        """Whether some accepted connection is still open (its request unanswered)."""
        for conn in list(self.conns):
            conn.setblocking(False)
            try:
                if conn.recv(4096, socket.MSG_PEEK):
                    return True  # the request arrived and its sender still waits
            except BlockingIOError:
                return True  # open, nothing sent yet
            except OSError:
                pass
        return False

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            conn.close()


def test_a_master_that_never_answers_stops_neither_health_nor_engine_calls(
        work: Path, master: Master) -> None:
    silent = SilentMaster()
    a = Agent(work, "node-a", None, store_port(), masterAddress=silent.address,
              metadataServer=master.metadata)
    try:
        assert silent.accepted.wait(60), "the agent never tried to join"
        # From the join's first connection on, Mooncake's setup would hold the GIL for
        # its 30 s RPC timeout: /healthz must answer well before that.
        wait_healthy(a.url, a.proc, timeout=20)
        assert silent.pending(), "/healthz answered only after the join gave up"
        # An engine call answers (a miss) inside the client's 10 s, well below the 30 s
        # Mooncake's setup would hold the agent for.
        assert a.engine().lookup("q", TOKENS) == 0
        a.engine().release("q")
        wait_for(lambda: "does not answer" in str(remote_status(a.url)["reason"]),
                 "the join reported the silent master", 60, interval=0.1)
        assert a.proc.poll() is None
    finally:
        a.close()
        silent.close()


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_a_frozen_peer_stops_neither_puts_nor_gets_between_live_agents(
        work: Path, master: Master) -> None:
    """Agent A holds blocks and is frozen (SIGSTOP): C's gets of A's blocks end as
    misses inside the engine's budget, and while A stays frozen B's new prompt
    reaches the pool and C loads it bit-exactly."""
    a, b, c = (Agent(work, f"node-{n}", master, store_port()) for n in "abc")
    mine, theirs = TOKENS + 1000, TOKENS + 2000
    try:
        for agent in (a, b, c):
            agent.joined()
        a.store("pa", mine)
        a.proc.send_signal(signal.SIGSTOP)
        assert c.load("ca", mine) < len(mine)  # A's blocks cannot arrive, and no hang
        b.store("pb", theirs)
        loads = iter(range(1000))
        wait_for(lambda: c.load(f"cb{next(loads)}", theirs) == len(theirs),
                 "C loads B's prompt", 90, interval=0.1)
        assert stopped(a.proc.pid), "A was resumed before the check"
        assert remote_status(b.url)["up"] is True and remote_status(c.url)["up"] is True
    finally:
        a.proc.send_signal(signal.SIGCONT)
        for agent in (a, b, c):
            agent.close()


def listening_ports(pid: int) -> set[int]:
    """TCP ports process ``pid`` listens on (its socket inodes in /proc/net/tcp{,6})."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def test_the_agent_listens_on_exactly_its_http_port_store_port_and_the_next(
        work: Path, master: Master) -> None:
    port = store_port()
    a = Agent(work, "node-a", master, port)
    try:
        a.joined()
        assert listening_ports(a.proc.pid) == {a.data["ports"]["http"], port, port + 1}
    finally:
        a.close()


def test_a_store_port_mooncake_would_move_is_refused_at_start(work: Path,
                                                              master: Master) -> None:
    """Mooncake takes no port in the ephemeral range 32768..60999: the data port would
    be a random one that a NetworkPolicy does not open."""
    a = Agent(work, "node-a", master, 40000)
    try:
        assert a.proc.wait(timeout=60) == 2
        text = a.log.read_text()
        assert "storePort: 40000" in text and "32768..60999" in text
    finally:
        a.close()


def test_a_second_agent_on_the_same_store_port_is_refused_and_the_first_keeps_its_blocks(
        work: Path, master: Master) -> None:
    port = store_port()
    a = Agent(work, "node-a", master, port)
    c = Agent(work, "node-c", master, store_port())
    b: Agent | None = None
    try:
        a.joined()
        c.joined()
        a.store("p", TOKENS)
        b = Agent(work, "node-b", master, port)
        assert b.proc.wait(timeout=60) == 2
        text = b.log.read_text()
        assert f"storePort {port}: port {port}" in text and "already in use" in text
        assert metadata_has(master, f"mooncake/rpc_meta/127.0.0.1:{port}")
        assert c.load("q", TOKENS) == len(TOKENS)  # A's blocks, bit-exact, from C
    finally:
        a.close()
        c.close()
        if b is not None:
            b.close()


def test_a_staging_buffer_smaller_than_two_blocks_refuses_the_registration(
        work: Path, master: Master) -> None:
    """1Mi of staging holds no two 1 MiB blocks (each object is the block and its
    header): the registration fails naming the setting and the bound, instead of a
    stage without a backend."""
    big = KVLayout(num_layers=32, num_kv_heads=16, head_size=128, dtype=KVDtype.FLOAT16,
                   tokens_per_block=4)
    assert big.bytes_per_block == 1 << 20
    a = Agent(work, "node-a", master, store_port(), layout=big, cpu="64Mi",
              localBufferSize="1Mi")
    try:
        wait_healthy(a.url, a.proc)
        with pytest.raises(ValueError) as exc:
            a.engine()
        assert "localBufferSize 1048576" in str(exc.value)
        assert f"at least {2 * ((1 << 20) + HEADER_BYTES)}" in str(exc.value)
    finally:
        a.close()
