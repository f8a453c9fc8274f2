{{- define "vllm-capacity.labels" -}}
app.kubernetes.io/name: vllm-capacity
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "vllm-capacity.podMetricsEndpoint" -}}
- port: {{ .port }}
  path: /metrics
  interval: {{ .interval }}
  {{- with .scheme }}
  scheme: {{ . }}
  {{- end }}
  {{- with .basicAuth }}
  basicAuth:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .tlsConfig }}
  tlsConfig:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  relabelings:
    - sourceLabels: [__meta_kubernetes_namespace]
      targetLabel: namespace
    - sourceLabels: [__meta_kubernetes_pod_name]
      targetLabel: pod
    - targetLabel: job
      replacement: {{ .job }}
{{- end }}

{{/* The PodMonitors' namespaceSelector: the namespaces named in matchNames when there are any (narrower than any,
which Helm's merge of the defaults would otherwise keep beside them), else any. */}}
{{- define "vllm-capacity.namespaceSelector" -}}
{{- with .Values.namespaceSelector.matchNames -}}
matchNames:
  {{- toYaml . | nindent 2 }}
{{- else -}}
any: {{ .Values.namespaceSelector.any }}
{{- end -}}
{{- end }}
