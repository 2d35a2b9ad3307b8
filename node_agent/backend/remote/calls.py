"""Every remote call bounded by a timeout.

Mooncake's calls are native and cannot be interrupted; a peer that stops answering
can hold one for a long time. :class:`BoundedCaller` runs each call on its lane's
worker thread and the caller waits at most the call's timeout. A call that overran keeps its
worker busy until the native call returns; while it does, further calls through
the same caller fail at once (:class:`RemoteBusy`) instead of piling up threads.
"""

from __future__ import annotations

import queue
import threading
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

    def busy(self) -> bool:
        """Whether an overrunning call still occupies this lane."""
        with self._lock:
            return self._running is not None and not self._running.done.is_set()

    def call(self, fn: Callable[[], R], timeout: float, what: str) -> R:
        """Run ``fn()`` and return its result within ``timeout`` seconds.

        Raises :class:`RemoteTimeout` when it does not return in time,
        :class:`RemoteBusy` while an earlier call still runs, and
        :class:`RemoteCallError` wrapping any exception ``fn`` raised."""
        if timeout <= 0:
            raise RemoteTimeout(f"{what}: no time left in the remote call budget")
        return self.wait(self.submit(fn, what), timeout, what)

    def submit(self, fn: Callable[[], R], what: str) -> PendingCall[R]:
        """Start ``fn()`` on the lane without waiting; pass the handle to :meth:`wait`.
        Raises :class:`RemoteBusy` while an earlier call still runs."""
        call: PendingCall[R] = PendingCall(fn)
        with self._lock:
            if self._running is not None and not self._running.done.is_set():
                raise RemoteBusy(
                    f"{what}: an earlier {self.name} call is still running (it overran its "
                    "timeout or was not waited for); the remote tier answers misses until "
                    "it returns"
                )
            self._running = call  # type: ignore[assignment]
        self._queue.put(call)  # type: ignore[arg-type]
        return call

    def wait(self, call: PendingCall[R], timeout: float, what: str) -> R:
        """The result of a submitted call, waiting at most ``timeout`` seconds."""
        if not call.done.wait(max(0.0, timeout)):
            raise RemoteTimeout(f"{what}: no answer within {timeout:g} s "
                                "(tiers.remote.timeoutSeconds); treated as a miss")
        if call.error is not None:
            raise RemoteCallError(f"{what}: {type(call.error).__name__}: {call.error}") \
                from call.error
        return call.result  # type: ignore[return-value]
