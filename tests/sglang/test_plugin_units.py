"""Settings, KV pool reading, and the connector's contract details that need no
agent group: SGLang's KV pools (attribute names and shapes from
sglang/srt/mem_cache/memory_pool.py) are built here from CPU tensors."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from node_agent.client import EngineClient, RankInfo
from node_agent.integrations.sglang.connector import AgentKVConnector, agent_rid
from node_agent.integrations.sglang.kv_pool import layout_from_kv_pool
from node_agent.integrations.sglang.settings import DEFAULT_SOCKET, PluginSettings
from node_agent.vocab.layout import KVDtype, KVLayout
from tests.sglang.stage import Handle
from tests.support.clock import ManualClock


def test_settings_defaults_and_errors_name_variable_value_and_fix() -> None:
    s = PluginSettings.from_env({})
    assert (s.socket, s.replica, s.timeout) == (DEFAULT_SOCKET, None, 15.0)
    assert s.replica_for(1) == "sglang"
    with pytest.raises(ValueError, match="FLEXKV_AGENT_REPLICA is not set but SGLang runs 2"):
        s.replica_for(2)
    assert PluginSettings.from_env({"FLEXKV_AGENT_REPLICA": "r7"}).replica_for(4) == "r7"
    with pytest.raises(ValueError, match=r"FLEXKV_AGENT_TIMEOUT='soon' is not a number"):
        PluginSettings.from_env({"FLEXKV_AGENT_TIMEOUT": "soon"})
    with pytest.raises(ValueError, match=r"FLEXKV_AGENT_RETRY_SECONDS='-1' must be .* > 0"):
        PluginSettings.from_env({"FLEXKV_AGENT_RETRY_SECONDS": "-1"})


def test_mha_and_mla_pools_become_layer_slot_head_layouts() -> None:
    k = [torch.zeros(36, 4, 16, dtype=torch.bfloat16) for _ in range(3)]
    v = [torch.zeros(36, 4, 16, dtype=torch.bfloat16) for _ in range(3)]
    layout, bufs = layout_from_kv_pool(SimpleNamespace(k_buffer=k, v_buffer=v), page_size=4)
    assert layout == KVLayout(num_layers=3, num_kv_heads=4, head_size=16, kv_dim=2,
                              dtype=KVDtype.BFLOAT16, tokens_per_block=4)
    assert bufs[0][0] is k[0] and bufs[1][2] is v[2]
    kv = [torch.zeros(36, 1, 576, dtype=torch.float16) for _ in range(2)]
    layout, bufs = layout_from_kv_pool(SimpleNamespace(kv_buffer=kv), page_size=4)
    assert (layout.kv_dim, layout.num_kv_heads, layout.head_size) == (1, 1, 576)
    assert len(bufs) == 1


@pytest.mark.parametrize(("pool", "fragment"), [
    (SimpleNamespace(), "neither kv_buffer (MLA) nor k_buffer/v_buffer"),
    (SimpleNamespace(kv_buffer=[torch.zeros(2, 4, 1, 8, 2)]), "one 3-D tensor per layer"),
    (SimpleNamespace(k_buffer=[torch.zeros(8, 2, 4)], v_buffer=[torch.zeros(8, 2, 5)]),
     "KV pool layers differ"),
    (SimpleNamespace(kv_buffer=[torch.zeros(8, 1, 4, dtype=torch.uint8)]),
     "--kv-cache-dtype auto"),
])
def test_unsupported_pools_are_refused_with_the_fix(pool: object, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        layout_from_kv_pool(pool, page_size=4)


def test_agent_rid_pairs_stages_by_request_and_attempt() -> None:
    assert agent_rid(SimpleNamespace(rid="abc", attempt_id=2)) == "abc:2"




def test_without_an_agent_every_call_degrades_and_the_length_check_still_raises(
        tmp_path: Path) -> None:
    """SGLang keeps serving from its radix cache: misses, -1, 0, no waits (the
    client finds no socket file); the contract's length check still applies."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_size=4, dtype=KVDtype.FLOAT32,
                      tokens_per_block=4)
    client = EngineClient(tmp_path / "none.sock", RankInfo(replica="r"), timeout=5)
    clock = ManualClock()
    conn = AgentKVConnector(client, layout, [[{"kind": "shm"}], [{"kind": "shm"}]],
                            page_size=4, retry_seconds=5, clock=clock)
    handle = Handle("q", 0)
    assert conn.connect() is False and conn.connected is False
    assert conn.lookup_kv(list(range(8)), None, handle) == (-1, 0)
    assert conn.retrieve_kv(handle, torch.arange(8)) == 0
    assert conn.store_kv(handle, list(range(8)), torch.arange(8)) == -1
    assert conn.check_completed_stores() == []
    conn.release_pending(handle)
    with pytest.raises(ValueError) as err:
        conn.store_kv(handle, list(range(8)), torch.arange(7))
    assert str(err.value) == "store_kv: token_ids has 8 entries but kv_indices has 7 entries"
    with pytest.raises(ValueError, match="page_size 8 differs from the layout's"):
        AgentKVConnector(client, layout, [], page_size=8)
    conn.shutdown()
