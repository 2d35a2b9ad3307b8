"""KV events for routers, through a real agent process (``python -m node_agent run``),
the client library over the real engine socket and a real ZMQ SUB socket.

The agent publishes vLLM's wire format: frames (topic, 8-byte big-endian sequence
number, msgpack ``KVEventBatch``); events are maps tagged by ``type``. Stores,
spills to the SSD tier and a flush come out in order, with consecutive sequence
numbers; the publisher is off unless ``kvEvents`` is configured (no socket bound);
a full queue drops and counts, never blocks a store.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import pickle
import re
import socket
from pathlib import Path
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest
import yaml
import zmq

from node_agent.client import EngineClient, RankInfo, SharedKVBuffers
from node_agent.events import KvEventPublisher, StageEvents
from node_agent.metrics import AgentMetrics
from tests.agent.harness import (
    LAYOUT,
    TPB,
    AgentProcess,
    agent_mapping,
    agent_process,
    start_agent_process,
    stop_process,
)
from tests.support.ports import free_port
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]
NUM_SLOTS = 64
CPU_BLOCKS = 8


def prompt(seed: int, blocks: int = 3) -> np.ndarray:
    return np.arange(seed * 1000, seed * 1000 + blocks * TPB, dtype=np.int64)


class Engine:
    """One engine rank of replica ``rep`` talking to the agent over its socket."""

    def __init__(self, agent: AgentProcess) -> None:
        self.bufs = SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS)
        self.client = EngineClient(agent.socket, RankInfo(replica="rep"), timeout=10)
        self.client.register_kv_buffers(LAYOUT, self.bufs.handles)
        self.done: set[str] = set()

    def store(self, rid: str, tokens: np.ndarray) -> None:
        assert self.client.store_kv(rid, tokens, np.arange(tokens.size, dtype=np.int64)) >= 0

        def stored() -> bool:
            self.done.update(self.client.poll_completed())
            return rid in self.done

        wait_for(stored, f"the store of {rid} completed", timeout=30)

    def close(self) -> None:
        self.client.close()
        self.bufs.close()


class Subscriber:
    """A SUB socket on the agent's events; :meth:`take` decodes batches."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)

    def take(self, timeout: float = 30.0) -> tuple[int, list[dict[str, Any]]]:
        """The next batch: (sequence number, events)."""
        assert self.sock.poll(int(timeout * 1000)), f"no event batch within {timeout}s"
        topic, seq, payload = self.sock.recv_multipart()
        ts, events, dp_rank = msgpack.unpackb(payload, raw=False)
        assert topic == b"" and isinstance(ts, float) and dp_rank == 0
        return int.from_bytes(seq, "big"), events

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def events_mapping(port: int, **extra: Any) -> dict[str, Any]:
    """agent.yaml keys of a test agent publishing on ``port``."""
    return {"kvEvents": {"endpoint": f"tcp://127.0.0.1:{port}", **extra},
            "tiers": {"cpu": {"size": CPU_BLOCKS * LAYOUT.bytes_per_block, "pinned": False}},
            "eviction": {"highWatermark": 1.0, "lowWatermark": 0.9}}


def vllm_chain(tokens: np.ndarray) -> list[int]:
    """vLLM's sha256 block hashes of ``tokens`` with its default seed, as its events
    carry them by default (the low 64 bits), written out here from vLLM's definition
    (tests/vllm/test_kv_events.py checks the agent against vLLM itself)."""
    def sha(obj: object) -> bytes:
        return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    prev = sha("vllm-none-hash")
    out = []
    for block in tokens.reshape(-1, TPB).tolist():
        prev = sha((prev, tuple(block), None))
        out.append(int.from_bytes(prev, "big") & (2**64 - 1))
    return out


