{{/*
The KV transfer sidecar, for an engine pod. The chart deploys no engine: an
engine chart that depends on this one (as subchart `kvmesh`) includes

  containers:
    - name: engine
      ...
      volumeMounts:
        - name: kvmesh-shm          # xfer.shmVolumeName
          mountPath: /dev/shm
    {{- include "kvmesh.xferSidecar" (dict "values" .Values.kvmesh "role" "prefill") | nindent 4 }}
  volumes:
    {{- include "kvmesh.xferVolumes" (dict "values" .Values.kvmesh) | nindent 4 }}

`values` is this chart's values map (image, securityContext, tls, auth, xfer);
`role` (prefill or decode) overrides xfer.role. Optional keys, the same in both
includes: `tlsSecretName` (the sidecar's kubernetes.io/tls Secret, overriding
tls.secretNames.xfer and tls.secretName) and `policyConfigMap` (the ConfigMap of
an inline auth.policy, e.g. "<release>-kvmesh-policy"; auth.existingConfigMap
or auth.existingSecret need none). The engine creates the pool file at
xfer.pool.path and the sidecar attaches to it; until it exists the sidecar
exits and is restarted.

The sidecar listens on the pod IP (POD_IP, from the downward API's
status.podIP) and advertises $(POD_IP):grpcPort to its peer
(KVMESH_XFER_ADVERTISE_ADDRESS: the decode sidecar's Heartbeat address; the
TCP transport's endpoint is the pod IP too), so the engine calls it at
$(POD_IP):grpcPort, not at 127.0.0.1. With a TLS Secret the port serves TLS
(mutual with tls.mutual: the engine then presents a certificate, identity role
engine; peer sidecars role peer) and the probes use the plaintext health-only
port xfer.healthPort. Peer sidecars dial each other by pod IP, so each
sidecar certificate must carry its pod IP as an IP SAN, or every sidecar
certificate carries one DNS name set in xfer.peers.serverName, which peers
then verify instead of the IP.
*/}}

{{/* The sidecar's security context for the server helpers: (dict "values" ...). */}}
{{- define "kvmesh.xferSecurityContext" -}}
{{- $v := .values }}
{{- $secret := "" }}
{{- if $v.tls.enabled }}
{{- $secret = .tlsSecretName | default $v.tls.secretNames.xfer | default $v.tls.secretName }}
{{- end }}
{{- $a := $v.auth }}
{{- if and $a.enabled (not $a.existingConfigMap.name) (not $a.existingSecret.name) (not .policyConfigMap) }}
{{- fail "kvmesh.xferSidecar: auth.enabled with an inline auth.policy: pass \"policyConfigMap\" (the kvmesh release's <release>-kvmesh-policy) to the include, or use auth.existingConfigMap / auth.existingSecret" }}
{{- end }}
{{- if and $a.enabled (not $secret) }}
{{- fail "kvmesh.xferSidecar: auth.enabled needs TLS: set tls.secretNames.xfer (or the include's tlsSecretName)" }}
{{- end }}
{{- toJson (dict "secretName" $secret "component" "xfer" "prefix" "KVMESH_XFER_" "volumePrefix" "kvmesh-xfer-" "policyConfigMap" (.policyConfigMap | default "")) }}
{{- end }}

