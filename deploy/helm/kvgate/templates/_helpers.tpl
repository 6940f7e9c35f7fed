{{/* Names and labels shared by every template. */}}
{{- define "kvgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvgate.fullname" -}}
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

{{- define "kvgate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kvgate.labels" -}}
helm.sh/chart: {{ include "kvgate.chart" . }}
{{ include "kvgate.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "kvgate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvgate.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The kvgate TOML as mounted: the user's config, plus [server.tls] when TLS is on. */}}
{{- define "kvgate.config" -}}
{{ .Values.config }}
{{- if .Values.tls.enabled }}

# Added by the chart (tls.enabled): the Secret is mounted at /etc/kvgate-tls.
[server.tls]
cert = "/etc/kvgate-tls/tls.crt"
key = "/etc/kvgate-tls/tls.key"
{{- end }}
{{- if .Values.cluster.natsUrl }}

# Added by the chart (cluster.natsUrl): the replicas share routing state over NATS
# (docs/cluster.md); replica_id defaults to the pod name.
[cluster]
nats_url = {{ .Values.cluster.natsUrl | quote }}
subject_prefix = {{ .Values.cluster.subjectPrefix | default (include "kvgate.fullname" .) | quote }}
heartbeat_interval_ms = {{ .Values.cluster.heartbeatIntervalMs | int }}
heartbeat_timeout_ms = {{ .Values.cluster.heartbeatTimeoutMs | int }}
{{- end }}
{{- if (include "kvgate.watchPool" .) }}

# Added by the chart (epp.inferencePool.watch): the members are the Ready pods of this
# InferencePool, watched on the API server with the pod's service account (docs/epp.md).
[[worker_pools]]
inference_pool = {{ include "kvgate.poolName" . | quote }}
inference_pool_group = {{ .Values.epp.inferencePool.group | quote }}
namespace = {{ .Release.Namespace | quote }}
{{- with .Values.epp.inferencePool.workerPool }}
{{ . }}
{{- end }}
{{- end }}
{{- end }}

{{/* The InferencePool's name: epp.inferencePool.name, else the release's full name. */}}
{{- define "kvgate.poolName" -}}
{{ .Values.epp.inferencePool.name | default (include "kvgate.fullname" .) }}
{{- end }}

{{/* Non-empty when kvgate watches an InferencePool (EPP mode with epp.inferencePool.watch). */}}
{{- define "kvgate.watchPool" -}}
{{- if and .Values.epp.enabled .Values.epp.inferencePool.watch }}true{{ end }}
{{- end }}
