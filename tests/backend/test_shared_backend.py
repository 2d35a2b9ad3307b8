"""One embedded backend shared by the stages of several replicas of one model
(:mod:`node_agent.backend.shared`): each stage's tasks move its own buffers, a
stage's reset ends only its own tasks unless the cache epoch moved, and the
backend lives until its last stage leaves."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from node_agent.backend.base import KVBackendError, KVResponseStatus
from node_agent.backend.embedded import EmbeddedBackend
from node_agent.backend.shared import Fingerprint, SharedBackends, SharedStageBackend
from node_agent.vocab.layout import KVDtype
from tests.backend.backend_helpers import config, make_buffers, small_layout, token_rows
from tests.support.waiting import wait_for

LAYOUT = small_layout()
TOKENS = np.arange(100, 108, dtype=np.int64)  # two blocks
SLOTS = 64


class Replicas:
    """A shared-backend registry with a cache epoch the test moves."""

    def __init__(self) -> None:
        self.epoch = 0
        self.shared = SharedBackends(lambda: self.epoch)
        self.fingerprint = Fingerprint("model-x", LAYOUT, 0, 1)
        self.built: list[EmbeddedBackend] = []

    def join(self, replica: str, seed: int) -> tuple[SharedStageBackend, list[list]]:
        def build() -> EmbeddedBackend:
            backend = EmbeddedBackend(config(LAYOUT, 16, deferred_visibility=True))
            self.built.append(backend)
            return backend

        stage = self.shared.join(self.fingerprint, replica, build)
        bufs = make_buffers(LAYOUT, SLOTS, seed)
        stage.register_kv_buffers(0, bufs)
        return stage, bufs


def store(stage: SharedStageBackend, tokens: np.ndarray, slots: np.ndarray) -> None:
    tid, mask = stage.put_match(tokens)
    assert tid >= 0 and mask.all()
    stage.launch([tid], [slots])
    assert stage.wait([tid], timeout=30, completely=True)[tid].status is KVResponseStatus.SUCCESS
    stage.publish(tid)


def load(stage: SharedStageBackend, tid: int, slots: np.ndarray) -> KVResponseStatus:
    stage.launch([tid], [slots])
    return stage.wait([tid], timeout=30, completely=True)[tid].status


def test_a_replica_loads_into_its_own_buffers_what_another_replica_stored() -> None:
    r = Replicas()
    a, bufs_a = r.join("rep-a", 1)
    b, bufs_b = r.join("rep-b", 2)
    assert len(r.built) == 1 and a.is_ready() and b.is_ready()
    src, dst = np.arange(0, 8), np.arange(32, 40)
    store(a, TOKENS, src)
    tid, mask = b.get_match(TOKENS)
    assert mask.all()
    assert load(b, tid, dst) is KVResponseStatus.SUCCESS
    assert all(x.equal(y) for x, y in zip(token_rows(LAYOUT, bufs_a, src),
                                          token_rows(LAYOUT, bufs_b, dst), strict=True))
    # A's own slots were never written by B's load.
    assert not all(x.equal(y) for x, y in zip(token_rows(LAYOUT, bufs_a, dst),
                                              token_rows(LAYOUT, bufs_b, dst), strict=True))
    # A task is launched only by the replica that matched it.
    tid, _ = b.get_match(TOKENS)
    with pytest.raises(KVBackendError, match=f"task {tid} is not a live"):
        a.launch([tid], [dst])
    b.cancel([tid])
    # Each replica counts its own lookups and hits.
    assert (b.stats().lookup_tokens, a.stats().lookup_tokens) == (16, 0)
    assert sum(t.hit_blocks for t in b.stats().tiers.values()) == 4
    assert b.status() == {"replicas": ["rep-a", "rep-b"], "storedBlocks": 0,
                          "crossHitBlocks": 4}
    assert a.status()["storedBlocks"] == 2


def test_a_stage_reset_ends_only_its_own_tasks_unless_the_cache_epoch_moved() -> None:
    r = Replicas()
    a, _ = r.join("rep-a", 1)
    b, _ = r.join("rep-b", 2)
    store(a, TOKENS, np.arange(0, 8))
    open_b, _ = b.get_match(TOKENS)
    open_a, _ = a.get_match(TOKENS)
    a.reset()  # same cache epoch: only A's open match ends
    assert a.wait([open_a], timeout=1)[open_a].status is KVResponseStatus.NOTFOUND
    assert load(b, open_b, np.arange(32, 40)) is KVResponseStatus.SUCCESS
    tid, mask = a.get_match(TOKENS)
    assert mask.all()
    a.cancel([tid])
    # The cache epoch moves: until one stage's reset flushes the shared backend,
    # no stage is served a block of the old epoch, nor stores one.
    r.epoch = 1
    for stage in (a, b):
        assert stage.get_match(TOKENS)[0] == -1
        assert stage.put_match(TOKENS + 1)[0] == -1
    b.reset()
    assert r.built[0].stats().tiers["cpu"].used_blocks == 0
    store(b, TOKENS, np.arange(0, 8))
    a.reset()  # the epoch's flush already ran: B's new blocks stay
    tid, mask = a.get_match(TOKENS)
    assert mask.all()
    a.cancel([tid])


def test_the_shared_backend_lives_until_its_last_replica_leaves() -> None:
    r = Replicas()
    a, _ = r.join("rep-a", 1)
    b, _ = r.join("rep-b", 2)
    store(a, TOKENS, np.arange(0, 8))
    open_a, _ = a.get_match(TOKENS)
    a.shutdown()
    a.shutdown()  # idempotent
    tid, mask = b.get_match(TOKENS)  # A's blocks stay; its open match ended
    assert mask.all()
    assert load(b, tid, np.arange(32, 40)) is KVResponseStatus.SUCCESS
    assert r.built[0].stats().tasks["matched"] == 0
    assert r.built[0].wait([open_a], timeout=1)[open_a].status is KVResponseStatus.NOTFOUND
    assert b.status()["replicas"] == ["rep-b"]
    b.shutdown()
    with pytest.raises(KVBackendError, match="shut down"):
        r.built[0].get_match(TOKENS)
    # A replica joining later starts a new, empty backend.
    c, _ = r.join("rep-c", 3)
    assert len(r.built) == 2
    assert c.get_match(TOKENS)[0] == -1


def test_only_single_stage_replicas_of_one_model_identity_share_a_backend() -> None:
    from node_agent.assembly import StageDeps, sharing_fingerprint
    from node_agent.config import config_from_mapping
    from node_agent.engine_api.identity import ModelIdentity, stage_namespace
    from node_agent.engine_api.service import RankRef
    from node_agent.metrics import AgentMetrics

    x = ModelIdentity(served_name="m", model="/models/x", revision="v1").digest()
    y = ModelIdentity(served_name="m", model="/models/y", revision="v1").digest()

    def fingerprint(rank: RankRef, layout: object = LAYOUT, **cfg: object) -> object:
        data = {"pool": "p", "nodeName": "n", "tokensPerBlock": LAYOUT.tokens_per_block,
                "maxStages": 4, "tiers": {"cpu": {"size": "64Mi"}}, **cfg}
        c = config_from_mapping(data)
        deps = StageDeps(cfg=c, metrics=AgentMetrics(), remote_pool=None,
                         key_epoch=lambda: 0, shared=SharedBackends(lambda: 0))
        return sharing_fingerprint(deps, rank, layout,  # type: ignore[arg-type]
                                   stage_namespace(rank.model, c.model_salt))

    a, b = RankRef("a", 0, 1, 0, 1, x), RankRef("b", 0, 1, 0, 1, x)
    assert fingerprint(a) == fingerprint(b) == Fingerprint(stage_namespace(x, "") or "",
                                                           LAYOUT, 0, 1)
    assert fingerprint(RankRef("c", 0, 1, 0, 1, y)) != fingerprint(a)
    assert fingerprint(a, small_layout(dtype=KVDtype.FLOAT16)) != fingerprint(a)
    # The pool's modelSalt alone is a model identity.
    assert fingerprint(RankRef("s", 0, 1, 0, 1), modelSalt="llama-v1") is not None
    # Never shared: no model identity, a stage of a PP group, backend flexkv, or an
    # agent that serves one stage.
    assert fingerprint(RankRef("n", 0, 1, 0, 1)) is None
    assert fingerprint(RankRef("pp", 0, 2, 0, 1, x)) is None
    assert fingerprint(a, backend="flexkv") is None
    assert fingerprint(a, maxStages=1) is None


class HoldFirstCopy:
    """Checkpoint hook: the first copy to reach a checkpoint signals ``entered`` and
    stays there until ``release`` is set (a copy slow to stop); others pass."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.abort: threading.Event | None = None
        """The held copy's abort flag."""
        self._held = False
        self._lock = threading.Lock()

    def __call__(self, abort: threading.Event | None) -> None:
        with self._lock:
            hold, self._held = not self._held, True
        if hold:
            self.abort = abort
            self.entered.set()
            assert self.release.wait(30), "the test never released the held copy"


