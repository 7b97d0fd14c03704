{{/* Names and labels shared by every object. */}}
{{- define "priod.name" -}}priod{{- end -}}

{{- define "priod.fullname" -}}
{{- if eq .Release.Name "priod" -}}priod{{- else -}}{{ printf "%s-priod" .Release.Name | trunc 63 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "priod.selectorLabels" -}}
app.kubernetes.io/name: priod
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "priod.labels" -}}
{{ include "priod.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: node-daemon
{{- if not .Values.plain }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}
{{- end -}}

{{- define "priod.priorityClassName" -}}
{{- if .Values.priorityClass.create -}}{{ .Values.priorityClass.name }}{{- else -}}{{ .Values.priorityClassName }}{{- end -}}
{{- end -}}

{{/* The daemon's config: the operator's settings, then what the chart must fix. */}}
{{- define "priod.config" -}}
{{ .Values.config }}
[metrics]
address = "0.0.0.0"
port = {{ .Values.metrics.port | int }}
{{- end -}}
