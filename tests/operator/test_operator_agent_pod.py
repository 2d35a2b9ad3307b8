"""The agent pod's host access and privileges as the operator renders them: a non-root
agent, an init container that only chowns the pod's host directories, the shared-memory
directory engines mount at /dev/shm, and SSD paths that can never be system directories."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from flexkv_operator import children, host_paths
from flexkv_operator.children import PoolIdentity
from flexkv_operator.spec import ConfigInvalid, parse_pool_spec

REPO = Path(__file__).resolve().parents[2]
OWNER = {"apiVersion": "flexkv.io/v1alpha1", "kind": "KVCachePool", "name": "p", "uid": "u1",
         "controller": True, "blockOwnerDeletion": True}
POOL = PoolIdentity("p", "ns", OWNER)
SSD = ["/mnt/nvme0/flexkv", "/data/flexkv"]


def _pod(**spec: Any) -> dict[str, Any]:
    config = parse_pool_spec({"tiers": {"cpu": {"size": "1Gi"}}, **spec}, "img:1")
    ds = children.render_daemon_set(POOL, config, "sa")
    pod: dict[str, Any] = ds["spec"]["template"]["spec"]
    return pod


def _ssd_pod(**spec: Any) -> dict[str, Any]:
    return _pod(tiers={"cpu": {"size": "1Gi"}, "ssd": {"size": "1Gi", "paths": SSD}}, **spec)


def test_default_agent_user_is_the_images_user() -> None:
    """One source: the CRD default, which must match the Dockerfile's USER."""
    match = re.search(r"^USER (\d+):(\d+)$", (REPO / "Dockerfile").read_text(), re.M)
    assert match, "Dockerfile has no numeric USER uid:gid line"
    config = parse_pool_spec({"tiers": {"cpu": {"size": 1}}}, "img:1")
    assert (config.agent_user, config.agent_group) == (int(match[1]), int(match[2]))


