"""The engine API server's last resort must not tell an engine its ``retrieve``
slots are free while the call's worker may still write them.

A ``TimeoutError`` reply is a miss to every connector (vLLM recomputes into the
blocks, SGLang frees the slots). So when the server's own bound runs out, a
``retrieve`` whose worker runs is answered ``SlotsInUse`` (the engine keeps the
slots out of use), and a call still queued for a worker is answered a timeout
and never run. The same holds for calls cut short by shutdown.

Real server, real client, real ipc socket. The service's ``retrieve`` marks when
it runs and blocks on an event the test sets only after the engine's answer came
(a copy that outlives its call): the outcome does not depend on timing, only on
whether a worker had taken the call when the server answered, and each case
asserts the invariant that covers both.
"""

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

from node_agent.client import (
    AgentTimeoutError,
    EngineAPIError,
    EngineClient,
    RankInfo,
    SlotsInUseError,
)
from node_agent.engine_api import protocol
from node_agent.engine_api.server import EngineServer
from node_agent.metrics import AgentMetrics
from tests.support.waiting import wait_for_async

pytestmark = pytest.mark.timeout(60)
RANK = RankInfo(replica="r0", pp_rank=0, pp_size=1)


class StuckLoads:
    """``retrieve`` records that it ran and blocks until :attr:`release` is set;
    ``release`` of rid ``"hold"`` blocks the same way (it keeps the one worker)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.retrieves_run = 0
        self.holding = threading.Event()

    def __call__(self, req: protocol.Request) -> Any:
        if req.op == "retrieve":
            self.retrieves_run += 1
            self.release.wait(30)
            return len(req.arrays["slot_mapping"])
        if req.op == "release" and req.args["rid"] == "hold":
            self.holding.set()
            self.release.wait(30)
        return None


@pytest.fixture()
def sock_path() -> Iterator[Path]:
    path = Path(f"/tmp/fkv-overrun-{os.getpid()}-{time.monotonic_ns()}.sock")
    yield path
    path.unlink(missing_ok=True)


async def _serve(sock_path: Path, service: StuckLoads, timeout: float) -> EngineServer:
    server = EngineServer(f"ipc://{sock_path}", service, AgentMetrics(),
                          call_timeout=timeout, max_workers=1)
    await server.start()
    return server


async def _settled(server: EngineServer) -> None:
    """Every call handed to the one worker before now has run or been skipped."""
    await asyncio.to_thread(server._pool.submit(lambda: None).result, 30)


async def test_a_retrieve_past_the_last_resort_is_never_answered_a_timeout_while_it_runs(
        sock_path: Path) -> None:
    service = StuckLoads()
    server = await _serve(sock_path, service, timeout=0.5)
    client = EngineClient(sock_path, RANK, timeout=20)
    try:
        with pytest.raises((SlotsInUseError, AgentTimeoutError)) as err:
            await asyncio.to_thread(client.retrieve, "r", np.arange(4))
        service.release.set()  # the stuck copy may end only after the engine's answer
        await _settled(server)
        if isinstance(err.value, AgentTimeoutError):
            # A timeout is a miss: allowed only when the worker never ran the call.
            assert service.retrieves_run == 0, (
                "the engine was answered a timeout (a miss: it reuses the slots) while "
                f"the retrieve's worker ran: {err.value}")
        else:
            assert "may still write the call's slots" in str(err.value)
    finally:
        service.release.set()
        client.close()
        await server.stop()


async def test_a_retrieve_answered_before_a_worker_took_it_is_never_run(
        sock_path: Path) -> None:
    service = StuckLoads()
    server = await _serve(sock_path, service, timeout=0.5)
    holder = EngineClient(sock_path, RANK, timeout=20)
    client = EngineClient(sock_path, RANK, timeout=20)
    try:
        held = asyncio.create_task(asyncio.to_thread(holder.release, "hold"))
        await wait_for_async(service.holding.is_set, "the one worker held", 30)
        # The retrieve waits for the held worker; the server's bound runs out first.
        with pytest.raises(AgentTimeoutError, match="did not finish within"):
            await asyncio.to_thread(client.retrieve, "r", np.arange(4))
        service.release.set()
        with pytest.raises(AgentTimeoutError):
            await held
        await _settled(server)
        assert service.retrieves_run == 0, (
            "a retrieve answered a timeout (a miss) ran after the answer and could "
            "write slots the engine reused")
    finally:
        service.release.set()
        holder.close()
        client.close()
        await server.stop()


async def test_a_retrieve_cut_short_by_shutdown_while_it_runs_is_not_a_miss(
        sock_path: Path) -> None:
    service = StuckLoads()
    server = await _serve(sock_path, service, timeout=30)
    client = EngineClient(sock_path, RANK, timeout=20)
    try:
        call = asyncio.create_task(asyncio.to_thread(client.retrieve, "r", np.arange(4)))
        await wait_for_async(lambda: service.retrieves_run == 1, "the retrieve running", 30)
        await server.stop(grace=0.1)
        with pytest.raises(EngineAPIError) as err:
            await call
        assert err.value.error_type == "SlotsInUse", (
            f"a running retrieve cut short by shutdown was answered {err.value}: the "
            "engine reads that as a miss and reuses slots the worker may still write")
    finally:
        service.release.set()
        client.close()
