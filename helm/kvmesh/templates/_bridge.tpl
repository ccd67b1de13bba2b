{{/*
The engine-side bridge (`kvmesh bridge`), for an engine pod. The chart deploys no
engine: an engine chart that depends on this one (as subchart `kvmesh`) includes

  containers:
    - name: engine
      ...                            # KV events to tcp://127.0.0.1:5557, replay on :5558
    {{- include "kvmesh.bridgeSidecar" (dict "values" .Values.kvmesh "model" "MODEL") | nindent 4 }}
  volumes:
    {{- include "kvmesh.bridgeVolumes" (dict "values" .Values.kvmesh) | nindent 4 }}

`values` is this chart's values map (image, securityContext, bridge); `model`
overrides bridge.model, `indexerTarget` bridge.indexerTarget. The bridge subscribes
to the engine's KV-event sockets inside the pod and publishes to the indexer
Service over gRPC, any replica: every engine pod gets the same snippet, and no
indexer config lists engines.

The instance is the pod: worker id $(POD_NAME) (the policy's `instances` patterns
match pod names), address http://$(POD_IP):bridge.apiPort, incarnation prefix
$(POD_UID), so a replaced pod never resumes its predecessor's stream. By default
nothing of the event stream leaves the pod: the bridge binds the events socket on
127.0.0.1 and the engine connects to it (vLLM and SGLang connect to a tcp endpoint
whose host is not a wildcard), and the engine binds its replay socket on
127.0.0.1. With bridge.dataParallelSize N the engine publishes rank r on both
ports + r (vLLM's and SGLang's rule) and the bridge forwards each rank.

Probes: grpc.health.v1 "" on the plaintext bridge.healthPort (SERVING while the
bridge runs; never tied to the indexer, whose absence must not restart or
unready the engine pod).
*/}}

{{/* The bridge's engine_events.endpoints as JSON, one per data-parallel rank: (dict "values" ... "model" ...). */}}
{{- define "kvmesh.bridgeEndpoints" -}}
{{- $b := .values.bridge }}
{{- $model := .model | default $b.model }}
{{- $n := int $b.dataParallelSize }}
{{- $out := list }}
{{- range $r := until $n }}
{{- $ep := dict "worker_id" "$(POD_NAME)" "dp_rank" $r "model" $model "address" (printf "http://$(POD_IP):%d" (int $b.apiPort)) "endpoint" (include "kvmesh.bridgeRankEndpoint" (dict "endpoint" $b.eventsEndpoint "rank" $r)) "bind" $b.bindEvents "topic" $b.topic "keys" $b.keys "lease_ttl_s" $b.leaseTtlSeconds }}
{{- if $b.replayEndpoint }}
{{- $_ := set $ep "replay_endpoint" (include "kvmesh.bridgeRankEndpoint" (dict "endpoint" $b.replayEndpoint "rank" $r)) }}
{{- end }}
{{- $out = append $out $ep }}
{{- end }}
{{- toJson $out }}
{{- end }}

{{/* A tcp endpoint's port offset by a rank (vLLM's and SGLang's offset_endpoint_port). */}}
{{- define "kvmesh.bridgeRankEndpoint" -}}
{{- if eq (int .rank) 0 }}
{{- .endpoint }}
{{- else }}
{{- $port := splitList ":" .endpoint | last }}
{{- printf "%s:%d" (trimSuffix (printf ":%s" $port) .endpoint) (add (atoi $port) .rank) }}
{{- end }}
{{- end }}

