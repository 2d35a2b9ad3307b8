"""The engine API transport on its own: wire format, the ROUTER server under garbage,
timeouts, the client's errors, and KV buffers shared across processes.

The server here runs a transport-level echo service (it reports what it decoded);
the agent's real service is exercised in test_agent_process.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
import zmq

from node_agent.client import (
    SOCKET_CHECK_SECONDS,
    AgentTimeoutError,
    AgentUnavailableError,
    EngineAPIError,
    EngineClient,
    RankInfo,
    SharedKVBuffers,
)
from node_agent.engine_api import protocol
from node_agent.engine_api.buffers import HandleError, cuda_handle_fields, open_buffer
from node_agent.engine_api.server import EngineServer, NotReadyError
from node_agent.metrics import AgentMetrics
from node_agent.vocab.recent_errors import RecentErrors
from tests.support.waiting import wait_for_async

pytestmark = pytest.mark.timeout(60)
RANK = RankInfo(replica="r0", pp_rank=0, pp_size=1)


def echo_service(req: protocol.Request) -> Any:
    """Reports what the server decoded; sleeps on request to exercise timeouts."""
    if req.op == "release" and req.args["rid"] == "sleep":
        time.sleep(1.0)
    if req.op == "release" and req.args["rid"] == "slow":
        time.sleep(0.4)
        return "finished"
    if req.op == "release" and req.args["rid"] == "bad":
        raise ValueError("bad rid 'bad'; use another")
    if req.op == "release" and req.args["rid"] == "boom":
        raise RuntimeError("internal failure")
    if req.op == "lookup":
        return int(req.arrays["token_ids"].sum())
    if req.op == "retrieve":
        return len(req.arrays["slot_mapping"])
    return {"op": req.op, "arrays": {k: len(v) for k, v in req.arrays.items()}}


# -- wire format ---------------------------------------------------------------

def test_request_round_trip_keeps_types_and_values() -> None:
    frames = protocol.encode_request(
        3, "store_kv", {"rid": "a", "rank": RANK.to_wire()},
        {"token_ids": [1, 2, 3], "kv_indices": np.array([7, 8, 9], dtype=np.int32)})
    req = protocol.decode_request(frames)
    assert (req.id, req.op, req.args["rid"]) == (3, "store_kv", "a")
    assert req.arrays["kv_indices"].dtype == np.int64
    assert req.arrays["kv_indices"].tolist() == [7, 8, 9]


@pytest.mark.parametrize(("frames", "fragment"), [
    ([], "empty message"),
    ([b"\xff\xfe"], "not UTF-8 JSON"),
    ([b"[1, 2]"], "header must be a JSON object"),
    ([b'{"v": 99, "id": 1, "op": "ping"}'], "protocol version 99 is not supported"),
    ([b'{"v": 1, "id": "x", "op": "ping"}'], "header 'id' must be an integer"),
    ([b'{"v": 1, "id": 1, "op": "rm -rf"}'], "unknown op 'rm -rf'"),
    ([b'{"v": 1, "id": 1, "op": "release", "args": {"rid": 5, "rank": {}}}'],
     "argument 'rid' must be str"),
    ([b'{"v": 1, "id": 1, "op": "release", "args": {"rank": {}}}'], "missing argument 'rid'"),
    ([b'{"v": 1, "id": 1, "op": "ping", "args": {"x": 1}}'], "unexpected argument 'x'"),
    ([b'{"v": 1, "id": 1, "op": "retrieve", "args": {"rid": "a", "rank": {}}, "arrays": '
      b'{"slot_mapping": {"frame": 1, "dtype": "float64", "len": 1}}}', b"\0" * 8],
     "must have dtype int64"),
    ([b'{"v": 1, "id": 1, "op": "retrieve", "args": {"rid": "a", "rank": {}}, "arrays": '
      b'{"slot_mapping": {"frame": 1, "dtype": "int64", "len": 2}}}', b"\0" * 8],
     "declares 2 x int64 but its frame holds 8 bytes"),
    ([b'{"v": 1, "id": 1, "op": "retrieve", "args": {"rid": "a", "rank": {}}, "arrays": '
      b'{"slot_mapping": {"frame": 4, "dtype": "int64", "len": 1}}}'], "names frame 4"),
    ([b" " * (protocol.MAX_HEADER_BYTES + 1)], "exceeds the limit"),
    ([b"{}"] * (protocol.MAX_FRAMES + 1), "frames exceed the limit"),
])
def test_malformed_requests_are_named(frames: list[bytes], fragment: str) -> None:
    with pytest.raises(protocol.ProtocolError) as err:
        protocol.decode_request(frames)
    assert fragment in str(err.value)


# -- server and client -----------------------------------------------------------

@pytest.fixture()
def sock_path(tmp_path: Path) -> Path:
    # Unix socket paths are short; tmp_path may be long.
    path = Path(f"/tmp/fkv-test-{os.getpid()}-{time.monotonic_ns()}.sock")
    yield path
    path.unlink(missing_ok=True)


async def _serve(sock_path: Path, timeout: float = 5.0) -> tuple[EngineServer, RecentErrors,
                                                                  AgentMetrics]:
    errors, metrics = RecentErrors(), AgentMetrics()
    server = EngineServer(f"ipc://{sock_path}", echo_service, metrics, call_timeout=timeout,
                          errors=errors)
    await server.start()
    return server, errors, metrics


async def test_client_calls_round_trip_through_server(sock_path: Path) -> None:
    server, _, metrics = await _serve(sock_path)
    try:
        client = EngineClient(sock_path, RANK, timeout=5)
        assert await asyncio.to_thread(client.lookup, "r", [1, 2, 3]) == 6
        assert await asyncio.to_thread(client.retrieve, "r", np.arange(4)) == 4
        with pytest.raises(ValueError, match="store_kv: token_ids has 3 entries but "
                                             "kv_indices has 2 entries"):
            await asyncio.to_thread(client.store_kv, "r", [1, 2, 3], [4, 5])
        with pytest.raises(ValueError, match="bad rid 'bad'"):
            await asyncio.to_thread(client.release, "bad")
        with pytest.raises(EngineAPIError, match="InternalError: internal failure"):
            await asyncio.to_thread(client.release, "boom")
        client.close()
        assert metrics.engine_requests.labels(op="lookup", outcome="ok")._value.get() == 1
        assert metrics.engine_requests.labels(op="release", outcome="error")._value.get() == 2
    finally:
        await server.stop()
    assert not sock_path.exists()


async def test_server_bounds_slow_calls_and_client_bounds_its_wait(sock_path: Path) -> None:
    server, errors, metrics = await _serve(sock_path, timeout=0.2)
    try:
        client = EngineClient(sock_path, RANK, timeout=5)
        with pytest.raises(AgentTimeoutError, match=r"did not finish within 0\.2s"):
            await asyncio.to_thread(client.release, "sleep")
        assert metrics.engine_requests.labels(op="release", outcome="timeout")._value.get() == 1
        impatient = EngineClient(sock_path, RANK, timeout=0.1)
        with pytest.raises(AgentTimeoutError, match="no answer from the agent"):
            await asyncio.to_thread(impatient.release, "sleep")
        # The timed-out client reconnects and gets its own answers, not stale ones.
        assert await asyncio.to_thread(impatient.lookup, "x", [5]) == 5
        # The server's bound is a last resort: reaching it is an internal error.
        assert any("InternalError" in e["message"] and "did not finish" in e["message"]
                   for e in errors.snapshot())
    finally:
        await server.stop()


async def test_stop_finishes_inflight_calls_within_grace(sock_path: Path) -> None:
    server, _, _ = await _serve(sock_path)
    client = EngineClient(sock_path, RANK, timeout=5)
    call = asyncio.create_task(asyncio.to_thread(client._call, "release",
                                                 {"rid": "slow", "rank": RANK.to_wire()}))
    await wait_for_async(lambda: server.inflight == 1, "the slow call in flight", 5)
    await server.stop(grace=5.0)
    assert await call == "finished"
    client.close()


async def test_stop_answers_calls_cut_short_by_the_grace(sock_path: Path) -> None:
    server, _, _ = await _serve(sock_path)
    client = EngineClient(sock_path, RANK, timeout=5)
    call = asyncio.create_task(asyncio.to_thread(client.release, "sleep"))
    await wait_for_async(lambda: server.inflight == 1, "the sleeping call in flight", 5)
    await server.stop(grace=0.1)
    with pytest.raises(EngineAPIError, match="agent is shutting down"):
        await call
    client.close()


class ForgetfulAgent:
    """A service that, like a restarted agent, has forgotten the rank: the first
    call answers NotReady, re-registration and the retry each take ``pause`` s."""

    def __init__(self, pause: float) -> None:
        self.pause = pause
        self.ops: list[str] = []

    def __call__(self, req: protocol.Request) -> Any:
        self.ops.append(req.op)
        if req.op == "register":
            time.sleep(self.pause)
            return {"stage": "r0/pp0"}
        if len(self.ops) == 1:
            raise NotReadyError("rank r0/pp0/tp0 has not registered its KV buffers")
        time.sleep(self.pause)
        return 7


async def test_reregistration_and_retry_share_the_calls_deadline(sock_path: Path) -> None:
    service = ForgetfulAgent(pause=0.6)
    server = EngineServer(f"ipc://{sock_path}", service, AgentMetrics(), call_timeout=5.0)
    await server.start()
    client = EngineClient(sock_path, RANK, timeout=1.0)
    client._registration = {"rank": RANK.to_wire(), "layout": {}, "buffers": []}
    try:
        # register (0.6 s) + retry (0.6 s) do not fit in one 1.0 s call budget.
        with pytest.raises(AgentTimeoutError, match=r"lookup: .*1\.0s"):
            await asyncio.to_thread(client.lookup, "x", [1, 2])
        assert service.ops[:2] == ["lookup", "register"]
        # With enough time the same sequence succeeds, within one call.
        service.ops.clear()
        client.timeout = 5.0
        assert await asyncio.to_thread(client.lookup, "x", [1, 2]) == 7
        assert service.ops == ["lookup", "register", "lookup"]
    finally:
        client.close()
        await server.stop(grace=2.0)


def test_client_names_socket_when_agent_is_down(tmp_path: Path) -> None:
    client = EngineClient(tmp_path / "nobody.sock", RANK, timeout=0.5)
    with pytest.raises(AgentUnavailableError) as err:
        client.lookup("r", [1])
    assert str(tmp_path / "nobody.sock") in str(err.value)
    assert "flexkv-agent run --config" in str(err.value)


async def test_connected_client_notices_a_removed_socket_file(sock_path: Path) -> None:
    """A connected client skips the socket-file check on calls less than
    SOCKET_CHECK_SECONDS apart, but an agent that went away (its socket file
    removed) is still named as absent, not waited for, once that time passed."""
    server, _, _ = await _serve(sock_path)
    client = EngineClient(sock_path, RANK, timeout=5)
    try:
        assert await asyncio.to_thread(client.lookup, "r", [1, 2]) == 3
        await server.stop(grace=1.0)
        assert not sock_path.exists()
        await asyncio.sleep(2 * SOCKET_CHECK_SECONDS)
        with pytest.raises(AgentUnavailableError, match="the socket does not exist"):
            await asyncio.to_thread(client.lookup, "r", [1, 2])
    finally:
        client.close()


def test_client_takes_the_ipc_endpoint_form_of_the_socket(tmp_path: Path) -> None:
    """The agent reports its socket as ipc://PATH (/status, logs); both forms work."""
    client = EngineClient(f"ipc://{tmp_path}/agent.sock", RANK, timeout=0.5)
    assert client.socket_path == tmp_path / "agent.sock"
    with pytest.raises(AgentUnavailableError, match=f"no flexkv agent at ipc://{tmp_path}/agent"):
        client.lookup("r", [1])


