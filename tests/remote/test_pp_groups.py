"""Two PP groups of two stages, real connectors fanning out over loopback pyzmq, each
stage with its own Mooncake client: group A stores a prompt, group B serves it from
the remote tier. B's leader decides the fetch; it reaches B's follower as REMOTE -> CPU
moves in the ordered stream, and every stage fetches its own stage's bytes."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from node_agent.backend.embedded import EmbeddedBackend
from node_agent.backend.hashing import BlockHasher
from node_agent.backend.remote.keys import KeySpace, block_digest
from node_agent.backend.remote.tier import RemoteTier
from node_agent.backend.stage_store import TierStore
from node_agent.coordinator import Coordinator, CoordinatorConfig
from node_agent.pp.group import GroupViewSource
from node_agent.vocab.group_view import GroupView
from tests.coordinator.harness import (
    LAYOUT,
    backend_config,
    group_status,
    kv_content,
    make_buffers,
    read_slots,
    wait_completed,
    write_slots,
)
from tests.remote.master import Master
from tests.remote.stages import Node, node
from tests.support.group_views import update_status
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]
TOKENS = np.arange(300, 332, dtype=np.int64)  # 8 blocks of 4 tokens
SRC = np.arange(32, dtype=np.int64)
DST = np.arange(200, 232, dtype=np.int64)


class Group:
    """Two connectors of one group (rank 0 leads), each with a remote tier.
    ``epochs[r]`` is stage r's ``cacheEpoch`` (its agent's key epoch), which both
    its remote keys and its connector follow, as in the agent."""

    def __init__(self, name: str, nodes: list[Node], epochs: list[int] | None = None,
                 namespace: str | None = None) -> None:
        self.views = [GroupViewSource(GroupView(name, 0, None, ())) for _ in nodes]
        self.conns: list[Coordinator] = []
        self.bufs = []
        self.epochs = list(epochs or [0] * len(nodes))
        for rank, n in enumerate(nodes):
            def tier(n: Node = n, rank: int = rank) -> RemoteTier:
                return RemoteTier(n.pool, KeySpace(LAYOUT, rank, len(nodes), "ns1", "tp",
                                                   self.epochs[rank]),
                                  epoch=lambda: self.epochs[rank])

            cfg = CoordinatorConfig(
                group=name, pp_rank=rank, layout=LAYOUT, fanout_endpoint="tcp://127.0.0.1:0",
                engine_call_seconds=8.0, fanout_wait_seconds=3.5, transfer_seconds=1.4,
                heartbeat_seconds=0.1, leader_timeout_seconds=3.0)
            conn = Coordinator(
                cfg, self.views[rank],
                backend_factory=lambda tier=tier: EmbeddedBackend(
                    dataclasses.replace(backend_config(64, True), namespace=namespace),
                    remote=tier()),
                store_factory=lambda tier=tier: TierStore(backend_config(64, True), tier()),
                keys=None, metrics=n.metrics,
                cache_epoch=lambda rank=rank: self.epochs[rank]).start()
            bufs = make_buffers()
            conn.register_kv_buffers(0, bufs)
            self.conns.append(conn)
            self.bufs.append(bufs)
        endpoints = {r: c.fanout_endpoint or "" for r, c in enumerate(self.conns)}
        for v in self.views:
            update_status(v, group_status(1, 0, endpoints))
        wait_for(lambda: all(c.ready() for c in self.conns), f"{name} ready", 20)

    def on_every_stage(self, fn: Callable[[int, Coordinator], Any]) -> list[Any]:
        """Run ``fn`` on every stage at once (each stage is its own engine rank)."""
        out: list[Any] = [None] * len(self.conns)
        errors: list[BaseException] = []

        def run(r: int) -> None:
            try:
                out[r] = fn(r, self.conns[r])
            except BaseException as e:  # handed to the test
                errors.append(e)

        threads = [threading.Thread(target=run, args=(r,)) for r in range(len(self.conns))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        return out

    def store(self, rid: str = "p", tokens: np.ndarray = TOKENS, content: int = 0) -> list[int]:
        """``store_kv`` of ``tokens`` from SRC on every stage at once (stage r's KV as
        stage ``r + content``'s), then wait until every stage reported it; the
        task ids."""
        def one(r: int, c: Coordinator) -> int:
            write_slots(self.bufs[r], SRC, kv_content(r + content, tokens))
            return c.store_kv(rid, tokens, torch.as_tensor(SRC))

        tasks = self.on_every_stage(one)
        for c in self.conns:
            wait_completed(c, rid, 20)
        return tasks

    def close(self) -> None:
        for c in reversed(self.conns):
            c.close()


def wait_written(nodes: list[Node], blocks: int, what: str) -> None:
    """Wait until each of ``nodes`` put exactly ``blocks`` blocks into the pool."""
    wait_for(lambda: all((n.metrics.registry.get_sample_value(
        "flexkv_agent_remote_bytes_total", {"direction": "put"}) or 0)
        == blocks * LAYOUT.bytes_per_block for n in nodes), what, 60)


@pytest.fixture
def groups(master: Master, request: pytest.FixtureRequest,
           ) -> Iterator[tuple[Group, Group, list[Node]]]:
    """Two groups of two stages on four nodes; ``request.param`` (indirect) is the
    stages' model namespace (the engines' model identity), None by default."""
    namespace = getattr(request, "param", None)
    nodes = [node(master) for _ in range(4)]
    made: list[Group] = []
    try:
        made.append(Group("tp-a", nodes[:2], namespace=namespace))
        made.append(Group("tp-b", nodes[2:], namespace=namespace))
        yield made[0], made[1], nodes
    finally:
        for g in made:
            g.close()
        for n in nodes:
            n.close()


@pytest.mark.parametrize("groups", [None, "model:7f3a"], indirect=True)
def test_group_b_serves_group_a_prefix_each_stage_from_its_own_keys(
        groups: tuple[Group, Group, list[Node]]) -> None:
    """With and without a model namespace: the leader's fetch outside its decision
    lock hashes the prompt as its match does, so B's lookup finds what it fetched."""
    a, b, nodes = groups
    assert all(t >= 0 for t in a.store())
    # Every stage of A writes its own blocks (the follower through CPU -> REMOTE moves).
    wait_written(nodes[:2], 8, "A's stages wrote 8 blocks")

    hits = b.on_every_stage(lambda r, c: c.lookup("q", TOKENS))
    assert hits == [len(TOKENS), len(TOKENS)]

    def retrieve(r: int, c: Coordinator) -> int:
        write_slots(b.bufs[r], DST, np.full((len(DST), LAYOUT.num_planes, LAYOUT.row_elems),
                                            -7.0, np.float32))
        return c.retrieve("q", torch.as_tensor(DST))

    assert b.on_every_stage(retrieve) == [len(TOKENS), len(TOKENS)]
    for r in range(2):
        assert np.array_equal(read_slots(b.bufs[r], DST), kv_content(r, TOKENS)), r
    for r, n in enumerate(nodes[2:]):
        assert n.metrics.registry.get_sample_value(
            "flexkv_agent_remote_hit_blocks_total") == 8, r
    # The follower got the fetch as moves in the ordered stream, like any tier move.
    assert b.conns[1].status()["counters"]["moves_applied"] >= 8


