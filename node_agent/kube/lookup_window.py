"""Lookups over the agent's recent window, for its heartbeat Lease.

The agent counts engine lookups and hits since it started; a pool's hit rate
should say how the cache does now, not since the oldest agent started (a flush or
a new workload would hide for hours). :class:`LookupWindow` turns the running
totals, sampled at each heartbeat, into the counts of the last
``window_seconds``: the difference between the newest totals and the newest
sample at least ``window_seconds`` old (or the first sample, while the agent is
younger than the window). ``windowSeconds`` says the span really covered: the
window plus at most one heartbeat period, or less while the agent is younger.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

from node_agent.contract.kube import LOOKUP_WINDOW_SECONDS


class LookupWindow:
    """Running lookup totals in, the last window's counts out (``flexkv.io/lookups``).

    The totals count from zero when the window is made (the agent's start): what
    was counted before the first sample is in the window. Totals must not
    decrease; a decrease (a stage's counters started again) starts the window
    again with the new totals counted from zero. Not thread-safe: the heartbeat
    alone calls :meth:`sample`.
    """

    def __init__(self, window_seconds: float = LOOKUP_WINDOW_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if window_seconds <= 0:
            raise ValueError(f"window_seconds={window_seconds} must be positive")
        self._window = window_seconds
        self._clock = clock
        self._samples: collections.deque[tuple[float, int, int]] = collections.deque(
            [(clock(), 0, 0)])

    def sample(self, lookup_tokens: int, hit_tokens: int) -> dict[str, int]:
        """Record the totals now; answer the annotation's value for the window."""
        now = self._clock()
        if lookup_tokens < self._samples[-1][1] or hit_tokens < self._samples[-1][2]:
            self._samples.clear()
            self._samples.append((now, 0, 0))
        self._samples.append((now, lookup_tokens, hit_tokens))
        # Keep one sample at or beyond the window's start as the baseline.
        while len(self._samples) > 1 and now - self._samples[1][0] >= self._window:
            self._samples.popleft()
        since, base_lookups, base_hits = self._samples[0]
        return {
            "windowSeconds": round(now - since),
            "lookupTokens": lookup_tokens - base_lookups,
            "hitTokens": hit_tokens - base_hits,
        }
