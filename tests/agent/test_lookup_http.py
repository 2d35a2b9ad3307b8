"""``POST /v1/lookup`` through a real agent process (``python -m node_agent run``) and
the client library over the real engine socket: the cached prefix of a prompt by
tier, read-only (a later eviction picks the same block whether or not the prompt
was looked up), and a clear 4xx naming the bad field for a bad body.
"""

from __future__ import annotations

import http.client
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from node_agent.client import EngineClient, RankInfo, SharedKVBuffers
from node_agent.http.lookup import MAX_BODY_BYTES
from tests.agent.harness import LAYOUT, TPB, AgentProcess, agent_process, short_dir
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]
NUM_SLOTS = 64
CPU_BLOCKS = 8


def prompt(seed: int, blocks: int) -> np.ndarray:
    return np.arange(seed * 1000, seed * 1000 + blocks * TPB, dtype=np.int64)


class Engine:
    def __init__(self, agent: AgentProcess, replica: str = "rep") -> None:
        self.bufs = SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS)
        self.client = EngineClient(agent.socket, RankInfo(replica=replica), timeout=10)
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


def lookup(agent: AgentProcess, body: Any) -> httpx.Response:
    return httpx.post(agent.url + "/v1/lookup", json=body, timeout=10)


def cached(agent: AgentProcess, tokens: np.ndarray) -> int:
    r = lookup(agent, {"tokenIds": tokens.tolist()})
    assert r.status_code == 200, r.text
    return int(r.json()["cachedTokens"])


def tiers_mapping(work: Path, ssd_blocks: int = 0) -> dict[str, Any]:
    tiers: dict[str, Any] = {"cpu": {"size": CPU_BLOCKS * LAYOUT.bytes_per_block,
                                     "pinned": False}}
    if ssd_blocks:
        tiers["ssd"] = {"size": ssd_blocks * LAYOUT.bytes_per_block,
                        "paths": [str(work / "ssd")], "persist": False}
    return {"tiers": tiers, "eviction": {"highWatermark": 1.0, "lowWatermark": 0.9}}


def test_lookup_answers_the_cached_prefix_by_tier(work: Path) -> None:
    with agent_process(work, **tiers_mapping(work, ssd_blocks=32)) as agent:
        engine = Engine(agent)
        try:
            a = prompt(1, blocks=3)
            engine.store("a", a)
            longer = np.concatenate([a, prompt(9, blocks=2), np.arange(3)])  # + partial block
            r = lookup(agent, {"tokenIds": longer.tolist(), "replica": "rep", "ppRank": 0})
            assert r.status_code == 200, r.text
            assert r.json() == {"replica": "rep", "ppRank": 0, "tokensPerBlock": TPB,
                                "queriedTokens": len(longer), "cachedTokens": 3 * TPB,
                                "tiers": {"cpu": 3 * TPB, "ssd": 0}}
            # The same question as little-endian int64, the answer the same.
            raw = httpx.post(agent.url + "/v1/lookup?replica=rep&ppRank=0",
                             content=longer.astype("<i8").tobytes(), timeout=10,
                             headers={"content-type": "application/octet-stream"})
            assert raw.status_code == 200 and raw.json() == r.json()
            # b fills the CPU tier past its size: a's blocks spill to the SSD tier.
            engine.store("b", prompt(2, blocks=CPU_BLOCKS))
            body = lookup(agent, {"tokenIds": a.tolist()}).json()
            assert body["cachedTokens"] == 3 * TPB
            assert body["tiers"]["ssd"] > 0
            assert body["tiers"]["cpu"] + body["tiers"]["ssd"] == 3 * TPB
            assert cached(agent, prompt(7, blocks=3)) == 0
        finally:
            engine.close()


def test_a_lookup_does_not_change_which_block_a_later_store_evicts(work: Path) -> None:
    with agent_process(work, **tiers_mapping(work)) as agent:
        engine = Engine(agent)
        try:
            old, new = prompt(1, blocks=3), prompt(2, blocks=3)
            engine.store("old", old)
            engine.store("new", new)
            for _ in range(5):  # a touch would make `old` the most recently used
                assert cached(agent, old) == 3 * TPB
            # Two more blocks than the tier has room for: the least recently used
            # leaves go, which are still old's (the lookups above changed nothing).
            engine.store("more", prompt(3, blocks=CPU_BLOCKS - 6 + 2))
            assert cached(agent, new) == 3 * TPB
            assert cached(agent, old) == 1 * TPB
        finally:
            engine.close()


def test_an_engine_lookup_after_http_lookups_still_hits_and_counts_alone(work: Path) -> None:
    with agent_process(work, **tiers_mapping(work)) as agent:
        engine = Engine(agent)
        try:
            a = prompt(1, blocks=2)
            engine.store("a", a)
            for _ in range(3):
                assert cached(agent, a) == 2 * TPB
            assert engine.client.lookup("g", a) == 2 * TPB
            [stage] = engine.client.status()["stages"]
            # Only the engine's lookup counted as hits; the HTTP lookups opened no task.
            assert stage["connector"]["tiers"]["cpu"]["hit_blocks"] == 2
            assert stage["connector"]["openLookups"] == 1
        finally:
            engine.close()