async def test_garbage_gets_error_replies_and_server_keeps_serving(sock_path: Path) -> None:
    server, errors, _ = await _serve(sock_path)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(f"ipc://{sock_path}")
    rng = np.random.default_rng(0)
    garbage: list[list[bytes]] = [
        [rng.bytes(64)],
        [b'{"v": 1, "id": 11, "op": "launch_missiles"}'],
        [b'{"v": 1, "id": 12, "op": "lookup", "args": {"rid": [], "rank": {}}}'],
        [b'{"v": 1, "id": 13, "op": "ping"}'] + [b"x"] * 20,
        [b'{"v": 1, "id": 14, "op": "ping", "pad": "' + b"a" * protocol.MAX_HEADER_BYTES + b'"}'],
    ]

    def exchange(frames: list[bytes]) -> dict[str, Any]:
        raw.send_multipart(frames)
        assert raw.poll(5000), "no reply to a malformed message"
        return json.loads(raw.recv_multipart()[0])

    try:
        replies = [await asyncio.to_thread(exchange, g) for g in garbage]
        assert all(r["ok"] is False for r in replies)
        assert [r["id"] for r in replies[1:4]] == [11, 12, 13]
        assert replies[1]["error"]["type"] == "ProtocolError"
        assert "unknown op 'launch_missiles'" in replies[1]["error"]["message"]
        ok = await asyncio.to_thread(
            exchange, protocol.encode_request(15, "ping"))
        assert ok == {"v": 1, "id": 15, "ok": True, "result": {"op": "ping", "arrays": {}}}
        assert server.alive and len(errors.snapshot()) == len(garbage)
    finally:
        raw.close()
        ctx.term()
        await server.stop()


