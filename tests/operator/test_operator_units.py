"""Pure pieces of the operator, tested without kopf or an API server."""

from __future__ import annotations

import base64
import datetime
import json
from typing import Any

import pytest
import yaml
from flexkv_operator import agent_pod, children, keys, names
from flexkv_operator.children import PoolIdentity
from flexkv_operator.conditions import Condition, merge_conditions
from flexkv_operator.group_election import Candidate, Published, decide
from flexkv_operator.group_publisher import (
    GroupMember,
    GroupPlan,
    needs_write,
    plan_groups,
    render_status,
)
from flexkv_operator.membership import LeaseTracker, parse_lease
from flexkv_operator.quantity import parse_bytes
from flexkv_operator.sizing import sizing_condition
from flexkv_operator.spec import ConfigInvalid, parse_pool_spec

OWNER = {
    "apiVersion": "flexkv.io/v1alpha1",
    "kind": "KVCachePool",
    "name": "p",
    "uid": "u1",
    "controller": True,
    "blockOwnerDeletion": True,
}
POOL = PoolIdentity("p", "ns", OWNER)


# --- quantities -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1, 1),
        ("8Gi", 8 << 30),
        ("500M", 500_000_000),
        ("1.5Ki", 1536),
        ("1Ti", 1 << 40),
        ("8e9", 8_000_000_000),
        ("8E9", 8_000_000_000),
        ("1.5e3", 1500),
        ("+1Ki", 1024),
        (".5Ki", 512),
        ("2000m", 2),
        ("7Ei", 7 << 60),
    ],
)
def test_quantities_parse_to_bytes(value: object, expected: int) -> None:
    assert parse_bytes(value, "f") == expected


@pytest.mark.parametrize(
    "value",
    [0, -1, "0", "0Gi", "-1Gi", "0.5", "1m", "8GB", "lots", "100000Ei", "1e400", 2**63, True,
     None, 1.5],
)
def test_bad_quantities_name_field_and_value(value: object) -> None:
    with pytest.raises(ValueError) as info:
        parse_bytes(value, "spec.tiers.cpu.size")
    assert str(info.value).startswith("spec.tiers.cpu.size: ")


