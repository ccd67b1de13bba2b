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

{{/* Name of the indexer's headless Service (indexer.service.headless), within 63 characters. */}}
{{- define "kvmesh.indexerHeadlessName" -}}
{{- printf "%s-headless" (include "kvmesh.componentName" (dict "root" . "component" "indexer") | trunc 54 | trimSuffix "-") }}
{{- end }}

{{/* The router's gRPC target of every ready indexer replica: dns:///<headless>.<ns>.svc:<port>. */}}
{{- define "kvmesh.indexerHeadlessTarget" -}}
{{- printf "dns:///%s.%s.svc:%d" (include "kvmesh.indexerHeadlessName" .) .Release.Namespace (int .Values.indexer.service.grpcPort) }}
{{- end }}

{{/* The Redis URL the indexer uses (never with credentials: they come from files). */}}
{{- define "kvmesh.redisUrl" -}}
{{- $r := .Values.redis }}
{{- if $r.external.url }}
{{- $r.external.url }}
{{- else }}
{{- printf "redis://%s:%d/0" (include "kvmesh.serviceHost" (dict "root" . "component" "redis")) (int $r.internal.port) }}
{{- end }}
{{- end }}

{{/* Secret and key of the in-chart Redis's password: the given Secret, or the generated one. */}}
{{- define "kvmesh.redisAuthSecretName" -}}
{{- .Values.redis.internal.auth.existingSecret.name | default (printf "%s-auth" (include "kvmesh.componentName" (dict "root" . "component" "redis"))) }}
{{- end }}

{{- define "kvmesh.redisAuthSecretKey" -}}
{{- if .Values.redis.internal.auth.existingSecret.name }}
{{- .Values.redis.internal.auth.existingSecret.key }}
{{- else -}}
password
{{- end }}
{{- end }}

{{/*
Files the indexer reads its Redis credentials and TLS material from, each a
Secret mounted as a directory (no subPath, so a rotated Secret reaches the
pod): a dict of volume name -> (mountPath, file, Secret, key) as JSON.
*/}}
{{- define "kvmesh.redisFiles" -}}
{{- $r := .Values.redis }}
{{- $files := dict }}
{{- if $r.external.url }}
{{- if $r.external.passwordSecret.name }}
{{- $_ := set $files "redis-auth" (dict "dir" "/etc/kvmesh/redis-auth" "secret" $r.external.passwordSecret.name "items" (list (dict "key" $r.external.passwordSecret.key "path" "password"))) }}
{{- end }}
{{- if $r.external.tls.enabled }}
{{- if $r.external.tls.caSecret.name }}
{{- $_ := set $files "redis-tls-ca" (dict "dir" "/etc/kvmesh/redis-tls" "secret" $r.external.tls.caSecret.name "items" (list (dict "key" $r.external.tls.caSecret.key "path" "ca.crt"))) }}
{{- end }}
{{- if $r.external.tls.clientCertSecret.name }}
{{- $_ := set $files "redis-client-tls" (dict "dir" "/etc/kvmesh/redis-client-tls" "secret" $r.external.tls.clientCertSecret.name "items" (list (dict "key" "tls.crt" "path" "tls.crt") (dict "key" "tls.key" "path" "tls.key"))) }}
{{- end }}
{{- end }}
{{- else if and $r.internal.enabled $r.internal.auth.enabled }}
{{- $_ := set $files "redis-auth" (dict "dir" "/etc/kvmesh/redis-auth" "secret" (include "kvmesh.redisAuthSecretName" .) "items" (list (dict "key" (include "kvmesh.redisAuthSecretKey" .) "path" "password"))) }}
{{- end }}
{{- toJson $files }}
{{- end }}

{{/*
Environment of the indexer's Redis connection. Credentials are files (a
mounted Secret), so no password is in the pod spec, the URL or the process
environment; the indexer re-reads the password file on every new connection.
*/}}
{{- define "kvmesh.redisEnv" -}}
{{- $r := .Values.redis }}
{{- $files := include "kvmesh.redisFiles" . | fromJson }}
- name: KVMESH_INDEXER_REDIS__URL
  value: {{ include "kvmesh.redisUrl" . | quote }}
