"""Waiting for a condition, bounded, failing with what was awaited.

Tests assert on what happened, never on when: they wait for a condition with a
generous bound and fail naming the condition, instead of sleeping a fixed time
and hoping. The probe is polled; its first truthy value is returned.

The coroutine form also takes a probe that returns an awaitable (an ``async
def`` probe, a call handed to ``asyncio.to_thread``): it is awaited each time.

A probe that asks something which may not answer yet (an HTTP endpoint of a
process still starting) names those exceptions in ``ignoring``: raising one of
them counts as "not yet", any other exception fails the wait at once.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def _probe(probe: Callable[[], T], ignoring: tuple[type[BaseException], ...]) -> T | None:
    if not ignoring:
        return probe()
    try:
        return probe()
    except ignoring:
        return None


def wait_for(
    probe: Callable[[], T], what: str, timeout: float = 10.0, interval: float = 0.005,
    *, ignoring: tuple[type[BaseException], ...] = (),
) -> T:
    """Poll ``probe`` until it returns a truthy value and return that value.

    Raises ``AssertionError`` naming ``what`` once ``timeout`` seconds (wall clock)
    passed without it; an exception of ``ignoring`` raised by ``probe`` counts as
    a falsy answer.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = _probe(probe, ignoring)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"Timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


async def _probe_async(probe: Callable[[], T | Awaitable[T]],
                       ignoring: tuple[type[BaseException], ...]) -> T | None:
    try:
        value = probe()
        if inspect.isawaitable(value):
            return await value
        return value
    except ignoring:
        return None


async def wait_for_async(
    probe: Callable[[], T | Awaitable[T]], what: str, timeout: float = 10.0,
    interval: float = 0.05, *, ignoring: tuple[type[BaseException], ...] = (),
) -> T:
    """The coroutine form of :func:`wait_for`, on the running loop's clock; a probe
    returning an awaitable is awaited.

    The deadline is measured with ``loop.time()``, so under ``looptime`` the
    timeout is in the loop's virtual seconds, like every other timer of the test.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = await _probe_async(probe, ignoring)
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"Timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)
