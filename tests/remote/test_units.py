"""Key derivation, write-behind bounds, bounded calls and tiers.remote config errors
(no master needed)."""

from __future__ import annotations

import dataclasses
import sys
import threading

import pytest
import yaml

from node_agent.backend.remote.calls import BoundedCaller, RemoteBusy, RemoteTimeout
from node_agent.backend.remote.keys import DIGEST_MASK, KeySpace, block_digest
from node_agent.backend.remote.writer import WriteBehind
from node_agent.config import ConfigError, config_from_mapping, load_config
from node_agent.metrics import AgentMetrics
from node_agent.vocab.layout import KVDtype, KVLayout, LayoutName

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_size=8, dtype=KVDtype.FLOAT16,
                  tokens_per_block=4)


def test_every_incompatibility_changes_the_key_and_nothing_else_does() -> None:
    base = KeySpace(LAYOUT, 0, 2, "ns", "pool", 0)
    variants = [
        dataclasses.replace(base, layout=dataclasses.replace(LAYOUT, num_layers=5)),
        dataclasses.replace(base, layout=dataclasses.replace(LAYOUT, num_kv_heads=4)),
        dataclasses.replace(base, layout=dataclasses.replace(LAYOUT, head_size=16)),
        dataclasses.replace(base, layout=dataclasses.replace(LAYOUT, dtype=KVDtype.BFLOAT16)),
        dataclasses.replace(base, layout=dataclasses.replace(LAYOUT, tokens_per_block=8)),
        dataclasses.replace(base, layout=dataclasses.replace(
            LAYOUT, name=LayoutName.LAYER_KV_SLOT_HEAD)),
        dataclasses.replace(base, layout=dataclasses.replace(LAYOUT, tp_size=2)),
        dataclasses.replace(base, pp_rank=1),
        dataclasses.replace(base, pp_size=3),
        dataclasses.replace(base, namespace="other"),
        dataclasses.replace(base, pool="other"),
        dataclasses.replace(base, cache_epoch=1),
        dataclasses.replace(base, hash_algorithm="blake2b"),
    ]
    keys = {v.keys([7])[0] for v in variants}
    assert len(keys) == len(variants)
    assert base.keys([7])[0] not in keys
    assert KeySpace(LAYOUT, 0, 2, "ns", "pool", 0).keys([7, 8]) == base.keys([7, 8])
    assert base.keys([7]) != base.keys([8])


def test_keys_carry_the_low_128_bits_of_the_block_hash() -> None:
    wide = (1 << 256) - 1
    assert block_digest(wide) == DIGEST_MASK
    assert block_digest(5) == 5
    assert KeySpace(LAYOUT).keys([block_digest(wide)])[0].endswith("f" * 32)
    # Hashes equal in their low 63 (or 64) bits are different keys.
    a, b = 1 << 70 | 5, 1 << 64 | 5
    ka, kb = KeySpace(LAYOUT).keys([block_digest(a), block_digest(b)])
    assert ka != kb and ka.endswith(f"{a:032x}")


def test_key_space_refuses_a_rank_outside_the_group() -> None:
    with pytest.raises(ValueError, match="pp_rank=2 is outside"):
        KeySpace(LAYOUT, pp_rank=2, pp_size=2)


def test_write_behind_is_bounded_counts_drops_and_never_blocks() -> None:
    metrics = AgentMetrics()
    release = threading.Event()
    written: list[list[tuple[int, int, int]]] = []

    def flush(batch: list[tuple[int, int, int]]) -> None:
        release.wait(30)
        written.append(batch)

    w = WriteBehind(capacity=4, batch_blocks=2, flush=flush, metrics=metrics)
    try:
        assert w.offer([(1, 1, 0)]) == 1
        # The worker holds the first block in its (blocked) flush; 4 more fit.
        assert not w.drain(0.05)
        taken = w.offer([(i, i, 0) for i in range(2, 10)])
        assert taken == 4 and w.depth == 4
        get = metrics.registry.get_sample_value
        assert get("flexkv_agent_remote_dropped_blocks_total", {"reason": "queue_full"}) == 4
        assert get("flexkv_agent_remote_queue_depth") == 4
        release.set()
        assert w.drain(30)
        assert sorted(b[0] for batch in written for b in batch) == [1, 2, 3, 4, 5]
        assert all(len(batch) <= 2 for batch in written)
    finally:
        release.set()
        w.close()