def test_a_stage_whose_own_blocks_are_missing_makes_the_group_miss(
        groups: tuple[Group, Group, list[Node]]) -> None:
    """Stage 1's objects are gone from the pool (evicted by Mooncake, say) while
    stage 0's are there: B's leader still finds its own, but B's follower cannot
    fetch its stage; the group answers a miss and no stage loads undefined bytes."""
    a, b, nodes = groups
    a.store()
    wait_written(nodes[:2], 8, "A's stages wrote 8 blocks")
    ids = [block_digest(h) for h in BlockHasher(LAYOUT.tokens_per_block).hashes(TOKENS)]
    client = nodes[1].pool.client()
    assert client is not None
    for key in KeySpace(LAYOUT, 1, 2, "ns1", "tp", 0).keys(ids):
        assert client._store.remove(key) == 0  # the real Mooncake call, stage 1 only

    assert b.on_every_stage(lambda r, c: c.lookup("q", TOKENS)) == [len(TOKENS)] * 2

    def retrieve(r: int, c: Coordinator) -> int:
        write_slots(b.bufs[r], DST, np.full((len(DST), LAYOUT.num_planes, LAYOUT.row_elems),
                                            -7.0, np.float32))
        return c.retrieve("q", torch.as_tensor(DST))

    assert b.on_every_stage(retrieve) == [0, 0]
    assert np.all(read_slots(b.bufs[1], DST) == -7.0)  # the follower never loaded


