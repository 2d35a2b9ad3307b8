"""agent.yaml parsing, environment overrides and validation errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from node_agent.config import ConfigError, config_from_mapping, load_config, parse_quantity

CONTRACT_EXAMPLE = """
pool: my-pool
namespace: default
backend: embedded
tokensPerBlock: 16
cacheEpoch: 0
tiers:
  cpu:
    size: 8Gi
    pinned: true
  ssd:
    size: 100Gi
    paths: [/var/lib/flexkv/ssd]
eviction:
  policy: lru
  highWatermark: 0.95
  lowWatermark: 0.85
ports:
  http: 8080
  fanout: 5557
engineSocket: /var/run/flexkv/engine.sock
timeouts:
  engineCallSeconds: 10
  fanoutWaitSeconds: 5
  unlaunchedMatchSeconds: 30
heartbeat:
  leaseDurationSeconds: 15
  renewDeadlineSeconds: 10
  retryPeriodSeconds: 2
curveKeyDir: /etc/flexkv/curve
expectedRanks: 1
"""


def test_contract_example_parses(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(CONTRACT_EXAMPLE)
    cfg = load_config(path, env={})
    assert cfg.pool == "my-pool"
    assert cfg.tiers.cpu.size == 8 * 2**30
    assert cfg.tiers.ssd is not None and cfg.tiers.ssd.size == 100 * 2**30
    assert cfg.tiers.ssd.paths == ("/var/lib/flexkv/ssd",)
    assert cfg.heartbeat.retry_period_seconds == 2.0
    assert cfg.engine_endpoint == "ipc:///var/run/flexkv/engine.sock"


def test_environment_overrides_leaves(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(CONTRACT_EXAMPLE)
    env = {"FLEXKV_PORTS_HTTP": "9090", "FLEXKV_TIERS_CPU_SIZE": "1.5Gi",
           "FLEXKV_TIMEOUTS_ENGINE_CALL_SECONDS": "3",
           "FLEXKV_TIMEOUTS_FANOUT_WAIT_SECONDS": "1.5", "FLEXKV_NODE_NAME": "node-b",
           "FLEXKV_CURVE_PUBLIC_KEY": "not configuration", "FLEXKV_TIERS_SSD_PATHS": "[/a, /b]"}
    cfg = load_config(path, env=env)
    assert cfg.ports.http == 9090
    assert cfg.tiers.cpu.size == 3 * 2**29
    assert cfg.timeouts.engine_call_seconds == 3.0
    assert cfg.node_name == "node-b"
    assert cfg.tiers.ssd is not None and cfg.tiers.ssd.paths == ("/a", "/b")


@pytest.mark.parametrize(("text", "value"), [
    ("8Gi", 8 * 2**30), ("512Mi", 512 * 2**20), ("1G", 10**9), ("1e9", 10**9),
    ("100", 100), (4096, 4096), ("1.5Ki", 1536),
])
def test_quantities(text: object, value: int) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize(("data", "fragment"), [
    ({"tiers": {"cpu": {"size": "8Gx"}}}, "tiers.cpu.size: '8Gx' has unknown suffix 'Gx'"),
    ({"tiers": {"cpu": {"size": "0.5"}}}, "tiers.cpu.size: '0.5' is not a whole number"),
    ({"tiers": {"cpu": {"size": -1}}}, "tiers.cpu.size: -1 is negative"),
    ({"tiers": {"cpu": {"sizes": 1}}}, "tiers.cpu.sizes: unknown key; allowed keys under "
                                       "tiers.cpu are copyLanes, pinned, size"),
    ({"tiers": {"cpu": {"copyLanes": 0}}},
     "tiers.cpu.copyLanes: 0 is out of range; use a value between 1 and 64"),
    ({"tiers": {"cpu": {"copyLanes": "all"}}}, "tiers.cpu.copyLanes: 'all' is not an integer"),
    ({"pools": "x"}, "pools: unknown key"),
    ({"backend": "redis"}, "backend: 'redis' is not allowed; use one of embedded, flexkv"),
    ({"ports": {"http": "eighty"}}, "ports.http: 'eighty' is not an integer"),
    ({"ports": {"http": 70000}}, "ports.http: 70000 is out of range; use a value between 0 and"),
    ({"heartbeat": {"retryPeriodSeconds": 20}}, "leaseDurationSeconds > renewDeadlineSeconds"),
    ({"eviction": {"lowWatermark": 0.99}}, "eviction.lowWatermark: 0.99 is not below"),
    ({"engineSocket": "/x" * 60}, "Unix socket paths are limited to 107"),
    ({"tiers": {"ssd": {"paths": "/one"}}}, "tiers.ssd.paths: '/one' is not a list of paths"),
    ({"tiers": []}, "tiers: [] is not a mapping"),
    ({"timeouts": {"engineCallSeconds": 0}}, "timeouts.engineCallSeconds: 0 is out of range"),
    ({"timeouts": {"engineCallSeconds": 4, "fanoutWaitSeconds": 5}},
     "timeouts.fanoutWaitSeconds: 5 is not below timeouts.engineCallSeconds 4; a follower's "
     "wait must fit inside the engine call: use about half"),
    ({"timeouts": {"engineCallSeconds": 5, "fanoutWaitSeconds": 5}},
     "timeouts.fanoutWaitSeconds: 5 is not below timeouts.engineCallSeconds 5"),
    ({"timeouts": {"engineCallSeconds": 0.04, "fanoutWaitSeconds": 0.01}},
     "timeouts.engineCallSeconds 0.04 leaves no time after the"),
    ({"maxStages": 2, "tierShares": 3},
     "tierShares: 3 is above maxStages 2; the tier sizes are split into one share per "
     "backend and the agent serves at most maxStages of them: lower tierShares, or raise "
     "maxStages to at least 3"),
    ({"maxStages": 4, "tierShares": 0}, "tierShares: 0 is out of range; use a value between 1"),
])
def test_invalid_values_name_key_value_and_fix(data: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_mapping(data)
    assert fragment in str(err.value)


def test_engine_socket_leaves_room_for_the_tier_socket_beside_it() -> None:
    """The tier socket is the engine socket's path plus '.tier', and both must fit a
    Unix socket path (107 bytes): 102 bytes are accepted, 103 refused."""
    ok = "/" + "s" * 101
    assert len(ok) == 102
    assert config_from_mapping({"engineSocket": ok}).engine_socket == ok
    long = ok + "x"
    with pytest.raises(ConfigError) as err:
        config_from_mapping({"engineSocket": long})
    msg = str(err.value)
    assert f"engineSocket: {long!r} is 103 bytes" in msg
    assert "the tier socket beside it adds '.tier', so it may have at most 102" in msg
    assert "use a shorter path" in msg


def test_copy_lanes_reach_every_stage_backend() -> None:
    from node_agent.assembly import backend_config
    from node_agent.vocab.layout import KVLayout

    layout = KVLayout(num_layers=2, num_kv_heads=1, head_size=8)
    assert backend_config(config_from_mapping({}), layout).copy_lanes == 2
    wide = config_from_mapping({"tiers": {"cpu": {"copyLanes": 6}}})
    assert backend_config(wide, layout).copy_lanes == 6


def test_tier_shares_default_to_max_stages() -> None:
    assert config_from_mapping({"maxStages": 4}).shares == 4
    assert config_from_mapping({"maxStages": 4, "tierShares": 1}).shares == 1
    assert config_from_mapping({}).shares == 1


def test_bad_environment_value_is_rejected_with_the_key() -> None:
    with pytest.raises(ConfigError, match="tokensPerBlock: 'sixteen' is not an integer"):
        load_config(None, env={"FLEXKV_TOKENS_PER_BLOCK": "sixteen"})


def test_unreadable_and_non_mapping_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(tmp_path / "missing.yaml", env={})
    path = tmp_path / "list.yaml"
    path.write_text(yaml.safe_dump([1, 2]))
    with pytest.raises(ConfigError, match="top level is list, not a mapping"):
        load_config(path, env={})


def test_downward_api_variables_fill_agent_local_keys() -> None:
    env = {"NODE_NAME": "node-7", "POD_NAME": "agent-abc", "POD_IP": "10.1.2.3"}
    cfg = load_config(None, env=env)
    assert (cfg.node_name, cfg.pod_name, cfg.advertise_address) == (
        "node-7", "agent-abc", "10.1.2.3")
    assert cfg.holder_identity == "agent-abc"
    pinned = load_config(None, env={**env, "FLEXKV_NODE_NAME": "override"})
    assert pinned.node_name == "override"