- name: KVMESH_INDEXER_REDIS__PREFIX
  value: {{ $r.prefix | quote }}
{{- if $r.cluster }}
- name: KVMESH_INDEXER_REDIS__CLUSTER
  value: "true"
{{- end }}
{{- if $r.external.url }}
{{- if $r.external.usernameSecret.name }}
- name: KVMESH_INDEXER_REDIS__USERNAME
  valueFrom:
    secretKeyRef:
      name: {{ $r.external.usernameSecret.name }}
      key: {{ $r.external.usernameSecret.key }}
{{- else if $r.external.username }}
- name: KVMESH_INDEXER_REDIS__USERNAME
  value: {{ $r.external.username | quote }}
{{- end }}
{{- if $r.external.tls.enabled }}
- name: KVMESH_INDEXER_REDIS__TLS_CHECK_HOSTNAME
  value: {{ ternary "true" "false" $r.external.tls.checkHostname | quote }}
{{- end }}
{{- else if and $r.internal.enabled $r.internal.auth.enabled }}
- name: KVMESH_INDEXER_REDIS__USERNAME
  value: {{ $r.internal.auth.username | quote }}
{{- end }}
{{- with (get $files "redis-auth") }}
- name: KVMESH_INDEXER_REDIS__PASSWORD_FILE
  value: {{ printf "%s/password" .dir | quote }}
{{- end }}
{{- with (get $files "redis-tls-ca") }}
- name: KVMESH_INDEXER_REDIS__TLS_CA_FILE
  value: {{ printf "%s/ca.crt" .dir | quote }}
{{- end }}
{{- with (get $files "redis-client-tls") }}
- name: KVMESH_INDEXER_REDIS__TLS_CERT_FILE
  value: {{ printf "%s/tls.crt" .dir | quote }}
- name: KVMESH_INDEXER_REDIS__TLS_KEY_FILE
  value: {{ printf "%s/tls.key" .dir | quote }}
{{- end }}
{{- end }}

{{/* Mounts and volumes of the Redis credential files (kvmesh.redisFiles). */}}
{{- define "kvmesh.redisMounts" -}}
{{- range $name, $f := include "kvmesh.redisFiles" . | fromJson }}
- name: {{ $name }}
  mountPath: {{ $f.dir }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "kvmesh.redisVolumes" -}}
{{- range $name, $f := include "kvmesh.redisFiles" . | fromJson }}
- name: {{ $name }}
  secret:
    secretName: {{ $f.secret }}
    defaultMode: 0440
    items:
      {{- toYaml $f.items | nindent 6 }}
{{- end }}
{{- end }}

{{/* -- TLS and authorization of the kvmesh servers ----------------------------------- */}}

{{/*
The TLS Secret of a component, "" for plaintext: (dict "root" $ "component" "indexer").
Its own name in tls.secretNames, else the one cert-manager writes, else the shared one.
*/}}
{{- define "kvmesh.tlsSecretName" -}}
{{- $t := .root.Values.tls }}
{{- if $t.enabled }}
{{- $own := get $t.secretNames .component }}
{{- if $own }}
{{- $own }}
{{- else if and $t.certManager.issuerRef.name (has .component (list "indexer" "tee" "cachesim")) }}
{{- printf "%s-tls" (include "kvmesh.componentName" .) }}
{{- else }}
{{- $t.secretName }}
{{- end }}
{{- end }}
{{- end }}

{{/* Where a TLS server's files are: the Secret is mounted as a directory here. */}}
{{- define "kvmesh.tlsDir" -}}
/etc/kvmesh/tls
{{- end }}

{{/* The CA bundle file clients are verified with (and the tee verifies its sink with). */}}
{{- define "kvmesh.caFile" -}}
{{- if .Values.tls.caSecret.name -}}
/etc/kvmesh/tls-ca/ca.crt
{{- else -}}
/etc/kvmesh/tls/ca.crt
{{- end }}
{{- end }}

{{/* Where the policy file is, when authorization is on. */}}
{{- define "kvmesh.policyFile" -}}
{{- $a := .Values.auth }}
{{- if $a.existingConfigMap.name }}
{{- printf "/etc/kvmesh/policy/%s" $a.existingConfigMap.key }}
{{- else if $a.existingSecret.name }}
{{- printf "/etc/kvmesh/policy/%s" $a.existingSecret.key }}
{{- else -}}
/etc/kvmesh/policy/policy.yaml
{{- end }}
{{- end }}