def listening_ports(pid: int) -> set[int]:
    """TCP ports process ``pid`` listens on (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            m = re.match(r"socket:\[(\d+)\]", os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
        if m:
            inodes.add(m.group(1))
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def warm_up(sub: Subscriber, engine: Engine) -> int:
    """Store fresh prompts until the subscriber sees one (a PUB socket drops what it
    sends before the subscription arrives); returns the last sequence number seen."""
    state = {"n": 0, "seq": -1}

    def seen() -> bool:
        state["n"] += 1
        engine.store(f"warm{state['n']}", prompt(900 + state["n"], blocks=1))
        if sub.sock.poll(200):
            state["seq"] = sub.take()[0]
            while sub.sock.poll(200):
                state["seq"] = sub.take()[0]
            return True
        return False

    wait_for(seen, "the subscriber received a first event batch", timeout=60, interval=0)
    return state["seq"]


def test_stores_spills_and_a_flush_are_published_in_order_with_consecutive_sequence_numbers(
        work: Path) -> None:
    port = free_port()
    ssd = work / "ssd"
    mapping = events_mapping(port)
    mapping["tiers"]["ssd"] = {"size": 64 * LAYOUT.bytes_per_block, "paths": [str(ssd)],
                               "persist": False}
    with agent_process(work, **mapping) as agent:
        sub = Subscriber(f"tcp://127.0.0.1:{port}")
        engine = Engine(agent)
        try:
            seq = warm_up(sub, engine)
            a, b = prompt(1), prompt(2, blocks=CPU_BLOCKS - 1)
            engine.store("a", a)
            seq_a, [stored] = sub.take()
            assert seq_a == seq + 1
            ha = vllm_chain(a)
            assert stored == {"type": "BlockStored", "block_hashes": ha,
                              "parent_block_hash": None, "token_ids": a.tolist(),
                              "block_size": TPB, "lora_id": None, "medium": "CPU",
                              "lora_name": None}
            # An extension of a cached prompt: only its new block, chained to a's last.
            longer = np.concatenate([a, prompt(3, blocks=1)])
            engine.store("a+", longer)
            seq_ext, [ext] = sub.take()
            assert seq_ext == seq_a + 1
            assert ext["block_hashes"] == vllm_chain(longer)[3:]
            assert ext["parent_block_hash"] == ha[-1]
            assert ext["token_ids"] == longer[3 * TPB:].tolist()
            # The CPU tier is full now (the warm-up blocks, a, a+): b spills the least
            # recently used block to the SSD tier: removed from CPU, stored on SSD.
            engine.store("b", b)
            events, seq_b = [], seq_ext
            while not events or events[-1]["medium"] != "CPU" or events[-1]["type"] != \
                    "BlockStored":  # the spills (at b's match), then b (once copied)
                seq_next, batch = sub.take()
                assert seq_next == seq_b + 1
                seq_b = seq_next
                events += batch
            moves = events[:-1]
            assert moves, "b's store spilled nothing"
            assert [e["type"] for e in moves] == ["BlockRemoved", "BlockStored"] * (len(moves) // 2)
            for removed, spilled in zip(moves[0::2], moves[1::2], strict=True):
                assert (removed["medium"], spilled["medium"]) == ("CPU", "SSD")
                assert spilled["block_hashes"] == removed["block_hashes"]
                assert len(spilled["token_ids"]) == TPB
            assert events[-1] == {**stored, "block_hashes": vllm_chain(b),
                                  "token_ids": b.tolist()}
            # A new cacheEpoch flushes every tier: AllBlocksCleared.
            path = work / "agent.yaml"
            cfg = yaml.safe_load(path.read_text())
            cfg["cacheEpoch"] = 1
            path.write_text(yaml.safe_dump(cfg))
            seq_clear, cleared = sub.take()
            assert seq_clear == seq_b + 1
            assert cleared == [{"type": "AllBlocksCleared"}]
        finally:
            engine.close()
            sub.close()
        metrics = httpx.get(agent.url + "/metrics", timeout=5).text
        assert re.search(r"^flexkv_agent_kv_events_total (\d+)", metrics, re.M)
        assert "flexkv_agent_kv_events_dropped_total 0.0" in metrics


def test_events_are_off_by_default_and_no_events_socket_is_bound(work: Path) -> None:
    with agent_process(work) as agent:
        engine = Engine(agent)
        try:
            engine.store("a", prompt(1))
        finally:
            engine.close()
        assert listening_ports(agent.proc.pid) == {agent.data["ports"]["http"]}
        assert "kv_events" not in httpx.get(agent.url + "/healthz", timeout=5).json()[
            "components"]
        assert "flexkv_agent_kv_events" not in httpx.get(agent.url + "/metrics", timeout=5).text

    port = free_port()
    with agent_process(work, **events_mapping(port)) as agent:
        assert listening_ports(agent.proc.pid) == {agent.data["ports"]["http"], port}
        assert httpx.get(agent.url + "/healthz", timeout=5).json()["components"]["kv_events"]


def test_an_events_port_in_use_stops_the_agent_with_an_error_naming_kv_events(
        work: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        data = agent_mapping(work, "solo", **events_mapping(port))
        path = work / "agent.yaml"
        path.write_text(yaml.safe_dump(data))
        proc = start_agent_process(path, work / "agent.log")
        try:
            rc = proc.wait(timeout=120)
        finally:
            stop_process(proc)
    assert rc != 0
    log = (work / "agent.log").read_text()
    assert f"kvEvents.endpoint 'tcp://127.0.0.1:{port}' cannot be bound: Address already " \
           "in use; free that port" in log, log[-2000:]


def test_stores_complete_without_a_subscriber_and_with_a_one_item_queue(work: Path) -> None:
    with agent_process(work, **events_mapping(free_port(), queueSize=1)) as agent:
        engine = Engine(agent)
        try:
            for i in range(12):  # more than the CPU tier holds: evictions queue events too
                engine.store(f"r{i}", prompt(i + 1, blocks=2))
        finally:
            engine.close()
        metrics = httpx.get(agent.url + "/metrics", timeout=5).text
        published = float(re.search(r"^flexkv_agent_kv_events_total (\S+)", metrics,
                                    re.M).group(1))  # type: ignore[union-attr]
        dropped = float(re.search(r"^flexkv_agent_kv_events_dropped_total (\S+)", metrics,
                                  re.M).group(1))  # type: ignore[union-attr]
        assert published + dropped >= 12  # every store was offered, sent or counted


def test_a_full_queue_drops_and_counts_and_the_next_batch_skips_a_sequence_number() -> None:
    metrics = AgentMetrics()
    metrics.init_kv_events()
    pub = KvEventPublisher(f"tcp://127.0.0.1:{free_port()}", queue_size=3,
                           block_hash="agent", metrics=metrics)
    stage = pub.stage(TPB)
    tokens = prompt(1, blocks=1)
    for h in range(1, 6):  # the sender is not running yet: the queue holds 3
        stage.stored([h], None, tokens)
    assert pub.dropped == 2
    assert metrics.registry.get_sample_value("flexkv_agent_kv_events_dropped_total") == 2
    pub.open()
    try:
        wait_for(lambda: metrics.registry.get_sample_value("flexkv_agent_kv_events_total") == 3,
                 "the three queued events were sent", timeout=30)
        # One batch was sent, numbered 1: number 0 was skipped for the dropped events.
        assert pub.seq == 2
    finally:
        pub.close()


class RouterView:
    """A router's view of an in-process publisher's stream: the blocks it believes
    are cached (hash -> medium), built by applying every event it received."""

    def __init__(self, pub: KvEventPublisher, stage: StageEvents, endpoint: str) -> None:
        self.pub, self.stage = pub, stage
        self.sub = Subscriber(endpoint)
        self.held: dict[int, str] = {}
        self.seqs: list[int] = []
        warm = iter(range(10_000, 20_000))

        def subscribed() -> bool:
            stage.stored([next(warm)], None, prompt(9, blocks=1))
            return bool(self.sub.sock.poll(200))

        wait_for(subscribed, "the subscriber received a first event batch", timeout=60,
                 interval=0)

    def apply(self, events: list[dict[str, Any]]) -> None:
        for e in events:
            if e["type"] == "BlockStored":
                self.held.update((h, e["medium"]) for h in e["block_hashes"])
            elif e["type"] == "BlockRemoved":
                for h in e["block_hashes"]:
                    self.held.pop(h, None)
            else:
                self.held.clear()

    def until_stored(self, marker: int, tokens: np.ndarray) -> list[dict[str, Any]]:
        """Store block ``marker`` (again while a small queue drops it) and apply the
        events received up to its ``BlockStored``; returns them."""
        seen: list[dict[str, Any]] = []

        def announced() -> bool:
            if not self.sub.sock.poll(0):
                self.stage.stored([marker], None, tokens)
            if self.sub.sock.poll(200):
                seq, batch = self.sub.take()
                self.seqs.append(seq)
                seen.extend(batch)
            return any(marker in e["block_hashes"] for e in seen
                       if e["type"] == "BlockStored")

        wait_for(announced, f"block {marker} was announced", timeout=60, interval=0)
        self.apply(seen)
        return seen

    def close(self) -> None:
        self.sub.close()


def test_a_lost_removal_clears_every_announced_block_so_no_subscriber_keeps_a_gone_one(
        ) -> None:
    """A subscriber applying the stream never holds a block the stage dropped, even
    when the queue was full when the block was dropped; the sender forgets the
    announced blocks too (a later move of one announces nothing)."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = KvEventPublisher(endpoint, queue_size=1, block_hash="agent")
    stage = pub.stage(TPB)
    pub.open()
    view = RouterView(pub, stage, endpoint)
    try:
        view.until_stored(1, prompt(8, blocks=1))
        view.held.clear()  # from here on only blocks 2..5 matter
        with pub._stages_lock:  # the sender stops at its next batch: the queue fills
            stage.stored([2, 3], None, prompt(1, blocks=2))
            wait_for(pub._queue.empty, "the sender took the first store", timeout=30)
            stage.stored([4], None, prompt(2, blocks=1))
            stage.moved(3, "cpu", None)  # the queue is full: this removal is lost
            assert pub.dropped == 1
        view.until_stored(5, prompt(3, blocks=1))
        truth = {2, 4, 5}
        assert set(view.held) <= truth, f"the subscriber holds dropped blocks " \
            f"{set(view.held) - truth}"
        # The sender forgot every block announced before the loss: a later spill of
        # one announces nothing (it would name a block nobody was told about).
        wait_for(pub._queue.empty, "the sender took every queued item", timeout=30)
        stage.moved(2, "cpu", "ssd")
        later = view.until_stored(6, prompt(4, blocks=1))
        assert not [e for e in later if 2 in e.get("block_hashes", ())], later
    finally:
        view.close()
        pub.close()