{{/* Checks of the bridge's values: (dict "values" ... "model" ... "indexerTarget" ...). */}}
{{- define "kvmesh.bridgeChecks" -}}
{{- $b := .values.bridge }}
{{- if not (.model | default $b.model) }}
{{- fail "kvmesh.bridgeSidecar: the engine's model is required: set bridge.model or pass \"model\" to the include" }}
{{- end }}
{{- if not (.indexerTarget | default $b.indexerTarget) }}
{{- fail "kvmesh.bridgeSidecar: bridge.indexerTarget is required: the indexer Service, e.g. dns:///<release>-kvmesh-indexer-headless.<namespace>.svc:50051 (round robin over every replica)" }}
{{- end }}
{{- $n := int $b.dataParallelSize }}
{{- range $ep := list $b.eventsEndpoint $b.replayEndpoint }}
{{- if and $ep (gt $n 1) (not (hasPrefix "tcp://" $ep)) }}
{{- fail (printf "kvmesh.bridgeSidecar: bridge.dataParallelSize %d needs tcp:// endpoints (vLLM offsets only tcp ports by rank), got %q" $n $ep) }}
{{- end }}
{{- end }}
{{- if and (hasPrefix "tcp://" $b.eventsEndpoint) (hasPrefix "tcp://" $b.replayEndpoint) }}
{{- $p := splitList ":" $b.eventsEndpoint | last | atoi }}
{{- $q := splitList ":" $b.replayEndpoint | last | atoi }}
{{- if and (lt $p (add $q $n)) (lt $q (add $p $n)) }}
{{- fail (printf "kvmesh.bridgeSidecar: bridge.eventsEndpoint and bridge.replayEndpoint overlap once offset by %d data-parallel ranks (ports %d.. and %d..): space them at least dataParallelSize apart" $n $p $q) }}
{{- end }}
{{- end }}
{{- if and $b.bindEvents (not (hasPrefix "tcp://127.0.0.1:" $b.eventsEndpoint)) (not (hasPrefix "ipc://" $b.eventsEndpoint)) }}
{{- fail (printf "kvmesh.bridgeSidecar: bridge.bindEvents binds %q, which peers outside the pod could reach and publish forged events to; bind tcp://127.0.0.1:<port> (or set bindEvents false and let the engine bind)" $b.eventsEndpoint) }}
{{- end }}
{{- if and $b.tls.secretName (not $b.tls.enabled) }}
{{- fail "kvmesh.bridgeSidecar: bridge.tls.secretName is set but bridge.tls.enabled is false (a client certificate needs TLS)" }}
{{- end }}
{{- if and $b.tokenSecret.name (not $b.tls.enabled) }}
{{- fail "kvmesh.bridgeSidecar: bridge.tokenSecret needs bridge.tls.enabled (a bearer token never travels in plaintext)" }}
{{- end }}
{{- end }}

