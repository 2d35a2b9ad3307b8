"""What the rendered chart does: one Recreate operator replica, hardened pod,
least-privilege RBAC with exactly the expected rules, image tags, namespace
modes, opt-in monitoring and example pool, and a NOTES.txt with real commands."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from flexkv_operator import children
from flexkv_operator.children import PoolIdentity
from flexkv_operator.spec import parse_pool_spec

from node_agent.config import config_from_mapping
from tests.chart.render import CHART, NAMESPACE, RELEASE, VALUES_CASES, Render, run_helm

FULLNAME = f"{RELEASE}-flexkv-operator"
OPERATOR_SA = f"{FULLNAME}-operator"
AGENT_SA = f"{FULLNAME}-agent"

# The operator's permissions in each namespace it watches, each verb one that
# flexkv_operator uses: every reconcile re-reads its pool (get); kopf watches
# pools, agent Leases and DaemonSets (event handlers only, no finalizers, so
# kopf never patches pools); status goes
# through the status subresource; groups and children are created and
# merge-patched (never PUT: no "update"); stale groups are deleted; Events
# are posted and, when repeated, counted up (patch).
OPERATOR_RULES = [
    {"apiGroups": ["flexkv.io"], "resources": ["kvcachepools"],
     "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["flexkv.io"], "resources": ["kvcachepools/status"], "verbs": ["patch"]},
    {"apiGroups": ["flexkv.io"], "resources": ["kvcachegroups"],
     "verbs": ["get", "list", "create", "patch", "delete"]},
    {"apiGroups": ["flexkv.io"], "resources": ["kvcachegroups/status"], "verbs": ["patch"]},
    {"apiGroups": ["apps"], "resources": ["daemonsets"],
     "verbs": ["get", "list", "watch", "create", "patch"]},
    # A pool's managed mooncake_master (Deployment and Service), deleted when the pool
    # turns it off.
    {"apiGroups": ["apps"], "resources": ["deployments"],
     "verbs": ["get", "create", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "create", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["configmaps", "secrets"],
     "verbs": ["get", "create", "patch"]},
    {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"],
     "verbs": ["get", "create", "patch"]},
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
     "verbs": ["list", "watch", "delete"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
]
# Leader election between operator replicas, in the release namespace only.
ELECTION_ROLE = f"{FULLNAME}-operator-leader-election"
ELECTION_RULES = [
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
     "resourceNames": ["flexkv-operator"], "verbs": ["get", "patch"]},
]
# Cluster-wide: listing nodes for sizing. kopf's CRD/namespace scanning is off.
OPERATOR_CLUSTER_RULES = [
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]},
]
# The agents' permissions: exactly the calls node_agent/kube makes
# (test_chart_agent_rbac.py derives them from the code).
AGENT_RULES = [
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
     "verbs": ["create", "get", "patch"]},
    {"apiGroups": ["flexkv.io"], "resources": ["kvcachegroups"],
     "verbs": ["list", "watch"]},
]


def _operator(render: Render) -> dict[str, Any]:
    return render.one("Deployment", FULLNAME)


def _container(render: Render) -> dict[str, Any]:
    containers = _operator(render)["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _env(render: Render) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in _container(render)["env"]}


# ---------------------------------------------------------------- operator pod


def test_two_operator_replicas_on_different_nodes_with_a_pdb(default_render: Render) -> None:
    """Active/passive: two replicas (one holds the leader-election Lease), preferring
    different nodes, and a PodDisruptionBudget that keeps one through drains."""
    spec = _operator(default_render)["spec"]
    assert spec["replicas"] == 2
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    [term] = spec["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    selector = term["podAffinityTerm"]["labelSelector"]["matchLabels"]
    assert selector == spec["selector"]["matchLabels"]
    pdb = default_render.one("PodDisruptionBudget", FULLNAME)
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": spec["selector"]}
    env = {e["name"]: e for e in _container(default_render)["env"]}
    assert env["FLEXKV_LEADER_ELECTION_NAMESPACE"]["value"] == pdb["metadata"]["namespace"]


@pytest.mark.parametrize("case", VALUES_CASES)
def test_operator_runs_non_root_read_only_without_capabilities(
    renders: dict[str, Render], case: str
) -> None:
    pod = _operator(renders[case])["spec"]["template"]["spec"]
    container = _container(renders[case])
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] > 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] > 0
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["privileged"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    for host in ("hostIPC", "hostPID", "hostNetwork"):
        assert not pod.get(host), host
    assert all("hostPath" not in v for v in pod["volumes"])
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/tmp"}


def test_operator_probes_liveness_and_readiness_apart(default_render: Render) -> None:
    """Liveness: kopf's /healthz; readiness: /readyz, which also fails on a stale watch."""
    container = _container(default_render)
    assert "--liveness-port=8081" in container["args"]
    assert "--metrics-port=8080" in container["args"]
    assert container["ports"] == [
        {"name": "liveness", "containerPort": 8081, "protocol": "TCP"},
        {"name": "metrics", "containerPort": 8080, "protocol": "TCP"},
    ]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "liveness"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["timeoutSeconds"] > 0