def test_a_bounded_call_times_out_and_the_lane_answers_busy_until_it_returns() -> None:
    lane = BoundedCaller("test")
    gate = threading.Event()
    try:
        with pytest.raises(RemoteTimeout, match=r"no answer within 0\.05 s"):
            lane.call(lambda: gate.wait(30), 0.05, "lookup")
        with pytest.raises(RemoteBusy, match="still running"):
            lane.call(lambda: 1, 1.0, "lookup")
        gate.set()
        deadline = 30.0
        while lane.busy() and deadline > 0:
            threading.Event().wait(0.01)
            deadline -= 0.01
        assert lane.call(lambda: 42, 5.0, "lookup") == 42
    finally:
        gate.set()
        lane.close()


def test_a_second_caller_waits_for_a_call_in_time_instead_of_failing_busy() -> None:
    """Stages of one agent share the pool's lanes: a call arriving while another
    caller's call runs (within its timeout) waits its turn; only a call that
    overran its timeout makes the lane answer busy."""
    lane = BoundedCaller("test")
    started, release = threading.Event(), threading.Event()
    results: dict[str, object] = {}

    def first() -> int:
        started.set()
        assert release.wait(30)
        return 1

    def run(name: str, fn) -> None:  # type: ignore[no-untyped-def]
        try:
            results[name] = lane.call(fn, 30.0, name)
        except Exception as exc:
            results[name] = exc

    t1 = threading.Thread(target=run, args=("put a", first))
    t1.start()
    try:
        assert started.wait(30)
        t2 = threading.Thread(target=run, args=("put b", lambda: 2))
        t2.start()
        t2.join(1.0)  # on a busy lane the second caller fails here at once
        release.set()
        t1.join(30)
        t2.join(30)
        assert results == {"put a": 1, "put b": 2}
    finally:
        release.set()
        lane.close()


class _JoinedClient:
    """What a joined Mooncake client offers the pool when no buffer is registered."""

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_callers_that_join_at_once_share_one_join() -> None:
    """Two stages reaching an unjoined pool at once: the second waits for the first
    join and takes its client (a second join would bind storePort again)."""
    from node_agent.backend.remote.settings import RemoteSettings
    from node_agent.backend.remote.tier import RemotePool

    gate, joining = threading.Event(), threading.Event()
    clients: list[_JoinedClient] = []

    def connector(settings: RemoteSettings) -> _JoinedClient:
        joining.set()
        assert gate.wait(30)
        clients.append(_JoinedClient())
        return clients[-1]

    settings = RemoteSettings(master_address="127.0.0.1:1", metadata_server="P2PHANDSHAKE",
                              local_hostname="127.0.0.1:2", timeout_seconds=30.0)
    pool = RemotePool(settings, connector=connector, prejoin=None)  # type: ignore[arg-type]
    first = threading.Thread(target=pool.start, kwargs={"timeout": 30.0})
    first.start()
    try:
        assert joining.wait(30)
        second = threading.Thread(target=pool.start, kwargs={"timeout": 30.0})
        second.start()
        second.join(1.0)
        gate.set()
        first.join(30)
        second.join(30)
        assert len(clients) == 1 and pool.client() is clients[0]
        assert pool.health.up
    finally:
        gate.set()
        pool.close()


REMOTE = {"mooncake": {"masterAddress": "m.ns.svc:50051",
                       "metadataServer": "http://m.ns.svc:8080/metadata"}}