# -- shared KV buffers across processes ------------------------------------------

ENGINE_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from node_agent.client import SharedKVBuffers
    bufs = SharedKVBuffers([[(8, 2, 4), (8, 2, 4)]], torch.float16)
    for i, t in enumerate(bufs.tensors[0]):
        t.copy_(torch.arange(64, dtype=torch.float16).view(8, 2, 4) + i)
    print(json.dumps(bufs.handles), flush=True)
    sys.stdin.readline()                      # the agent side wrote into slot 3
    ok = bool((bufs.tensors[0][1][3] == -1).all())
    print("seen" if ok else "not seen", flush=True)
    bufs.close()
""")


def test_shared_memory_buffers_alias_across_processes() -> None:
    proc = subprocess.Popen([sys.executable, "-c", ENGINE_SCRIPT], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    opened = []
    try:
        assert proc.stdout is not None and proc.stdin is not None
        handles = json.loads(proc.stdout.readline())
        opened = [open_buffer(h) for h in handles[0]]
        assert opened[0].tensor.shape == (8, 2, 4)
        expected = torch.arange(64, dtype=torch.float16).view(8, 2, 4)
        assert torch.equal(opened[0].tensor, expected)
        assert torch.equal(opened[1].tensor, expected + 1)
        opened[1].tensor[3] = -1
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "seen"
        assert proc.wait(timeout=20) == 0
    finally:
        for b in opened:
            b.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


@pytest.mark.parametrize(("handle", "fragment"), [
    ("nope", "must be an object"),
    ({"kind": "nfs"}, "handle kind 'nfs' is unknown"),
    ({"kind": "shm", "name": "x", "dtype": "complex64", "shape": [1]}, "dtype 'complex64'"),
    ({"kind": "shm", "name": "x", "dtype": "float16", "shape": [0]}, "positive ints"),
    ({"kind": "shm", "name": "flexkv-no-such-segment", "dtype": "float16", "shape": [4]},
     "does not exist"),
])
def test_bad_handles_are_refused(handle: object, fragment: str) -> None:
    with pytest.raises(HandleError, match=fragment):
        open_buffer(handle)


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


_GOOD_CUDA = {
    "kind": "cuda_ipc", "device": 0, "handle": _b64(b"\x02c" + bytes(64)), "storageSize": 64,
    "storageOffsetBytes": 0, "refCounterHandle": _b64(b"/torch_1_2_0"), "refCounterOffset": 0,
    "eventHandle": "", "eventSyncRequired": False, "dtype": "float16", "shape": [4, 8],
    "stride": [8, 1], "tensorOffset": 0,
}


@pytest.mark.parametrize(("change", "fragment"), [
    ({"device": None}, "has no 'device' field"),
    ({"device": "0"}, "field 'device' is '0'; it must be an int >= 0"),
    ({"storageSize": 0}, "field 'storageSize' is 0; it must be an int >= 1"),
    ({"refCounterOffset": 1.5}, "field 'refCounterOffset' is 1.5"),
    ({"refCounterOffset": 10_000}, "'refCounterOffset' is 10000; torch's reference-counter "
                                   "file has 10000 slots"),
    ({"tensorOffset": True}, "field 'tensorOffset' is True"),
    ({"handle": "not base64!"}, "field 'handle' is not valid base64"),
    ({"handle": 17}, "field 'handle' must be base64 text, got int"),
    ({"handle": "AAAA"}, "'handle' holds 3 bytes that are not a torch CUDA IPC memory handle"),
    ({"handle": _b64(b"\x00c" + bytes(64))}, "'handle' holds 66 bytes that are not"),
    ({"handle": _b64(b"\x02x" + bytes(64))}, "'handle' holds 66 bytes that are not"),
    ({"handle": _b64(b"\x02c" + bytes(63))}, "'handle' holds 65 bytes that are not"),
    ({"handle": _b64(b"\x02e" + bytes(64))}, "is an expandable-segment handle; the agent "
                                             "opens only buffers allocated by plain cudaMalloc"),
    ({"handle": _b64(b"\x02e")}, "expandable_segments:True in PYTORCH_CUDA_ALLOC_CONF"),
    ({"refCounterHandle": "ü"}, "field 'refCounterHandle' is not valid base64"),
    ({"refCounterHandle": "AAAA"}, "'refCounterHandle' is b'\\x00\\x00\\x00', not the name"),
    ({"refCounterHandle": _b64(b"torch_1")}, "'refCounterHandle' is b'torch_1', not the name"),
    ({"refCounterHandle": _b64(b"/torch_1_2_0\x00x")}, "not the name of torch's reference"),
    # Another process's shared memory: an engine's KV segment, a multiprocessing one.
    ({"refCounterHandle": _b64(b"/flexkv-4242-ab12")}, "not the name of torch's reference"),
    ({"refCounterHandle": _b64(b"/psm_1a2b3c")}, "would decrement a counter in that shared"),
    ({"refCounterHandle": _b64(b"/torch_1_2")}, "(/torch_<pid>_<random>_<n>)"),
    ({"stride": [8]}, "stride [8] must be a list of ints >= 0, one per dimension"),
    ({"stride": [8, "1"]}, "stride [8, '1'] must be a list"),
    ({"eventSyncRequired": "yes"}, "'eventSyncRequired' is 'yes'; it must be true or false"),
    ({"eventSyncRequired": True}, "'eventHandle' has 0 bytes but 'eventSyncRequired' is true"),
    ({"eventSyncRequired": True, "eventHandle": "AAAA"}, "'eventHandle' has 3 bytes but"),
    ({"dtype": "int64"}, "dtype 'int64' is not supported"),
])
def test_bad_cuda_handle_fields_are_named(change: dict[str, Any], fragment: str) -> None:
    handle = {k: v for k, v in {**_GOOD_CUDA, **change}.items() if v is not None}
    with pytest.raises(HandleError) as err:
        cuda_handle_fields(handle)
    assert fragment in str(err.value)
    # open_buffer checks the fields before it needs a GPU.
    with pytest.raises(HandleError, match=re.escape(fragment)):
        open_buffer(handle)


def test_well_formed_cuda_handle_fields_parse() -> None:
    f = cuda_handle_fields(dict(_GOOD_CUDA))
    assert (f.device, f.storage_size, f.shape, f.stride) == (0, 64, (4, 8), (8, 1))
    assert f.handle == b"\x02c" + bytes(64) and f.event_handle == b""
    assert f.ref_counter_handle == b"/torch_1_2_0"
    # The raw 64-byte form older torch releases export, and a synchronised event.
    legacy = cuda_handle_fields(dict(_GOOD_CUDA, handle=_b64(bytes(range(64))),
                                     eventSyncRequired=True, eventHandle=_b64(bytes(64))))
    assert legacy.handle == bytes(range(64)) and legacy.event_handle == bytes(64)


class _Mapped:
    """Stands in for the storage torch mapped: only its address is read."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


