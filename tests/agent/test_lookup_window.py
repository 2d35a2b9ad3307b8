"""The heartbeat's lookup counts cover the last window, not the agent's lifetime,
and stages coming and going never distort them."""

from __future__ import annotations

import pytest

from node_agent.kube.lookup_window import LookupWindow


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_counts_are_those_of_the_last_window_once_the_agent_is_older_than_it() -> None:
    clock = Clock()
    window = LookupWindow(300, clock)
    assert window.sample({"a": (0, 0)}) == {
        "windowSeconds": 0, "lookupTokens": 0, "hitTokens": 0}
    clock.now += 100
    assert window.sample({"a": (1000, 900)}) == {
        "windowSeconds": 100, "lookupTokens": 1000, "hitTokens": 900}
    clock.now += 250  # the first sample is now 350 s old, the second 250 s
    assert window.sample({"a": (1500, 900)}) == {
        "windowSeconds": 350, "lookupTokens": 1500, "hitTokens": 900}
    clock.now += 100  # the 1000/900 sample is 350 s old: the new baseline
    assert window.sample({"a": (2500, 1000)}) == {
        "windowSeconds": 350, "lookupTokens": 1500, "hitTokens": 100}


def test_a_cache_that_stopped_hitting_shows_it_after_one_window() -> None:
    clock = Clock()
    window = LookupWindow(60, clock)
    looked_up = hit = 0
    for _ in range(20):  # 10 minutes of hits every 30 s
        looked_up += 100
        hit += 100
        window.sample({"a": (looked_up, hit)})
        clock.now += 30
    for _ in range(3):  # then a flush: nothing hits
        looked_up += 100
        last = window.sample({"a": (looked_up, hit)})
        clock.now += 30
    assert last["hitTokens"] == 0 and last["lookupTokens"] > 0


def test_what_was_counted_before_the_first_sample_is_in_the_window() -> None:
    clock = Clock()
    window = LookupWindow(300, clock)
    clock.now += 2  # a stage appeared and served lookups before the first heartbeat
    assert window.sample({"a": (48, 32)}) == {
        "windowSeconds": 2, "lookupTokens": 48, "hitTokens": 32}


def test_a_source_that_starts_again_is_counted_from_zero() -> None:
    clock = Clock()
    window = LookupWindow(300, clock)
    window.sample({"a": (5000, 4000)})
    clock.now += 10
    assert window.sample({"a": (10, 5)}) == {
        "windowSeconds": 10, "lookupTokens": 5010, "hitTokens": 4005}


def test_a_stage_that_leaves_never_makes_old_counts_look_recent() -> None:
    clock = Clock()
    window = LookupWindow(300, clock)
    window.sample({"old": (1_000_000, 900_000)})
    clock.now += 3600  # an hour later: the window holds nothing of that
    window.sample({"old": (1_000_000, 900_000), "small": (0, 0)})
    clock.now += 5
    window.sample({"old": (1_000_000, 900_000), "small": (50, 10)})
    clock.now += 5
    # The small stage is retired: the sum of the totals drops, the counts do not.
    assert window.sample({"old": (1_000_000, 900_000)}) == {
        "windowSeconds": 3610, "lookupTokens": 50, "hitTokens": 10}


def test_a_replaced_stage_never_lends_its_counts_to_the_new_one() -> None:
    clock = Clock()
    window = LookupWindow(300, clock)
    window.sample({"stage-a": (1000, 0)})
    clock.now += 10
    # Another backend of the same stage (a new source) at (1000, 900): it counted
    # 1000 looked up and 900 hit since it started, all of it new.
    got = window.sample({"stage-b": (1000, 900)})
    assert got == {"windowSeconds": 10, "lookupTokens": 2000, "hitTokens": 900}
    assert got["hitTokens"] <= got["lookupTokens"]


def test_a_window_that_is_not_positive_is_refused_naming_the_value() -> None:
    with pytest.raises(ValueError, match="window_seconds=0 must be positive"):
        LookupWindow(0)
