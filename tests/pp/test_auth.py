"""CurveZMQ: only holders of the pool's secret key can reach a fan-out server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zmq

from node_agent.pp.auth import CurveKeyError, CurveKeys
from node_agent.pp.channel import FanoutServer, Sender
from node_agent.pp.messages import Decision, Envelope, Message, Op, encode
from node_agent.vocab.placement import Direction
from tests.support.waiting import wait_for

ROGUE = r"""
import sys, time, zmq, numpy as np
from node_agent.pp.messages import Decision, Envelope, Op, encode
from node_agent.vocab.placement import Direction
endpoint, mode, server_key = sys.argv[1], sys.argv[2], sys.argv[3].encode()
ctx = zmq.Context()
s = ctx.socket(zmq.PUSH)
s.linger = 0
if mode == "foreign":  # a valid Curve client, but with a keypair of its own
    pub, sec = zmq.curve_keypair()
    s.curve_publickey, s.curve_secretkey, s.curve_serverkey = pub, sec, server_key
s.connect(endpoint)
d = Decision(Direction.STORE, "evil", 0, 1, np.ones(16, bool), np.array([[0, 0, 1]]), None)
for seq in range(1, 21):
    try:
        s.send_multipart(encode(Envelope(Op.PUT, "g", 0, seq), d), flags=zmq.NOBLOCK)
    except zmq.Again:
        pass
    time.sleep(0.02)
s.close(0)
ctx.term()
"""


def _run_rogue(endpoint: str, mode: str, server_key: bytes) -> None:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    subprocess.run([sys.executable, "-c", ROGUE, endpoint, mode, server_key.decode()],
                   env=env, timeout=30, check=True)


@pytest.mark.parametrize("mode", ["plain", "foreign"])
def test_process_without_the_pool_key_cannot_inject(mode: str) -> None:
    keys = CurveKeys.generate()
    got: list[Message] = []
    srv = FanoutServer("tcp://127.0.0.1:0", keys).start()
    srv.register("g", got.append)
    try:
        _run_rogue(srv.endpoint, mode, keys.public)  # returns once the rogue exited
        assert got == [] and srv.received == 0
        # The same server accepts a sender holding the pool's keypair; once its
        # message is in, nothing of the rogue's (sent before it) came in with it.
        good = Sender(srv.endpoint, keys)
        d = Decision(Direction.STORE, "ok", 0, 1, np.ones(16, bool), np.array([[0, 0, 1]]), None)
        good.send(encode(Envelope(Op.PUT, "g", 0, 1), d))
        wait_for(lambda: got, "the key holder's message", 5)
        good.close()
        assert [m.body.rid for m in got] == ["ok"]  # type: ignore[union-attr]
        assert srv.received == 1
    finally:
        srv.close()


def test_keys_load_from_directory_then_environment(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    keys = CurveKeys.generate()
    keys.write(tmp_path)
    assert (tmp_path / "curve-secret.key").stat().st_mode & 0o777 == 0o600
    assert CurveKeys.load(tmp_path) == keys
    other = CurveKeys.generate()
    monkeypatch.setenv("FLEXKV_CURVE_PUBLIC_KEY", other.public.decode())
    monkeypatch.setenv("FLEXKV_CURVE_SECRET_KEY", other.secret.decode())
    assert CurveKeys.load(tmp_path / "missing") == other
    assert CurveKeys.load(None) == other


def test_missing_or_bad_keys_name_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLEXKV_CURVE_PUBLIC_KEY", raising=False)
    monkeypatch.delenv("FLEXKV_CURVE_SECRET_KEY", raising=False)
    with pytest.raises(CurveKeyError, match="mount the pool's <pool>-curve Secret"):
        CurveKeys.load(tmp_path)
    with pytest.raises(CurveKeyError, match="40 Z85 characters"):
        CurveKeys(b"short", b"x" * 40)
    a, b = zmq.curve_keypair(), zmq.curve_keypair()
    with pytest.raises(CurveKeyError, match="does not belong"):
        CurveKeys(a[0], b[1])
