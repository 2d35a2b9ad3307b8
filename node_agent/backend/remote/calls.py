"""Every remote call bounded by a timeout.

Mooncake's calls are native and cannot be interrupted; a peer that stops answering
can hold one for a long time. :class:`BoundedCaller` runs each call on its lane's
worker thread and the caller waits at most the call's timeout. Callers of one lane
(the stages of an agent share its pool's lanes) take turns: a call arriving while
another caller's call runs waits for it, within its own timeout. A call that
overran keeps its worker busy until the native call returns; while it does, further
calls through the same caller fail at once (:class:`RemoteBusy`) instead of piling
up threads.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

R = TypeVar("R")


class RemoteCallError(RuntimeError):
    """A remote call failed, timed out or could not start; the caller treats it as a miss."""


class RemoteTimeout(RemoteCallError):
    """The call did not return within its timeout (it may still be running)."""


class RemoteBusy(RemoteCallError):
    """An earlier call through this caller overran its timeout and is still running."""


class PendingCall(Generic[R]):
    def __init__(self, fn: Callable[[], R]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: R | None = None
        self.error: BaseException | None = None
        self.overran = False  # its caller stopped waiting before it returned

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as e:  # handed to the waiting caller
            self.error = e
        finally:
            self.done.set()


class BoundedCaller:
    """Runs callables with a timeout, one at a time per caller (``name`` names the lane)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._running: PendingCall[object] | None = None
        self._queue: queue.SimpleQueue[PendingCall[object] | None] = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._serve, name=f"flexkv-remote-{name}",
                                        daemon=True)
        self._worker.start()

    def _serve(self) -> None:
        while True:
            call = self._queue.get()
            if call is None:
                return
            call.run()

    def close(self) -> None:
        """Stop the worker once it is idle (a call still running finishes first)."""
        self._queue.put(None)

    def quiet(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the running call (if any) to return; whether
        none runs now."""
        with self._lock:
            r = self._running
        return r is None or r.done.wait(max(0.0, timeout))

    def busy(self) -> bool:
        """Whether an overrunning call still occupies this lane."""
        with self._lock:
            return self._running is not None and not self._running.done.is_set()

    def overrunning(self) -> bool:
        """Whether a call whose caller stopped waiting (it overran its timeout) still
        runs: it may still read or write the memory it was given."""
        with self._lock:
            r = self._running
            return r is not None and r.overran and not r.done.is_set()

    def call(self, fn: Callable[[], R], timeout: float, what: str) -> R:
        """Run ``fn()`` and return its result within ``timeout`` seconds.

        Raises :class:`RemoteTimeout` when it does not return in time,
        :class:`RemoteBusy` while an earlier call still runs, and
        :class:`RemoteCallError` wrapping any exception ``fn`` raised."""
        if timeout <= 0:
            raise RemoteTimeout(f"{what}: no time left in the remote call budget")
        deadline = time.monotonic() + timeout
        call = self.submit(fn, what, timeout)
        return self.wait(call, deadline - time.monotonic(), what, budget=timeout)

    def submit(self, fn: Callable[[], R], what: str, turn: float = 0.0) -> PendingCall[R]:
        """Start ``fn()`` on the lane without waiting for it; pass the handle to
        :meth:`wait`. Waits up to ``turn`` seconds for another caller's call that
        is still within its timeout. Raises :class:`RemoteBusy` while a call that
        overran its timeout still runs, or when the turn did not come in time."""
        call: PendingCall[R] = PendingCall(fn)
        deadline = time.monotonic() + turn
        while True:
            with self._lock:
                running = self._running
                if running is None or running.done.is_set():
                    self._running = call  # type: ignore[assignment]
                    break
                overran = running.overran
            left = deadline - time.monotonic()
            if overran or left <= 0 or not running.done.wait(left):
                raise RemoteBusy(
                    f"{what}: an earlier {self.name} call is still running (it overran its "
                    "timeout, or another caller's call outlasted this one's budget); the "
                    "remote tier answers misses until it returns"
                )
        self._queue.put(call)  # type: ignore[arg-type]
        return call

    def wait(self, call: PendingCall[R], timeout: float, what: str,
             budget: float | None = None) -> R:
        """The result of a submitted call, waiting at most ``timeout`` seconds (of
        ``budget``, the call's whole timeout, which the error names)."""
        if not call.done.wait(max(0.0, timeout)):
            call.overran = True
            raise RemoteTimeout(f"{what}: no answer within {budget or timeout:g} s "
                                "(tiers.remote.timeoutSeconds); treated as a miss")
        if call.error is not None:
            raise RemoteCallError(f"{what}: {type(call.error).__name__}: {call.error}") \
                from call.error
        return call.result  # type: ignore[return-value]