def test_a_batch_the_sender_cannot_translate_is_reported_as_a_gap_and_a_clear() -> None:
    """An item the sender fails on loses its whole batch (a removal in it too): the
    subscriber sees a sequence gap and AllBlocksCleared right away, so it holds no
    block that is gone, and the stream goes on."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = KvEventPublisher(endpoint, block_hash="agent")
    stage = pub.stage(TPB)
    pub.open()
    view = RouterView(pub, stage, endpoint)
    try:
        view.until_stored(1, prompt(8, blocks=1))
        view.until_stored(2, prompt(7, blocks=1))
        view.held.clear()
        view.until_stored(3, prompt(6, blocks=1))
        assert view.held == {3: "CPU"}
        before, seen = view.seqs[-1], len(view.seqs)
        with pub._stages_lock:  # the sender stops at its next batch: one batch below
            stage.stored([4], None, prompt(5, blocks=1))
            wait_for(pub._queue.empty, "the sender took the first store", timeout=30)
            stage.moved(3, "cpu", None)
            stage.stored([5], None, np.array(["not a token"] * TPB))  # fails the batch
        view.until_stored(6, prompt(4, blocks=1))
        assert 3 not in view.held, "the subscriber still holds a dropped block"
        assert set(view.held) <= {4, 6}
        assert pub.dropped >= 1
        after = [before, *view.seqs[seen:]]
        assert any(b - a > 1 for a, b in itertools.pairwise(after)), \
            f"no sequence gap after the failed batch: {after}"
    finally:
        view.close()
        pub.close()


def test_the_sender_hashes_the_vllm_way_as_bytes_or_ints_or_passes_the_agents_hashes() -> None:
    """What the sender thread makes of one stored run (no socket: ``translate`` is
    the sender's step), for each ``blockHash`` / ``intBlockHashes`` choice."""
    tokens = prompt(4, blocks=2)
    ints = vllm_chain(tokens)
    raw = KvEventPublisher("tcp://127.0.0.1:1", int_hashes=False).stage(TPB)
    [event] = raw.translate((raw, 0, [11, 12], None, tokens), True)
    assert [int.from_bytes(h, "big") & (2**64 - 1) for h in event["block_hashes"]] == ints
    assert all(isinstance(h, bytes) and len(h) == 32 for h in event["block_hashes"])
    agent = KvEventPublisher("tcp://127.0.0.1:1", block_hash="agent").stage(TPB)
    wide = 2**100 + 5  # a 128-bit agent hash does not fit msgpack's ints: bytes
    [event] = agent.translate((agent, 0, [11, wide], None, tokens), True)
    assert event["block_hashes"] == [11, wide.to_bytes(13, "big")]
    assert event["token_ids"] == tokens.tolist()
    # A run whose parent was never announced cannot be chained the vLLM way.
    assert raw.translate((raw, 0, [13], 99, tokens[:TPB]), True) == []