def test_a_store_a_leaving_replica_launches_while_it_leaves_never_blocks_its_prefix() -> None:
    r = Replicas()
    a, _ = r.join("rep-a", 1)
    b, _ = r.join("rep-b", 2)
    hook = HoldFirstCopy()
    r.built[0].store.copier.checkpoint_hook = hook
    # A's engine has a store copying (slow to stop) when A's stage leaves.
    slow, _ = a.put_match(TOKENS + 50)
    a.launch([slow], [np.arange(0, 8)])
    assert hook.entered.wait(30)
    leaving = threading.Thread(target=a.shutdown)
    leaving.start()
    wait_for(lambda: hook.abort is not None and hook.abort.is_set(),
             "A's leave aborted its store", timeout=30)
    # Engine calls of A that were already past their stage's checks go on: they
    # store nothing, match nothing and launch nothing.
    assert a.put_match(TOKENS)[0] == -1
    assert a.get_match(TOKENS + 50)[0] == -1
    with pytest.raises(KVBackendError, match="left this shared backend"):
        a.launch([slow], [np.arange(0, 8)])
    hook.release.set()
    leaving.join(timeout=30)
    assert not leaving.is_alive()
    # Nothing of A's is left pending: B stores the prefix and loads it back.
    store(b, TOKENS, np.arange(0, 8))
    tid, mask = b.get_match(TOKENS)
    assert mask.all()
    assert load(b, tid, np.arange(32, 40)) is KVResponseStatus.SUCCESS
    stats = r.built[0].stats()
    assert stats.tasks["unpublished"] == 0


