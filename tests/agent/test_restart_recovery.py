"""The node's SSD cache survives an agent restart: real agent processes
(``python -m node_agent run``) with ``tiers.ssd.persist`` and the client library.

A SIGKILL in the middle of a burst of stores (spills to SSD in flight), a block
torn on disk as a power loss leaves one, a clean stop with blocks on the CPU
tier, a bumped ``cacheEpoch``, a second pool on the same SSD path and a stage
that does not persist registering first after a restart."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import numpy as np
import pytest
import torch
import yaml

from node_agent.agent import Agent
from node_agent.assembly import backend_config, default_stage_builder
from node_agent.backend.hashing import BlockHasher
from node_agent.backend.ssd_format import HEADER_BYTES, RECORDS_NAME, decode_records
from node_agent.backend.ssd_tier import FILE_NAME
from node_agent.client import AgentUnavailableError, EngineClient, RankInfo, SharedKVBuffers
from node_agent.config import config_from_mapping
from node_agent.contract.kube import ANNOTATION_TIERS
from node_agent.engine_api.identity import ModelIdentity, stage_namespace
from node_agent.kube.heartbeat import LeaseHeartbeat
from tests.agent.harness import (
    LAYOUT,
    NUM_SLOTS,
    TPB,
    agent_mapping,
    start_agent_process,
    stop_process,
    wait_healthy,
)
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
RANK = RankInfo(replica="eng-0", model=ModelIdentity(model="llama-test").digest())
BPB = LAYOUT.bytes_per_block
BLOCKS = 4  # blocks per prompt
PROMPT = BLOCKS * TPB  # tokens per prompt
CPU_BLOCKS = 8


def _config(work: Path, name: str = "agent", **extra: Any) -> tuple[Path, dict[str, Any]]:
    data = agent_mapping(work, name, **extra)
    data["tiers"] = {"cpu": {"size": CPU_BLOCKS * BPB, "pinned": False},
                     "ssd": {"size": 128 * BPB, "paths": [str(work / "ssd")],
                             "persist": True}}
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, data


def _prompt(i: int) -> np.ndarray:
    return np.random.default_rng(1000 + i).integers(0, 50_000, PROMPT, dtype=np.int64)


def _planes(bufs: SharedKVBuffers) -> list[torch.Tensor]:
    return [t.view(t.shape[0], -1) for g in bufs.tensors for t in g]


class Engine:
    """One engine rank: shared KV buffers and a client; remembers what it stored."""

    def __init__(self, sock: str, rank: RankInfo = RANK) -> None:
        self.bufs = SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS)
        self.client = EngineClient(sock, rank, timeout=30)
        self.client.register_kv_buffers(LAYOUT, self.bufs.handles)
        self.stored: dict[int, list[torch.Tensor]] = {}
        self.closed = False

    def store(self, i: int, wait: bool = True) -> None:
        """Write prompt ``i``'s KV (random bytes) into slots 0..PROMPT and store it."""
        slots = torch.arange(PROMPT)
        g = torch.Generator().manual_seed(i)
        want = []
        for t in _planes(self.bufs):
            rows = torch.randint(-100, 100, (PROMPT, t.shape[1]), generator=g).to(t.dtype)
            t[slots] = rows
            want.append(rows.clone())
        self.client.store_kv(f"s{i}", _prompt(i), slots.numpy())
        self.stored[i] = want
        if wait:
            wait_for(lambda: f"s{i}" in self.client.wait_completed(1.0),
                     f"store of prompt {i} completed", 30)
            self.client.release(f"s{i}")

    def hit_blocks(self, i: int) -> int:
        """Load what the agent holds of prompt ``i`` into slots 128.. and check every
        loaded token bit-exact against what was stored; returns the blocks hit."""
        hit = self.client.lookup(f"g{i}", _prompt(i))
        assert hit % TPB == 0
        if not hit:
            self.client.release(f"g{i}")
            return 0
        dst = torch.arange(128, 128 + hit)
        for t in _planes(self.bufs):
            t[dst] = 0
        assert self.client.retrieve(f"g{i}", dst.numpy()) == hit
        for p, (t, want) in enumerate(zip(_planes(self.bufs), self.stored[i], strict=True)):
            assert torch.equal(t[dst].view(torch.int16), want[:hit].view(torch.int16)), \
                f"prompt {i} plane {p}: a served block differs from what was stored"
        return hit // TPB

    def close(self) -> None:
        """Idempotent: a test may close the engine before the agent stops."""
        if not self.closed:
            self.closed = True
            self.client.close()
            self.bufs.close()


def _status(url: str) -> dict[str, Any]:
    r = httpx.get(url + "/status", timeout=5)
    r.raise_for_status()
    out: dict[str, Any] = r.json()
    return out


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _records(work: Path) -> int:
    raw = (work / "ssd" / RECORDS_NAME.format(slot=0)).read_bytes()[HEADER_BYTES:]
    return sum(1 for k in range(0, len(raw), 128) if raw[k:k + 4] == b"FKVR")


