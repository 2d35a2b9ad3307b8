"""Every input edge of the engine API, through the public engine API: a real
agent on loopback, the client library over the real ipc socket. Each bad call
raises ``ValueError`` with the message the README promises, nothing is
written, and the agent keeps serving (a valid round trip afterwards). Item 8
(re-registration with larger buffers) is proved on the same path.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from node_agent.backend.slots import validate_slot_mapping
from node_agent.client import EngineClient, RankInfo, SharedKVBuffers
from node_agent.coordinator.inputs import prepare_lookup, prepare_store
from node_agent.engine_api import protocol
from tests.agent.harness import (
    LAYOUT,
    NUM_SLOTS,
    TPB,
    agent_mapping,
    cfg_of,
    running_agent,
    wait_http,
    wait_stored,
)

pytestmark = pytest.mark.timeout(90)
BIG = 2**63 + 5


def _fill(bufs: SharedKVBuffers, slots: np.ndarray, seed: int) -> None:
    for group in bufs.tensors:
        for layer, t in enumerate(group):
            vals = torch.arange(len(slots) * t[0].numel(), dtype=torch.float32).reshape(
                len(slots), *t.shape[1:])
            t[torch.as_tensor(slots)] = ((vals + 1000 * seed + 10 * layer) % 2000).to(t.dtype)


def _read(bufs: SharedKVBuffers, slots: np.ndarray) -> list[torch.Tensor]:
    return [t[torch.as_tensor(slots)].clone() for group in bufs.tensors for t in group]


async def _raises(fn: Callable[[], Any], pattern: str) -> str:
    with pytest.raises(ValueError, match=pattern) as err:
        await asyncio.to_thread(fn)
    return str(err.value)


async def test_every_input_edge_is_refused_with_the_promised_error(work: Path) -> None:
    cfg = cfg_of(agent_mapping(work, "solo"))
    small = SharedKVBuffers.for_layout(LAYOUT, 64)
    bufs = SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS)
    async with running_agent(cfg) as ra:
        client = EngineClient(cfg.engine_socket, RankInfo(replica="solo-0"), timeout=5)
        try:
            # register with a missing layout key: a ValueError naming it.
            raw = protocol.layout_to_wire(LAYOUT)
            del raw["headSize"]
            await _raises(lambda: client.register_kv_buffers(raw, small.handles),
                          r"layout key 'headSize' is missing")
            await asyncio.to_thread(client.register_kv_buffers, LAYOUT, small.handles)
            await wait_http(ra, "/readyz", 200, 10)
            tokens = np.arange(32, dtype=np.int64)
            # Item 8: the engine restarts with 256 slots instead of 64.
            await _raises(lambda: client.store_kv("x", tokens, np.arange(200, 232)),
                          r"outside the registered buffers' 64 slots")
            await asyncio.to_thread(client.register_kv_buffers, LAYOUT, bufs.handles)

            # 2-D kv_indices are never flattened into a matching count.
            await _raises(lambda: client.store_kv("a", tokens, np.arange(32).reshape(16, 2)),
                          r"^store_kv: token_ids has 32 entries but kv_indices has 16 entries$")
            await _raises(lambda: client.store_kv("a", tokens.reshape(16, 2),
                                                  np.arange(32).reshape(16, 2)),
                          r"token_ids has shape \(16, 2\); it must be 1-D")
            # bools inside Python int lists are refused, not taken as 1.
            ids = tokens.tolist()
            await _raises(lambda: client.store_kv("a", [ids[0], True, *ids[2:]], tokens),
                          r"store_kv: token_ids has dtype bool")
            await _raises(lambda: client.store_kv("a", tokens, [0, False, *range(2, 32)]),
                          r"store_kv: kv_indices has dtype bool")
            await _raises(lambda: client.lookup("a", [ids[0], True, *ids[2:]]),
                          r"lookup: token_ids has dtype bool")
            # A uint64 slot of 2**63 + 5 is named with its true value.
            msg = await _raises(lambda: client.store_kv(
                "a", tokens, np.array([BIG, *range(1, 32)], dtype=np.uint64)),
                r"store_kv: kv_indices")
            assert str(BIG) in msg and "-" not in msg.split(str(BIG))[0][-3:]
            # A malformed token_mask: floats, holes, an unaligned start, 2-D.
            await _raises(lambda: client.lookup("a", tokens, np.ones(32) * 0.5),
                          r"lookup: token_mask has dtype float64")
            holes = np.ones(32, bool)
            holes[8:12] = False
            await _raises(lambda: client.lookup("a", tokens, holes),
                          r"lookup: token_mask is True at 28 tokens between 0 and 32, not one "
                          r"contiguous span")
            unaligned = np.zeros(32, bool)
            unaligned[TPB + 1:] = True
            await _raises(lambda: client.lookup("a", tokens, unaligned),
                          rf"lookup: token_mask starts at token {TPB + 1}, not a multiple of "
                          rf"tokens_per_block={TPB}")
            await _raises(lambda: client.lookup("a", tokens, np.ones((16, 2), bool)),
                          r"lookup: token_mask has shape \(16, 2\)")
            await _raises(lambda: client.lookup("a", tokens, np.ones(31, bool)),
                          r"token_mask has shape \(31,\) but token_ids has 32 entries")

            # Nothing was written; the agent still serves a valid round trip into
            # slots past the old 64-slot limit (item 8).
            assert await asyncio.to_thread(client.lookup, "probe", tokens) == 0
            await asyncio.to_thread(client.release, "probe")
            src = np.arange(200, 232)
            _fill(bufs, src, seed=3)
            want = _read(bufs, src)
            assert await asyncio.to_thread(client.store_kv, "b", tokens, src) >= 0
            await wait_stored(client, "b")
            mask = np.zeros(32, bool)
            mask[TPB:] = True
            assert await asyncio.to_thread(client.lookup, "c", tokens, mask) == 32 - TPB
            dst = np.arange(100, 100 + 32 - TPB)
            assert await asyncio.to_thread(client.retrieve, "c", dst) == 32 - TPB
            got = _read(bufs, dst)
            assert all(bool((w[TPB:] == g).all()) for w, g in zip(want, got, strict=True))
        finally:
            client.close()
            small.close()
            bufs.close()


@pytest.mark.parametrize("value", [
    np.array([BIG, 1, 2, 3], dtype=np.uint64),
    torch.tensor([BIG, 1, 2, 3], dtype=torch.uint64),
])
def test_connector_names_a_huge_unsigned_slot_with_its_true_value(value: Any) -> None:
    with pytest.raises(ValueError, match=rf"holds slot {BIG} at index 0, outside"):
        validate_slot_mapping(value, 4, NUM_SLOTS, what="store_kv: kv_indices")
    with pytest.raises(ValueError, match=rf"store_kv: kv_indices holds slot {BIG}"):
        prepare_store(np.arange(4), value, 4, NUM_SLOTS)


def test_connector_inputs_refuse_bools_in_int_lists_and_2d_arrays() -> None:
    with pytest.raises(ValueError, match="store_kv: token_ids has dtype bool"):
        prepare_store([0, True, 2, 3], np.arange(4), 4, NUM_SLOTS)
    with pytest.raises(ValueError, match=r"^store_kv: token_ids has 8 entries but kv_indices "
                                         r"has 4 entries$"):
        prepare_store(np.arange(8), np.arange(8).reshape(4, 2), 4, NUM_SLOTS)


def test_unreadable_inputs_are_value_errors_before_any_decision() -> None:
    meta = torch.zeros(8, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="store_kv: the inputs cannot be read"):
        prepare_store(np.arange(8), meta, 4, NUM_SLOTS)
    with pytest.raises(ValueError, match="lookup: token_mask has dtype object"):
        prepare_lookup(np.arange(8), object(), 4)
