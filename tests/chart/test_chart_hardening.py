"""Optional hardening of the chart: NetworkPolicies and the ValidatingAdmissionPolicy.

Both are held to the agent pods the operator really renders (its own code, on
docs/helm.md's example pool): the NetworkPolicies select those pods and name
their ports; the admission policy's CEL rules, evaluated with cel-python, admit
the agent pod and an engine pod as documented and refuse other pods that reach
for the node.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import celpy
import kubernetes_validate
import pytest

from tests.chart.operator_children import agent_children
from tests.chart.render import (
    CHART,
    CURRENT_KUBE,
    OLDEST_KUBE,
    Render,
    doc_examples,
    run_helm,
    template,
)

NS = "llm-serving"
SSD = "/mnt/nvme0/flexkv"
# ValidatingAdmissionPolicy is admissionregistration.k8s.io/v1 from 1.30 on.
VAP_OLDEST_KUBE = "1.30.0"
HARDENED = ("--set", f"operator.watch.namespaces={{{NS}}}",
            "--set", "networkPolicy.enabled=true", "--set", "admissionPolicy.enabled=true",
            "--set", f"admissionPolicy.agentHostPaths={{{SSD}}}",
            "--set", "admissionPolicy.hostIPCServiceAccounts={llm-serving:vllm}",
            "--kube-version", CURRENT_KUBE)


@pytest.fixture(scope="module")
def hardened(helm: str) -> Render:
    return Render("hardened", template(helm, *HARDENED))


@pytest.fixture(scope="module")
def agent_pod(hardened: Render) -> dict[str, Any]:
    pool = next(e for e in doc_examples() if e["kind"] == "KVCachePool")
    pool = {**pool, "metadata": {**pool["metadata"], "namespace": NS}}
    assert SSD in pool["spec"]["tiers"]["ssd"]["paths"], "docs example pool changed its SSD path"
    daemonset = next(o for o in agent_children(hardened, pool)
                     if o["kind"] == "DaemonSet")
    pod: dict[str, Any] = {"apiVersion": "v1", "kind": "Pod",
                           "metadata": {**daemonset["spec"]["template"]["metadata"],
                                        "namespace": NS, "name": "agent-x"},
                           "spec": daemonset["spec"]["template"]["spec"]}
    return pod


@pytest.mark.parametrize("kube", [OLDEST_KUBE, CURRENT_KUBE])
def test_network_policies_are_valid(hardened: Render, kube: str) -> None:
    for policy in hardened.of_kind("NetworkPolicy"):
        kubernetes_validate.validate(policy, kube, strict=True)


def test_network_policies_select_the_pods_and_name_their_ports(
    hardened: Render, agent_pod: dict[str, Any]
) -> None:
    policies = {p["metadata"]["name"]: p for p in hardened.of_kind("NetworkPolicy")}
    agents = next(p for n, p in policies.items() if n.endswith("-agents"))
    assert agents["metadata"]["namespace"] == NS
    selector = agents["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= agent_pod["metadata"]["labels"].items()
    ports = {p["name"] for c in agent_pod["spec"]["containers"] for p in c.get("ports", [])}
    by_port = {p["port"]: rule["from"] for rule in agents["spec"]["ingress"]
               for p in rule["ports"]}
    assert ports == {"http", "fanout"}, "a pool without a remote tier"
    # The remote tier's named ports (tests below): RPC and data; the KV-event port of
    # a pool with spec.kvEvents, open to whoever may reach the HTTP port; nothing else.
    assert set(by_port) == ports | {"mooncake", "mooncake-data", "kv-events"}
    assert by_port["fanout"] == [{"podSelector": {"matchLabels": selector}}]
    assert {"podSelector": {}} in by_port["http"]
    assert by_port["kv-events"] == by_port["http"]

    operator = next(p for n, p in policies.items() if n.endswith("-operator"))
    pod_labels = hardened.one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert operator["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    container = hardened.one("Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert operator["spec"]["ingress"] == [
        {"ports": [{"port": container["ports"][0]["name"], "protocol": "TCP"}]}]


def test_agent_http_can_be_limited_to_agents_and_listed_peers(render_with: Any) -> None:
    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    render = render_with("--set", "networkPolicy.enabled=true",
                         "--set", "networkPolicy.agents.httpFromSameNamespace=false",
                         "--set-json", f"networkPolicy.agents.httpFrom=[{json.dumps(peer)}]")
    agents = next(p for p in render.of_kind("NetworkPolicy")
                  if p["metadata"]["name"].endswith("-agents"))
    http = next(r["from"] for r in agents["spec"]["ingress"] if r["ports"][0]["port"] == "http")
    assert {"podSelector": {}} not in http and peer in http


@pytest.mark.parametrize("kube", [VAP_OLDEST_KUBE, CURRENT_KUBE])
def test_admission_policy_is_valid(hardened: Render, kube: str) -> None:
    for kind in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"):
        kubernetes_validate.validate(hardened.one(kind), kube, strict=True)


def test_admission_policy_refuses_kubernetes_without_it(helm: str) -> None:
    out = run_helm(helm, "template", "kv", str(CHART), "--kube-version", OLDEST_KUBE,
                   "--set", "admissionPolicy.enabled=true", check=False)
    assert out.returncode != 0
    assert "admissionPolicy.enabled needs Kubernetes 1.30 or newer" in out.stderr


def test_admission_binding_covers_the_agent_namespaces(hardened: Render) -> None:
    binding = hardened.one("ValidatingAdmissionPolicyBinding")
    policy = hardened.one("ValidatingAdmissionPolicy")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    expr = binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"]
    assert expr == [{"key": "kubernetes.io/metadata.name", "operator": "In", "values": [NS]}]


def _admit(policy: dict[str, Any], pod: dict[str, Any]) -> list[str]:
    """Messages of the validations ``pod`` fails, evaluating the policy's CEL with cel-python."""
    env = celpy.Environment()
    obj = celpy.json_to_cel(pod)
    variables = celpy.celtypes.MapType()
    for var in policy["spec"]["variables"]:
        program = env.program(env.compile(var["expression"]))
        variables[celpy.celtypes.StringType(var["name"])] = program.evaluate(
            {"object": obj, "variables": variables})
    failed = []
    for rule in policy["spec"]["validations"]:
        program = env.program(env.compile(rule["expression"]))
        if not bool(program.evaluate({"object": obj, "variables": variables})):
            failed.append(rule["message"])
    return failed