def test_each_shared_backend_recovers_only_its_own_model_s_persisted_blocks_after_a_restart(
        tmp_path: Path) -> None:
    def builder(namespace: str) -> Callable[[], EmbeddedBackend]:
        return lambda: EmbeddedBackend(config(
            LAYOUT, 8, ssd_blocks=16, ssd_dir=tmp_path, ssd_persist=True, namespace=namespace,
            pool="p", deferred_visibility=True))

    x, y = Fingerprint("model:x", LAYOUT, 0, 1), Fingerprint("model:y", LAYOUT, 0, 1)

    def join(shared: SharedBackends, replica: str, fp: Fingerprint,
             seed: int) -> tuple[SharedStageBackend, list[list]]:
        stage = shared.join(fp, replica, builder(fp.namespace))
        bufs = make_buffers(LAYOUT, SLOTS, seed)
        stage.register_kv_buffers(0, bufs)
        return stage, bufs

    before = SharedBackends(lambda: 0)
    (a, bufs_a), (b, _), (c, bufs_c) = (join(before, "rep-a", x, 1), join(before, "rep-b", x, 2),
                                         join(before, "rep-c", y, 3))
    src = np.arange(0, 8)
    store(a, TOKENS, src)
    store(c, TOKENS, src)  # the same tokens under the other model
    expected = {"rep-b": token_rows(LAYOUT, bufs_a, src), "rep-c": token_rows(LAYOUT, bufs_c, src)}
    for stage in (a, b, c):  # the last replica of each model spills its CPU tier to SSD
        stage.shutdown()
    # After the restart the replicas register in another order; each model's
    # backend recovers its own files.
    after = SharedBackends(lambda: 0)
    restarted = {"rep-c": join(after, "rep-c", y, 13), "rep-b": join(after, "rep-b", x, 12)}
    for replica, (stage, bufs) in restarted.items():
        assert stage.backend.recovery_done.wait(30)
        assert stage.backend.recovered_blocks == 2
        tid, mask = stage.get_match(TOKENS)
        assert mask.all()
        assert load(stage, tid, np.arange(32, 40)) is KVResponseStatus.SUCCESS
        assert all(got.equal(want) for got, want in zip(
            token_rows(LAYOUT, bufs, np.arange(32, 40)), expected[replica], strict=True)), replica
        stage.shutdown()


