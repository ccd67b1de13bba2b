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

`values` is this chart's values map (image, securityContext, xfer); `role`
(prefill or decode) overrides xfer.role. The engine creates the pool file at
xfer.pool.path and the sidecar attaches to it; until it exists the sidecar
exits and is restarted.

The sidecar listens on the pod IP and advertises it to its peer (the TCP
transport's endpoint and the decode sidecar's Heartbeat address), so the
engine calls it at $(POD_IP):grpcPort, not at 127.0.0.1.
*/}}
{{- define "kvmesh.xferSidecar" -}}
{{- $v := .values }}
{{- $x := $v.xfer }}
{{- $role := .role | default $x.role }}
{{- if not (has $role (list "prefill" "decode")) }}
{{- fail (printf "kvmesh.xferSidecar: role must be prefill or decode, got %q" $role) }}
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
  readinessProbe:
    grpc:
      port: {{ $x.grpcPort }}
    periodSeconds: 5
    timeoutSeconds: 2
  livenessProbe:
    grpc:
      port: {{ $x.grpcPort }}
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
{{- end }}

{{/* The volumes the sidecar needs in the engine pod: (dict "values" .Values.kvmesh). */}}
{{- define "kvmesh.xferVolumes" -}}
{{- $x := .values.xfer -}}
- name: {{ $x.shmVolumeName }}
  emptyDir:
    medium: Memory
    sizeLimit: {{ $x.shmSizeLimit }}
- name: kvmesh-xfer-tmp
  emptyDir:
    sizeLimit: 64Mi
{{- end }}
