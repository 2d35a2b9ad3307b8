"""Property: agents that serve several stages at once (stages of several PP groups,
each agent leading one group and following another, plus single-stage replicas)
never hand one group's KV to another, and a group reports a hit only for blocks
every one of its stages holds.

The agents are modelled as the agent builds them (docs/agent.md "Several stages
on one agent"): each agent's multi-stage stages share its one fan-out server
(one port, messages routed by group); every stage has its own connector, backend
and engine buffers. Three agents, three 2-stage groups in a ring (group ``gK``
leads on agent K and follows on agent K+1), and two single-stage replicas of one
model on agent 0::

    agent 0: g0 stage 0 (leader), g2 stage 1 (follower), r0, r1
    agent 1: g1 stage 0 (leader), g0 stage 1 (follower)
    agent 2: g2 stage 0 (leader), g1 stage 1 (follower)

Each group serves its own model: the KV of a token depends on the model, the PP
rank and the whole prefix, so bytes of another group (same token ids, other
model) or of another stage are a mismatch. The two single-stage replicas serve one
model, so their KV of the same tokens is the same; a hit either of them stored
may serve the other.

Hypothesis draws one schedule of steps (store, lookup, retrieve, release, reset),
each for one group over reused rids and prompts that share prefixes, and a lag
per stage (stage s issues its i-th call at step i + lag[s]). Every stage runs its
calls on its own thread, as its engine rank would, so the groups' calls
interleave. Checked on every call: a lookup never reports more than the longest
block-aligned prefix stored in that model; a retrieve loads 0 or the hit, and
every loaded slot holds the stage's own model's KV of exactly those tokens.
After the schedule, with every stage quiet, every prompt is looked up on every
stage of each group at once: the stages agree on the hit and every stage loads
all of it, bit-exact.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from node_agent.coordinator import Coordinator
from node_agent.pp.channel import FanoutServer
from node_agent.pp.group import GroupViewSource
from node_agent.vocab.group_view import GroupView
from tests.coordinator.harness import (
    LAYOUT,
    Buffers,
    group_status,
    kv_content,
    make_coordinator,
    read_slots,
    started,
    write_slots,
)
from tests.coordinator.pairs import StageThread
from tests.support.group_views import update_status
from tests.support.waiting import wait_for

TPB = LAYOUT.tokens_per_block
PROMPTS = [
    np.arange(0, 2 * TPB),
    np.arange(0, 3 * TPB),  # extends prompt 0
    np.arange(50, 50 + 2 * TPB),
    np.concatenate([np.arange(50, 50 + TPB), np.arange(90, 90 + TPB)]),  # shares a block with 2
]
RIDS = ("a", "b")
AGENTS = 3
PP_GROUPS = ("g0", "g1", "g2")
REPLICAS = ("r0", "r1")
UNITS = PP_GROUPS + REPLICAS
SHARED_MODEL = 7
"""The model the single-stage replicas serve (each PP group serves its own, 0..2)."""
SLOTS_PER_STEP = 16
MAX_STEPS = 14
FINAL_SLOT = 448
_examples = itertools.count()


def content(model: int, rank: int, tokens: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """The KV a stage of PP rank ``rank`` of ``model`` computes for ``tokens``."""
    return kv_content(model * 31 + rank, tokens)


def hit_bound(tokens: npt.NDArray[np.int64], stored: list[npt.NDArray[np.int64]]) -> int:
    """The longest block-aligned prefix of ``tokens`` that one stored prompt starts with."""
    best = 0
    for s in stored:
        n = min(len(s), len(tokens))
        same = int(np.argmin(np.append(s[:n] == tokens[:n], False)))
        best = max(best, same - same % TPB)
    return best


@dataclass
class StageSlot:
    """One stage on one agent: its connector, engine buffers and engine thread."""

    unit: str
    rank: int
    model: int
    conn: Coordinator
    bufs: Buffers
    thread: StageThread
    looked: dict[str, tuple[npt.NDArray[np.int64], int]] = field(default_factory=dict)

    def loaded_ok(self, tokens: npt.ArrayLike, slots: npt.ArrayLike, loaded: int) -> bool:
        """The first ``loaded`` slots hold this stage's KV of the first ``loaded`` tokens."""
        if loaded == 0:
            return True
        sl = np.asarray(slots, dtype=np.int64)[:loaded]
        want = content(self.model, self.rank, np.asarray(tokens, dtype=np.int64))[:loaded]
        return bool(np.array_equal(read_slots(self.bufs, sl), want))