def test_operator_environment_names_agent_image_and_account(default_render: Render) -> None:
    env = _env(default_render)
    assert env["FLEXKV_AGENT_SERVICE_ACCOUNT"] == AGENT_SA
    assert env["FLEXKV_OPERATOR_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert _container(default_render)["command"] == ["flexkv-operator"]


# ---------------------------------------------------------------------- images


def test_two_images_tagged_with_the_app_version_by_default(
    default_render: Render, chart_meta: dict[str, Any]
) -> None:
    version = chart_meta["appVersion"]
    assert _container(default_render)["image"] == f"flexkv-operator:{version}"
    assert _env(default_render)["FLEXKV_AGENT_IMAGE"] == f"flexkv-agent:{version}"


def test_image_overrides_reach_operator_and_agents(render_with: Any) -> None:
    render = render_with("--set", "image.repository=reg.example/fkv", "--set", "image.tag=1.2.3")
    assert _container(render)["image"] == "reg.example/fkv:1.2.3"
    assert _env(render)["FLEXKV_AGENT_IMAGE"] == "flexkv-agent:1.2.3", "agent tag follows image.tag"
    split = render_with("--set", "agent.image.repository=reg.example/gpu",
                        "--set", "agent.image.tag=1.2.3-cuda")
    assert _env(split)["FLEXKV_AGENT_IMAGE"] == "reg.example/gpu:1.2.3-cuda"
    assert _container(split)["image"].startswith("flexkv-operator:")


def test_digest_pins_and_global_registry_prefixes_both_images(render_with: Any) -> None:
    op, ag = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    render = render_with("--set", "global.imageRegistry=mirror.example:5000/ml",
                         "--set", f"image.digest={op}", "--set", f"agent.image.digest={ag}",
                         "--set", "image.tag=9.9.9")
    assert _container(render)["image"] == f"mirror.example:5000/ml/flexkv-operator@{op}"
    assert _env(render)["FLEXKV_AGENT_IMAGE"] == f"mirror.example:5000/ml/flexkv-agent@{ag}"
    tagged = render_with("--set", "global.imageRegistry=mirror.example/")
    assert _container(tagged)["image"].startswith("mirror.example/flexkv-operator:")


def test_common_labels_land_on_every_rendered_object(render_with: Any) -> None:
    render = render_with("--set", "commonLabels.team=kv-cache", "--set",
                         "monitoring.podMonitor.enabled=true", "--set", "examplePool.enabled=true",
                         "--set", "monitoring.dashboard.enabled=true",
                         "--set", "monitoring.prometheusRule.enabled=true",
                         "--set", "networkPolicy.enabled=true",
                         "--set", "admissionPolicy.enabled=true", "--kube-version", "1.30.0")
    assert len({o["kind"] for o in render.objects}) >= 12
    missing = [f"{o['kind']}/{o['metadata']['name']}" for o in render.objects
               if o["metadata"].get("labels", {}).get("team") != "kv-cache"]
    assert missing == []


# ------------------------------------------------------------------- namespaces


def test_default_watches_the_release_namespace_only(default_render: Render) -> None:
    args = _container(default_render)["args"]
    assert [a for a in args if a.startswith("--namespace")] == [f"--namespace={NAMESPACE}"]
    assert "--all-namespaces" not in args


def test_multi_namespace_mode(renders: dict[str, Render]) -> None:
    render = renders["multi-namespace-values.yaml"]
    args = _container(render)["args"]
    assert [a for a in args if a.startswith("--namespace")] == [
        "--namespace=llm-prod", "--namespace=llm-staging"
    ]
    for ns in ("llm-prod", "llm-staging"):
        assert render.one("Role", f"{FULLNAME}-operator", ns)["rules"] == OPERATOR_RULES
        assert render.one("ServiceAccount", AGENT_SA, ns)["imagePullSecrets"] == [
            {"name": "registry-credentials"}
        ]
        assert render.one("Role", f"{FULLNAME}-agent", ns)["rules"] == AGENT_RULES
    assert render.of_kind("ClusterRole") == [
        render.one("ClusterRole", f"{FULLNAME}-operator-cluster")
    ]
    assert render.one("KVCachePool")["metadata"]["namespace"] == "llm-staging"


def test_all_namespaces_mode(renders: dict[str, Render]) -> None:
    render = renders["all-namespaces-values.yaml"]
    args = _container(render)["args"]
    assert "--all-namespaces" in args and "--verbose" in args
    assert not [a for a in args if a.startswith("--namespace")]
    binding = render.one("ClusterRoleBinding", f"{FULLNAME}-operator")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": OPERATOR_SA, "namespace": NAMESPACE}
    ]
    roles = [r for r in render.of_kind("Role") if r["metadata"]["name"] != ELECTION_ROLE]
    assert {r["metadata"]["name"] for r in roles} == {
        f"{FULLNAME}-agent", f"{FULLNAME}-operator-children"}
    assert {r["metadata"]["namespace"] for r in roles} == {"inference-a", "inference-b"}
    assert render.one("Role", ELECTION_ROLE)["metadata"]["namespace"] == NAMESPACE
    monitor = render.one("PodMonitor", f"{FULLNAME}-agents")
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["inference-a", "inference-b"]}