def test_remote_section_parses_with_defaults_and_env_overrides(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = config_from_mapping({"tiers": {"remote": REMOTE}})
    rt = cfg.tiers.remote
    assert rt is not None
    assert (rt.write_policy, rt.queue_blocks, rt.timeout_seconds) == ("store", 1024, 2.0)
    assert rt.mooncake.segment_size == 4 << 30 and rt.mooncake.local_buffer_size == 512 << 20
    assert rt.mooncake.store_port == 17500 and rt.mooncake.protocol == "tcp"
    assert config_from_mapping({"tiers": {"cpu": {"size": "1Gi"}}}).tiers.remote is None
    path = tmp_path / "agent.yaml"
    path.write_text("tiers:\n  remote:\n    mooncake:\n      metadataServer: P2PHANDSHAKE\n")
    env = {"FLEXKV_TIERS_REMOTE_MOONCAKE_MASTER_ADDRESS": "10.0.0.5:50051",
           "FLEXKV_TIERS_REMOTE_WRITE_POLICY": "evict"}
    cfg = load_config(path, env)
    assert cfg.tiers.remote is not None
    assert cfg.tiers.remote.mooncake.master_address == "10.0.0.5:50051"
    assert cfg.tiers.remote.write_policy == "evict"


@pytest.mark.parametrize(("section", "needle"), [
    ({"mooncake": {"metadataServer": "http://m:8080/metadata"}},
     "tiers.remote.mooncake.masterAddress: missing"),
    ({"mooncake": {"masterAddress": "m:50051"}}, "tiers.remote.mooncake.metadataServer: missing"),
    ({**REMOTE, "writePolicy": "always"}, "tiers.remote.writePolicy: 'always' is not allowed"),
    ({**REMOTE, "queueBlocks": 0}, "tiers.remote.queueBlocks: 0 is out of range"),
    ({**REMOTE, "timeoutSeconds": 0}, "tiers.remote.timeoutSeconds: 0 is out of range"),
    ({**REMOTE, "timeoutSeconds": 20}, "tiers.remote.timeoutSeconds: 20 is not below"),
    ({"mooncake": {**REMOTE["mooncake"], "masterAddress": "nohost"}},
     "masterAddress: 'nohost' is not a host:port"),
    ({"mooncake": {**REMOTE["mooncake"], "metadataServer": "m:8080"}},
     "metadataServer: 'm:8080' is not an http(s) URL"),
    ({"mooncake": {**REMOTE["mooncake"], "protocol": "udp"}}, "protocol: 'udp' is not allowed"),
    ({"mooncake": {**REMOTE["mooncake"], "deviceName": "mlx5_0"}}, "need protocol rdma"),
    ({"mooncake": {**REMOTE["mooncake"], "segmentSize": "1Ki"}}, "segmentSize: 1024 bytes"),
    ({"mooncake": {**REMOTE["mooncake"], "localBufferSize": "12Q"}}, "unknown suffix 'Q'"),
    ({"mooncake": {**REMOTE["mooncake"], "segmentSize": "8Mi"}},
     "segmentSize: 8388608 bytes is below 16Mi (16777216), the smallest segment Mooncake"),
    ({"mooncake": {**REMOTE["mooncake"], "localBufferSize": "1Ti"}},
     "localBufferSize: 1099511627776 bytes is above 64Gi"),
    ({"mooncake": {**REMOTE["mooncake"], "storePort": 40000}},
     "storePort: 40000 is not in 1024..32766 or 61000..65534"),
    ({"mooncake": {**REMOTE["mooncake"], "storePort": 65535}}, "storePort: 65535 is out"),
    ({**REMOTE, "size": "1Gi"}, "tiers.remote.size: unknown key"),
])
def test_remote_config_errors_name_key_value_and_fix(section: dict[str, object],
                                                     needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        config_from_mapping({"tiers": {"remote": section}})
    assert needle in str(exc.value)


def test_a_missing_mooncake_is_an_actionable_error_and_the_agent_exits_2(
        tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    from node_agent.__main__ import main
    from node_agent.backend.remote.mooncake_client import MooncakeUnavailable, check_available

    for var in ("MC_LEGACY_RPC_PORT_BINDING", "MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT"):
        monkeypatch.setenv(var, "")  # restored after the test (the agent sets them)
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(MooncakeUnavailable) as exc:
        check_available()
    assert "flexkv-operator[remote]" in str(exc.value) and "libibverbs1" in str(exc.value)
    assert "remove tiers.remote" in str(exc.value)
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump({
        "kubernetes": "off", "engineSocket": str(tmp_path / "e.sock"),
        "tiers": {"cpu": {"size": "1Mi", "pinned": False}, "remote": REMOTE}}))
    assert main(["run", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "the remote tier cannot start" in err and "libibverbs1" in err
