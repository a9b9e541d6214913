{{/* Chart name, overridable with nameOverride. */}}
{{- define "flowmill.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name of the release's resources: <release>-<chart>, or the release name alone when it
already contains the chart name. Kubernetes names are at most 63 characters.
*/}}
{{- define "flowmill.fullname" -}}
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

{{/*
Name of cluster-scoped objects (ClusterRole, ClusterRoleBinding): they share one cluster-wide
namespace, so the release namespace is part of the name and releases of the same name in
two namespaces do not collide.
*/}}
{{- define "flowmill.clusterName" -}}
{{- printf "%s-%s" .Release.Namespace (include "flowmill.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "flowmill.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "flowmill.selectorLabels" -}}
app.kubernetes.io/name: {{ include "flowmill.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "flowmill.labels" -}}
helm.sh/chart: {{ include "flowmill.chart" . }}
{{ include "flowmill.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: flowmill
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "flowmill.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "flowmill.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name must name an existing ServiceAccount when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "flowmill.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The namespaces watched in namespace scope, as a JSON list (default: the release's). */}}
{{- define "flowmill.watchNamespaces" -}}
{{- if .Values.watchNamespaces }}
{{- toJson (uniq .Values.watchNamespaces) }}
{{- else }}
{{- toJson (list .Release.Namespace) }}
{{- end }}
{{- end }}

{{- define "flowmill.peeringName" -}}
{{- default (include "flowmill.fullname" .) .Values.kopf.peering.name }}
{{- end }}

{{/*
RBAC rules on namespaced resources: exactly what the operator does with them (delete on
trainingjobs: ttlSecondsAfterFinished). Secrets are absent on purpose: pods reference them
with secretKeyRef and the kubelet resolves them.
*/}}
{{- define "flowmill.namespacedRules" -}}
- apiGroups: ["flowmill.dev"]
  resources: ["trainingjobs"]
  verbs: ["get", "list", "watch", "patch", "update", "delete"]
- apiGroups: ["flowmill.dev"]
  resources: ["trainingjobs/status"]
  verbs: ["get", "patch", "update"]
# Owner references with blockOwnerDeletion on the job's pods and Services need this where
# the OwnerReferencesPermissionEnforcement admission plugin is on (e.g. OpenShift).
- apiGroups: ["flowmill.dev"]
  resources: ["trainingjobs/finalizers"]
  verbs: ["update"]
- apiGroups: [""]
  resources: ["pods", "services"]
  verbs: ["get", "list", "watch", "create", "delete"]
# Each job's NetworkPolicy: its tasks take traffic from its own pods and the operator.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create", "delete"]
# Each job's certificates (spec.security.tls): the Secret <job>-tls, read, written and
# rotated by name; never listed or watched, so no other Secret's data reaches the operator.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create", "update", "delete"]
# Each gang-scheduled job's PodGroup (runPolicy.gangScheduling), by name.
- apiGroups: ["scheduling.k8s.io"]
  resources: ["podgroups"]
  verbs: ["get", "create", "delete"]
# A queued job's Kueue Workload (label kueue.x-k8s.io/queue-name): made, watched, and its
# status answered (an eviction acknowledged, the job's end reported).
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["get", "list", "watch", "create", "delete"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads/status"]
  verbs: ["get", "update"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end }}

{{/* Cluster-scoped reads for jobs in a Kueue queue: the admitted ResourceFlavors (their
node labels and tolerations go on the pods) and the class that gives a job its priority. */}}
{{- define "flowmill.queueingRules" -}}
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["resourceflavors", "workloadpriorityclasses"]
  verbs: ["get"]
- apiGroups: ["scheduling.k8s.io"]
  resources: ["priorityclasses"]
  verbs: ["get"]
{{- end }}

{{/* kopf's peering objects: kopf reads them and patches its own presence into them. */}}
{{- define "flowmill.peeringRule" -}}
- apiGroups: ["kopf.dev"]
  resources: [{{ . | quote }}]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}