def _permissions(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"]
            for r in rule["resources"] for v in rule["verbs"]}


def test_all_namespaces_mode_writes_children_only_in_agent_namespaces(
    renders: dict[str, Render],
) -> None:
    """Cluster-wide rules plus the per-namespace Role are exactly the watched-namespace
    Role, and nothing that reads Secrets or creates workloads is cluster-wide."""
    render = renders["all-namespaces-values.yaml"]
    cluster = _permissions(render.one("ClusterRole", f"{FULLNAME}-operator")["rules"])
    for ns in ("inference-a", "inference-b"):
        role = render.one("Role", f"{FULLNAME}-operator-children", ns)
        local = _permissions(role["rules"])
        assert cluster | local == _permissions(OPERATOR_RULES)
        binding = render.one("RoleBinding", f"{FULLNAME}-operator-children", ns)
        assert binding["roleRef"]["name"] == role["metadata"]["name"]
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": OPERATOR_SA, "namespace": NAMESPACE}]
    assert not {p for p in cluster if p[1] in ("secrets", "configmaps", "services",
                                                "poddisruptionbudgets")}
    assert not {p for p in cluster if p[2] in ("create", "patch", "delete", "get")
                and p[1] in ("daemonsets", "deployments", "leases")}


# ------------------------------------------------------------------------- RBAC


@pytest.mark.parametrize("case", VALUES_CASES)
def test_rbac_has_no_wildcards(renders: dict[str, Render], case: str) -> None:
    for obj in renders[case].objects:
        if obj["kind"] in ("Role", "ClusterRole"):
            for rule in obj["rules"]:
                for key in ("apiGroups", "resources", "verbs", "resourceNames"):
                    assert "*" not in rule.get(key, []), (obj["metadata"]["name"], rule)
                assert "nonResourceURLs" not in rule


