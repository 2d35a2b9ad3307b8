"""The SGLang plugin's connector in a two-stage PP replica: two rank processes,
each with its own real agent process, driven with SGLang 0.5.23's call sequence
(match_prefix -> init_load_back -> checkpoint -> check_completed_stores, aborts,
flush; see tests/sglang/stage.py for what each step mirrors)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from tests.sglang.group import (
    CLIENT_TIMEOUT,
    ENGINE_CALL_SECONDS,
    Replica,
    two_stage_replica,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
PAGE = 4  # tests.agent.harness.TPB: SGLang's --page-size equals tokensPerBlock
STORE_WAIT = 4 * ENGINE_CALL_SECONDS


def prompt(seed: int, n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(1, 50_000, size=n)]


@pytest.fixture(scope="module")
def replica() -> Iterator[Replica]:
    with two_stage_replica() as rep:
        yield rep


def stored(rep: Replica, rid: str, tokens: list[int]) -> int:
    """checkpoint on both ranks, then ticks until both report the handle."""
    tasks = [r["task"] for r in rep.both("store", rid=rid, tokens=tokens)]
    assert tasks[0] == tasks[1] and tasks[0] >= 0, tasks
    for r in rep.both("wait_stores", within=STORE_WAIT):
        assert r == {"completed": [f"{rid}:0"], "locked": []}, r
    return tasks[0]


def test_same_hit_on_both_stages_and_bit_exact_loads(replica: Replica) -> None:
    base = prompt(1, 64)
    stored(replica, "a", base)
    # A later request repeating the prompt plus a partial page: the key is cut to
    # whole pages, the hit is the stored prefix, the same on both stages.
    hits = replica.both("match", rid="b", tokens=base + prompt(2, 6))
    assert [h["hit"] for h in hits] == [64, 64], hits
    loads = replica.both("load", rid="b")
    for ld in loads:
        assert ld == {"loaded": 64, "promised": 64, "exact": True, "runtime_error": False}, ld
    # Four pages already on the device: only the rest is looked up and loaded.
    hits = replica.both("match", rid="c", tokens=base, device_len=16)
    assert [h["hit"] for h in hits] == [48, 48], hits
    for ld in replica.both("load", rid="c"):
        assert ld["loaded"] == 48 and ld["exact"] is True, ld
    # A prompt never stored misses on both stages; init_load_back is not reached.
    assert [h["hit"] for h in replica.both("match", rid="m", tokens=prompt(3, 32))] == [0, 0]


def test_store_is_cut_to_whole_pages_and_short_stores_write_nothing(replica: Replica) -> None:
    tokens = prompt(10, 4 * PAGE + 3)
    stored(replica, "p", tokens)
    hits = replica.both("match", rid="p2", tokens=tokens + prompt(11, 8))
    assert [h["hit"] for h in hits] == [4 * PAGE] * 2, hits
    replica.both("abort", rid="p2")
    assert [r["task"] for r in replica.both("store", rid="short", tokens=prompt(12, PAGE - 1))] \
        == [-1, -1]
    assert all(s["inflight"] == 0 for s in replica.both("status"))


def test_the_connector_store_kv_contract_holds_on_every_rank(replica: Replica) -> None:
    for r in replica.both("store_bad", tokens=[1, 2, 3, 4, 5], indices=[0, 1, 2, 3]):
        assert r["error"] == "store_kv: token_ids has 5 entries but kv_indices has 4 entries"
    # Nothing was sent or written: the group keeps pairing calls as before.
    tokens = prompt(20, 32)
    stored(replica, "after-bad", tokens)
    assert [h["hit"] for h in replica.both("match", rid="after-bad-2", tokens=tokens)] \
        == [32, 32]
    for ld in replica.both("load", rid="after-bad-2"):
        assert ld["exact"] is True, ld


def test_abort_between_match_and_load_drops_the_held_hit(replica: Replica) -> None:
    tokens = prompt(30, 32)
    stored(replica, "ab", tokens)
    assert [h["hit"] for h in replica.both("match", rid="ab-2", tokens=tokens)] == [32, 32]
    replica.both("abort", rid="ab-2")
    # init_load_back after the abort finds no marker: release_pending, 0 loaded.
    for ld in replica.both("load", rid="ab-2"):
        assert ld["loaded"] == 0 and not ld["runtime_error"], ld
    # The blocks stay cached for the next request.
    assert [h["hit"] for h in replica.both("match", rid="ab-3", tokens=tokens)] == [32, 32]
    for ld in replica.both("load", rid="ab-3"):
        assert ld["loaded"] == 32 and ld["exact"] is True, ld


def test_retrieve_is_all_or_nothing_across_the_group(replica: Replica) -> None:
    tokens = prompt(40, 48)
    stored(replica, "an", tokens)
    assert [h["hit"] for h in replica.both("match", rid="an-2", tokens=tokens)] == [48, 48]
    # Stage 1 cannot allocate (init_load_back releases the held hit); stage 0 loads.
    stage0, stage1 = replica.ranks
    stage1.call("abort", rid="an-2")
    ld = stage0.call("load", rid="an-2")
    assert ld["loaded"] == 0 and not ld["runtime_error"], ld  # never a partial load
    # A slot mapping shorter than the promised hit is never half-loaded either.
    assert [h["hit"] for h in replica.both("match", rid="an-3", tokens=tokens)] == [48, 48]
    for ld in replica.both("load", rid="an-3", promised=40):
        assert ld["loaded"] == 0 and not ld["runtime_error"], ld
    # Both stages load together again afterwards.
    assert [h["hit"] for h in replica.both("match", rid="an-4", tokens=tokens)] == [48, 48]
    for ld in replica.both("load", rid="an-4"):
        assert ld["loaded"] == 48 and ld["exact"] is True, ld


def test_flush_waits_for_stores_and_keeps_the_agents_cache(replica: Replica) -> None:
    tokens = prompt(50, 40)
    tasks = [r["task"] for r in replica.both("store", rid="fl", tokens=tokens)]
    assert tasks[0] == tasks[1] >= 0
    for r in replica.both("flush"):
        assert r == {"inflight": 0, "locked": 0}, r  # every source slot is free again
    # SGLang's flush_cache does not flush FlexKV; the agents keep the blocks too.
    assert [h["hit"] for h in replica.both("match", rid="fl-2", tokens=tokens)] == [40, 40]
    for ld in replica.both("load", rid="fl-2"):
        assert ld["exact"] is True, ld


def test_stage_killed_mid_store_every_rank_answers_not_stored_or_miss() -> None:
    with two_stage_replica(retry_seconds=60.0, orphan_store_seconds=3 * CLIENT_TIMEOUT) as rep:
        old = prompt(60, 32)
        stored(rep, "old", old)
        stage0, stage1 = rep.ranks
        new = prompt(61, 64)
        # Stage 0 (the leader's rank) starts its store; stage 1's agent dies before
        # stage 1 reaches the same checkpoint.
        t0 = stage0.call("store", rid="new", tokens=new)["task"]
        rep.kill_agent(1)
        t1 = stage1.call("store", rid="new", tokens=new)["task"]
        # Stage 1 got no answer: its slots stay locked as for a launched store
        # (a pseudo task), or -1. Stage 0's store is never published.
        assert t0 >= 0 and isinstance(t1, int)
        done0 = stage0.call("wait_stores", within=STORE_WAIT)
        assert done0 == {"completed": ["new:0"], "locked": []}, done0
        done1 = stage1.call("wait_stores", within=4 * CLIENT_TIMEOUT)
        assert done1["locked"] == [], done1
        # Every later call answers a miss / not stored / 0, none hangs.
        hits = rep.both("match", rid="new-2", tokens=new)
        assert [h["hit"] for h in hits] == [0, 0], hits  # the half-stored prefix is invisible
        hits = rep.both("match", rid="old-2", tokens=old)
        assert hits[1]["hit"] == 0, hits  # stage 1 has no agent
        for ld in rep.both("load", rid="old-2"):
            assert ld["loaded"] == 0 and not ld["runtime_error"], ld
        tasks = [r["task"] for r in rep.both("store", rid="later", tokens=prompt(62, 32))]
        assert tasks[1] == -1, tasks
        for r in rep.both("wait_stores", within=STORE_WAIT):
            assert r["locked"] == [], r
        assert [h["hit"] for h in rep.both("match", rid="later-2", tokens=prompt(62, 32))] \
            == [0, 0]
