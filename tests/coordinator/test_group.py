"""A PP group of 3 stage processes over real Curve-authenticated pyzmq sockets,
each with its own engine buffers of distinct, deterministic content.

Invariants (docs/invariants.md) proved here:
1. mismatched / bad inputs raise with nothing written (every stage);
2. blocks become visible only after every stage stored them; a failed stage
   (killed, lost message) leaves them invisible;
3. one leader per epoch: old-epoch messages are dropped; gaps resync, never guess;
4. followers never evict on their own: every move the leader decided is applied
   by every follower, and loads after eviction stay bit-exact on every stage;
5. every call is bounded: a lost message or dead stage ends as -1 / a miss;
6. round trips are bit-exact into other slots, on every stage;
7. tier use stays within capacity under a random workload.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from node_agent.pp.messages import Op
from tests.coordinator.harness import LAYOUT
from tests.coordinator.procs import Group, load_and_check, random_slots, store, wait_completed
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow
TPB = LAYOUT.tokens_per_block
RANKS = (0, 1, 2)


def test_mismatch_raises_on_every_stage_and_nothing_is_written(group: Group) -> None:
    for r in RANKS:
        with pytest.raises(RuntimeError,
                           match="store_kv: token_ids has 8 entries but kv_indices has 7 entries"):
            group.stages[r].call("store_raw", rid="bad", tokens=list(range(8)),
                                 slots=np.arange(7))
    assert group.all("lookup", rid="bad2", tokens=list(range(8))) == {0: 0, 1: 0, 2: 0}


def test_blocks_invisible_until_every_stage_stored(group: Group) -> None:
    rng = random.Random(1)
    tokens = list(range(1000, 1000 + 3 * TPB))
    # Only the leader reached store_kv: its copy finishes, but nothing is visible.
    lead = store(group, "p", tokens, rng, ranks=(0,))
    assert lead[0] >= 0
    wait_for(lambda: group.stages[0].call("copies_ended") == 1,
             "the leader's own copy of p ended", interval=0.05)
    assert group.stages[0].call("lookup", rid="probe", tokens=tokens) == 0
    # The followers store the same decision with their own slots: now visible.
    rest = store(group, "p", tokens, rng, ranks=(1, 2))
    assert rest == {1: lead[0], 2: lead[0]}
    wait_completed(group, "p")
    assert load_and_check(group, "q", tokens, rng) == 3 * TPB


def test_random_workload_keeps_every_invariant(group: Group) -> None:
    rng = random.Random(7)
    prompts: list[list[int]] = []
    next_tok = 1
    stored = 0
    for step in range(36):
        if not prompts or rng.random() < 0.55:
            base = rng.choice(prompts) if prompts and rng.random() < 0.7 else []
            keep = rng.randint(0, min(len(base) // TPB, 8)) * TPB
            fresh = list(range(next_tok, next_tok + rng.randint(1, 5) * TPB + rng.randint(0, 3)))
            next_tok += len(fresh)
            tokens = base[:keep] + fresh
            rid = f"s{step}"
            tasks = store(group, rid, tokens, rng)
            assert len(set(tasks.values())) == 1, f"stages disagree on the task: {tasks}"
            if tasks[0] >= 0:
                wait_completed(group, rid)
                stored += 1
            # Fully stored right now: the whole aligned prompt hits on every stage.
            aligned = len(tokens) // TPB * TPB
            assert load_and_check(group, f"l{step}", tokens, rng) == aligned
            group.all("release", rid=rid)
        else:
            tokens = rng.choice(prompts)
            cut = rng.randint(TPB, len(tokens))
            load_and_check(group, f"l{step}", tokens[:cut], rng)
        prompts.append(tokens)
    assert stored > 5
    status = group.all("status")
    lead = status[0]
    for name, tier in lead["tiers"].items():
        assert tier["used_blocks"] <= tier["capacity_blocks"], name
    assert lead["counters"]["stores_discarded"] == 0
    for r in (1, 2):
        s = status[r]
        assert s["role"] == "follower" and not s["degraded"]
        assert s["gauges"]["lag_count"] > 0 and s["gauges"]["role_follower"] == 1
        assert s["dropped_metric"]["gap"] == 0 and s["dropped_metric"]["stale_epoch"] == 0
        assert s["lastSeq"] == lead["lastSeq"]
    # The capacity (32 blocks) was exceeded by the workload, so the leader evicted and
    # every follower applied the same moves in stream order.
    assert lead["tiers"]["cpu"]["evictions"] > 0, (lead["tiers"], lead["counters"])
    moves = {r: status[r]["counters"]["moves_applied"] for r in (1, 2)}
    assert moves[1] == moves[2] == lead["counters"]["moves_sent"] > 0


def test_follower_killed_mid_store_leaves_blocks_invisible(group: Group) -> None:
    rng = random.Random(3)
    base = list(range(500, 500 + 2 * TPB))
    store(group, "a", base, rng)
    wait_completed(group, "a")
    longer = base + list(range(900, 900 + 3 * TPB))
    # Leader and follower 1 store; follower 2 dies before reaching its store.
    group.stages[2].kill()
    tasks = store(group, "b", longer, rng, ranks=(0, 1))
    assert tasks[0] >= 0 and tasks[1] == tasks[0]
    wait_completed(group, "b", ranks=(0, 1), timeout=30)  # the leader's deadline ends it
    # Only the old prefix is visible: the new blocks were discarded, not published.
    assert group.stages[0].call("lookup", rid="probe", tokens=longer) == 2 * TPB
    s = group.stages[0].call("status")
    assert s["counters"]["stores_discarded"] == 1
    # A replacement process joins (new endpoint): the group flushes and works again.
    group.restart(2)
    group.publish_view(1, 0)
    group.wait_ready()
    assert load_and_check(group, "c", longer, rng) == 0  # flushed: the dead stage lost it
    store(group, "d", longer, rng)
    wait_completed(group, "d")
    assert load_and_check(group, "e", longer, rng) == len(longer)


def test_leader_replaced_under_new_epoch(group: Group) -> None:
    rng = random.Random(5)
    tokens = list(range(300, 300 + 4 * TPB))
    store(group, "a", tokens, rng)
    wait_completed(group, "a")
    # The operator elects rank 1 under epoch 2; rank 0 has not seen it yet and keeps
    # acting as the epoch-1 leader.
    group.publish_view(2, 1, ranks=(1, 2))
    zombie_tokens = list(range(7000, 7000 + 2 * TPB))
    z = group.stages[0].call("store", rid="z", tokens=zombie_tokens,
                             slots=random_slots(rng, len(zombie_tokens)))
    # Rank 0 steps down once rank 1's epoch-2 stream reaches it; the store raced
    # that: either refused at once (-1) or decided and then discarded.
    wait_for(lambda: all(group.stages[r].call("status")["dropped_metric"]["stale_epoch"] > 0
                         for r in (1, 2)),
             "both followers dropping the epoch-1 leader's messages", interval=0.05)
    if z >= 0:
        wait_completed(group, "z", ranks=(0,), timeout=15)  # discarded: no follower acked
    wait_for(lambda: group.stages[0].call("status").get("steppedDownFor") == 2,
             "the epoch-1 leader stepping down", interval=0.05)
    zst = group.stages[0].call("status")
    assert zst["counters"]["stores_published"] == 1 and not zst["ready"]  # only "a"
    assert group.stages[0].call("store", rid="z2", tokens=zombie_tokens,
                                slots=random_slots(rng, len(zombie_tokens))) == -1
    # Rank 0 learns the new view and follows rank 1.
    group.publish_view(2, 1, ranks=(0,))
    group.wait_ready()
    st = group.all("status")
    assert [st[r]["role"] for r in RANKS] == ["follower", "leader", "follower"]
    assert all(st[r]["epoch"] == 2 for r in RANKS)
    for r in RANKS:
        g = st[r]["gauges"]
        assert g["epoch"] == 2 and g["leader_changes"] == 1
        assert (g["role_leader"], g["role_follower"]) == ((1, 0) if r == 1 else (0, 1))
    # The new epoch starts from an empty cache; a new round trip is bit-exact on every
    # stage (the zombie's decisions were never applied anywhere).
    assert load_and_check(group, "b", tokens, rng) == 0
    assert load_and_check(group, "bz", zombie_tokens, rng) == 0
    store(group, "c", tokens, rng)
    wait_completed(group, "c")
    assert load_and_check(group, "d", tokens, rng) == len(tokens)


@pytest.mark.parametrize("action, args", [("drop", (1,)), ("duplicate", (4,)), ("reorder", ())])
def test_injected_faults_never_apply_out_of_order(group: Group, action: str,
                                                  args: tuple[int, ...]) -> None:
    rng = random.Random(11)
    tokens = list(range(40, 40 + 3 * TPB))
    store(group, "warm", tokens, rng)
    wait_completed(group, "warm")
    group.stages[0].call("faults", rank=2, action=action, args=args)
    probe = tokens + list(range(4000, 4000 + 2 * TPB))
    tasks = store(group, "f", probe, rng)
    if tasks[0] >= 0:
        wait_completed(group, "f", ranks=(0,), timeout=15)
    # Whatever the fault did, any load is all-or-nothing and bit-exact; after the
    # stream recovers the group works normally.
    group.wait_ready()
    load_and_check(group, "g", probe, rng)
    group.wait_ready()
    after = probe + list(range(5000, 5000 + 2 * TPB))
    tasks = store(group, "h", after, rng)
    assert tasks[0] >= 0
    wait_completed(group, "h")
    assert load_and_check(group, "i", after, rng) == len(after)
    # Assert on what the fault hit, not on when: it may have hit a heartbeat
    # (sent by its own thread at any moment), which leaves the stream intact.
    hits = group.stages[0].call("fault_log", rank=2)
    assert hits and all(a == {"drop": "drop", "duplicate": "dup",
                              "reorder": "hold"}[action] for a, _ in hits)
    stream_hit = any(Op[o].in_stream for _, ops in hits for o in ops)
    dropped = group.stages[2].call("status")["dropped_metric"]
    if stream_hit:
        assert dropped["duplicate" if action == "duplicate" else "gap"] >= 1, hits


ROGUE = r"""
import sys, time, zmq, numpy as np
from node_agent.vocab.placement import Direction
from node_agent.pp.messages import Decision, Envelope, Op, encode
ctx = zmq.Context()
s = ctx.socket(zmq.PUSH)
s.linger = 0
pub, sec = zmq.curve_keypair()
s.curve_publickey, s.curve_secretkey, s.curve_serverkey = pub, sec, sys.argv[2].encode()
s.connect(sys.argv[1])
d = Decision(Direction.LOAD, "evil", 0, 1, np.ones(8, bool), np.array([[0, 0, 2]]), None)
for seq in range(1, 200):
    try:
        s.send_multipart(encode(Envelope(Op.GET, sys.argv[3], 1, seq), d), flags=zmq.NOBLOCK)
    except zmq.Again:
        pass
    time.sleep(0.005)