{{- define "kvmesh.xferSidecar" -}}
{{- $v := .values }}
{{- $x := $v.xfer }}
{{- $role := .role | default $x.role }}
{{- if not (has $role (list "prefill" "decode")) }}
{{- fail (printf "kvmesh.xferSidecar: role must be prefill or decode, got %q" $role) }}
{{- end }}
{{- $sec := include "kvmesh.xferSecurityContext" . | fromJson }}
{{- $_ := set $sec "root" (dict "Values" $v) }}
{{- $tlsOn := $sec.secretName }}
{{- if and $x.peers.allowedIdentities (not (and $tlsOn $v.tls.mutual)) }}
{{- fail "kvmesh.xferSidecar: xfer.peers.allowedIdentities needs mutual TLS (a TLS Secret and tls.mutual)" }}
{{- end }}
{{- if and $x.peers.sharedSecret.name (not $tlsOn) }}
{{- fail "kvmesh.xferSidecar: xfer.peers.sharedSecret needs TLS (the secret never travels in plaintext): set tls.secretNames.xfer" }}
{{- end -}}
- name: kvmesh-xfer
  image: {{ include "kvmesh.image" $v | quote }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  command: ["kvmesh"]
  args: ["xfer", "serve", "--role", {{ $role | quote }}]
  env:
    - name: POD_IP
      valueFrom:
        fieldRef:
          fieldPath: status.podIP
    - name: KVMESH_XFER_HOST
      value: "$(POD_IP)"
    - name: KVMESH_XFER_PORT
      value: {{ int $x.grpcPort | quote }}
    {{- /* Peers call back here: the pod IP (POD_IP above, so it expands) and the port. */}}
    - name: KVMESH_XFER_ADVERTISE_ADDRESS
      value: {{ printf "$(POD_IP):%d" (int $x.grpcPort) | quote }}
    - name: KVMESH_XFER_METRICS_PORT
      value: {{ int $x.metricsPort | quote }}
    - name: KVMESH_XFER_TRANSPORT
      value: {{ $x.transport | quote }}
    - name: KVMESH_XFER_QUEUES
      value: {{ int $x.queues | quote }}
    - name: KVMESH_XFER_POOL__PATH
      value: {{ $x.pool.path | quote }}
    - name: KVMESH_XFER_POOL__PAGE_SIZE
      value: {{ int $x.pool.pageSize | quote }}
    - name: KVMESH_XFER_POOL__PAGE_COUNT
      value: {{ int $x.pool.pageCount | quote }}
    - name: KVMESH_XFER_POOL__AUX_SIZE
      value: {{ int $x.pool.auxSize | quote }}
    - name: KVMESH_XFER_POOL__AUX_COUNT
      value: {{ int $x.pool.auxCount | quote }}
    - name: KVMESH_XFER_POOL__POPULATE
      value: {{ $x.pool.populate | quote }}
    {{- if $tlsOn }}
    - name: KVMESH_XFER_HEALTH_PORT
      value: {{ int $x.healthPort | quote }}
    {{- end }}
    {{- with include "kvmesh.serverSecurityEnv" $sec | trim }}{{ . | nindent 4 }}{{ end }}
    {{- with $x.peers.allowedIdentities }}
    - name: KVMESH_XFER_PEERS__ALLOWED_IDENTITIES
      value: {{ toJson . | quote }}
    {{- end }}
    {{- if $x.peers.sharedSecret.name }}
    - name: KVMESH_XFER_PEERS__SHARED_SECRET_FILE
      value: "/etc/kvmesh/xfer-peer/secret"
    {{- end }}
    {{- if and $tlsOn $x.peers.serverName }}
    {{- /* Peers are dialed by pod IP: verify their certificates against this name instead. */}}
    - name: KVMESH_XFER_PEERS__TLS__ENABLED
      value: "true"
    - name: KVMESH_XFER_PEERS__TLS__CA_FILE
      value: {{ include "kvmesh.caFile" $sec.root | quote }}
    - name: KVMESH_XFER_PEERS__TLS__CERT_FILE
      value: {{ printf "%s/tls.crt" (include "kvmesh.tlsDir" .) | quote }}
    - name: KVMESH_XFER_PEERS__TLS__KEY_FILE
      value: {{ printf "%s/tls.key" (include "kvmesh.tlsDir" .) | quote }}
    - name: KVMESH_XFER_PEERS__TLS__SERVER_NAME
      value: {{ $x.peers.serverName | quote }}
    - name: KVMESH_XFER_PEERS__TLS__RELOAD_INTERVAL_S
      value: {{ $v.tls.reloadIntervalSeconds | quote }}
    {{- end }}
    {{- with $x.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: xfer-grpc
      containerPort: {{ $x.grpcPort }}
      protocol: TCP
    - name: xfer-metrics
      containerPort: {{ $x.metricsPort }}
      protocol: TCP
    {{- if $tlsOn }}
    # Plaintext grpc.health.v1 only, for the probes (kubelet's gRPC probe speaks no TLS).
    - name: xfer-health
      containerPort: {{ $x.healthPort }}
      protocol: TCP
    {{- end }}
  {{- $probePort := ternary $x.healthPort $x.grpcPort (not (empty $tlsOn)) }}
  readinessProbe:
    grpc:
      port: {{ $probePort }}
    periodSeconds: 5
    timeoutSeconds: 2
  livenessProbe:
    grpc:
      port: {{ $probePort }}
    initialDelaySeconds: 5
    periodSeconds: 10
    timeoutSeconds: 2
    failureThreshold: 3
  securityContext:
    {{- toYaml $v.securityContext | nindent 4 }}
  resources:
    {{- toYaml $x.resources | nindent 4 }}
  volumeMounts:
    - name: {{ $x.shmVolumeName }}
      mountPath: /dev/shm
    - name: kvmesh-xfer-tmp
      mountPath: /tmp
    {{- with include "kvmesh.serverSecurityMounts" $sec | trim }}{{ . | nindent 4 }}{{ end }}
    {{- if $x.peers.sharedSecret.name }}
    - name: kvmesh-xfer-peer-secret
      mountPath: /etc/kvmesh/xfer-peer
      readOnly: true
    {{- end }}
{{- end }}

{{/* The volumes the sidecar needs in the engine pod: the same dict as kvmesh.xferSidecar (without role). */}}
{{- define "kvmesh.xferVolumes" -}}
{{- $x := .values.xfer }}
{{- $sec := include "kvmesh.xferSecurityContext" . | fromJson }}
{{- $_ := set $sec "root" (dict "Values" .values) -}}
- name: {{ $x.shmVolumeName }}
  emptyDir:
    medium: Memory
    sizeLimit: {{ $x.shmSizeLimit }}
- name: kvmesh-xfer-tmp
  emptyDir:
    sizeLimit: 64Mi
{{- with include "kvmesh.serverSecurityVolumes" $sec | trim }}{{ . | nindent 0 }}{{ end }}
{{- with $x.peers.sharedSecret }}
{{- if .name }}
- name: kvmesh-xfer-peer-secret
  secret:
    secretName: {{ .name }}
    defaultMode: 0440
    items:
      - key: {{ .key }}
        path: secret
{{- end }}
{{- end }}
{{- end }}
