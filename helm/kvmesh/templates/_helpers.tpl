{{/* Names, labels and shared snippets of the kvmesh chart. */}}

{{- define "kvmesh.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Resource name prefix: release + chart, unless the release name already holds the chart name. */}}
{{- define "kvmesh.fullname" -}}
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

{{/* Name of one component's resources: (dict "root" $ "component" "indexer"). */}}
{{- define "kvmesh.componentName" -}}
{{- printf "%s-%s" (include "kvmesh.fullname" .root | trunc 50 | trimSuffix "-") .component }}
{{- end }}

{{- define "kvmesh.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every resource of a component: (dict "root" $ "component" "indexer"). */}}
{{- define "kvmesh.labels" -}}
helm.sh/chart: {{ include "kvmesh.chart" .root }}
{{ include "kvmesh.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: kvmesh
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of a component: (dict "root" $ "component" "indexer"). */}}
{{- define "kvmesh.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvmesh.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kvmesh.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvmesh.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The kvmesh image reference from a values map (the chart's, or a parent's .Values.kvmesh). */}}
{{- define "kvmesh.image" -}}
{{- printf "%s:%s" .image.repository .image.tag }}
{{- end }}

{{/* Host:port of a component's Service inside the cluster. */}}
{{- define "kvmesh.serviceHost" -}}
{{- printf "%s.%s.svc" (include "kvmesh.componentName" .) .root.Release.Namespace }}
{{- end }}

{{/* The Redis URL the indexer uses, before the password is spliced in. */}}
{{- define "kvmesh.redisUrl" -}}
{{- $r := .Values.redis }}
{{- if $r.external.url }}
{{- $r.external.url }}
{{- else }}
{{- printf "redis://%s:%d/0" (include "kvmesh.serviceHost" (dict "root" . "component" "redis")) (int $r.internal.port) }}
{{- end }}
{{- end }}

{{/*
Environment of the indexer's Redis connection. The password comes from a Secret
into KVMESH_REDIS_PASSWORD and is spliced into the URL by Kubernetes' $(VAR)
expansion, so it never appears in the pod spec.
*/}}
{{- define "kvmesh.redisEnv" -}}
{{- $r := .Values.redis }}
{{- $url := include "kvmesh.redisUrl" . }}
{{- if and $r.external.url $r.external.passwordSecret.name }}
- name: KVMESH_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $r.external.passwordSecret.name }}
      key: {{ $r.external.passwordSecret.key }}
{{- $url = regexReplaceAll "^(rediss?)://" $url "${1}://:$$(KVMESH_REDIS_PASSWORD)@" }}
{{- end }}
{{- if and $r.external.url $r.external.tls.enabled $r.external.tls.caSecret.name }}
{{- $sep := ternary "&" "?" (contains "?" $url) }}
{{- $url = printf "%s%sssl_ca_certs=/etc/kvmesh/redis-tls/ca.crt" $url $sep }}
{{- end }}
- name: KVMESH_INDEXER_REDIS__URL
  value: {{ $url | quote }}
- name: KVMESH_INDEXER_REDIS__PREFIX
  value: {{ $r.prefix | quote }}
{{- if $r.cluster }}
- name: KVMESH_INDEXER_REDIS__CLUSTER
  value: "true"
{{- end }}
{{- end }}

{{/* Volumes every kvmesh pod gets: a writable /tmp under a read-only root filesystem. */}}
{{- define "kvmesh.tmpVolume" -}}
- name: tmp
  emptyDir:
    sizeLimit: 64Mi
{{- end }}

{{- define "kvmesh.tmpMount" -}}
- name: tmp
  mountPath: /tmp
{{- end }}

{{/* Scheduling keys shared by the component Deployments: pass the component's values. */}}
{{- define "kvmesh.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