def test_a_follower_on_another_cache_epoch_never_fetches_that_epochs_objects(
        master: Master) -> None:
    """B's follower applied a ``cacheEpoch`` bump before B's leader. B's leader
    finds A's epoch-0 objects and decides their fetch; the follower is on epoch 1,
    where another writer stored other bytes under its stage's keys for the same
    tokens. It fetches nothing (the REMOTE moves name epoch 0), refuses the load
    decision, and the group answers a miss: no stage loads another epoch's bytes."""
    nodes = [node(master) for _ in range(4)]
    made: list[Group] = []
    try:
        a = Group("ep-a", nodes[:2])
        made.append(a)
        a1 = Group("ep-a1", nodes[:2], epochs=[1, 1])  # epoch 1, other bytes
        made.append(a1)
        b = Group("ep-b", nodes[2:], epochs=[0, 1])
        made.append(b)

        for g, offset in ((a, 0), (a1, 5)):
            assert all(t >= 0 for t in g.store(content=offset))
        wait_written(nodes[:2], 16, "both epochs' objects written by every stage")

        assert b.on_every_stage(lambda r, c: c.lookup("q", TOKENS)) == [len(TOKENS), 0]

        def retrieve(r: int, c: Coordinator) -> int:
            write_slots(b.bufs[r], DST, np.full((len(DST), LAYOUT.num_planes,
                                                 LAYOUT.row_elems), -7.0, np.float32))
            return c.retrieve("q", torch.as_tensor(DST if r == 0 else DST[:0]))

        assert b.on_every_stage(retrieve) == [0, 0]
        assert np.all(read_slots(b.bufs[1], DST) == -7.0)  # the follower never loaded
        follower = nodes[3].metrics.registry
        assert (follower.get_sample_value("flexkv_agent_remote_hit_blocks_total") or 0) == 0
        assert (follower.get_sample_value("flexkv_agent_remote_bytes_total",
                                          {"direction": "get"}) or 0) == 0
        refused = {k: nodes[3].metrics.registry.get_sample_value(
            "flexkv_agent_cache_epoch_refused_total", {"group": "ep-b", "kind": k})
            for k in ("fetch", "get")}
        assert refused == {"fetch": 8, "get": 1}
    finally:
        for g in made:
            g.close()
        for n in nodes:
            n.close()


def test_a_retrieve_whose_lookup_straddles_a_group_flush_is_a_miss_on_every_stage(
        groups: tuple[Group, Group, list[Node]]) -> None:
    """Every stage looked up; the group's cache is flushed (a ``cacheEpoch`` bump
    resets the leader, which flushes the followers) before the retrieves: each
    stage answers 0 and loads nothing."""
    a, _, _ = groups
    assert all(t >= 0 for t in a.store())
    assert a.on_every_stage(lambda r, c: c.lookup("q", TOKENS)) == [len(TOKENS)] * 2
    resets = a.conns[1].status()["counters"]["resets"]
    a.conns[0].reset()
    wait_for(lambda: a.conns[1].status()["counters"]["resets"] > resets,
             "the follower applied the flush", 20)

    def retrieve(r: int, c: Coordinator) -> int:
        write_slots(a.bufs[r], DST, np.full((len(DST), LAYOUT.num_planes, LAYOUT.row_elems),
                                            -7.0, np.float32))
        return c.retrieve("q", torch.as_tensor(DST))

    assert a.on_every_stage(retrieve) == [0, 0]
    for r in range(2):
        assert np.all(read_slots(a.bufs[r], DST) == -7.0), r