def test_quantity_error_lists_exactly_the_accepted_suffixes() -> None:
    """Every suffix the message names parses, and every one that parses is named."""
    with pytest.raises(ValueError) as info:
        parse_bytes("8GB", "f")
    listed = str(info.value).split("suffix from ", 1)[1].split(" (e.g.", 1)[0].split(", ")
    assert {"P", "E", "Pi", "Ei"} <= set(listed)
    for suffix in listed:
        assert parse_bytes(f"1{suffix}" if suffix != "m" else "1000m", "f") >= 1
    for suffix in ("Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "k", "M", "G", "T", "P", "E"):
        assert suffix in listed


# --- Z85 and Curve keys -------------------------------------------------------------


def test_z85_matches_the_spec_test_vector() -> None:
    # ZeroMQ RFC 32 (Z85) test vector.
    data = bytes([0x86, 0x4F, 0xD2, 0x6F, 0xB5, 0x59, 0xF7, 0x5B])
    assert keys.z85_encode(data) == "HelloWorld"
    assert keys.z85_decode("HelloWorld") == data


def test_z85_round_trips_and_rejects_bad_input() -> None:
    data = bytes(range(32))
    assert keys.z85_decode(keys.z85_encode(data)) == data
    with pytest.raises(ValueError, match="4-byte"):
        keys.z85_encode(b"abc")
    with pytest.raises(ValueError, match="Z85 character"):
        keys.z85_decode("Hello~orld")


def test_curve_keypair_is_a_matching_x25519_pair() -> None:
    public, secret = keys.curve_keypair()
    assert len(public) == len(secret) == 40
    assert keys.public_from_secret(secret) == public
    assert keys.curve_keypair()[0] != public


# --- spec -----------------------------------------------------------------------------


def test_spec_defaults_from_the_crd() -> None:
    config = parse_pool_spec({"tiers": {"cpu": {"size": "1Gi"}}}, "img:1")
    assert config.backend == "embedded" and config.tokens_per_block == 16
    assert config.cpu_bytes == 1 << 30 and config.ssd_paths == ()
    assert (
        config.timings.lease_duration,
        config.timings.renew_deadline,
        config.timings.retry_period,
    ) == (15, 10, 2)
    assert config.image == "img:1"


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (
            {"tiers": {"cpu": {"size": "1Gi"}}, "leaderElection": {"leaseDurationSeconds": 5}},
            "leaderElection",
        ),
        ({"tiers": {"cpu": {"size": "huge"}}}, "tiers.cpu.size"),
        (
            {"tiers": {"cpu": {"size": "1Gi"}},
             "timeouts": {"engineCallSeconds": 2, "fanoutWaitSeconds": 3}},
            "timeouts",
        ),
        ({"tiers": {}}, "tiers.cpu.size"),
        (
            {"tiers": {"cpu": {"size": 1}}, "agent": {"ports": {"http": 1, "fanout": 1}}},
            "agent.ports",
        ),
        (
            {
                "tiers": {"cpu": {"size": 1}},
                "eviction": {"lowWatermark": 0.99, "highWatermark": 0.5},
            },
            "eviction",
        ),
        (
            {"tiers": {"cpu": {"size": 1}, "ssd": {"size": 1, "paths": ["/a", "/a"]}}},
            "tiers.ssd.paths",
        ),
        ({"tiers": {"cpu": {"size": 1, "pinned": False}}, "backend": "flexkv"}, "tiers.cpu.pinned"),
        ({"tiers": {"cpu": {"size": 1}}, "maxStages": 0}, "maxStages"),
        ({"tiers": {"cpu": {"size": 1}}, "maxStages": True}, "maxStages"),
        ({"tiers": {"cpu": {"size": 1}}, "maxStages": 4, "tierShares": 0}, "tierShares"),
        ({"tiers": {"cpu": {"size": 1}}, "maxStages": 4, "tierShares": "1"}, "tierShares"),
        ({"tiers": {"cpu": {"size": 1, "copyLanes": 0}}}, "tiers.cpu.copyLanes"),
        ({"tiers": {"cpu": {"size": 1, "copyLanes": 65}}}, "tiers.cpu.copyLanes"),
        ({"tiers": {"cpu": {"size": 1, "copyLanes": True}}}, "tiers.cpu.copyLanes"),
        ({"tiers": {"cpu": {"size": 1, "copyLanes": 4}}, "backend": "flexkv"},
         "tiers.cpu.copyLanes"),
        ({"tiers": {"cpu": {"size": 1}}, "kvEvents": {"port": 0}}, "kvEvents.port"),
        ({"tiers": {"cpu": {"size": 1}}, "kvEvents": {"port": 8080}}, "kvEvents.port"),
        ({"tiers": {"cpu": {"size": 1}}, "kvEvents": {"port": 5558, "blockHash": "md5"}},
         "kvEvents.blockHash"),
    ],
)
def test_invalid_specs_name_the_field_and_the_fix(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigInvalid) as info:
        parse_pool_spec(spec, "img:1")
    assert [p.field for p in info.value.problems] == [field]
    assert f"spec.{field}" in str(info.value)


def test_kv_events_are_rendered_only_when_set_and_open_a_named_container_port() -> None:
    plain = _config()
    assert plain.kv_events is None
    doc = yaml.safe_load(children.render_config_map(POOL, plain)["data"]["agent.yaml"])
    assert "kvEvents" not in doc
    assert "kv-events" not in [p["name"] for p in agent_pod.container_ports(plain)]

    on = _config(kvEvents={"port": 5558})
    doc = yaml.safe_load(children.render_config_map(POOL, on)["data"]["agent.yaml"])
    assert doc["kvEvents"] == {"endpoint": "tcp://*:5558", "blockHash": "vllm-sha256",
                               "hashSeed": "vllm-none-hash", "intBlockHashes": True}
    assert {"name": "kv-events", "containerPort": 5558, "protocol": "TCP"} in \
        agent_pod.container_ports(on)
    # Turning events on changes the agents' config hash (they restart with it); a pool
    # without them keeps the hash it had.
    assert children.config_hash(POOL, on) != children.config_hash(POOL, plain)