class Node:
    """The three agents and every stage they serve."""

    def __init__(self) -> None:
        self.servers = [FanoutServer("tcp://127.0.0.1:0", None).start() for _ in range(AGENTS)]
        self.units: dict[str, list[StageSlot]] = {}
        self.stored: dict[int, list[npt.NDArray[np.int64]]] = {}
        """Model -> every prompt a store of it was issued for, in every example so
        far (the stages keep their blocks from one example to the next): the bound
        on any hit."""
        # fanout + 3 x transfer < call (CoordinatorConfig checks it); generous copy
        # bounds so no copy times out on a loaded machine.
        timeouts = {"engine_call_seconds": 8.0, "fanout_wait_seconds": 0.5,
                    "transfer_seconds": 2.0}
        for g, group in enumerate(PP_GROUPS):
            placed = {0: g, 1: (g + 1) % AGENTS}  # PP rank -> agent
            stages = []
            for rank, agent in placed.items():
                view = GroupViewSource(GroupView(group, 0, None, ()))
                conn, bufs = started(make_coordinator(
                    rank, view, keys=None, cpu_blocks=24, server=self.servers[agent],
                    **timeouts))
                stages.append(StageSlot(group, rank, g, conn, bufs, StageThread(rank)))
            self.units[group] = stages
            eps = {r: str(self.servers[a].endpoint) for r, a in placed.items()}
            for s in stages:
                update_status(s.conn._view, group_status(1, 0, eps))
        for replica in REPLICAS:
            view = GroupViewSource(GroupView(replica, 0, None, ()))
            conn, bufs = started(make_coordinator(0, view, keys=None, endpoint=None,
                                                  cpu_blocks=24, **timeouts))
            update_status(view, group_status(1, 0, {0: "tcp://127.0.0.1:1"}))
            self.units[replica] = [StageSlot(replica, 0, SHARED_MODEL, conn, bufs,
                                             StageThread(0))]

    @property
    def stages(self) -> list[StageSlot]:
        return [s for unit in self.units.values() for s in unit]

    def wait_ready(self, timeout: float = 30.0) -> None:
        wait_for(lambda: all(s.conn.ready() for s in self.stages), "every stage ready", timeout)

    def settle(self, timeout: float = 30.0) -> None:
        """Wait until no leader has a store in flight."""
        leaders = [unit[0].conn for unit in self.units.values()]
        wait_for(lambda: all(c.status().get("inflightStores", 0) == 0 for c in leaders),
                 "every store terminal on every leader", timeout)

    def close(self) -> None:
        for s in self.stages:
            s.thread.stop()
        for s in reversed(self.stages):
            s.conn.close()
        for server in self.servers:
            server.close()


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    n = Node()
    try:
        n.wait_ready()
        yield n
    finally:
        n.close()


Step = tuple[str, int, str, int]  # (kind, unit index into UNITS, rid, prompt)
steps_strategy = st.lists(
    st.tuples(st.sampled_from(["store", "store", "store", "lookup", "lookup", "retrieve",
                               "retrieve", "release", "release", "reset"]),
              st.integers(0, len(UNITS) - 1), st.sampled_from(["a", "a", "b"]),
              st.integers(0, len(PROMPTS) - 1)),
    min_size=4, max_size=MAX_STEPS,
)