@pytest.mark.parametrize(("offset", "size", "driver", "fragment"), [
    (4096, 8192, (0x10000, 1 << 20), None),  # inside the export: taken
    (0, 1 << 20, (0x10000, 1 << 20), None),  # the whole export
    (4096, 1 << 20, (0x10000, 1 << 20), "is an allocation of 1048576 bytes"),
    # The offset lands in another allocation: its range starts elsewhere.
    (1 << 30, 64, (0x10000 + (1 << 30) - 64, 4096), "not the start of an allocation"),
    (1 << 30, 64, (0x10000, 1 << 20), "is an allocation of 1048576 bytes"),
    (0, 64, None, "no allocation at its mapped base"),
])
def test_cuda_storage_must_lie_inside_the_allocation_it_exported(
        monkeypatch: pytest.MonkeyPatch, offset: int, size: int,
        driver: tuple[int, int] | None, fragment: str | None) -> None:
    """The check's arithmetic, with the driver's answer for the mapped base given
    (the CUDA driver is the boundary faked here; a GPU host runs the real one in
    test_unopenable_cuda_handles_are_refused_without_a_crash)."""
    from node_agent.engine_api import buffers

    asked: list[int] = []

    def address_range(ptr: int, device: int) -> tuple[int | None, int]:
        asked.append(ptr)
        return driver if driver is not None else (None, 0)

    monkeypatch.setattr(buffers, "_address_range", address_range)
    f = cuda_handle_fields(dict(_GOOD_CUDA, storageOffsetBytes=offset, storageSize=size))
    storage = cast(torch.UntypedStorage, _Mapped(0x10000 + offset))
    if fragment is None:
        buffers._check_inside_allocation(storage, f)
    else:
        with pytest.raises(HandleError, match=re.escape(fragment)):
            buffers._check_inside_allocation(storage, f)
    assert asked == [0x10000]  # the mapped base, not the storage's own address


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cuda_handle_without_cuda_names_the_fix() -> None:
    with pytest.raises(HandleError, match="CUDA is not available to the agent"):
        open_buffer(dict(_GOOD_CUDA))