def test_rbac_rules_are_exactly_the_expected_ones(default_render: Render) -> None:
    render = default_render
    assert render.one("Role", f"{FULLNAME}-operator", NAMESPACE)["rules"] == OPERATOR_RULES
    assert render.one("ClusterRole", f"{FULLNAME}-operator-cluster")["rules"] == (
        OPERATOR_CLUSTER_RULES
    )
    assert render.one("Role", f"{FULLNAME}-agent", NAMESPACE)["rules"] == AGENT_RULES
    assert render.one("Role", ELECTION_ROLE, NAMESPACE)["rules"] == ELECTION_RULES
    assert len(render.of_kind("Role")) == 3
    assert len(render.of_kind("ClusterRole")) == 1


def test_bindings_tie_each_role_to_its_own_account(default_render: Render) -> None:
    render = default_render
    expected = {
        ("RoleBinding", f"{FULLNAME}-operator"): ("Role", OPERATOR_SA, NAMESPACE),
        ("RoleBinding", f"{FULLNAME}-agent"): ("Role", AGENT_SA, NAMESPACE),
        ("RoleBinding", ELECTION_ROLE): ("Role", OPERATOR_SA, NAMESPACE),
        ("ClusterRoleBinding", f"{FULLNAME}-operator-cluster"): (
            "ClusterRole", OPERATOR_SA, NAMESPACE
        ),
    }
    bindings = render.of_kind("RoleBinding") + render.of_kind("ClusterRoleBinding")
    assert len(bindings) == len(expected)
    for binding in bindings:
        role_kind, account, namespace = expected[(binding["kind"], binding["metadata"]["name"])]
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": role_kind,
            "name": binding["metadata"]["name"],
        }
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": account, "namespace": namespace}
        ]
    deployment_sa = _operator(render)["spec"]["template"]["spec"]["serviceAccountName"]
    assert deployment_sa == OPERATOR_SA
    assert {sa["metadata"]["name"] for sa in render.of_kind("ServiceAccount")} == {
        OPERATOR_SA, AGENT_SA
    }


def test_rbac_off_renders_no_rbac(render_with: Any) -> None:
    render = render_with("--set", "rbac.create=false")
    kinds = {o["kind"] for o in render.objects}
    assert kinds.isdisjoint({"Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"})


def test_existing_service_accounts_are_used_by_name(render_with: Any) -> None:
    render = render_with(
        "--set", "operator.serviceAccount.create=false",
        "--set", "operator.serviceAccount.name=platform-op",
        "--set", "agent.serviceAccount.create=false",
        "--set", "agent.serviceAccount.name=platform-agent",
    )
    assert render.of_kind("ServiceAccount") == []
    assert _operator(render)["spec"]["template"]["spec"]["serviceAccountName"] == "platform-op"
    assert _env(render)["FLEXKV_AGENT_SERVICE_ACCOUNT"] == "platform-agent"
    subjects = render.one("RoleBinding", f"{FULLNAME}-operator")["subjects"]
    assert subjects[0]["name"] == "platform-op"


# ------------------------------------------------------------------- opt-ins


def test_monitoring_and_example_pool_are_off_by_default(default_render: Render) -> None:
    kinds = {o["kind"] for o in default_render.objects}
    assert "PodMonitor" not in kinds and "KVCachePool" not in kinds
    assert default_render.of_kind("ConfigMap") == []


def test_operator_pod_monitor_scrapes_its_metrics_port(renders: dict[str, Render]) -> None:
    render = renders["monitoring-values.yaml"]
    monitor = render.one("PodMonitor", f"{FULLNAME}-operator")
    assert monitor["spec"]["selector"]["matchLabels"] == (
        _operator(render)["spec"]["selector"]["matchLabels"]
    )
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"


def test_pod_monitor_scrapes_agent_http_port(renders: dict[str, Render]) -> None:
    monitor = renders["monitoring-values.yaml"].one("PodMonitor", f"{FULLNAME}-agents")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["selector"] == {
        "matchLabels": {"app.kubernetes.io/name": "flexkv-agent"}
    }
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
    assert endpoint["interval"] == "30s" and endpoint["scrapeTimeout"] == "10s"
    targets = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
    assert targets["pool"] == ["__meta_kubernetes_pod_label_flexkv_io_pool"]


def test_example_pool_uses_the_release_namespace(renders: dict[str, Render]) -> None:
    pool = renders["example-pool-values.yaml"].one("KVCachePool", "demo")
    assert pool["metadata"]["namespace"] == NAMESPACE
    assert pool["spec"]["backend"] == "embedded"
    assert pool["spec"]["tiers"]["cpu"]["size"] == "4Gi"