def test_a_tier_share_is_held_per_backend_and_sized_by_tier_shares() -> None:
    from node_agent.assembly import StageDeps, backend_key, default_stage_builder, stage_share
    from node_agent.config import config_from_mapping
    from node_agent.engine_api.identity import ModelIdentity
    from node_agent.engine_api.service import RankRef
    from node_agent.metrics import AgentMetrics

    x = ModelIdentity(served_name="m", model="/models/x", revision="v1").digest()
    y = ModelIdentity(served_name="m", model="/models/y", revision="v1").digest()

    def deps(**cfg: object) -> StageDeps:
        data = {"pool": "p", "nodeName": "n", "tokensPerBlock": LAYOUT.tokens_per_block,
                "maxStages": 4, "tiers": {"cpu": {"size": "64Mi"}}, **cfg}
        return StageDeps(cfg=config_from_mapping(data), metrics=AgentMetrics(),
                         remote_pool=None, key_epoch=lambda: 0,
                         shared=SharedBackends(lambda: 0))

    d = deps(tierShares=1)
    key = {name: backend_key(d, rank, LAYOUT) for name, rank in {
        "a": RankRef("a", 0, 1, 0, 1, x), "b": RankRef("b", 0, 1, 0, 1, x),
        "y": RankRef("y", 0, 1, 0, 1, y), "anon": RankRef("anon", 0, 1, 0, 1),
        "anon2": RankRef("anon2", 0, 1, 0, 1), "pp0": RankRef("pp", 0, 2, 0, 1, x),
        "pp1": RankRef("pp", 1, 2, 0, 1, x)}.items()}
    # Replicas of one model hold one share; every other stage holds its own.
    assert key["a"] == key["b"]
    assert len({key[n] for n in ("a", "y", "anon", "anon2", "pp0", "pp1")}) == 6
    # The tier sizes are split into tierShares shares (absent: maxStages).
    assert stage_share(d.cfg).tiers.cpu.size == 64 << 20
    assert stage_share(deps().cfg).tiers.cpu.size == 16 << 20
    assert stage_share(deps(tierShares=2).cfg).tiers.cpu.size == 32 << 20
    # A block that does not fit one share is refused naming tierShares and the fix.
    tiny = deps(maxStages=4, tierShares=2,
                tiers={"cpu": {"size": LAYOUT.bytes_per_block, "pinned": False}})
    with pytest.raises(ValueError, match=r"each of the agent's tierShares 2 backends gets "
                       r"1/tierShares of tiers.cpu.size and tiers.ssd.size; raise the sizes "
                       r"or lower tierShares"):
        default_stage_builder(tiny, RankRef("a", 0, 1, 0, 1, x), LAYOUT)