{{- define "kvmesh.bridgeSidecar" -}}
{{- $v := .values }}
{{- $b := $v.bridge }}
{{- include "kvmesh.bridgeChecks" . }}
{{- $t := $b.tls -}}
- name: kvmesh-bridge
  image: {{ include "kvmesh.image" $v | quote }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  command: ["kvmesh"]
  args: ["bridge"]
  env:
    {{- /* Defined first: the values below expand $(POD_NAME), $(POD_IP), $(POD_UID). */}}
    - name: POD_NAME
      valueFrom:
        fieldRef:
          fieldPath: metadata.name
    - name: POD_IP
      valueFrom:
        fieldRef:
          fieldPath: status.podIP
    - name: POD_UID
      valueFrom:
        fieldRef:
          fieldPath: metadata.uid
    - name: KVMESH_BRIDGE_INDEXER__TARGET
      value: {{ .indexerTarget | default $b.indexerTarget | quote }}
    - name: KVMESH_BRIDGE_INDEXER__LOAD_BALANCING
      value: {{ $b.loadBalancing | quote }}
    - name: KVMESH_BRIDGE_ENGINE_EVENTS__ENDPOINTS
      value: {{ include "kvmesh.bridgeEndpoints" . | quote }}
    - name: KVMESH_BRIDGE_ENGINE_EVENTS__ON_UNRECOVERABLE_GAP
      value: {{ $b.onUnrecoverableGap | quote }}
    - name: KVMESH_BRIDGE_BUFFER__MAX_BATCHES
      value: {{ int $b.buffer.maxBatches | quote }}
    - name: KVMESH_BRIDGE_BUFFER__MAX_BYTES
      value: {{ int64 $b.buffer.maxBytes | quote }}
    - name: KVMESH_BRIDGE_INCARNATION_PREFIX
      value: "$(POD_UID)"
    {{- /* The pod IP: kubelet's probes and Prometheus reach it there; nothing else is served. */}}
    - name: KVMESH_BRIDGE_HOST
      value: "$(POD_IP)"
    - name: KVMESH_BRIDGE_METRICS_PORT
      value: {{ int $b.metricsPort | quote }}
    - name: KVMESH_BRIDGE_HEALTH_PORT
      value: {{ int $b.healthPort | quote }}
    {{- if $t.enabled }}
    - name: KVMESH_BRIDGE_INDEXER__TLS__ENABLED
      value: "true"
    {{- if $t.caSecret.name }}
    - name: KVMESH_BRIDGE_INDEXER__TLS__CA_FILE
      value: "/etc/kvmesh/bridge-ca/ca.crt"
    {{- else if $t.secretName }}
    - name: KVMESH_BRIDGE_INDEXER__TLS__CA_FILE
      value: "/etc/kvmesh/bridge-tls/ca.crt"
    {{- end }}
    {{- if $t.secretName }}
    - name: KVMESH_BRIDGE_INDEXER__TLS__CERT_FILE
      value: "/etc/kvmesh/bridge-tls/tls.crt"
    - name: KVMESH_BRIDGE_INDEXER__TLS__KEY_FILE
      value: "/etc/kvmesh/bridge-tls/tls.key"
    {{- end }}
    {{- with $t.serverName }}
    - name: KVMESH_BRIDGE_INDEXER__TLS__SERVER_NAME
      value: {{ . | quote }}
    {{- end }}
    {{- if $b.tokenSecret.name }}
    - name: KVMESH_BRIDGE_INDEXER__TLS__TOKEN_FILE
      value: "/etc/kvmesh/bridge-token/token"
    {{- end }}
    - name: KVMESH_BRIDGE_INDEXER__TLS__RELOAD_INTERVAL_S
      value: {{ $v.tls.reloadIntervalSeconds | quote }}
    {{- end }}
    {{- with $b.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: bridge-metrics
      containerPort: {{ $b.metricsPort }}
      protocol: TCP
    # Plaintext grpc.health.v1 only, for the probes.
    - name: bridge-health
      containerPort: {{ $b.healthPort }}
      protocol: TCP
  readinessProbe:
    grpc:
      port: {{ $b.healthPort }}
    periodSeconds: 5
    timeoutSeconds: 2
  livenessProbe:
    grpc:
      port: {{ $b.healthPort }}
    initialDelaySeconds: 5
    periodSeconds: 10
    timeoutSeconds: 2
    failureThreshold: 3
  securityContext:
    {{- toYaml $v.securityContext | nindent 4 }}
  resources:
    {{- toYaml $b.resources | nindent 4 }}
  volumeMounts:
    - name: kvmesh-bridge-tmp
      mountPath: /tmp
    {{- if $t.secretName }}
    - name: kvmesh-bridge-tls
      mountPath: /etc/kvmesh/bridge-tls
      readOnly: true
    {{- end }}
    {{- if $t.caSecret.name }}
    - name: kvmesh-bridge-ca
      mountPath: /etc/kvmesh/bridge-ca
      readOnly: true
    {{- end }}
    {{- if $b.tokenSecret.name }}
    - name: kvmesh-bridge-token
      mountPath: /etc/kvmesh/bridge-token
      readOnly: true
    {{- end }}
{{- end }}

{{/* The volumes the bridge needs in the engine pod: a writable /tmp under its read-only
root filesystem, and its Secrets, mounted as directories so rotations reach it: (dict "values" ...). */}}
{{- define "kvmesh.bridgeVolumes" -}}
{{- $b := .values.bridge }}
{{- $t := $b.tls -}}
- name: kvmesh-bridge-tmp
  emptyDir:
    sizeLimit: 64Mi
{{- if $t.secretName }}
- name: kvmesh-bridge-tls
  secret:
    secretName: {{ $t.secretName }}
    defaultMode: 0440
{{- end }}
{{- if $t.caSecret.name }}
- name: kvmesh-bridge-ca
  secret:
    secretName: {{ $t.caSecret.name }}
    defaultMode: 0440
    items:
      - key: {{ $t.caSecret.key }}
        path: ca.crt
{{- end }}
{{- if $b.tokenSecret.name }}
- name: kvmesh-bridge-token
  secret:
    secretName: {{ $b.tokenSecret.name }}
    defaultMode: 0440
    items:
      - key: {{ $b.tokenSecret.key }}
        path: token
{{- end }}
{{- end }}
