{{/* Full name: the release name, plus the chart name unless already in it. */}}
{{- define "phasefleet.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "phasefleet.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "phasefleet.labels" -}}
{{ include "phasefleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/*
The operator's ServiceAccount. Never the namespace's `default` one: the chart's RBAC would
then also go to every pod in the namespace that runs without a ServiceAccount of its own.
*/}}
{{- define "phasefleet.serviceAccountName" -}}
{{- $name := .Values.serviceAccount.name -}}
{{- if .Values.serviceAccount.create -}}
{{- $name = default (include "phasefleet.fullname" .) $name -}}
{{- else if empty $name -}}
{{- fail "serviceAccount.name is required when serviceAccount.create is false: name an existing ServiceAccount for the operator (the chart never binds rights to the namespace's default ServiceAccount)" -}}
{{- end -}}
{{- if eq $name "default" -}}
{{- fail "serviceAccount.name may not be \"default\": the chart's RBAC would go to every pod in the namespace that has no ServiceAccount of its own; pick another name" -}}
{{- end -}}
{{- $name -}}
{{- end -}}

{{/*
The operator's permissions, shared by the ClusterRole (all namespaces) and the per-namespace
Roles. docs/operator.md explains each rule.
*/}}
{{- define "phasefleet.rules" -}}
# Watch InferenceServices; patch them for kopf's progress and last-handled-spec annotations.
- apiGroups: [serving.phasefleet.dev]
  resources: [inferenceservices]
  verbs: [get, list, watch, patch]
# Write status (server-side apply on the status subresource).
- apiGroups: [serving.phasefleet.dev]
  resources: [inferenceservices/status]
  verbs: [get, patch]
# Children carry ownerReferences with blockOwnerDeletion, which needs update on finalizers.
- apiGroups: [serving.phasefleet.dev]
  resources: [inferenceservices/finalizers]
  verbs: [update]
# The children: server-side apply (create + patch), watch for drift, delete when unwanted.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, delete]
# The router's own identity: a ServiceAccount bound to a Role that reads EndpointSlices.
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, list, watch, create, patch, delete]
# Kubernetes lets a Role grant only what its creator holds: the router's Role reads these.
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
# Each service's internal token: created once, never read back (no get, list or watch).
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
# Check that the model's PVC (or a named model cache claim) exists before creating pods that
# would hang on it; create spec.model.cache.pvc's claim once (owned by the service, so the
# garbage collector deletes it). Never updated, patched or deleted; no list or watch.
- apiGroups: [""]
  resources: [persistentvolumeclaims]
  verbs: [get, create]
# Read why a pool's pods cannot run (unschedulable, a missing token Secret, a container's
# last words), by label, for status: the watch is how a failing pod, which changes no
# Deployment, reaches the Degraded condition. The autoscaler marks the pod a scale-down
# removes first (pod-deletion-cost annotation).
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch, patch]
{{- if .Values.rbac.readSecrets }}
# Opt-in: check that the Hugging Face token Secret and key exist before creating pods (get by
# name only; no list/watch). With a ClusterRole this is every Secret in the cluster.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
{{- end }}
# Events on InferenceServices: Created, Updated, DriftCorrected, and errors.
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- end -}}
