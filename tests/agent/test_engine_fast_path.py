"""The engine socket's fast paths, through a real :class:`EngineServer` on an ipc
socket: ``inline_ops`` are answered by the I/O thread even while every worker is
busy, large arrays travel as views of the caller's memory and arrive intact,
and an already-int64 array is sent as it is while every other input is still
converted and checked."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from node_agent.client import EngineClient, RankInfo
from node_agent.engine_api import protocol
from node_agent.engine_api.server import EngineServer, Parked
from node_agent.metrics import AgentMetrics
from tests.support.waiting import wait_for_async

pytestmark = pytest.mark.timeout(60)
RANK = RankInfo(replica="r0")


@pytest.fixture()
def sock_path() -> Iterator[Path]:
    path = Path(f"/tmp/fkv-fast-{os.getpid()}-{time.monotonic_ns()}.sock")
    yield path
    path.unlink(missing_ok=True)


def test_large_int64_arrays_are_sent_as_views_and_small_ones_as_copies() -> None:
    big = np.arange(20_000, dtype=np.int64)
    frames = protocol.encode_request(1, "lookup", {"rid": "a", "rank": {}}, {"token_ids": big})
    assert isinstance(frames[1], memoryview) and np.shares_memory(np.asarray(frames[1]), big)
    req = protocol.decode_request([bytes(f) for f in frames])
    assert np.array_equal(req.arrays["token_ids"], big)
    small = protocol.encode_request(2, "lookup", {"rid": "a", "rank": {}},
                                    {"token_ids": np.arange(8, dtype=np.int64)})
    assert isinstance(small[1], bytes)
    # Non-int64 input still goes through the checked conversion.
    with pytest.raises(ValueError, match="has dtype float64"):
        protocol.encode_request(3, "lookup", {"rid": "a", "rank": {}},
                                {"token_ids": np.ones(4)})
    with pytest.raises(ValueError, match="must be 1-D"):
        protocol.encode_request(4, "lookup", {"rid": "a", "rank": {}},
                                {"token_ids": np.ones((2, 2), dtype=np.int64)})


async def test_inline_ping_answers_while_workers_are_busy_and_big_arrays_arrive(
        sock_path: Path) -> None:
    gate = threading.Event()
    ops: list[str] = []

    def service(req: protocol.Request) -> Any:
        ops.append(req.op)
        if req.op == "ping":
            return {"version": protocol.VERSION, "thread": threading.current_thread().name}
        if req.op == "release":
            gate.wait(10)
            return None
        if req.op == "lookup":
            arr = req.arrays["token_ids"]
            return [len(arr), int(arr.sum()), int(arr[-1])]
        return None

    server = EngineServer(f"ipc://{sock_path}", service, AgentMetrics(), call_timeout=20,
                          max_workers=1, inline_ops=frozenset({"ping"}))
    await server.start()
    blocked = EngineClient(sock_path, RANK, timeout=15)
    other = EngineClient(sock_path, RANK, timeout=15)
    try:
        held = asyncio.create_task(asyncio.to_thread(blocked.release, "r"))
        await wait_for_async(lambda: server.inflight == 1, "the blocking call in flight", 5)
        pong = await asyncio.to_thread(other.ping)
        assert pong["thread"] == "engine-api-io"
        assert server.inflight == 1 and not held.done()
        gate.set()
        await held
        big = np.arange(3, 3 + 300_000, dtype=np.int64)
        got = await asyncio.to_thread(other._call,
                                      "lookup", {"rid": "b", "rank": RANK.to_wire()},
                                      {"token_ids": big})
        assert got == [len(big), int(big.sum()), int(big[-1])]
        assert big[0] == 3 and big[-1] == 3 + 300_000 - 1  # the caller's array is untouched
    finally:
        gate.set()
        blocked.close()
        other.close()
        await server.stop(grace=2.0)


async def test_calls_the_service_picks_inline_are_answered_by_the_io_thread(
        sock_path: Path) -> None:
    """``inline`` picks requests by content: a picked lookup is answered on the I/O
    thread while the only worker is blocked; an unpicked one waits for a worker."""
    gate = threading.Event()
    threads: dict[str, str] = {}

    def service(req: protocol.Request) -> Any:
        rid = req.args.get("rid", req.op)
        threads[rid] = threading.current_thread().name
        if req.op == "release":
            gate.wait(10)
        return len(req.arrays.get("token_ids", ()))

    def inline(req: protocol.Request) -> bool:
        return req.op == "lookup" and req.args["rid"].startswith("fast")

    server = EngineServer(f"ipc://{sock_path}", service, AgentMetrics(), call_timeout=20,
                          max_workers=1, inline_ops=frozenset({"ping"}), inline=inline)
    await server.start()
    blocked = EngineClient(sock_path, RANK, timeout=15)
    other = EngineClient(sock_path, RANK, timeout=15)
    slow_client = EngineClient(sock_path, RANK, timeout=15)
    try:
        held = asyncio.create_task(asyncio.to_thread(blocked.release, "r"))
        await wait_for_async(lambda: server.inflight == 1, "the blocking call in flight", 5)
        ids = np.arange(64, dtype=np.int64)
        assert await asyncio.to_thread(other.lookup, "fast-1", ids) == 64
        assert threads["fast-1"] == "engine-api-io"
        slow = asyncio.create_task(asyncio.to_thread(slow_client.lookup, "slow-1", ids))
        await wait_for_async(lambda: server.inflight == 2, "the unpicked lookup queued", 5)
        assert "slow-1" not in threads and not held.done()
        gate.set()
        await held
        assert await slow == 64
        assert threads["slow-1"].startswith("engine-call")
    finally:
        gate.set()
        for c in (blocked, other, slow_client):
            c.close()
        await server.stop(grace=2.0)


async def test_release_is_sent_without_waiting_only_where_the_agent_answers_it_in_order(
        sock_path: Path) -> None:
    """``release_nowait`` waits for the answer (and raises its error) until a
    registration says the agent answers ``release`` in arrival order; then it only
    sends, every release is handled in order before the next call, and the next
    call gets its own answer however many unanswered releases came first (more
    than the socket's queue holds)."""
    handled: list[str] = []
    in_order: list[str] = []

    def service(req: protocol.Request) -> Any:
        handled.append(req.args.get("rid", req.op))
        if req.op == "register":
            return {"stage": "r0/pp0", "inOrder": list(in_order)}
        if req.op == "release" and req.args["rid"] == "bad":
            raise ValueError("release: bad rid 'bad'; use another")
        return int(req.arrays["token_ids"].sum()) if req.op == "lookup" else None

    metrics = AgentMetrics()
    server = EngineServer(f"ipc://{sock_path}", service, metrics, call_timeout=20,
                          max_workers=1, inline_ops=frozenset({"ping", "release", "lookup"}))
    await server.start()
    client = EngineClient(sock_path, RANK, timeout=15)
    try:
        # Not registered: a waited release, whose error reaches the caller.
        with pytest.raises(ValueError, match="bad rid 'bad'"):
            await asyncio.to_thread(client.release_nowait, "bad")
        # An agent that does not say (an older one): still waited.
        await asyncio.to_thread(client.register_kv_buffers, {"layout": 1}, [])
        with pytest.raises(ValueError, match="bad rid 'bad'"):
            await asyncio.to_thread(client.release_nowait, "bad")
        in_order.append("release")
        await asyncio.to_thread(client.register_kv_buffers, {"layout": 1}, [])
        handled.clear()

        def burst() -> int:
            client.release_nowait("bad")  # its error answer is dropped
            for i in range(3000):
                client.release_nowait(f"n{i}")
            return client.lookup("q", [1, 2, 3])

        assert await asyncio.to_thread(burst) == 6
        assert handled == ["bad", *(f"n{i}" for i in range(3000)), "q"]
        assert metrics.engine_requests.labels(
            op="release", outcome="error")._value.get() == 3
        # A re-registration that no longer lists it makes releases waited again.
        in_order.clear()
        await asyncio.to_thread(client.register_kv_buffers, {"layout": 1}, [])
        with pytest.raises(ValueError, match="bad rid 'bad'"):
            await asyncio.to_thread(client.release_nowait, "bad")
    finally:
        client.close()
        await server.stop(grace=2.0)


async def test_parked_calls_are_answered_on_wake_or_expiry_without_a_worker(
        sock_path: Path) -> None:
    """``park`` keeps a waiting call on the I/O thread: it is answered when a
    wake makes its poll return something (while the only worker is blocked),
    with its ``expired`` value when its time is up, and at shutdown; every
    result a poll took is sent."""
    gate = threading.Event()
    ready: list[str] = []
    polled_on: set[str] = set()

    def service(req: protocol.Request) -> Any:
        if req.op == "release":
            gate.wait(10)
        return None

    def park(req: protocol.Request) -> Parked | None:
        if req.op != "wait_completed":
            return None

        def poll() -> list[str] | None:
            polled_on.add(threading.current_thread().name)
            out = list(ready)
            ready.clear()
            return out or None

        return Parked(poll, req.args["timeoutMs"] / 1000, [])

    server = EngineServer(f"ipc://{sock_path}", service, AgentMetrics(), call_timeout=20,
                          max_workers=1, park=park)
    await server.start()
    blocked = EngineClient(sock_path, RANK, timeout=15)
    waiter = EngineClient(sock_path, RANK, timeout=15)
    try:
        held = asyncio.create_task(asyncio.to_thread(blocked.release, "r"))
        await wait_for_async(lambda: server.inflight == 1, "the blocking call in flight", 5)
        # Expiry: nothing became ready; answered [] although no worker is free.
        assert await asyncio.to_thread(waiter.wait_completed, 0.05) == []
        # Wake: the waiting call is answered with what its poll returned.
        got = asyncio.create_task(asyncio.to_thread(waiter.wait_completed, 10.0))
        await asyncio.sleep(0.1)
        assert not got.done()
        ready.append("s1")
        server.wake()
        assert await asyncio.wait_for(got, 5) == ["s1"]
        assert polled_on == {"engine-api-io"} and server.inflight == 1
        assert not held.done()
        # Shutdown answers a parked call with its expired value.
        gate.set()
        await held
        last = asyncio.create_task(asyncio.to_thread(waiter._call, "wait_completed",
                                                     {"rank": RANK.to_wire(), "timeoutMs": 1000}))
        await asyncio.sleep(0.1)
        await server.stop(grace=2.0)
        assert await asyncio.wait_for(last, 5) == []
    finally:
        gate.set()
        blocked.close()
        waiter.close()
        await server.stop(grace=2.0)
