{{/* Names, labels and small computed values shared by the templates. */}}

{{- define "pstrain.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* "<release>-pstrain", or the release name when it already contains the chart name. */}}
{{- define "pstrain.fullname" -}}
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

{{- define "pstrain.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pstrain.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pstrain.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "pstrain.labels" -}}
helm.sh/chart: {{ include "pstrain.chart" . }}
{{ include "pstrain.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pstrain
{{- end }}

{{- define "pstrain.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pstrain.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* "repository@digest" when a digest is set, else "repository:tag" (tag defaults to appVersion). */}}
{{- define "pstrain.imageRef" -}}
{{- $image := index . 0 }}
{{- $root := index . 1 }}
{{- if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag) }}
{{- end }}
{{- end }}

{{/* True (non-empty) when the operator serves only the namespaces in watchNamespaces. */}}
{{- define "pstrain.namespaced" -}}
{{- if .Values.watchNamespaces }}true{{ end }}
{{- end }}

{{/* Refuse value combinations that would run two active operators, or scrape nothing. */}}
{{- define "pstrain.checkValues" -}}
{{- if and (gt (int .Values.replicaCount) 1) (not .Values.leaderElection.enabled) }}
{{- fail (printf "replicaCount is %d; it must be 1 unless leaderElection.enabled is true, or several operators would act on the same jobs." (int .Values.replicaCount)) }}
{{- end }}
{{- if and .Values.metrics.serviceMonitor.enabled (not .Values.metrics.service.enabled) }}
{{- fail "metrics.serviceMonitor.enabled is true but metrics.service.enabled is false; the ServiceMonitor scrapes that Service, so enable it too." }}
{{- end }}
{{- if eq (int .Values.metrics.port) (int .Values.health.port) }}
{{- fail (printf "metrics.port and health.port are both %d; they must differ." (int .Values.metrics.port)) }}
{{- end }}
{{- end }}