def _tear(work: Path, prompt: int, block: int) -> None:
    """Overwrite the middle of prompt ``prompt``'s block ``block`` on disk (the torn
    write a power loss can leave)."""
    h = BlockHasher(TPB, "xxh3_64").hashes(_prompt(prompt), stage_namespace(RANK.model, ""))[block]
    raw = (work / "ssd" / RECORDS_NAME.format(slot=0)).read_bytes()
    digest = raw[8:24]
    recs, _ = decode_records(raw[HEADER_BYTES:], digest, 8)
    [rec] = [r for r in recs if r.hash == h]
    with open(work / "ssd" / FILE_NAME.format(slot=0, index=0), "r+b") as f:
        f.seek(rec.block * BPB + BPB // 2)
        f.write(b"\x5a" * 8)


@contextlib.contextmanager
def _running(work: Path, path: Path, data: dict[str, Any],
             stored: dict[int, list[torch.Tensor]] | None = None,
             ) -> Iterator[tuple[subprocess.Popen[bytes], Engine, str]]:
    """An agent process from ``path`` and one engine registered with it (knowing
    what was ``stored`` before, for the bit-exact checks); both stopped on exit."""
    url = f"http://127.0.0.1:{data['ports']['http']}"
    proc = start_agent_process(path, work / "agent.log")
    engine = None
    try:
        wait_healthy(url, proc)
        engine = Engine(data["engineSocket"])
        engine.stored = dict(stored or {})
        yield proc, engine, url
    finally:
        if engine is not None:
            engine.close()
        stop_process(proc)


def test_a_prompt_stored_before_a_sigkill_mid_spill_is_a_bit_exact_hit_after_it(
        work: Path) -> None:
    path, data = _config(work)
    with _running(work, path, data) as (proc, engine, _):
        for i in range(8):  # the CPU tier holds two prompts: the first six spill whole
            engine.store(i)
        assert _records(work) >= 6 * BLOCKS

        # A burst of stores from another thread (each spills older blocks inside its
        # call); the agent is SIGKILLed while it runs.
        burst_client = EngineClient(data["engineSocket"], RANK, timeout=30)
        started = threading.Event()
        stop = threading.Event()

        def burst() -> None:
            i = 100
            while not stop.is_set() and i < 120:  # 80 blocks more: nothing leaves the SSD
                try:
                    burst_client.store_kv(f"b{i}", _prompt(i), np.arange(PROMPT))
                except (AgentUnavailableError, TimeoutError, RuntimeError):
                    return
                i += 1
                if i == 110:
                    started.set()

        t = threading.Thread(target=burst, daemon=True)
        t.start()
        assert started.wait(60), "the burst of stores did not start"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        stop.set()
        t.join(30)
        burst_client.close()
        stored = engine.stored
    _tear(work, prompt=1, block=2)  # and one torn block on disk

    with _running(work, path, data, stored) as (_, engine, url):
        wait_for(lambda: _status(url)["tiers"]["ssd"].get("recoveredBlocks", 0) > 0,
                 "the agent recovered its SSD blocks", 60, 0.1)
        hits = {i: engine.hit_blocks(i) for i in range(8)}  # bit-exact, checked inside
        assert hits[0] == BLOCKS, hits  # stored long before the kill: a whole hit
        assert hits[1] == 2, hits  # its third block was torn: the prefix before it only
        assert all(hits[i] == BLOCKS for i in range(2, 6)), hits
        assert _metric(url, 'flexkv_agent_recovered_dropped_blocks_total{reason="checksum"}') \
            >= 1
        assert _metric(url, "flexkv_agent_recovered_blocks_total") >= 6 * BLOCKS - 2


def test_a_clean_stop_spills_the_cpu_tier_and_every_prompt_survives_it(work: Path) -> None:
    path, data = _config(work)
    with _running(work, path, data) as (proc, engine, _):
        for i in range(3):  # the last two prompts stay (mostly) on the CPU tier
            engine.store(i)
        assert _records(work) < 3 * BLOCKS
        stored = engine.stored
        engine.close()
        assert stop_process(proc) == 0
    assert _records(work) == 3 * BLOCKS  # spilled on stop

    with _running(work, path, data, stored) as (_, engine, url):
        wait_for(lambda: _status(url)["tiers"]["ssd"].get("recoveredBlocks", 0)
                 == 3 * BLOCKS, "the agent recovered every block", 60, 0.1)
        assert [engine.hit_blocks(i) for i in range(3)] == [BLOCKS] * 3


def test_a_bumped_cache_epoch_across_a_restart_serves_nothing_old(work: Path) -> None:
    path, data = _config(work)
    with _running(work, path, data) as (proc, engine, _):
        for i in range(3):
            engine.store(i)
        engine.close()
        assert stop_process(proc) == 0
    assert _records(work) == 3 * BLOCKS

    data["cacheEpoch"] = 1
    path.write_text(yaml.safe_dump(data))
    with _running(work, path, data) as (_, engine, url):  # the SSD tier opens here
        assert _records(work) == 0  # the old epoch's files were cleaned
        assert [engine.client.lookup(f"g{i}", _prompt(i)) for i in range(3)] == [0, 0, 0]
        assert _status(url)["tiers"]["ssd"]["recoveredBlocks"] == 0


def test_a_stage_that_does_not_persist_never_truncates_saved_blocks_of_another(
        work: Path) -> None:
    """Two stages on one agent share its SSD directory: one persists (a model
    identity), one does not (none). After a restart the one without identity
    registers first; it takes a slot holding no saved blocks, and the persistent
    stage then recovers every block it saved."""
    path, data = _config(work, maxStages=2)
    data["tiers"]["cpu"]["size"] = 2 * CPU_BLOCKS * BPB  # CPU_BLOCKS per stage
    path.write_text(yaml.safe_dump(data))
    anonymous = RankInfo(replica="eng-1")  # no model identity: its SSD tier never persists
    with _running(work, path, data) as (proc, engine, _):
        other = Engine(data["engineSocket"], anonymous)
        try:
            for i in range(3):
                engine.store(i)
            other.store(7)
        finally:
            other.close()
        stored = engine.stored
        engine.close()
        assert stop_process(proc) == 0
    assert _records(work) == 3 * BLOCKS  # the persistent stage holds slot 0

    url = f"http://127.0.0.1:{data['ports']['http']}"
    proc = start_agent_process(path, work / "agent.log")
    first = engine = None
    try:
        wait_healthy(url, proc)
        first = Engine(data["engineSocket"], anonymous)  # its SSD tier opens here
        engine = Engine(data["engineSocket"])
        engine.stored = stored
        wait_for(lambda: _status(url)["tiers"]["ssd"].get("recoveredBlocks", 0)
                 == 3 * BLOCKS, "the persistent stage recovered every block", 60, 0.1)
        assert [engine.hit_blocks(i) for i in range(3)] == [BLOCKS] * 3
    finally:
        for e in (first, engine):
            if e is not None:
                e.close()
        stop_process(proc)


def test_a_second_pool_on_the_same_ssd_path_is_refused_at_start(work: Path) -> None:
    path, data = _config(work)
    url = f"http://127.0.0.1:{data['ports']['http']}"
    proc = start_agent_process(path, work / "agent.log")
    other = None
    try:
        wait_healthy(url, proc)
        other_path, _ = _config(work, "other", pool="other-pool")
        other = start_agent_process(other_path, work / "other.log")
        assert other.wait(timeout=60) == 2
        log = (work / "other.log").read_text()
        assert "is in use by pool 'tp'" in log and "'other-pool'" in log, log
        assert "give each pool its own tiers.ssd.paths" in log
        assert _status(url)["pool"] == "tp"  # the first agent is untouched
    finally:
        if other is not None:
            stop_process(other)
        stop_process(proc)


def test_only_single_stage_groups_keep_their_ssd_tier(work: Path) -> None:
    """A PP group's stages (leader and followers) never persist: one stage's
    surviving files prove nothing about the other stages' (docs/pp.md)."""
    _, data = _config(work)
    agent = Agent(config_from_mapping(data), default_stage_builder)
    try:
        model = ModelIdentity(model="llama-test").digest()
        assert not backend_config(agent.cfg, LAYOUT, "", pp_size=1).ssd_persist  # no identity
        single = backend_config(agent.cfg, LAYOUT, model, pp_size=1)
        assert single.ssd_persist and single.pool == "tp"
        for pp_size in (2, 4):
            assert not backend_config(agent.cfg, LAYOUT, model, pp_size=pp_size).ssd_persist
        data["tiers"]["ssd"]["persist"] = False
        off = Agent(config_from_mapping(data), default_stage_builder)
        assert not backend_config(off.cfg, LAYOUT, model, pp_size=1).ssd_persist
        if off.ssd_owner is not None:
            off.ssd_owner.close()
    finally:
        if agent.ssd_owner is not None:
            agent.ssd_owner.close()


def test_the_lease_and_status_report_the_recovered_blocks(work: Path) -> None:
    """The Lease's tiers annotation (what the operator reads) carries the same
    ``recoveredBlocks`` as ``/status``: what the stages' backends recovered."""
    _, data = _config(work)
    agent = Agent(config_from_mapping(data), default_stage_builder)
    try:
        agent._recovered_blocks = lambda: 7  # type: ignore[method-assign]
        assert agent.status()["tiers"]["ssd"]["recoveredBlocks"] == 7
        beat = LeaseHeartbeat(cast(Any, None), agent.cfg, agent._heartbeat_info)
        tiers = json.loads(beat._body()["metadata"]["annotations"][ANNOTATION_TIERS])
        assert tiers["ssd"]["recoveredBlocks"] == 7
    finally:
        if agent.ssd_owner is not None:
            agent.ssd_owner.close()