def test_copy_lanes_with_backend_flexkv_is_refused_naming_the_fix() -> None:
    with pytest.raises(ConfigInvalid) as info:
        parse_pool_spec({"backend": "flexkv", "tiers": {"cpu": {"size": 1, "copyLanes": 4}}},
                        "img:1")
    assert "remove copyLanes or use backend: embedded" in str(info.value)


def test_tier_shares_above_max_stages_is_refused_naming_both_and_the_fix() -> None:
    with pytest.raises(ConfigInvalid) as info:
        parse_pool_spec({"tiers": {"cpu": {"size": 1}}, "maxStages": 2, "tierShares": 3},
                        "img:1")
    assert [p.field for p in info.value.problems] == ["tierShares"]
    assert "spec.tierShares: 3 is above maxStages 2" in str(info.value)
    assert "lower tierShares or raise maxStages to at least 3" in str(info.value)


def test_tier_shares_are_rendered_only_when_set() -> None:
    plain = _config(maxStages=4)
    assert plain.tier_shares is None
    doc = yaml.safe_load(children.render_config_map(POOL, plain)["data"]["agent.yaml"])
    assert "tierShares" not in doc and doc["maxStages"] == 4

    one = _config(maxStages=4, tierShares=1)
    doc = yaml.safe_load(children.render_config_map(POOL, one)["data"]["agent.yaml"])
    assert doc["tierShares"] == 1 and doc["maxStages"] == 4
    # Setting it changes the agents' config hash (they restart with it); a pool
    # without it keeps the hash it had.
    assert children.config_hash(POOL, one) != children.config_hash(POOL, plain)
    assert children.config_hash(POOL, plain) == children.config_hash(
        POOL, _config(maxStages=4))


def test_missing_image_is_a_config_error() -> None:
    with pytest.raises(ConfigInvalid, match="FLEXKV_AGENT_IMAGE"):
        parse_pool_spec({"tiers": {"cpu": {"size": 1}}}, "")


# --- rendering ------------------------------------------------------------------------


def _config(**spec: Any) -> Any:
    return parse_pool_spec({"tiers": {"cpu": {"size": "2Gi"}}, **spec}, "img:1")


def test_agent_yaml_follows_the_contract() -> None:
    cm = children.render_config_map(POOL, _config(cacheEpoch=4))
    doc = yaml.safe_load(cm["data"]["agent.yaml"])
    assert set(doc) == {
        "pool",
        "namespace",
        "backend",
        "tokensPerBlock",
        "cacheEpoch",
        "tiers",
        "eviction",
        "ports",
        "engineSocket",
        "timeouts",
        "heartbeat",
        "curveKeyDir",
        "expectedRanks",
    }
    assert doc["pool"] == "p" and doc["cacheEpoch"] == 4
    assert doc["heartbeat"] == {
        "leaseDurationSeconds": 15,
        "renewDeadlineSeconds": 10,
        "retryPeriodSeconds": 2,
    }
    assert doc["engineSocket"] == "/var/run/flexkv/engine.sock"
    assert doc["curveKeyDir"] == "/etc/flexkv/curve"
    assert cm["metadata"]["name"] == "p-agent-config"
    assert cm["metadata"]["ownerReferences"] == [OWNER]


def test_daemon_set_carries_the_agent_contract() -> None:
    config = _config(
        tiers={"cpu": {"size": "2Gi"}, "ssd": {"size": "10Gi", "paths": ["/mnt/a"]}},
        placement={"nodeSelector": {"gpu": "yes"}, "tolerations": [{"operator": "Exists"}]},
        agent={"resources": {"requests": {"memory": "1Gi"}}},
    )
    ds = children.render_daemon_set(POOL, config, "sa-x")
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] + container["args"] == [
        "flexkv-agent",
        "run",
        "--config",
        "/etc/flexkv/agent.yaml",
    ]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "http": 8080,
        "fanout": 5557,
    }
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert [e["name"] for e in container["env"]] == [
        "NODE_NAME",
        "POD_NAME",
        "POD_UID",
        "POD_IP",
        "POD_NAMESPACE",
    ]
    assert pod["hostIPC"] is True and pod["serviceAccountName"] == "sa-x"
    assert pod["nodeSelector"] == {"gpu": "yes"} and pod["tolerations"] == [{"operator": "Exists"}]
    host_paths = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert host_paths == {"/var/run/flexkv", "/dev/shm/flexkv", "/mnt/a"}
    assert ds["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 1},
    }
    assert names.ANNOTATION_CONFIG_HASH in ds["spec"]["template"]["metadata"]["annotations"]
    assert (
        ds["spec"]["selector"]["matchLabels"].items()
        <= ds["spec"]["template"]["metadata"]["labels"].items()
    )


