"""KV-event streams as the vLLM tests read them: ``events_listener.py`` under .venv-vllm
subscribed to vLLM's and the agent's publishers, and the block chains a stream
stored for a prompt."""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path
from typing import Any

from tests.vllm.harness import BLOCK, PREFIX, VLLM_PYTHON, engine_env

LISTENER = Path(__file__).with_name("events_listener.py")


class Listener:
    """``events_listener.py`` under .venv-vllm; :attr:`events` grows as lines arrive."""

    def __init__(self, log: Path, **endpoints: str) -> None:
        self._log = log.open("a")
        self.proc = subprocess.Popen(
            [str(VLLM_PYTHON), str(LISTENER), *(f"{k}={v}" for k, v in endpoints.items())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            env=engine_env())
        self.events: list[dict[str, Any]] = []
        self.ready = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if not line.startswith(PREFIX):
                continue
            msg = json.loads(line[len(PREFIX):])
            if msg.get("ready"):
                self.ready.set()
                continue
            with self._lock:
                self.events.append(msg)

    def of(self, source: str) -> list[dict[str, Any]]:
        with self._lock:
            return [e for e in self.events if e["source"] == source]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._log.close()


def stored_blocks(events: list[dict[str, Any]]) -> dict[str, tuple[int, ...]]:
    """Block hash -> its tokens, over every BlockStored event of one stream."""
    out: dict[str, tuple[int, ...]] = {}
    for e in events:
        if e["type"] != "BlockStored":
            continue
        bs = e["block_size"]
        for i, h in enumerate(e["block_hashes"]):
            out[h] = tuple(e["token_ids"][i * bs:(i + 1) * bs])
    return out


def chain_of(events: list[dict[str, Any]], tokens: list[int]) -> list[str]:
    """The hashes one stream stored for the blocks of ``tokens``, in prompt order,
    following parent links from the block with no parent."""
    by_parent: dict[str | None, list[tuple[str, tuple[int, ...]]]] = {}
    for e in events:
        if e["type"] != "BlockStored":
            continue
        bs, parent = e["block_size"], e["parent_block_hash"]
        for i, h in enumerate(e["block_hashes"]):
            by_parent.setdefault(parent, []).append((h, tuple(e["token_ids"][i * bs:(i + 1) * bs])))
            parent = h
    out: list[str] = []
    parent = None
    for i in range(len(tokens) // BLOCK):
        want = tuple(tokens[i * BLOCK:(i + 1) * BLOCK])
        nxt = [h for h, t in by_parent.get(parent, []) if t == want]
        if not nxt:
            break
        parent = nxt[0]
        out.append(parent)
    return out