def test_several_replicas_example_has_one_agent_serve_four_engines_per_node(
        renders: dict[str, Render]) -> None:
    pool = renders["several-replicas-values.yaml"].one("KVCachePool", "llama-8b")
    assert pool["spec"]["maxStages"] == 4
    assert pool["spec"]["expectedRanks"] == 4
    assert pool["spec"]["tokensPerBlock"] == 128
    # Four replicas of one model hold one backend: it gets the node's whole budget.
    assert pool["spec"]["tierShares"] == 1
    config = parse_pool_spec(pool["spec"], "img:1")
    agent = config_from_mapping(children.agent_config(
        PoolIdentity("llama-8b", NAMESPACE, {}), config))
    assert (agent.max_stages, agent.shares, agent.tiers.cpu.size) == (4, 1, 64 << 30)


# ------------------------------------------------------------------------ NOTES


@pytest.fixture(scope="module")
def notes_chart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the chart whose NOTES.txt is also rendered into a ConfigMap
    (helm template never prints NOTES.txt)."""
    copy = tmp_path_factory.mktemp("chart") / "flexkv-operator"
    shutil.copytree(CHART, copy)
    text = (copy / "templates" / "NOTES.txt").read_text()
    (copy / "templates" / "_notes_check.tpl").write_text(
        '{{- define "notes.check" -}}\n' + text + "\n{{- end }}\n"
    )
    (copy / "templates" / "notes-check.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes-check\ndata:\n"
        '  notes: |-\n{{ include "notes.check" . | indent 4 }}\n'
    )
    return copy


def _notes(helm: str, chart: Path, *args: str) -> str:
    out = run_helm(helm, "template", RELEASE, str(chart), "--namespace", NAMESPACE,
                   "--show-only", "templates/notes-check.yaml", *args).stdout
    rendered: str = yaml.safe_load(out)["data"]["notes"]
    assert "{{" not in rendered and "<no value>" not in rendered, rendered
    return rendered


def test_notes_give_real_commands(helm: str, notes_chart: Path) -> None:
    notes = _notes(helm, notes_chart, "--set", "examplePool.enabled=true")
    assert "kubectl get kvcachepools -A" in notes
    assert f"rollout status deployment/{FULLNAME}" in notes
    assert "describe kvcachepool example" in notes
    assert "-l app.kubernetes.io/name=flexkv-agent" in notes
    assert f"NS={NAMESPACE}" in notes
    assert 'port-forward "pod/$POD" 8080:8080' in notes
    assert "curl -s http://127.0.0.1:8080/status" in notes


def test_notes_point_at_a_pool_namespace(helm: str, notes_chart: Path) -> None:
    values = CHART / "ci" / "multi-namespace-values.yaml"
    with_pool = _notes(helm, notes_chart, "--values", str(values))
    assert "NS=llm-staging" in with_pool
    assert "The operator watches: llm-prod, llm-staging." in with_pool
    without_pool = _notes(helm, notes_chart, "--values", str(values),
                          "--set", "examplePool.enabled=false")
    assert "NS=llm-prod" in without_pool
    everywhere = _notes(helm, notes_chart, "--set", "operator.watch.allNamespaces=true")
    assert "The operator watches every namespace." in everywhere


def test_chart_files_are_all_templated(helm: str) -> None:
    """No template file renders to nothing by accident in the fullest configuration."""
    templates = {str(p.relative_to(CHART / "templates"))
                 for p in (CHART / "templates").rglob("*.yaml")}
    out = run_helm(
        helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
        "--set", "monitoring.podMonitor.enabled=true", "--set", "monitoring.dashboard.enabled=true",
        "--set", "monitoring.prometheusRule.enabled=true",
        "--set", "examplePool.enabled=true", "--set", "networkPolicy.enabled=true",
        "--set", "admissionPolicy.enabled=true", "--kube-version", "1.30.0",
    ).stdout
    sources = {line.split("/templates/", 1)[1] for line in out.splitlines()
               if line.startswith("# Source: ")}
    assert sources == templates
