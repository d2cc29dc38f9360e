{{/*
Pod-level helpers: the ServiceAccount name, the security contexts (values
podSecurityContext and securityContext; a key set to null is left out, e.g. the
uid for OpenShift's restricted SCC) and the fields every pod of the chart shares.
Same scope dict as in _helpers.tpl.
*/}}

{{/* The ServiceAccount the pods run as. */}}
{{- define "speckv.serviceAccountName" -}}
{{- $v := .values | default .root.Values -}}
{{- if $v.serviceAccount.create -}}
{{- $v.serviceAccount.name | default (include "speckv.fullname" .) -}}
{{- else -}}
{{- $v.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end -}}

{{/* The `securityContext:` of every container of the chart (nothing when emptied). */}}
{{- define "speckv.containerSecurityContext" -}}
{{- $v := .values | default .root.Values -}}
{{- with $v.securityContext -}}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end -}}
{{- end -}}

{{/* The pod `securityContext:` (nothing when emptied). */}}
{{- define "speckv.podSecurityContext" -}}
{{- $v := .values | default .root.Values -}}
{{- with $v.podSecurityContext -}}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end -}}
{{- end -}}

{{/* ServiceAccount, security context and pull secrets: every pod of the chart. */}}
{{- define "speckv.podIdentity" -}}
{{- $v := .values | default .root.Values -}}
serviceAccountName: {{ include "speckv.serviceAccountName" . }}
automountServiceAccountToken: {{ $v.serviceAccount.automountServiceAccountToken }}
enableServiceLinks: false
{{- with include "speckv.podSecurityContext" . }}
{{ . }}
{{- end }}
{{- with $v.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
Pod-level fields of the chart's workloads; .placement: the role's values
(nodeSelector, tolerations, affinity, priorityClassName,
topologySpreadConstraints). A spread constraint without a labelSelector gets
the role's selector labels.
*/}}
{{- define "speckv.podCommon" -}}
{{- $v := .values | default .root.Values -}}
{{- include "speckv.podIdentity" . }}
terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds | int }}
{{- with .placement.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .placement.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .placement.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .placement.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .placement.topologySpreadConstraints }}
{{- $selector := include "speckv.selectorLabels" $ | fromYaml }}
topologySpreadConstraints:
{{- range . }}
{{- $c := deepCopy . }}
{{- if not (hasKey $c "labelSelector") }}{{ $_ := set $c "labelSelector" (dict "matchLabels" $selector) }}{{ end }}
  - {{- toYaml $c | nindent 4 }}
{{- end }}
{{- end }}
{{- end -}}