def test_agent_container_is_non_root_without_capabilities() -> None:
    pod = _ssd_pod()
    (agent,) = pod["containers"]
    assert agent["securityContext"] == {
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert pod["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    # The read-only root filesystem leaves /tmp (HOME, FlexKV's ipc directory) writable.
    tmp = [m for m in agent["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert [m["name"] for m in tmp] == ["tmp"]
    assert {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}} in pod["volumes"]


def test_init_container_chowns_exactly_the_host_directories_as_argv() -> None:
    pod = _ssd_pod(agent={"imagePullPolicy": "Always",
                          "resources": {"requests": {"cpu": "1"}}})
    (init,) = pod["initContainers"]
    (agent,) = pod["containers"]
    host_volumes = {v["name"]: v["hostPath"] for v in pod["volumes"] if "hostPath" in v}
    agent_host_mounts = [m for m in agent["volumeMounts"] if m["name"] in host_volumes]
    assert init["command"] == [
        "chown", "--", "10001:10001", "/var/run/flexkv", "/dev/shm", *SSD,
    ]
    assert "args" not in init  # no shell, no second word list to interpret
    assert init["volumeMounts"] == agent_host_mounts
    assert [m["mountPath"] for m in init["volumeMounts"]] == init["command"][3:]
    assert (init["image"], init["imagePullPolicy"]) == (agent["image"], "Always")
    assert init["resources"] == agent["resources"] == {
        "requests": {"cpu": "1", "memory": str(2**30 + 512 * 2**20)}}
    assert init["securityContext"] == {
        "runAsUser": 0,
        "runAsGroup": 0,
        "runAsNonRoot": False,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]},
    }
    assert all(v["type"] == "DirectoryOrCreate" for v in host_volumes.values())


def test_shared_memory_directory_is_the_containers_dev_shm() -> None:
    pod = _pod()
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["shm"]["hostPath"] == {"path": "/dev/shm/flexkv", "type": "DirectoryOrCreate"}
    for container in (*pod["initContainers"], *pod["containers"]):
        at_shm = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        assert at_shm == [{"name": "shm", "mountPath": "/dev/shm"}], container["name"]
    assert host_paths.SHM_HOST_DIR == "/dev/shm/flexkv" and host_paths.SHM_MOUNT == "/dev/shm"


def test_pool_user_reaches_the_agent_and_the_chown() -> None:
    pod = _ssd_pod(agent={"securityContext": {"runAsUser": 2000, "runAsGroup": 3000}})
    (init,) = pod["initContainers"]
    (agent,) = pod["containers"]
    assert init["command"][2] == "2000:3000"
    assert (agent["securityContext"]["runAsUser"], agent["securityContext"]["runAsGroup"]) == (
        2000, 3000)


def test_a_path_with_shell_characters_stays_one_argument() -> None:
    """The CRD's pattern refuses such a path; an API server that skipped validation still
    cannot make the init container run anything but chown on one literal path."""
    odd = "/mnt/x;reboot $(id)"
    pod = _pod(tiers={"cpu": {"size": 1}, "ssd": {"size": 1, "paths": [odd]}})
    (init,) = pod["initContainers"]
    assert init["command"][0] == "chown" and init["command"][-1] == odd


def test_agent_pod_user_change_rolls_the_agents() -> None:
    """The UID is part of the pod template, so a change reaches every agent."""
    config_a = parse_pool_spec({"tiers": {"cpu": {"size": 1}}}, "img:1")
    config_b = parse_pool_spec(
        {"tiers": {"cpu": {"size": 1}}, "agent": {"securityContext": {"runAsUser": 2000}}},
        "img:1",
    )
    def spec_hash(config: Any) -> str:
        ds = children.render_daemon_set(POOL, config, "sa")
        return str(ds["metadata"]["annotations"][children.ANNOTATION_SPEC_HASH])

    assert spec_hash(config_a) != spec_hash(config_b)


@pytest.mark.parametrize(
    "bad",
    [
        "/", "/var", "/var/lib", "/mnt", "/home", "/opt",
        "/etc/flexkv", "/usr/local/ssd", "/proc/x", "/sys/x", "/boot/x", "/root/ssd",
        "/var/run/flexkv", "/var/run/flexkv/ssd", "/run/flexkv", "/dev/shm", "/dev/shm/flexkv",
        "/tmp/ssd", "/var/lib/kubelet/pods", "/var/lib/containerd/x", "/var/log/ssd",
        "/mnt/../etc", "/mnt/./a", "/mnt/a/", "//mnt/a", "/mnt//a",
    ],
)
def test_ssd_paths_that_are_system_or_pod_directories_are_refused(bad: str) -> None:
    with pytest.raises(ConfigInvalid) as info:
        parse_pool_spec(
            {"tiers": {"cpu": {"size": 1}, "ssd": {"size": 1, "paths": ["/mnt/ok", bad]}}}, "i")
    (problem,) = info.value.problems
    assert problem.field == "tiers.ssd.paths[1]"
    assert repr(bad) in problem.message
    assert "/mnt/nvme0/flexkv" in problem.message or "write it as" in problem.message


def test_unnormalised_path_gets_its_normal_form_as_the_fix() -> None:
    assert host_paths.ssd_path_problem("/mnt/a/../b/") is not None
    assert "write it as '/mnt/b'" in str(host_paths.ssd_path_problem("/mnt/a/../b/"))
    assert "write it as '/mnt/a'" in str(host_paths.ssd_path_problem("//mnt/a"))


@pytest.mark.parametrize(
    "good", ["/mnt/nvme0/flexkv", "/data", "/data/flexkv", "/var/lib/flexkv/ssd",
             "/srv/cache", "/home/ssd", "/var/cache/flexkv"],
)
def test_dedicated_ssd_directories_are_accepted(good: str) -> None:
    assert host_paths.ssd_path_problem(good) is None
    config = parse_pool_spec(
        {"tiers": {"cpu": {"size": 1}, "ssd": {"size": 1, "paths": [good]}}}, "i")
    assert config.ssd_paths == (good,)


@pytest.mark.parametrize("value", [0, -1, True, "10001", 2**31])
def test_root_or_malformed_agent_ids_are_config_errors(value: object) -> None:
    for key in ("runAsUser", "runAsGroup"):
        with pytest.raises(ConfigInvalid) as info:
            parse_pool_spec({"tiers": {"cpu": {"size": 1}},
                             "agent": {"securityContext": {key: value}}}, "img:1")
        (problem,) = info.value.problems
        assert problem.field == f"agent.securityContext.{key}"
        assert repr(value) in problem.message and "non-root" in problem.message


def test_a_pool_without_resources_gets_requests_covering_its_cpu_tier() -> None:
    """Never BestEffort: the first pods the kubelet evicts under memory pressure."""
    (agent,) = _pod()["containers"]
    assert agent["resources"] == {"requests": {"cpu": "250m",
                                               "memory": str(2**30 + 512 * 2**20)}}


def test_a_lone_limit_is_left_to_kubernetes_as_the_request() -> None:
    """A default request above a pool's limit would make the pod invalid."""
    (agent,) = _pod(agent={"resources": {"limits": {"memory": "1Gi", "cpu": "2"}}})["containers"]
    assert agent["resources"] == {"limits": {"memory": "1Gi", "cpu": "2"}}


def test_priority_class_reaches_the_agent_pods() -> None:
    assert _pod(agent={"priorityClassName": "kv-cache-critical"})["priorityClassName"] == (
        "kv-cache-critical")
    assert _pod().get("priorityClassName") is None