def test_handle_larger_than_segment_is_refused() -> None:
    with SharedKVBuffers([[(4, 4)]], torch.float16) as bufs:
        h = dict(bufs.handles[0][0], shape=[400, 4])
        with pytest.raises(HandleError, match="needs 3200 bytes but the segment has"):
            open_buffer(h)


# CUDA IPC refuses to open a handle in the exporting process, and a handle torch
# cannot take can kill the process that opens it: each open runs in a child.
_OPEN_IN_CHILD = (
    "import json,sys,torch\n"
    "from node_agent.engine_api.buffers import HandleError, open_buffer\n"
    "try:\n"
    "    b = open_buffer(json.loads(sys.stdin.read()))\n"
    "    print('SUM', float(b.tensor.sum()))\n"
    "except HandleError as e:\n"
    "    print('REFUSED', e)\n"
)


def _open_in_child(handle: dict[str, Any]) -> str:
    """What ``open_buffer(handle)`` does in a fresh process: ``SUM <sum>`` or
    ``REFUSED <message>``; a crash of the child fails the test."""
    done = subprocess.run([sys.executable, "-c", _OPEN_IN_CHILD], input=json.dumps(handle),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"open_buffer crashed ({done.returncode}): {done.stderr}"
    return done.stdout.strip()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_handle_round_trip_in_process() -> None:
    from node_agent.engine_api.buffers import cuda_handle

    t = torch.arange(32, dtype=torch.float16, device="cuda").view(4, 8)
    assert _open_in_child(cuda_handle(t)) == f"SUM {float(t.sum())}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_unopenable_cuda_handles_are_refused_without_a_crash() -> None:
    from node_agent.engine_api.buffers import cuda_handle

    t = torch.ones(1 << 18, dtype=torch.float32, device="cuda")  # 1 MiB
    good = cuda_handle(t)
    one_d = {"shape": [1], "stride": [1]}
    cases = {
        # A well-formed handle of memory no process exported.
        "unknown memory": (dict(_GOOD_CUDA), "cannot be opened"),
        # A real export whose sizes reach past the allocation the engine shared.
        "past the allocation": (dict(good, storageSize=good["storageSize"] * 64, **one_d),
                                "but the exported memory is an allocation of"),
        # The storage would start far outside the export (where another allocation
        # of the opening process may be): refused from the export's own size.
        "offset past the allocation": (dict(good, storageOffsetBytes=1 << 40, **one_d),
                                       "but the exported memory is an allocation of"),
        "device the agent lacks": (dict(good, device=torch.cuda.device_count()),
                                   "CUDA device(s); give the agent every GPU"),
    }
    for name, (handle, fragment) in cases.items():
        out = _open_in_child(handle)
        assert out.startswith("REFUSED") and fragment in out, (name, out)
    assert float(t.sum()) == float(1 << 18)  # the exporter's tensor is untouched


async def test_worker_calls_past_the_inflight_limit_are_refused_inline_calls_answered(
        sock_path: Path) -> None:
    gate = threading.Event()

    def blocking(req: protocol.Request) -> Any:
        if req.op == "release":
            gate.wait(10)
        return "done"

    metrics = AgentMetrics()
    server = EngineServer(f"ipc://{sock_path}", blocking, metrics, call_timeout=20,
                          max_workers=1, max_inflight=2,
                          inline=lambda req: req.op == "commit_load")
    await server.start()
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(f"ipc://{sock_path}")
    try:
        for i in (1, 2):  # one runs, one waits for the single worker
            raw.send_multipart(protocol.encode_request(i, "release", {"rid": "r", "rank": {}}))
        await wait_for_async(lambda: server.inflight == 2, "two calls in flight", 5)
        raw.send_multipart(protocol.encode_request(3, "release", {"rid": "r", "rank": {}}))
        assert await asyncio.to_thread(raw.poll, 5000), "the busy call got no answer"
        busy = protocol.decode_reply(raw.recv_multipart())
        assert (busy.id, busy.ok, busy.error_type) == (3, False, "NotReady")
        assert "agent busy" in (busy.error_message or "")
        assert server.refused_busy == 1 and server.inflight == 2
        assert metrics.engine_requests.labels(op="busy", outcome="error")._value.get() == 1
        # A call the I/O thread answers itself holds no worker: it is answered at
        # the limit too (an engine may send one without waiting for the answer,
        # end_claim_nowait, so a refusal would go unseen).
        raw.send_multipart(protocol.encode_request(
            4, "commit_load", {"rid": "r", "rank": {}, "claim": 1}))
        assert await asyncio.to_thread(raw.poll, 5000), "the inline call got no answer"
        inline = protocol.decode_reply(raw.recv_multipart())
        assert (inline.id, inline.ok, inline.result) == (4, True, "done")
        assert server.refused_busy == 1 and server.inflight == 2
        gate.set()
        got = set()
        for _ in (1, 2):
            assert await asyncio.to_thread(raw.poll, 5000)
            reply = protocol.decode_reply(raw.recv_multipart())
            assert reply.ok and reply.result == "done"
            got.add(reply.id)
        assert got == {1, 2}
    finally:
        gate.set()
        raw.close()
        ctx.term()
        await server.stop(grace=2.0)


async def test_frames_past_the_limit_are_dropped_and_the_message_refused(
        sock_path: Path) -> None:
    server, _, _ = await _serve(sock_path)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(f"ipc://{sock_path}")
    try:
        raw.send_multipart([b'{"v": 1, "id": 21, "op": "ping"}'] + [b"y" * 1024] * 500)
        assert await asyncio.to_thread(raw.poll, 5000)
        reply = protocol.decode_reply(raw.recv_multipart())
        assert (reply.id, reply.error_type) == (21, "ProtocolError")
        assert f"{protocol.MAX_FRAMES + 1} frames exceed the limit" in (reply.error_message or "")
        raw.send_multipart(protocol.encode_request(22, "ping"))
        assert await asyncio.to_thread(raw.poll, 5000)
        assert protocol.decode_reply(raw.recv_multipart()).ok
    finally:
        raw.close()
        ctx.term()
        await server.stop()
