"""Subscribe to KV-event streams and print every event, decoded with vLLM's own classes.

Run under .venv-vllm's python: ``events_listener.py NAME=ENDPOINT ...``. Each event
becomes one JSON line ``@@ {"source", "seq", "type", "medium", "block_hashes",
"parent_block_hash", "token_ids"}`` (hashes as strings: ints in decimal, bytes in
hex). Runs until stdin closes.
"""

from __future__ import annotations

import json
import sys
import threading

import msgspec
import zmq

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


def text(h: object) -> str | None:
    if h is None:
        return None
    return h.hex() if isinstance(h, bytes) else str(h)


def main() -> None:
    ctx = zmq.Context()
    poller = zmq.Poller()
    names: dict[zmq.Socket[bytes], str] = {}
    for arg in sys.argv[1:]:
        name, endpoint = arg.split("=", 1)
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        poller.register(sock, zmq.POLLIN)
        names[sock] = name
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    print("@@ " + json.dumps({"ready": True}), flush=True)
    while not done.is_set():
        for sock, _ in poller.poll(100):
            _topic, seq, payload = sock.recv_multipart()
            batch = decoder.decode(payload)
            for ev in batch.events:
                out: dict[str, object] = {"source": names[sock],
                                          "seq": int.from_bytes(seq, "big"),
                                          "type": type(ev).__name__}
                if isinstance(ev, BlockStored):
                    out.update(medium=ev.medium, block_hashes=[text(h) for h in ev.block_hashes],
                               parent_block_hash=text(ev.parent_block_hash),
                               token_ids=list(ev.token_ids), block_size=ev.block_size)
                elif isinstance(ev, BlockRemoved):
                    out.update(medium=ev.medium, block_hashes=[text(h) for h in ev.block_hashes])
                else:
                    assert isinstance(ev, AllBlocksCleared)
                print("@@ " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
