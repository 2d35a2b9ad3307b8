"""Waiting for a condition, bounded, failing with what was awaited.

Tests assert on what happened, never on when: they wait for a condition with a
generous bound and fail naming the condition, instead of sleeping a fixed time
and hoping. The probe is polled; its first truthy value is returned.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    probe: Callable[[], T], what: str, timeout: float = 10.0, interval: float = 0.005
) -> T:
    """Poll ``probe`` until it returns a truthy value and return that value.

    Raises ``AssertionError`` naming ``what`` once ``timeout`` seconds (wall clock)
    passed without it.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"Timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


async def wait_for_async(
    probe: Callable[[], T], what: str, timeout: float = 10.0, interval: float = 0.05
) -> T:
    """The coroutine form of :func:`wait_for`, on the running loop's clock.

    The deadline is measured with ``loop.time()``, so under ``looptime`` the
    timeout is in the loop's virtual seconds, like every other timer of the test.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = probe()
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"Timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)