def test_config_hash_rolls_on_spec_changes_but_not_on_cache_epoch() -> None:
    base = children.config_hash(POOL, _config())
    assert children.config_hash(POOL, _config(cacheEpoch=9)) == base
    assert children.config_hash(POOL, _config(tokensPerBlock=32)) != base
    # The ConfigMap itself does change, so agents see the new epoch in place.
    assert children.render_config_map(POOL, _config(cacheEpoch=9)) != children.render_config_map(
        POOL, _config()
    )


def test_services_and_pdb() -> None:
    config = _config(monitoring={"serviceLabels": {"release": "prom"}})
    headless = children.render_headless_service(POOL, config)
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"]
    assert headless["metadata"]["labels"]["release"] == "prom"
    local = children.render_local_service(POOL, config)
    assert local["spec"]["internalTrafficPolicy"] == "Local"
    pdb = children.render_pdb(POOL, config)
    assert pdb["spec"]["maxUnavailable"] == 1


def test_curve_secret_holds_base64_z85_keys() -> None:
    public, secret = keys.curve_keypair()
    manifest = children.render_curve_secret(POOL, public, secret)
    assert base64.b64decode(manifest["data"]["curve-public.key"]).decode() == public
    assert base64.b64decode(manifest["data"]["curve-secret.key"]).decode() == secret


def test_group_names_are_dns_safe() -> None:
    assert names.group_name("Pool", "Llama_70B/0") == "pool-llama-70b-0"
    assert len(names.group_name("p", "x" * 400)) <= 253


# --- conditions -----------------------------------------------------------------------


def test_condition_transition_time_moves_only_on_status_change() -> None:
    t0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    t1 = t0 + datetime.timedelta(minutes=1)
    first = merge_conditions(None, [Condition("Ready", False, "A", "a")], 1, t0)
    same = merge_conditions(first, [Condition("Ready", False, "B", "b")], 2, t1)
    flipped = merge_conditions(same, [Condition("Ready", True, "C", "c")], 2, t1)
    assert same[0]["lastTransitionTime"] == first[0]["lastTransitionTime"]
    assert same[0]["reason"] == "B" and same[0]["observedGeneration"] == 2
    assert (
        flipped[0]["lastTransitionTime"] == "2026-01-01T00:01:00Z"
        and flipped[0]["status"] == "True"
    )


# --- election -------------------------------------------------------------------------


def cand(node: str, rank: int, *, fresh: bool = True, ready: bool = True) -> Candidate:
    return Candidate(node, rank, f"tcp://{node}:5557", ready, fresh)


def test_first_election_prefers_rank_zero() -> None:
    decision = decide(Published(0, None, None), [cand("b", 1), cand("a", 0)])
    assert decision.leader == cand("a", 0) and decision.epoch == 1 and decision.changed
    assert not decision.failover


def test_fresh_leader_is_kept_without_epoch_change() -> None:
    decision = decide(Published(4, "b", 1), [cand("a", 0), cand("b", 1)])
    assert decision.leader == cand("b", 1) and decision.epoch == 4 and not decision.changed


def test_lost_leader_fails_over_with_a_higher_epoch() -> None:
    decision = decide(Published(4, "a", 0), [cand("a", 0, fresh=False), cand("b", 1), cand("c", 2)])
    assert decision.leader == cand("b", 1) and decision.epoch == 5
    assert decision.changed and decision.failover


def test_ready_members_win_over_lower_ranked_unready_ones() -> None:
    decision = decide(Published(0, None, None), [cand("a", 0, ready=False), cand("b", 1)])
    assert decision.leader == cand("b", 1)


