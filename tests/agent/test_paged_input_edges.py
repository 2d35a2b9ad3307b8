"""vLLM's paged layout (``layer_block_head_token_kv``) through the public engine API:
a real agent process (``python -m node_agent run``), the client library over the
real ipc socket, buffers in shared memory. ``store_kv`` and ``retrieve`` with
slots that are not whole, aligned pages raise ``ValueError`` naming the page
size, the position and the slot; nothing is decided, stored or loaded, and the
agent keeps serving a whole-page round trip, compared byte for byte.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from node_agent.client import EngineClient, RankInfo, SharedKVBuffers
from node_agent.vocab.layout import KVDtype, KVLayout, LayoutName
from tests.agent.harness import (
    TPB,
    agent_process,
)
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]
LAYERS, HEADS, HEAD = 2, 2, 8
NUM_BLOCKS = 32
LAYOUT = KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_size=HEAD, kv_dim=2,
                  dtype=KVDtype.FLOAT16, tokens_per_block=TPB,
                  name=LayoutName.LAYER_BLOCK_HEAD_TOKEN_KV)
TOKENS = np.arange(500, 500 + 3 * TPB, dtype=np.int64)
SENTINEL = -7.0


def pages(blocks: list[int]) -> np.ndarray:
    """The slots of whole pages ``blocks``, in order (slot = block * TPB + offset)."""
    b = np.asarray(blocks, dtype=np.int64)
    return (b[:, None] * TPB + np.arange(TPB)).reshape(-1)


def page_bytes(bufs: SharedKVBuffers, slots: np.ndarray) -> list[torch.Tensor]:
    blocks = torch.as_tensor(slots[::TPB] // TPB)
    return [layer[blocks].clone() for layer in bufs.tensors[0]]


def connector(client: EngineClient) -> dict[str, Any]:
    [stage] = client.status()["stages"]
    result: dict[str, Any] = stage["connector"]
    return result


def test_slots_that_are_not_whole_pages_are_refused_and_nothing_is_stored_or_loaded(
        work: Path) -> None:
    shape = (NUM_BLOCKS, HEADS, TPB, 2 * HEAD)
    bufs = SharedKVBuffers([[shape] * LAYERS], torch.float16)
    with agent_process(work) as agent:
        client = EngineClient(agent.socket, RankInfo(replica="paged-0"), timeout=10)
        try:
            client.register_kv_buffers(LAYOUT, bufs.handles)
            gen = torch.Generator().manual_seed(5)
            for layer in bufs.tensors[0]:
                layer.copy_(torch.randn(shape, generator=gen).to(torch.float16))
            src = pages([1, 2, 3])

            # store_kv: refused before any decision.
            shifted = src + 1
            swapped = src.copy()
            swapped[[5, 6]] = swapped[[6, 5]]
            with pytest.raises(ValueError, match=r"^store_kv: kv_indices does not form whole, "
                               r"aligned pages of page size 4: position 0 starts a page with "
                               r"slot 5, not a multiple of the page size 4"):
                client.store_kv("bad", TOKENS, shifted)
            with pytest.raises(ValueError, match=r"store_kv: kv_indices does not form whole, "
                               r"aligned pages of page size 4: position 5 holds slot 10 but "
                               r"page 2 continues with slot 9"):
                client.store_kv("bad", TOKENS, swapped)
            state = connector(client)
            assert state["counters"]["stores"] == 0  # no call reached the group
            assert state["inflightStores"] == 0
            assert client.lookup("probe", TOKENS) == 0  # nothing was stored
            client.release("probe")

            # A whole-page store is taken, then retrieve refuses slots that are not pages.
            assert client.store_kv("good", TOKENS, src) >= 0
            wait_for(lambda: "good" in client.wait_completed(1.0), "the store completed", 30)
            client.release("good")
            dst = pages([20, 21, 22])
            bad_dst = dst.copy()
            bad_dst[[9, 10]] = bad_dst[[10, 9]]
            for layer in bufs.tensors[0]:
                layer[torch.as_tensor([20, 21, 22])] = SENTINEL
            assert client.lookup("load", TOKENS) == len(TOKENS)
            with pytest.raises(ValueError, match=r"^retrieve: slot_mapping does not form whole, "
                               r"aligned pages of page size 4: position 9 holds slot 90 but "
                               r"page 22 continues with slot 89"):
                client.retrieve("load", bad_dst)
            assert all(bool((b == SENTINEL).all()) for b in page_bytes(bufs, dst))  # untouched
            state = connector(client)
            assert state["counters"]["retrieves"] == 1
            assert state["openLookups"] == 0  # the refused load ended: its match was cancelled

            # The agent keeps serving: a whole-page load, byte for byte.
            assert client.lookup("load", TOKENS) == len(TOKENS)
            assert client.retrieve("load", dst) == len(TOKENS)
            assert all(a.equal(b) for a, b in zip(page_bytes(bufs, src), page_bytes(bufs, dst),
                                                  strict=True))
            client.release("load")
        finally:
            client.close()
            bufs.close()