def _engine_pod(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "engine", "namespace": NS},
            "spec": {"containers": [{"name": "e", "image": "vllm"}], **spec}}


def test_admission_policy_admits_the_agent_pod(hardened: Render, agent_pod: dict[str, Any]) -> None:
    spec = agent_pod["spec"]
    assert spec["hostIPC"] is True
    assert SSD in {v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    assert _admit(hardened.one("ValidatingAdmissionPolicy"), agent_pod) == []


def test_admission_policy_admits_documented_engine_pods(hardened: Render) -> None:
    policy = hardened.one("ValidatingAdmissionPolicy")
    socket = {"name": "s", "hostPath": {"path": "/var/run/flexkv", "type": "Directory"}}
    shm = {"name": "m", "hostPath": {"path": "/dev/shm/flexkv", "type": "Directory"}}
    assert _admit(policy, _engine_pod(volumes=[socket, shm])) == []
    assert _admit(policy, _engine_pod(serviceAccountName="vllm", hostIPC=True,
                                      volumes=[socket])) == []
    assert _admit(policy, _engine_pod()) == []
    assert _admit(policy, _engine_pod(hostIPC=False, volumes=[{"name": "e", "emptyDir": {}}])) == []


@pytest.mark.parametrize("case", ["ssd-path", "root", "trailing-slash", "hostipc", "agent-etc"])
def test_admission_policy_refuses_pods_reaching_for_the_node(
    hardened: Render, agent_pod: dict[str, Any], case: str
) -> None:
    policy = hardened.one("ValidatingAdmissionPolicy")
    pods = {
        "ssd-path": _engine_pod(volumes=[{"name": "k", "hostPath": {"path": SSD}}]),
        "root": _engine_pod(volumes=[{"name": "k", "hostPath": {"path": "/"}}]),
        "trailing-slash": _engine_pod(volumes=[{"name": "k",
                                                 "hostPath": {"path": "/var/run/flexkv/"}}]),
        "hostipc": _engine_pod(serviceAccountName="default", hostIPC=True),
    }
    if case == "agent-etc":
        pod = copy.deepcopy(agent_pod)
        pod["spec"]["volumes"].append({"name": "etc", "hostPath": {"path": "/etc"}})
    else:
        pod = pods[case]
    failed = _admit(policy, pod)
    assert len(failed) == 1, failed
    assert ("hostIPC" if case == "hostipc" else "hostPath") in failed[0]


# -- the remote tier: Mooncake authenticates nothing, so only agents reach it -----------


def _remote_pool() -> dict[str, Any]:
    """docs/helm.md's pool with a managed Mooncake master."""
    pool = next(
        e for e in doc_examples()
        if e["kind"] == "KVCachePool" and "remote" in e["spec"]["tiers"]
    )
    assert pool["spec"]["tiers"]["remote"]["mooncake"]["managed"] is True
    return {**pool, "metadata": {**pool["metadata"], "namespace": NS}}


def _pod(workload: dict[str, Any]) -> dict[str, Any]:
    template = workload["spec"]["template"]
    return {"metadata": template["metadata"], "spec": template["spec"]}


def _selects(policy: dict[str, Any], pod: dict[str, Any]) -> bool:
    return bool(
        policy["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    )


def _port_names(pod: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in pod["spec"]["containers"]
            for p in c.get("ports", [])}


def test_mooncake_ports_are_open_to_the_agents_only(hardened: Render) -> None:
    children = agent_children(hardened, _remote_pool())
    agent = _pod(next(o for o in children if o["kind"] == "DaemonSet"))
    master = _pod(next(o for o in children if o["kind"] == "Deployment"))
    policies = {p["metadata"]["name"]: p for p in hardened.of_kind("NetworkPolicy")}
    agents = next(p for n, p in policies.items() if n.endswith("-agents"))
    masters = next(p for n, p in policies.items() if n.endswith("-mooncake-master"))
    assert masters["metadata"]["namespace"] == NS
    # Each policy selects its own pods and not the other's.
    assert _selects(agents, agent) and not _selects(agents, master)
    assert _selects(masters, master) and not _selects(masters, agent)
    only_agents = [{"podSelector": agents["spec"]["podSelector"]}]

    # The master: RPC and metadata (the ports the agents' agent.yaml names), from agents.
    [rule] = masters["spec"]["ingress"]
    assert rule["from"] == only_agents
    master_ports = _port_names(master)
    assert {p["port"] for p in rule["ports"]} == {"rpc", "metadata"}
    assert (master_ports["rpc"], master_ports["metadata"]) == (50051, 8080)
    assert "metrics" in master_ports, "declared, and left closed"

    # The agents: Mooncake's RPC port (storePort) and data port (storePort + 1), both
    # pinned by the agent and named by the DaemonSet, from agents only; no port range.
    mooncake = [r for r in agents["spec"]["ingress"]
                if {p["port"] for p in r["ports"]} & {"mooncake", "mooncake-data"}]
    assert mooncake == [{"ports": [{"port": "mooncake", "protocol": "TCP"},
                                   {"port": "mooncake-data", "protocol": "TCP"}],
                         "from": only_agents}]
    assert not any("endPort" in p for r in agents["spec"]["ingress"] for p in r["ports"])
    store_port = _remote_pool()["spec"]["tiers"]["remote"]["mooncake"]["storePort"]
    named = _port_names(agent)
    assert (named["mooncake"], named["mooncake-data"]) == (store_port, store_port + 1)


def test_the_removed_mooncake_port_range_value_is_refused(helm: str) -> None:
    """Mooncake's ports are pinned by the agent; the old range value is an unknown key."""
    out = run_helm(helm, "template", "kv", str(CHART), "--set", "networkPolicy.enabled=true",
                   "--set", "networkPolicy.agents.mooncakeDataPorts.from=15000", check=False)
    assert out.returncode != 0
    assert "Additional property mooncakeDataPorts is not allowed" in out.stderr
