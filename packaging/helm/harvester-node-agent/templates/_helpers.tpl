{{/*
Names. Everything the release creates is named after it (a release named
harvester-node-agent renders exactly packaging/kubernetes/, which a test
checks), except what the agents and the controller find by a fixed name:
the Lease, the Secret harvester-node-agent-membership and the per-node Roles
the controller creates at run time.
*/}}
{{- define "hna.fullname" -}}
{{- printf "%s-controller" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "hna.serviceAccountName" -}}
{{- include "hna.fullname" . -}}
{{- end -}}

{{/* What selects the controller's Pods. */}}
{{- define "hna.selectorLabels" -}}
app.kubernetes.io/name: harvester-node-agent
app.kubernetes.io/component: controller
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "hna.labels" -}}
{{ include "hna.selectorLabels" . }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* Cluster-wide objects without a component (the admission policies). */}}
{{- define "hna.policyLabels" -}}
app.kubernetes.io/name: harvester-node-agent
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The image, behind Rancher's system default registry when it is set. */}}
{{- define "hna.image" -}}
{{- $registry := "" -}}
{{- with .Values.global -}}{{- with .cattle -}}{{- $registry = .systemDefaultRegistry | default "" -}}{{- end -}}{{- end -}}
{{- if $registry -}}
{{- printf "%s/%s:%s" (trimSuffix "/" $registry) .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{/* The controller's default class (contract::ClassPolicy::default). */}}
{{- define "hna.defaultClass" -}}harvester-node-agent.io/dhcp{{- end -}}

{{/* Values that contradict each other: refused before anything is made. */}}
{{- define "hna.validate" -}}
{{- if eq .Values.loadBalancerClass "kube-vip.io/kube-vip-class" -}}
{{- fail "loadBalancerClass kube-vip.io/kube-vip-class is kube-vip's own class: two implementations would answer for the same Services; choose a class of this controller's own (default harvester-node-agent.io/dhcp)" -}}
{{- end -}}
{{- $actions := .Values.admissionPolicies.validationActions -}}
{{- if and (has "Deny" $actions) (has "Warn" $actions) -}}
{{- fail "admissionPolicies.validationActions: Deny and Warn together are refused by the API server; choose [Deny] (the default) or [Warn, Audit] to try the policies out" -}}
{{- end -}}
{{- end -}}