def test_no_fresh_member_means_no_leader_and_a_new_epoch_once() -> None:
    gone = decide(Published(2, "a", 0), [cand("a", 0, fresh=False)])
    assert gone.leader is None and gone.epoch == 3 and gone.failover
    still = decide(Published(3, None, None), [cand("a", 0, fresh=False)])
    assert still.leader is None and still.epoch == 3 and not still.changed


# --- membership -----------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def lease(
    node: str,
    renew: str,
    *,
    rv: str = "1",
    memberships: list[dict[str, Any]] | None = None,
    ready: bool = True,
    duration: int = 10,
    holder_time_in_future: bool = False,
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"flexkv-agent-{node}",
            "namespace": "ns",
            "resourceVersion": rv,
            "labels": {
                "app.kubernetes.io/name": "flexkv-agent",
                "flexkv.io/pool": "p",
                "flexkv.io/node": node,
            },
            "annotations": {
                "flexkv.io/endpoints": json.dumps(
                    {"http": "1.2.3.4:8080", "fanout": "tcp://1.2.3.4:5557"}
                ),
                "flexkv.io/memberships": json.dumps(memberships or []),
                "flexkv.io/tiers": json.dumps({"cpu": {"capacityBytes": 10, "usedBytes": 2}}),
                "flexkv.io/ready": "true" if ready else "false",
                "flexkv.io/cache-epoch": "0",
            },
        },
        "spec": {
            "holderIdentity": f"pod-{node}",
            "leaseDurationSeconds": duration,
            "renewTime": "2099-01-01T00:00:00Z" if holder_time_in_future else renew,
        },
    }


def test_lease_parsing_reads_every_annotation() -> None:
    record = parse_lease(
        lease("n1", "t1", memberships=[{"replica": "r", "ppRank": 1, "ppSize": 2}])
    )
    assert record is not None
    assert record.node == "n1" and record.pod == "pod-n1" and record.ready
    assert record.fanout_endpoint == "tcp://1.2.3.4:5557" and record.http_endpoint == "1.2.3.4:8080"
    assert record.memberships[0].replica == "r" and record.memberships[0].pp_size == 2
    assert (
        record.tiers == {"cpu": {"capacityBytes": 10, "usedBytes": 2}} and record.cache_epoch == 0
    )


def test_malformed_annotations_do_not_break_parsing() -> None:
    body = lease("n1", "t1")
    body["metadata"]["annotations"]["flexkv.io/memberships"] = "{not json"
    record = parse_lease(body)
    assert record is not None and record.memberships == () and record.problems
    assert parse_lease({"metadata": {"name": "other", "labels": {}}}) is None


def test_expiry_is_judged_by_the_observers_clock_only() -> None:
    clock = FakeClock()
    tracker = LeaseTracker(clock=clock)
    # The holder's own renewTime claims the far future: it must not matter.
    assert tracker.observe(lease("n1", "t1", holder_time_in_future=True))
    clock.now += 9.9
    assert tracker.agents("ns", "p", 15)[0].fresh
    clock.now += 0.2
    assert not tracker.agents("ns", "p", 15)[0].fresh
    # A renewal (new renewTime / resourceVersion) makes it fresh again, from now.
    assert not tracker.observe(lease("n1", "t2", rv="2"))
    view = tracker.agents("ns", "p", 15)[0]
    assert view.fresh and view.expires_at == pytest.approx(clock.now + 10)


def test_only_significant_lease_changes_ask_for_a_reconcile() -> None:
    tracker = LeaseTracker(clock=FakeClock())
    assert tracker.observe(lease("n1", "t1"))
    assert not tracker.observe(lease("n1", "t2", rv="2"))
    assert tracker.observe(lease("n1", "t3", rv="3", ready=False))
    assert tracker.forget("ns", "flexkv-agent-n1") is not None
    assert tracker.agents("ns", "p", 15) == []


# --- groups ---------------------------------------------------------------------------


def test_plan_groups_by_replica() -> None:
    tracker = LeaseTracker(clock=FakeClock())
    for node, rank in (("a", 0), ("b", 1)):
        tracker.observe(
            lease(node, "t", memberships=[{"replica": "r1", "ppRank": rank, "ppSize": 2}])
        )
    tracker.observe(lease("c", "t", memberships=[{"replica": "r2", "ppRank": 0, "ppSize": 1}]))
    plans = plan_groups(tracker.agents("ns", "p", 15))
    assert [(p.replica, p.pp_size, [m.candidate.node for m in p.members]) for p in plans] == [
        ("r1", 2, ["a", "b"]),
        ("r2", 1, ["c"]),
    ]