@pytest.mark.parametrize(("body", "status", "message"), [
    ([1, 2], 400, r"^body: list is not a JSON object"),
    ({}, 400, r"^tokenIds: missing"),
    ({"tokenIds": "1 2"}, 400, r"^tokenIds: str is not an array"),
    ({"tokenIds": [1, 2.5]}, 400, r"^tokenIds\[1\]: 2.5 is not an integer token id"),
    ({"tokenIds": [1, True]}, 400, r"^tokenIds\[1\]: True is not an integer token id"),
    ({"tokenIds": [1, -3]}, 400, r"^tokenIds\[1\]: -3 is out of range"),
    ({"tokenIds": [1, 2**70]}, 400, r"^tokenIds\[1\]: 1180591620717411303424 is out of range"),
    ({"tokenIds": [1, -1, 2**64 - 1]}, 400, r"^tokenIds\[1\]: -1 is out of range"),
    ({"tokenIds": [1], "ppRank": -1}, 400, r"^ppRank: -1 is not a pipeline stage rank"),
    ({"tokenIds": [1], "replica": 7}, 400, r"^replica: 7 is not a replica name"),
    ({"tokenIds": [1], "tokens": [1]}, 400, r"^tokens: unknown field; allowed fields are"),
    ({"tokenIds": [1], "replica": "other"}, 404,
     r"^replica 'other' ppRank 0: no such stage on this agent; known stages: rep/pp0$"),
    ({"tokenIds": [1], "ppRank": 1}, 404, r"^replica 'rep' ppRank 1: no such stage"),
])
def test_bad_lookup_bodies_get_a_4xx_naming_the_field(
        agent_with_stage: AgentProcess, body: Any, status: int, message: str) -> None:
    r = lookup(agent_with_stage, body)
    assert r.status_code == status, r.text
    assert re.search(message, r.json()["error"]), r.json()["error"]


def test_a_body_that_is_not_json_gets_a_400(agent_with_stage: AgentProcess) -> None:
    r = httpx.post(agent_with_stage.url + "/v1/lookup", content=b"{nope", timeout=10)
    assert r.status_code == 400
    assert r.json()["error"].startswith("body: not JSON")


@pytest.mark.parametrize(("query", "content", "message"), [
    ("", b"\x01" * 12, r"^body: 12 bytes is not a whole number of 8-byte token ids"),
    ("", np.array([5, -1], dtype="<i8").tobytes(), r"^tokenIds\[1\]: -1 is out of range"),
    ("?ppRank=x", b"", r"^ppRank: 'x' is not a pipeline stage rank"),
    ("?ppRank=%C2%B2", b"", r"^ppRank: '²' is not a pipeline stage rank"),
    ("?rank=0", b"", r"^rank: unknown query parameter"),
])
def test_bad_int64_bodies_get_a_400_naming_the_field(
        agent_with_stage: AgentProcess, query: str, content: bytes, message: str) -> None:
    r = httpx.post(agent_with_stage.url + "/v1/lookup" + query, content=content, timeout=10,
                   headers={"content-type": "application/octet-stream"})
    assert r.status_code == 400, r.text
    assert re.search(message, r.json()["error"]), r.json()["error"]


def test_a_body_over_the_limit_is_refused_before_it_is_read(
        agent_with_stage: AgentProcess) -> None:
    url = httpx.URL(agent_with_stage.url)
    # Declared too long: refused on its headers, the body never sent.
    conn = http.client.HTTPConnection(url.host, url.port, timeout=30)
    try:
        conn.putrequest("POST", "/v1/lookup")
        conn.putheader("Content-Type", "application/octet-stream")
        conn.putheader("Content-Length", str(MAX_BODY_BYTES + 8))
        conn.endheaders()
        r = conn.getresponse()
        assert r.status == 413
        error = json.loads(r.read())["error"]
        assert error.startswith(f"body: {MAX_BODY_BYTES + 8} bytes is over the "
                                f"{MAX_BODY_BYTES}-byte limit of a lookup; send"), error
    finally:
        conn.close()
    # No declared length (chunked): refused once the bytes received pass the limit.
    chunk = bytes(2**20)
    chunks = [chunk] * (MAX_BODY_BYTES // len(chunk)) + [bytes(8)]
    conn = http.client.HTTPConnection(url.host, url.port, timeout=30)
    try:
        conn.request("POST", "/v1/lookup", body=iter(chunks), encode_chunked=True,
                     headers={"Content-Type": "application/octet-stream"})
        r = conn.getresponse()
        assert r.status == 413
        error = json.loads(r.read())["error"]
        assert error.startswith(f"body: more bytes is over the {MAX_BODY_BYTES}-byte limit"), \
            error
    finally:
        conn.close()
    # A body of exactly the limit is read and answered.
    r = httpx.post(agent_with_stage.url + "/v1/lookup", content=bytes(MAX_BODY_BYTES),
                   headers={"content-type": "application/octet-stream"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["queriedTokens"] == MAX_BODY_BYTES // 8


@pytest.fixture(scope="module")
def agent_with_stage() -> Iterator[AgentProcess]:
    work = short_dir("lookup-bad")
    try:
        with agent_process(work) as agent:
            engine = Engine(agent)
            try:
                yield agent
            finally:
                engine.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
