{{/*
Helpers. Most take a scope dict rather than the root context, so that a
chart which has speckv as a dependency can use the public templates
(speckv.sidecarContainer, speckv.predictorInitContainers, speckv.sidecarVolumes)
with its own root and `.Values.speckv`:

  root:   the root context ($) of the chart that renders
  values: the speckv values (default: root.Values)
  role:   "encoder" | "decoder"
*/}}

{{- define "speckv.name" -}}
{{- $v := .values | default .root.Values -}}
{{- default "speckv" $v.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* <release>-speckv, or the release name when it already contains the chart name. */}}
{{- define "speckv.fullname" -}}
{{- $v := .values | default .root.Values -}}
{{- if $v.fullnameOverride -}}
{{- $v.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "speckv.name" . -}}
{{- if contains $name .root.Release.Name -}}
{{- .root.Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .root.Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The speckv chart's appVersion, also when rendered from a parent chart. */}}
{{- define "speckv.appVersion" -}}
{{- if eq .root.Chart.Name "speckv" -}}
{{- .root.Chart.AppVersion -}}
{{- else if and .root.Subcharts (hasKey .root.Subcharts "speckv") -}}
{{- (index .root.Subcharts "speckv").Chart.AppVersion -}}
{{- end -}}
{{- end -}}

{{- define "speckv.version" -}}
{{- $v := .values | default .root.Values -}}
{{- $tag := $v.image.tag | default (include "speckv.appVersion" .) -}}
{{- required "speckv: set image.tag (the speckv chart's appVersion is not visible from here)" $tag -}}
{{- end -}}

{{- define "speckv.image" -}}
{{- $v := .values | default .root.Values -}}
{{- if $v.image.digest -}}
{{- printf "%s@%s" $v.image.repository $v.image.digest -}}
{{- else -}}
{{- $tag := include "speckv.version" . -}}
{{- if $v.image.variant -}}{{- $tag = printf "%s-%s" $tag $v.image.variant -}}
{{- /* NOTE: the shipped default checkpoint (predictor.source image) is built from the embedded
demo model, which only the demo images carry (docker/Dockerfile's demo target) */ -}}
{{- if eq $v.predictor.source "image" -}}{{- $tag = printf "%s-demo" $tag -}}{{- end -}}
{{- end -}}
{{- printf "%s:%s" $v.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{- define "speckv.selectorLabels" -}}
app.kubernetes.io/name: {{ include "speckv.name" . }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{- end -}}

{{- define "speckv.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "speckv.selectorLabels" . }}
app.kubernetes.io/version: {{ include "speckv.version" . | trunc 63 | trimSuffix "-" | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: speckv
{{- end -}}

{{/* gRPC health service name of a role. */}}
{{- define "speckv.healthService" -}}
{{- if eq .role "encoder" -}}speckv.v1.EncoderService{{- else -}}speckv.v1.DecoderService{{- end -}}
{{- end -}}

{{/* Fails the render on inconsistent values the schema cannot express. */}}
{{- define "speckv.checks" -}}
{{- $v := .values | default .root.Values -}}
{{- if le (float64 $v.terminationGracePeriodSeconds) (float64 $v.config.graceSeconds) -}}
{{- fail (printf "speckv: terminationGracePeriodSeconds (%v) must be greater than config.graceSeconds (%v)" $v.terminationGracePeriodSeconds $v.config.graceSeconds) -}}
{{- end -}}
{{- $ports := list (int $v.ports.grpc) (int $v.ports.metrics) -}}
{{- if $v.tls.enabled }}{{ $ports = append $ports (int $v.ports.health) }}{{ end -}}
{{- if eq $v.mode "sidecar" }}{{ $ports = append $ports (int $v.vllm.port) }}{{ end -}}
{{- if ne (len $ports) (len (uniq $ports)) -}}
{{- fail (printf "speckv: ports must differ within a pod, got %v" $ports) -}}
{{- end -}}
{{- if and (hasPrefix "cuda" $v.predictor.device) (eq $v.image.variant "cpu") -}}
{{- fail (printf "speckv: predictor.device %s needs image.variant cuda (the cpu image has no CUDA torch)" $v.predictor.device) -}}
{{- end -}}
{{- end -}}

{{/* The speckv container's environment. */}}
{{- define "speckv.env" -}}
{{- $v := .values | default .root.Values -}}
- name: SPECKV_LISTEN
  value: {{ printf "0.0.0.0:%d" (int $v.ports.grpc) | quote }}
- name: SPECKV_METRICS_HOST
  value: "0.0.0.0"
- name: SPECKV_METRICS_PORT
  value: {{ $v.ports.metrics | int | quote }}
- name: SPECKV_CACHE
  value: /cache
- name: HOME
  value: /tmp
- name: SPECKV_MAX_INFLIGHT_BYTES
  value: {{ $v.config.maxInflightBytes | quote }}
- name: SPECKV_MAX_TRANSFERS
  value: {{ $v.config.maxTransfers | int | quote }}
- name: SPECKV_MU_CACHE_BYTES
  value: {{ $v.config.muCacheBytes | quote }}
- name: SPECKV_PREDICTOR_BATCH_TOKENS
  value: {{ $v.config.predictorBatchTokens | int | quote }}
- name: SPECKV_GRACE_S
  value: {{ $v.config.graceSeconds | toString | quote }}
- name: SPECKV_LEASE_S
  value: {{ $v.config.leaseSeconds | toString | quote }}
- name: SPECKV_PREDICTOR_DEVICE
  value: {{ $v.predictor.device | quote }}
{{- with $v.config.modelId }}
- name: SPECKV_MODEL_ID
  value: {{ . | quote }}
{{- end }}
{{- if ne $v.predictor.source "image" }}
- name: SPECKV_PREDICTOR
  value: {{ $v.predictor.mountPath | quote }}
{{- end }}
{{- with $v.predictor.pin }}
- name: SPECKV_PIN
  value: {{ . | quote }}
{{- end }}
{{- if $v.tls.enabled }}
- name: SPECKV_TLS_CERT
  value: /etc/speckv/tls/tls.crt
- name: SPECKV_TLS_KEY
  value: /etc/speckv/tls/tls.key
- name: SPECKV_TLS_CA
  value: /etc/speckv/tls/ca.crt
- name: SPECKV_HEALTH_LISTEN
  value: {{ printf "0.0.0.0:%d" (int $v.ports.health) | quote }}
{{- end }}
{{- with $v.config.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- with (index $v .role).env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "speckv.volumeMounts" -}}
{{- $v := .values | default .root.Values -}}
- name: speckv-tmp
  mountPath: /tmp
- name: speckv-cache
  mountPath: /cache
{{- if ne $v.predictor.source "image" }}
- name: speckv-predictor
  mountPath: {{ $v.predictor.mountPath }}
  readOnly: true
  {{- if and (eq $v.predictor.source "pvc") $v.predictor.pvc.subPath }}
  subPath: {{ $v.predictor.pvc.subPath }}
  {{- end }}
{{- end }}
{{- if $v.tls.enabled }}
- name: speckv-tls
  mountPath: /etc/speckv/tls
  readOnly: true
{{- end }}
{{- with $v.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "speckv.probeAction" -}}
{{- $v := .values | default .root.Values -}}
grpc:
  port: {{ ternary $v.ports.health $v.ports.grpc (eq (toString $v.tls.enabled) "true") | int }}
  service: {{ .service | quote }}
{{- end -}}

{{/*
PUBLIC: the speckv sidecar as a Kubernetes native sidecar container (one
list item for a pod's initContainers; restartPolicy: Always). Put it after
speckv.predictorInitContainers and add speckv.sidecarVolumes to the pod's
volumes. Example (a chart with speckv as a dependency):

  initContainers:
    {{- include "speckv.predictorInitContainers" (dict "root" $ "values" .Values.speckv "role" "encoder") | nindent 4 }}
    {{- include "speckv.sidecarContainer" (dict "root" $ "values" .Values.speckv "role" "encoder") | nindent 4 }}
  volumes:
    {{- include "speckv.sidecarVolumes" (dict "root" $ "values" .Values.speckv) | nindent 4 }}
*/}}
{{- define "speckv.sidecarContainer" -}}
{{- include "speckv.container" (merge (dict "sidecar" true) .) }}
{{- end -}}

{{/* A speckv container; .sidecar true makes it a native sidecar. */}}
{{- define "speckv.container" -}}
{{- $v := .values | default .root.Values -}}
{{- $scope := dict "root" .root "values" $v "role" .role -}}
{{- if not (has .role (list "encoder" "decoder")) -}}
{{- fail (printf "speckv: role must be encoder or decoder, not %v" .role) -}}
{{- end -}}
{{- include "speckv.checks" $scope -}}
- name: speckv-{{ .role }}
  image: {{ include "speckv.image" $scope | quote }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  {{- if .sidecar }}
  restartPolicy: Always
  {{- end }}
  args: ["serve", {{ .role | quote }}]
  ports:
    - name: grpc
      containerPort: {{ $v.ports.grpc | int }}
      protocol: TCP
    - name: metrics
      containerPort: {{ $v.ports.metrics | int }}
      protocol: TCP
    {{- if $v.tls.enabled }}
    - name: health
      containerPort: {{ $v.ports.health | int }}
      protocol: TCP
    {{- end }}
  env:
    {{- include "speckv.env" $scope | nindent 4 }}
    {{- with .localSocket }}
    # the local KV hand-off (sealed memfds over a Unix socket in the shared speckv-local volume)
    - name: SPECKV_LOCAL_SOCKET
      value: {{ .path | quote }}
    {{- with .uids }}
    - name: SPECKV_LOCAL_UIDS
      value: {{ . | quote }}
    {{- end }}
    {{- end }}
  startupProbe:
    {{- include "speckv.probeAction" (merge (dict "service" (include "speckv.healthService" $scope)) $scope) | nindent 4 }}
    periodSeconds: {{ $v.probes.startup.periodSeconds | int }}
    failureThreshold: {{ $v.probes.startup.failureThreshold | int }}
  livenessProbe:
    {{- include "speckv.probeAction" (merge (dict "service" "") $scope) | nindent 4 }}
    periodSeconds: {{ $v.probes.liveness.periodSeconds | int }}
    failureThreshold: {{ $v.probes.liveness.failureThreshold | int }}
  readinessProbe:
    {{- include "speckv.probeAction" (merge (dict "service" (include "speckv.healthService" $scope)) $scope) | nindent 4 }}
    periodSeconds: {{ $v.probes.readiness.periodSeconds | int }}
    failureThreshold: {{ $v.probes.readiness.failureThreshold | int }}
  {{- with (index $v .role).resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- include "speckv.containerSecurityContext" $scope | nindent 2 }}
  volumeMounts:
    {{- include "speckv.volumeMounts" $scope | nindent 4 }}
    {{- with .localSocket }}
    - name: speckv-local
      mountPath: {{ .dir }}
    {{- end }}
{{- end -}}

{{/*
PUBLIC: the init containers that provide the predictor checkpoint (list
items for initContainers; empty unless predictor.source is fetch): download
and unpack predictor.fetch.url, then verify it against predictor.pin (with
the resources of .role's sidecar). Same scope dict as speckv.sidecarContainer.
*/}}
{{- define "speckv.predictorInitContainers" -}}
{{- $v := .values | default .root.Values -}}
{{- $scope := dict "root" .root "values" $v "role" .role -}}
{{- if eq $v.predictor.source "fetch" -}}
{{- $f := $v.predictor.fetch -}}
- name: speckv-predictor-fetch
  image: {{ printf "%s:%s" $f.image.repository $f.image.tag | quote }}
  imagePullPolicy: {{ $f.image.pullPolicy }}
  command:
    - sh
    - -ec
    - |
      rm -rf "$DEST"/* "$DEST"/.speckv-download.tar.gz
      curl -fsSL --retry 5 --retry-connrefused -o "$DEST/.speckv-download.tar.gz" "$PREDICTOR_URL"
      if [ "$STRIP" -gt 0 ]; then set -- --strip-components="$STRIP"; fi
      tar -xzf "$DEST/.speckv-download.tar.gz" -C "$DEST" "$@"
      rm -f "$DEST/.speckv-download.tar.gz"
      ls -l "$DEST"
  env:
    - name: PREDICTOR_URL
      value: {{ $f.url | quote }}
    - name: DEST
      value: {{ $v.predictor.mountPath | quote }}
    - name: STRIP
      value: {{ $f.stripComponents | int | quote }}
    - name: HOME
      value: /tmp
  {{- with $f.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- include "speckv.containerSecurityContext" $scope | nindent 2 }}
  volumeMounts:
    - name: speckv-predictor
      mountPath: {{ $v.predictor.mountPath }}
    - name: speckv-tmp
      mountPath: /tmp
- name: speckv-predictor-verify
  image: {{ include "speckv.image" $scope | quote }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  args: ["predictor", "info", {{ $v.predictor.mountPath | quote }}, "--pin", {{ required "speckv: predictor.pin is required for predictor.source=fetch" $v.predictor.pin | quote }}]
  env:
    - name: SPECKV_CACHE
      value: /cache
    - name: HOME
      value: /tmp
  {{- /* the role's resources: no larger pod request, room to load the checkpoint */}}
  {{- with and .role (index $v .role).resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- include "speckv.containerSecurityContext" $scope | nindent 2 }}
  volumeMounts:
    - name: speckv-predictor
      mountPath: {{ $v.predictor.mountPath }}
      readOnly: true
    - name: speckv-tmp
      mountPath: /tmp
    - name: speckv-cache
      mountPath: /cache
{{- end -}}
{{- end -}}

{{/* PUBLIC: the volumes the speckv containers mount (list items for volumes). */}}
{{- define "speckv.sidecarVolumes" -}}
{{- $v := .values | default .root.Values -}}
- name: speckv-tmp
  emptyDir:
    sizeLimit: {{ $v.config.tmpSizeLimit }}
- name: speckv-cache
  emptyDir:
    sizeLimit: {{ $v.config.cacheSizeLimit }}
{{- if eq $v.predictor.source "pvc" }}
- name: speckv-predictor
  persistentVolumeClaim:
    claimName: {{ required "speckv: predictor.pvc.claimName is required for predictor.source=pvc" $v.predictor.pvc.claimName }}
    readOnly: true
{{- else if eq $v.predictor.source "fetch" }}
- name: speckv-predictor
  emptyDir:
    sizeLimit: {{ $v.predictor.fetch.sizeLimit }}
{{- end }}
{{- if $v.tls.enabled }}
- name: speckv-tls
  secret:
    secretName: {{ required "speckv: tls.secretName is required when tls.enabled" $v.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- with $v.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}