def test_agents_with_several_memberships_each_join_every_group_they_report() -> None:
    tracker = LeaseTracker(clock=FakeClock())
    tracker.observe(lease("a", "t", memberships=[
        {"replica": "ga", "ppRank": 0, "ppSize": 2}, {"replica": "gb", "ppRank": 1, "ppSize": 2},
        {"replica": "solo-0", "ppRank": 0, "ppSize": 1}]))
    tracker.observe(lease("b", "t", memberships=[
        {"replica": "ga", "ppRank": 1, "ppSize": 2}, {"replica": "gb", "ppRank": 0, "ppSize": 2},
        {"replica": "solo-1", "ppRank": 0, "ppSize": 1}]))
    plans = plan_groups(tracker.agents("ns", "p", 15))
    assert [(p.replica, p.pp_size, [(m.candidate.node, m.candidate.pp_rank) for m in p.members])
            for p in plans] == [
        ("ga", 2, [("a", 0), ("b", 1)]),
        ("gb", 2, [("b", 0), ("a", 1)]),
        ("solo-0", 1, [("a", 0)]),
        ("solo-1", 1, [("b", 0)]),
    ]


def test_group_status_and_write_throttling() -> None:
    t0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    plan = GroupPlan(
        "r", 2, (GroupMember(cand("a", 0), t0), GroupMember(cand("b", 1, fresh=False), t0))
    )
    decision = decide(Published(0, None, None), [m.candidate for m in plan.members])
    status = render_status(plan, decision, {}, 1, t0, "op")
    assert status["leader"]["node"] == "a" and status["epoch"] == 1
    assert status["phase"] == "Degraded" and status["memberCount"] == 2
    assert status["members"][1]["ready"] is False
    later = GroupPlan(
        "r",
        2,
        tuple(GroupMember(m.candidate, t0 + datetime.timedelta(seconds=3)) for m in plan.members),
    )
    again = render_status(
        later,
        decide(Published(1, "a", 0), [m.candidate for m in later.members]),
        status,
        1,
        t0,
        "op",
    )
    assert not needs_write(status, again, heartbeat_slack=10)
    assert needs_write(status, again, heartbeat_slack=2)


# --- sizing ---------------------------------------------------------------------------


def node(name: str, memory: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": labels or {}},
        "status": {"allocatable": {"memory": memory, "ephemeral-storage": "100Gi"}},
    }


def test_sizing_compares_tiers_with_allocatable_memory() -> None:
    config = _config(placement={"nodeSelector": {"gpu": "yes"}})
    ok = sizing_condition([node("a", "64Gi", {"gpu": "yes"}), node("tiny", "1Gi")], config)
    assert ok.status is True
    bad = sizing_condition(
        [node("a", "64Gi", {"gpu": "yes"}), node("b", "1Gi", {"gpu": "yes"})], config
    )
    assert bad.status is False and "b:" in bad.message and "spec.tiers" in bad.message
    assert sizing_condition(None, config).status is None


def test_sizing_compares_copy_lanes_with_allocatable_cpu() -> None:
    def with_cpu(name: str, cpu: str) -> dict[str, Any]:
        n = node(name, "64Gi")
        n["status"]["allocatable"]["cpu"] = cpu
        return n

    config = _config(tiers={"cpu": {"size": "2Gi", "copyLanes": 8}})
    assert sizing_condition([with_cpu("big", "16"), with_cpu("eight", "8000m")],
                            config).status is True
    bad = sizing_condition([with_cpu("big", "16"), with_cpu("small", "3500m")], config)
    assert bad.status is False
    assert bad.message.startswith(
        "1 of 2 nodes are too small (small: tiers.cpu.copyLanes 8 > allocatable cpu 3.5); ")
    assert "tiers.cpu.copyLanes" in bad.message.split(";")[-1]  # the fix names it
    # Without copyLanes the node's CPU is not compared.
    assert sizing_condition([with_cpu("small", "1")], _config()).status is True
