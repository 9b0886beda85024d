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

{{- define "phasefleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "phasefleet.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
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
# Check that the model's PVC exists before creating pods that would hang on it.
- apiGroups: [""]
  resources: [persistentvolumeclaims]
  verbs: [get]
{{- if .Values.rbac.readSecrets }}
# Check that the Hugging Face token Secret and key exist (get by name only; no list/watch).
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
{{- end }}
# Events on InferenceServices: Created, Updated, DriftCorrected, and errors.
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- end -}}
