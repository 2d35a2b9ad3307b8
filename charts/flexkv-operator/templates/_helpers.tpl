{{/*
Names, labels and derived values shared by every template. All helpers are
prefixed "flexkv-operator." so they never collide with a parent chart's.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "flexkv-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The release-qualified name used as the prefix of every object, cut to 63
characters (DNS-1123 label). A release already named like the chart is not
repeated.
*/}}
{{- define "flexkv-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "<chart>-<version>" for the helm.sh/chart label. */}}
{{- define "flexkv-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object the chart renders, commonLabels last. */}}
{{- define "flexkv-operator.labels" -}}
helm.sh/chart: {{ include "flexkv-operator.chart" . }}
{{ include "flexkv-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: flexkv
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Labels that select the operator's pods; never change them on upgrade. */}}
{{- define "flexkv-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "flexkv-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The operator's ServiceAccount name. */}}
{{- define "flexkv-operator.operatorServiceAccountName" -}}
{{- default (printf "%s-operator" (include "flexkv-operator.fullname" . | trunc 54 | trimSuffix "-")) .Values.operator.serviceAccount.name }}
{{- end }}

{{/* The agents' ServiceAccount name (the same in every agent namespace). */}}
{{- define "flexkv-operator.agentServiceAccountName" -}}
{{- default (printf "%s-agent" (include "flexkv-operator.fullname" . | trunc 57 | trimSuffix "-")) .Values.agent.serviceAccount.name }}
{{- end }}

{{/* The image tag: image.tag, or the chart's appVersion. */}}
{{- define "flexkv-operator.imageTag" -}}
{{- default .Chart.AppVersion .Values.image.tag }}
{{- end }}

{{/*
An image reference from (dict "root" $ "repository" r "tag" t "digest" d):
global.imageRegistry in front of the repository when set, then "@digest" when
a digest is given, else ":tag".
*/}}
{{- define "flexkv-operator.imageRef" -}}
{{- $repo := .repository }}
{{- with .root.Values.global.imageRegistry }}
{{- $repo = printf "%s/%s" (trimSuffix "/" .) $repo }}
{{- end }}
{{- if .digest }}
{{- printf "%s@%s" $repo .digest }}
{{- else }}
{{- printf "%s:%s" $repo .tag }}
{{- end }}
{{- end }}

{{/* The operator image reference. */}}
{{- define "flexkv-operator.image" -}}
{{- include "flexkv-operator.imageRef" (dict "root" . "repository" .Values.image.repository "tag" (include "flexkv-operator.imageTag" .) "digest" .Values.image.digest) }}
{{- end }}

{{/* The agent image reference handed to the operator (FLEXKV_AGENT_IMAGE). */}}
{{- define "flexkv-operator.agentImage" -}}
{{- $tag := default (include "flexkv-operator.imageTag" .) .Values.agent.image.tag }}
{{- include "flexkv-operator.imageRef" (dict "root" . "repository" .Values.agent.image.repository "tag" $tag "digest" .Values.agent.image.digest) }}
{{- end }}

{{/*
The namespaces the operator watches, as a JSON list (read it back with
fromJsonArray). Empty in all-namespaces mode.
*/}}
{{- define "flexkv-operator.watchNamespaces" -}}
{{- if .Values.operator.watch.allNamespaces }}
{{- list | toJson }}
{{- else if .Values.operator.watch.namespaces }}
{{- .Values.operator.watch.namespaces | uniq | toJson }}
{{- else }}
{{- list .Release.Namespace | toJson }}
{{- end }}
{{- end }}

{{/*
The namespaces that get the agent ServiceAccount and Role, as a JSON list:
agent.namespaces, else the watched namespaces, else the release namespace.
*/}}
{{- define "flexkv-operator.agentNamespaces" -}}
{{- if .Values.agent.namespaces }}
{{- .Values.agent.namespaces | uniq | toJson }}
{{- else if and (not .Values.operator.watch.allNamespaces) .Values.operator.watch.namespaces }}
{{- .Values.operator.watch.namespaces | uniq | toJson }}
{{- else }}
{{- list .Release.Namespace | toJson }}
{{- end }}
{{- end }}

{{/*
The operator's namespaced permissions, used by its Role in each watched
namespace or by its ClusterRole in all-namespaces mode. Each verb is one the
operator uses (docs/helm.md, "RBAC"): kopf watches pools, agent Leases and the
agents' DaemonSets; every reconcile re-reads its pool by name (get); the
operator writes pool and group status through the status subresource,
creates and merge-patches groups and pool children (never PUT, so no
"update"), deletes groups whose replica is gone (children go by
owner reference), deletes a pool's managed mooncake_master (Deployment and
Service) when the pool turns it off, deletes the Leases of agents whose node
left the cluster, and posts Events. tests/chart checks this exact list.
*/}}
{{- define "flexkv-operator.operatorNamespacedRules" -}}
- apiGroups: ["flexkv.io"]
  resources: ["kvcachepools"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["flexkv.io"]
  resources: ["kvcachepools/status"]
  verbs: ["patch"]
- apiGroups: ["flexkv.io"]
  resources: ["kvcachegroups"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["flexkv.io"]
  resources: ["kvcachegroups/status"]
  verbs: ["patch"]
- apiGroups: ["apps"]
  resources: ["daemonsets"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["configmaps", "secrets"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["list", "watch", "delete"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end }}

{{/*
All-namespaces mode splits the rules above in two, so that no Secret and no
DaemonSet anywhere else in the cluster is within the operator's reach:
cluster-wide (ClusterRole), what pools can need in any namespace: read and
watch pools, groups, DaemonSets and Leases, write pool and group status and
groups, post Events ...
*/}}
{{- define "flexkv-operator.operatorClusterWideRules" -}}
- apiGroups: ["flexkv.io"]
  resources: ["kvcachepools"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["flexkv.io"]
  resources: ["kvcachepools/status"]
  verbs: ["patch"]
- apiGroups: ["flexkv.io"]
  resources: ["kvcachegroups"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["flexkv.io"]
  resources: ["kvcachegroups/status"]
  verbs: ["patch"]
- apiGroups: ["apps"]
  resources: ["daemonsets"]
  verbs: ["list", "watch"]
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["list", "watch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end }}

{{/*
... and, in each agent namespace only (a Role), the agents' children:
DaemonSet, Services, ConfigMap, CurveZMQ Secret, PodDisruptionBudget, the
managed mooncake_master's Deployment and Service, and the deletion of Leases of
agents whose node left.
*/}}
{{- define "flexkv-operator.operatorAgentNamespaceRules" -}}
- apiGroups: ["apps"]
  resources: ["daemonsets"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["configmaps", "secrets"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["delete"]
{{- end }}