class Schedule:
    """One example: the steps, played by every stage of the node."""

    def __init__(self, node: Node, steps: list[Step]) -> None:
        self.node, self.steps = node, steps
        self.prefix = f"x{next(_examples)}-"
        self.stored = node.stored

    def run(self, s: StageSlot, i: int) -> Any:
        kind, _, rid_, p = self.steps[i]
        rid, tokens, conn = self.prefix + rid_, PROMPTS[p], s.conn
        if kind == "reset":
            conn.reset()  # the leader flushes the group; a follower its open lookups
            s.looked.clear()
            return None
        if kind == "store":
            src = np.arange(i * SLOTS_PER_STEP, i * SLOTS_PER_STEP + len(tokens))
            write_slots(s.bufs, src, content(s.model, s.rank, tokens))
            return conn.store_kv(rid, tokens, torch.as_tensor(src))
        if kind == "lookup":
            hit = conn.lookup(rid, tokens)
            bound = hit_bound(tokens, self.stored.get(s.model, []))
            assert 0 <= hit <= bound, (
                f"{s.unit} stage {s.rank} reported a {hit}-token hit for prompt {p}; its "
                f"model stored at most {bound} tokens of it")
            s.looked[rid] = (tokens, hit)
            return hit
        if kind == "release":
            conn.release(rid)
            s.looked.pop(rid, None)
            return None
        entry = s.looked.pop(rid, None)
        if entry is None:
            return None  # no open lookup on this stage: its engine would not retrieve
        looked, hit = entry
        dst = np.arange(256 + i * SLOTS_PER_STEP, 256 + i * SLOTS_PER_STEP + hit)
        write_slots(s.bufs, dst, np.full((hit, LAYOUT.num_planes, LAYOUT.row_elems), -7.0,
                                         np.float32))
        loaded = conn.retrieve(rid, torch.as_tensor(dst))
        assert loaded in (0, hit), f"{s.unit} stage {s.rank} loaded {loaded} of a {hit} hit"
        assert s.loaded_ok(looked, dst, loaded), (
            f"{s.unit} stage {s.rank} loaded KV that is not its model's KV of "
            f"{looked.tolist()}")
        return loaded

    def play(self, lags: list[int]) -> None:
        stages = self.node.stages
        # Stores count for the hit bound from the moment they are issued.
        for kind, u, _, p in self.steps:
            if kind == "store":
                self.stored.setdefault(self.node.units[UNITS[u]][0].model, []).append(PROMPTS[p])
        futures: list[Future[Any]] = []
        for t in range(len(self.steps) + max(lags)):
            for s, lag in zip(stages, lags, strict=True):
                i = t - lag
                if 0 <= i < len(self.steps) and UNITS[self.steps[i][1]] == s.unit:
                    fut = s.thread.submit(lambda s=s, i=i: self.run(s, i))
                    futures.append(fut)
                    # A quick call ends before the next is issued; one that waits
                    # for its stage-mate stays pending.
                    with contextlib.suppress(TimeoutError):
                        fut.exception(timeout=0.005)
        for fut in futures:
            fut.result(120)  # re-raises a stage's failed assertion
        for s in stages:  # end every rid of the schedule on every stage
            for rid in RIDS:
                s.conn.release(self.prefix + rid)
        self.node.settle()

    def check_every_stage_holds_its_hits(self) -> None:
        """With every stage quiet: each prompt on every stage of a group at once."""
        self.node.wait_ready()
        for unit in UNITS:
            stages = self.node.units[unit]
            for p, tokens in enumerate(PROMPTS):
                rid = f"{self.prefix}check{p}"
                hits = [f.result(60) for f in [
                    s.thread.submit(lambda s=s, rid=rid, t=tokens: s.conn.lookup(rid, t))
                    for s in stages]]
                assert len(set(hits)) == 1, f"{unit}: stages disagree on the hit: {hits}"
                hit = hits[0]
                assert hit <= hit_bound(tokens, self.stored.get(stages[0].model, []))
                dst = np.arange(FINAL_SLOT, FINAL_SLOT + hit)
                for s in stages:
                    write_slots(s.bufs, dst, np.full((hit, LAYOUT.num_planes,
                                                      LAYOUT.row_elems), -7.0, np.float32))
                loaded = [f.result(60) for f in [
                    s.thread.submit(lambda s=s, rid=rid, dst=dst: s.conn.retrieve(
                        rid, torch.as_tensor(dst))) for s in stages]]
                assert loaded == [hit] * len(stages), (
                    f"{unit} reported a {hit}-token hit for prompt {p}; its stages "
                    f"loaded {loaded}")
                for s in stages:
                    assert s.loaded_ok(tokens, dst, hit), (
                        f"{unit} stage {s.rank} holds KV that is not its model's KV of "
                        f"prompt {p}")
                    s.conn.release(rid)


SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
LAGS = st.lists(st.integers(0, 2), min_size=2 * len(PP_GROUPS) + len(REPLICAS),
                max_size=2 * len(PP_GROUPS) + len(REPLICAS))
# Every group stores the same prompt, then every group loads it: the groups'
# decisions cross the agents' shared fan-out servers at once.
SAME_PROMPT_EVERYWHERE: list[Step] = (
    [("store", u, "a", 1) for u in range(len(UNITS))]
    + [("lookup", u, "b", 1) for u in range(len(UNITS))]
    + [("retrieve", u, "b", 0) for u in range(len(UNITS))])
# One replica stores what the other replica of its model then looks up, and a
# group's reset while its follower lags.
REPLICA_THEN_RESET: list[Step] = [
    ("store", 3, "a", 0), ("lookup", 4, "a", 1), ("retrieve", 4, "a", 0),
    ("store", 0, "a", 0), ("reset", 0, "a", 0), ("lookup", 0, "b", 0),
    ("retrieve", 0, "b", 0), ("store", 0, "b", 2), ("lookup", 0, "a", 3),
    ("retrieve", 0, "a", 0)]


@settings(max_examples=150, **SETTINGS)  # type: ignore[arg-type]
@example(steps=SAME_PROMPT_EVERYWHERE[:MAX_STEPS], lags=[0, 2, 1, 0, 2, 0, 0, 0])
@example(steps=REPLICA_THEN_RESET, lags=[0, 2, 0, 0, 0, 0, 0, 0])
@given(steps=steps_strategy, lags=LAGS)
def test_groups_sharing_agents_only_load_their_own_models_kv_and_hit_what_every_stage_holds(
        node: Node, steps: list[Step], lags: list[int]) -> None:
    node.wait_ready()
    schedule = Schedule(node, steps)
    schedule.play(lags)
    schedule.check_every_stage_holds_its_hits()
