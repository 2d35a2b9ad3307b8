"""Lookups over the agent's recent window, for its heartbeat Lease.

Each stage the agent leads counts the tokens engines looked up and the tokens
found since its backend started; a pool's hit rate should say how the cache does
now, not since the oldest agent started (a flush or a new workload would hide for
hours). :class:`LookupWindow` turns those running totals, sampled at each
heartbeat, into the counts of the last ``window_seconds``.

Totals are kept per *source* (one backend instance of one stage): what a source
counted since the previous sample is added to the agent's running sum; a new
source counts from zero, a source whose totals went down started again (counted
from zero), and a source that disappeared adds nothing more. Stages coming and
going therefore never move the sum backwards nor mix one stage's counts with
another's. The window is the running sum now less the newest sample at least
``window_seconds`` old (or the agent's start, while it is younger);
``windowSeconds`` says the span really covered.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Hashable, Mapping

from node_agent.contract.kube import LOOKUP_WINDOW_SECONDS


class LookupWindow:
    """Per-source running lookup totals in, the last window's counts out
    (``flexkv.io/lookups``). Not thread-safe: the heartbeat alone calls
    :meth:`sample`."""

    def __init__(self, window_seconds: float = LOOKUP_WINDOW_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if window_seconds <= 0:
            raise ValueError(f"window_seconds={window_seconds} must be positive")
        self._window = window_seconds
        self._clock = clock
        self._last: dict[Hashable, tuple[int, int]] = {}
        self._sum = (0, 0)
        self._samples: collections.deque[tuple[float, int, int]] = collections.deque(
            [(clock(), 0, 0)])

    def sample(self, totals: Mapping[Hashable, tuple[int, int]]) -> dict[str, int]:
        """Record each source's (looked up, hit) totals now; answer the annotation's
        value for the window."""
        now = self._clock()
        looked_up, hit = self._sum
        for source, (lk, ht) in totals.items():
            prev_lk, prev_ht = self._last.get(source, (0, 0))
            if lk < prev_lk or ht < prev_ht:  # the source started again
                prev_lk, prev_ht = 0, 0
            looked_up += lk - prev_lk
            hit += ht - prev_ht
        self._last = dict(totals)
        self._sum = (looked_up, hit)
        self._samples.append((now, looked_up, hit))
        # Keep one sample at or beyond the window's start as the baseline.
        while len(self._samples) > 1 and now - self._samples[1][0] >= self._window:
            self._samples.popleft()
        since, base_lookups, base_hits = self._samples[0]
        return {
            "windowSeconds": round(now - since),
            "lookupTokens": looked_up - base_lookups,
            "hitTokens": min(hit - base_hits, looked_up - base_lookups),
        }
