"""The fan-out server's receive loop: every message handled once and in order,
also across idle waits, and an idle server stops when closed."""

from __future__ import annotations

import threading
import time

from node_agent.pp.auth import CurveKeys
from node_agent.pp.channel import FanoutServer, Sender
from node_agent.pp.messages import Envelope, Message, Op, Release, encode
from tests.support.waiting import wait_for


def _release(seq: int) -> list[bytes]:
    return encode(Envelope(Op.RELEASE, "g", 0, seq), Release(f"r{seq}", 0))


def test_messages_around_idle_waits_are_each_handled_once_in_order() -> None:
    keys = CurveKeys.generate()
    got: list[Message] = []
    srv = FanoutServer("tcp://127.0.0.1:0", keys).start()
    srv.register("g", got.append)
    sender = Sender(srv.endpoint, keys)
    try:
        seq = 0
        # Alone, then after waits longer than the server's receive timeout (its
        # idle loop), then a burst that queues up while the server is busy.
        for pause in (0.0, 0.12, 0.3):
            time.sleep(pause)
            seq += 1
            assert sender.send(_release(seq))
            wait_for(lambda n=seq: len(got) == n, f"message {seq}", 10)
        for _ in range(500):
            seq += 1
            assert sender.send(_release(seq))
        wait_for(lambda n=seq: len(got) == n, "the burst", 30)
        time.sleep(0.1)  # nothing more arrives: no message handled twice
        assert [m.env.seq for m in got] == list(range(1, seq + 1))
        assert srv.received == seq
    finally:
        sender.close()
        srv.close()


def test_an_idle_server_stops_when_closed() -> None:
    before = set(threading.enumerate())
    srv = FanoutServer("tcp://127.0.0.1:0", None).start()
    threads = [t for t in threading.enumerate()
               if t not in before and t.name == "fanout-server"]
    assert len(threads) == 1
    time.sleep(0.2)  # several receive timeouts with nothing to receive
    srv.close()
    # close() joins the thread (bounded); a receive that never timed out would
    # leave it blocked and alive here.
    assert not threads[0].is_alive()