s.close(0)
ctx.term()
"""


def test_unauthenticated_sender_cannot_inject_a_decision(group: Group) -> None:
    assert group.keys is not None
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", ROGUE, group.endpoints[2], group.keys.public.decode(),
                    "pool-replica-0"], cwd=root, env={"PYTHONPATH": str(root)}, timeout=30,
                   check=True)
    # Had the forged GET decision been accepted, this lookup would pair with it.
    assert group.stages[2].call("lookup", rid="evil", tokens=list(range(8))) == 0
    s = group.stages[2].call("status")
    assert s["dropped_metric"]["gap"] == 0 and not s["degraded"]


def test_dead_leader_makes_followers_answer_at_once_never_hang(group: Group) -> None:
    rng = random.Random(13)
    group.stages[0].kill()
    wait_for(lambda: not any(group.stages[r].call("ready") for r in (1, 2)),
             "the followers noticing the silent leader", interval=0.05)
    tokens = list(range(8000, 8000 + 2 * TPB))
    waited = {r: group.stages[r].call("status")["counters"]["decision_timeouts"] for r in (1, 2)}
    assert store(group, "x", tokens, rng, ranks=(1, 2)) == {1: -1, 2: -1}
    assert group.all("lookup", (1, 2), rid="y", tokens=tokens) == {1: 0, 2: 0}
    # Unsynced stages answer without waiting for a decision (none timed out).
    assert {r: group.stages[r].call("status")["counters"]["decision_timeouts"]
            for r in (1, 2)} == waited
    assert all(group.stages[r].call("status")["degraded"] for r in (1, 2))
