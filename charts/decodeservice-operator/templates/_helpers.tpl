{{/* Chart name, cut to 63 characters (the DNS label limit). */}}
{{- define "decodeservice-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name, cut to 63 characters. */}}
{{- define "decodeservice-operator.fullname" -}}
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

{{- define "decodeservice-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "decodeservice-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "decodeservice-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "decodeservice-operator.labels" -}}
helm.sh/chart: {{ include "decodeservice-operator.chart" . }}
{{ include "decodeservice-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "decodeservice-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "decodeservice-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "decodeservice-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The CUDA build of the same image: builtin engines with resources.gpus > 0 run it. */}}
{{- define "decodeservice-operator.cudaImage" -}}
{{- printf "%s:%s" .Values.image.repository (default (printf "%s-cuda" .Chart.AppVersion) .Values.image.cudaTag) }}
{{- end }}

{{/* The fleet routers' image: router.image, each part defaulting to the operator's own. */}}
{{- define "decodeservice-operator.routerImage" -}}
{{- printf "%s:%s" (default .Values.image.repository .Values.router.image.repository) (default (default .Chart.AppVersion .Values.image.tag) .Values.router.image.tag) }}
{{- end }}

{{/* The rules the operator needs, nothing more: no wildcards, no Secrets. */}}
{{- define "decodeservice-operator.rules" -}}
- apiGroups: ["decode.dev"]
  resources: ["decodeservices"]
  verbs: ["get", "list", "watch", "patch", "update"]
- apiGroups: ["decode.dev"]
  resources: ["decodeservices/status"]
  verbs: ["get", "patch", "update"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services", "configmaps"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create"]
# spec.routing.inferencePool: server-side apply creates (create + patch), a disabled pool is deleted.
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "create", "patch", "delete"]
# resources.nodes > 1: each replica is a LeaderWorkerSet group (applied like the Deployment; the one of a
# service that went back to one node is deleted). The autoscaler reads and applies its replicas.
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "create", "patch", "delete"]
# spec.routing.mode router: each service's router runs as its own ServiceAccount, bound to a Role that may
# only read EndpointSlices. The API server lets the operator create that Role only if it holds the same
# permissions itself (no escalate, no bind), hence the read-only EndpointSlice rule.
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["get", "list", "watch"]
{{- end }}