{{/*
Server TLS and authorization environment of a component:
(dict "root" $ "component" "indexer" "prefix" "KVMESH_INDEXER_").
*/}}
{{- define "kvmesh.serverSecurityEnv" -}}
{{- $t := .root.Values.tls }}
{{- $secret := .secretName | default (include "kvmesh.tlsSecretName" .) }}
{{- if $secret }}
- name: {{ .prefix }}TLS__CERT_FILE
  value: {{ printf "%s/tls.crt" (include "kvmesh.tlsDir" .) | quote }}
- name: {{ .prefix }}TLS__KEY_FILE
  value: {{ printf "%s/tls.key" (include "kvmesh.tlsDir" .) | quote }}
{{- if $t.mutual }}
- name: {{ .prefix }}TLS__CLIENT_CA_FILE
  value: {{ include "kvmesh.caFile" .root | quote }}
- name: {{ .prefix }}TLS__CLIENT_AUTH
  value: {{ $t.clientAuth | quote }}
{{- end }}
- name: {{ .prefix }}TLS__RELOAD_INTERVAL_S
  value: {{ $t.reloadIntervalSeconds | quote }}
{{- end }}
{{- if and .root.Values.auth.enabled (not .noAuth) }}
- name: {{ .prefix }}AUTH__POLICY_FILE
  value: {{ include "kvmesh.policyFile" .root | quote }}
- name: {{ .prefix }}AUTH__RELOAD_INTERVAL_S
  value: {{ .root.Values.auth.reloadIntervalSeconds | quote }}
{{- end }}
{{- end }}

{{/* "mutual TLS", "TLS" or "PLAINTEXT": how a component serves, for NOTES.txt. */}}
{{- define "kvmesh.notesTransport" -}}
{{- if include "kvmesh.tlsSecretName" . }}{{ if .root.Values.tls.mutual }}mutual TLS{{ else }}TLS{{ end }}{{ else }}PLAINTEXT{{ end }}
{{- end }}

{{/* Volume mounts of kvmesh.serverSecurityEnv's files: same dict. */}}
{{- define "kvmesh.serverSecurityMounts" -}}
{{- $secret := .secretName | default (include "kvmesh.tlsSecretName" .) }}
{{- $pfx := .volumePrefix | default "" }}
{{- if $secret }}
- name: {{ $pfx }}tls
  mountPath: {{ include "kvmesh.tlsDir" . }}
  readOnly: true
{{- if .root.Values.tls.caSecret.name }}
- name: {{ $pfx }}tls-ca
  mountPath: /etc/kvmesh/tls-ca
  readOnly: true
{{- end }}
{{- end }}
{{- if and .root.Values.auth.enabled (not .noAuth) }}
- name: {{ $pfx }}policy
  mountPath: /etc/kvmesh/policy
  readOnly: true
{{- end }}
{{- end }}

{{/* Volumes of kvmesh.serverSecurityEnv's files: same dict. */}}
{{- define "kvmesh.serverSecurityVolumes" -}}
{{- $secret := .secretName | default (include "kvmesh.tlsSecretName" .) }}
{{- $pfx := .volumePrefix | default "" }}
{{- $a := .root.Values.auth }}
{{- if $secret }}
- name: {{ $pfx }}tls
  secret:
    secretName: {{ $secret }}
    defaultMode: 0440
{{- with .root.Values.tls.caSecret }}
{{- if .name }}
- name: {{ $pfx }}tls-ca
  secret:
    secretName: {{ .name }}
    defaultMode: 0440
    items:
      - key: {{ .key }}
        path: ca.crt
{{- end }}
{{- end }}
{{- end }}
{{- if and $a.enabled (not .noAuth) }}
- name: {{ $pfx }}policy
{{- if $a.existingConfigMap.name }}
  configMap:
    name: {{ $a.existingConfigMap.name }}
    items:
      - key: {{ $a.existingConfigMap.key }}
        path: {{ $a.existingConfigMap.key }}
{{- else if $a.existingSecret.name }}
  secret:
    secretName: {{ $a.existingSecret.name }}
    defaultMode: 0440
    items:
      - key: {{ $a.existingSecret.key }}
        path: {{ $a.existingSecret.key }}
{{- else if .policyConfigMap }}
  configMap:
    name: {{ .policyConfigMap }}
{{- else }}
  configMap:
    name: {{ include "kvmesh.fullname" .root }}-policy
{{- end }}
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
