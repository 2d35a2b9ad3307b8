"""The heartbeat's lookup counts cover the last window, not the agent's lifetime."""

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
    assert window.sample(0, 0) == {"windowSeconds": 0, "lookupTokens": 0, "hitTokens": 0}
    clock.now += 100
    assert window.sample(1000, 900) == {
        "windowSeconds": 100, "lookupTokens": 1000, "hitTokens": 900}
    clock.now += 250  # the first sample is now 350 s old, the second 250 s
    assert window.sample(1500, 900) == {
        "windowSeconds": 350, "lookupTokens": 1500, "hitTokens": 900}
    clock.now += 100  # the 1000/900 sample is 350 s old: the new baseline
    assert window.sample(2500, 1000) == {
        "windowSeconds": 350, "lookupTokens": 1500, "hitTokens": 100}


def test_a_cache_that_stopped_hitting_shows_it_after_one_window() -> None:
    clock = Clock()
    window = LookupWindow(60, clock)
    totals = [0, 0]
    for _ in range(20):  # 10 minutes of hits every 30 s
        totals[0] += 100
        totals[1] += 100
        window.sample(*totals)
        clock.now += 30
    for _ in range(3):  # then a flush: nothing hits
        totals[0] += 100
        last = window.sample(*totals)
        clock.now += 30
    assert last["hitTokens"] == 0 and last["lookupTokens"] > 0


def test_totals_that_go_down_start_the_window_again_from_zero() -> None:
    clock = Clock()
    window = LookupWindow(300, clock)
    window.sample(5000, 4000)
    clock.now += 10
    assert window.sample(10, 5) == {"windowSeconds": 0, "lookupTokens": 10, "hitTokens": 5}
    clock.now += 10
    assert window.sample(30, 5) == {"windowSeconds": 10, "lookupTokens": 30, "hitTokens": 5}


def test_what_was_counted_before_the_first_sample_is_in_the_window() -> None:
    clock = Clock()
    window = LookupWindow(300, clock)
    clock.now += 2  # a stage appeared and served lookups before the first heartbeat
    assert window.sample(48, 32) == {"windowSeconds": 2, "lookupTokens": 48, "hitTokens": 32}


def test_a_window_that_is_not_positive_is_refused_naming_the_value() -> None:
    with pytest.raises(ValueError, match="window_seconds=0 must be positive"):
        LookupWindow(0)