def test_a_remote_fetch_never_holds_up_another_requests_lookup(
        groups: tuple[Group, Group, list[Node]]) -> None:
    """B's leader fetches a prompt that only the pool holds; while that fetch is
    held in the middle, a lookup of another prompt cached locally in B answers its
    full hit on every stage (the fetch runs outside the leader's decision lock),
    and the fetching lookup then gets its hit too."""
    a, b, nodes = groups

    def store(g: Group, rid: str, tokens: np.ndarray) -> None:
        assert all(t >= 0 for t in g.store(rid, tokens))
        for c in g.conns:
            c.release(rid)

    store(a, "p", TOKENS)
    wait_for(lambda: all((n.metrics.registry.get_sample_value(
        "flexkv_agent_remote_bytes_total", {"direction": "put"}) or 0)
        >= 8 * LAYOUT.bytes_per_block for n in nodes[:2]), "A's stages wrote 8 blocks", 60)
    local = TOKENS + 1000
    store(b, "l", local)

    backend = b.conns[0]._role.backend  # type: ignore[union-attr]
    tier = backend.remote
    assert tier is not None
    fetch, entered, gate = tier.fetch, threading.Event(), threading.Event()

    def held_fetch(*args: Any, **kwargs: Any) -> int:
        entered.set()
        assert gate.wait(120)
        return int(fetch(*args, **kwargs))

    tier.fetch = held_fetch  # type: ignore[method-assign]
    fetching: list[int] = []
    fetcher = threading.Thread(target=lambda: fetching.append(b.conns[0].lookup("q", TOKENS)))
    local_hits: list[list[int]] = []
    looker = threading.Thread(target=lambda: local_hits.append(
        b.on_every_stage(lambda r, c: c.lookup("m", local))))
    try:
        fetcher.start()
        assert entered.wait(30), "the remote fetch did not start"
        looker.start()
        looker.join(30)
        assert not looker.is_alive(), "a local-hit lookup waited for another request's fetch"
        assert local_hits == [[len(local), len(local)]]
    finally:
        gate.set()
        fetcher.join(60)
        looker.join(60)
    assert fetching == [len(TOKENS)]
    for c in b.conns:
        c.release("m")
        c.release("q")


@pytest.mark.master_lease_ms(500)  # the removals below wait out the gets' leases
def test_blocks_a_follower_could_not_fetch_are_fetched_again_once_its_objects_return(
        groups: tuple[Group, Group, list[Node]]) -> None:
    """Stage 1's objects are missing while B's leader fetches the prompt: the group
    misses. Once they are back in the pool, the next lookup of the prefix is a
    full hit on every stage with each stage's own bytes: the blocks the follower
    could not fetch were fetched again, not left indexed on the leader as a hit
    that every later load misses."""
    a, b, nodes = groups
    a.store()
    wait_written(nodes[:2], 8, "A's stages wrote 8 blocks")
    digests = [block_digest(h) for h in BlockHasher(LAYOUT.tokens_per_block).hashes(TOKENS)]
    keys = KeySpace(LAYOUT, 1, 2, "ns1", "tp", 0).keys(digests)
    client = nodes[1].pool.client()
    assert client is not None
    saved = [client._store.get(k) for k in keys]  # the real Mooncake calls, stage 1 only
    assert all(isinstance(v, bytes) and v for v in saved)

    def remove(key: str) -> bool:
        return bool(client._store.remove(key) == 0)  # once the get's read lease ended

    for key in keys:
        wait_for(lambda key=key: remove(key), f"{key} removed", 60)

    def retrieve(rid: str) -> Callable[[int, Coordinator], int]:
        def one(r: int, c: Coordinator) -> int:
            write_slots(b.bufs[r], DST, np.full(
                (len(DST), LAYOUT.num_planes, LAYOUT.row_elems), -7.0, np.float32))
            return c.retrieve(rid, torch.as_tensor(DST))
        return one

    assert b.on_every_stage(lambda r, c: c.lookup("q", TOKENS)) == [len(TOKENS)] * 2
    assert b.on_every_stage(retrieve("q")) == [0, 0]
    for c in b.conns:
        c.release("q")

    for key, value in zip(keys, saved, strict=True):
        assert client._store.put(key, value) == 0
    assert b.on_every_stage(lambda r, c: c.lookup("s", TOKENS)) == [len(TOKENS)] * 2
    assert b.on_every_stage(retrieve("s")) == [len(TOKENS)] * 2
    for r in range(2):
        assert np.array_equal(read_slots(b.bufs[r], DST), kv_content(r, TOKENS)), r
