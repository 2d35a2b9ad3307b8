"""The chart and the operator meet in the agent pods: the operator renders them from a
KVCachePool with the image and ServiceAccount the chart hands it. This check runs
the operator's own rendering on the chart's and the docs' example pools and holds
the result to what the chart promises: valid Kubernetes objects, the chart's agent
ServiceAccount and image, the labels and port the PodMonitor and NOTES select,
and exactly the host access docs/helm.md documents."""

from __future__ import annotations

from typing import Any

import kubernetes_validate

from tests.chart.operator_children import agent_children, operator_env
from tests.chart.render import CURRENT_KUBE, OLDEST_KUBE, Render, doc_examples

ENGINE_SOCKET_DIR = "/var/run/flexkv"
SHM_HOST_DIR = "/dev/shm/flexkv"


def _pools(renders: dict[str, Render]) -> list[tuple[Render, dict[str, Any]]]:
    render = renders["example-pool-values.yaml"]
    pools = [(render, render.one("KVCachePool"))]
    multi = renders["multi-namespace-values.yaml"]
    pools.append((multi, multi.one("KVCachePool")))
    for example in doc_examples():
        if example["kind"] == "KVCachePool":
            # docs/helm.md installs with operator.watch.namespaces=[<pool namespace>].
            pools.append((multi, {**example, "metadata": {
                **example["metadata"], "namespace": "llm-staging"}}))
    return pools


def test_operator_renders_valid_kubernetes_for_the_example_pools(
    renders: dict[str, Render],
) -> None:
    errors = []
    for render, pool in _pools(renders):
        for obj in agent_children(render, pool):
            for kube in (OLDEST_KUBE, CURRENT_KUBE):
                try:
                    kubernetes_validate.validate(obj, kube, strict=True)
                except kubernetes_validate.ValidationError as e:
                    errors.append(f"{pool['metadata']['name']} {obj['kind']} {kube}: {e.message}")
    assert errors == []


def test_agent_pods_use_the_charts_account_image_labels_and_port(
    renders: dict[str, Render],
) -> None:
    for render, pool in _pools(renders):
        namespace = pool["metadata"]["namespace"]
        (daemon_set,) = [o for o in agent_children(render, pool) if o["kind"] == "DaemonSet"]
        template = daemon_set["spec"]["template"]
        pod = template["spec"]
        account = pod["serviceAccountName"]
        # The account exists in the pool's namespace and is bound to the agent Role.
        render.one("ServiceAccount", account, namespace)
        bound = [
            b["roleRef"]["name"]
            for b in render.of_kind("RoleBinding")
            if b["metadata"]["namespace"] == namespace
            and {"kind": "ServiceAccount", "name": account, "namespace": namespace}
            in b["subjects"]
        ]
        assert len(bound) == 1, bound
        role = render.one("Role", bound[0], namespace)
        assert {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                "verbs": ["create", "get", "patch"]} in role["rules"]
        (container,) = pod["containers"]
        wanted_image = pool["spec"].get("agent", {}).get("image") or (
            operator_env(render)["FLEXKV_AGENT_IMAGE"]
        )
        assert container["image"] == wanted_image
        assert container["command"] == ["flexkv-agent"]
        assert container["args"] == ["run", "--config", "/etc/flexkv/agent.yaml"]
        # PodMonitor: pods labelled flexkv-agent with the pool, metrics on port "http".
        labels = template["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "flexkv-agent"
        assert labels["flexkv.io/pool"] == pool["metadata"]["name"]
        assert "http" in {p["name"] for p in container["ports"]}


def test_agent_host_access_is_exactly_what_the_docs_explain(renders: dict[str, Render]) -> None:
    for render, pool in _pools(renders):
        (daemon_set,) = [o for o in agent_children(render, pool) if o["kind"] == "DaemonSet"]
        pod = daemon_set["spec"]["template"]["spec"]
        assert pod["hostIPC"] is True
        assert not pod.get("hostNetwork") and not pod.get("hostPID")
        host_paths = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
        ssd = set(pool["spec"]["tiers"].get("ssd", {}).get("paths", []))
        assert host_paths == {ENGINE_SOCKET_DIR, SHM_HOST_DIR} | ssd
        (agent,) = pod["containers"]
        context = agent["securityContext"]
        assert context["runAsNonRoot"] is True and context["runAsUser"] != 0
        assert context["capabilities"] == {"drop": ["ALL"]}
        assert context["allowPrivilegeEscalation"] is False
        # The one root step: chown of the host directories, with CHOWN and nothing else.
        (init,) = pod["initContainers"]
        init_context = init["securityContext"]
        assert init["command"][:2] == ["chown", "--"]
        assert init_context["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
        assert init_context["allowPrivilegeEscalation"] is False
        assert {m["name"] for m in init["volumeMounts"]} == {
            v["name"] for v in pod["volumes"] if "hostPath" in v}
        for container in (init, agent):
            assert not container["securityContext"].get("privileged")
