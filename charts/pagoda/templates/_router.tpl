{{- /* The request router (`python -m pagoda_operator.router`): names, labels and image. Its pods carry
app.kubernetes.io/name: pagoda-router, so the operator Deployment's selector (pagoda-operator) never matches them. */ -}}
{{- define "pagoda.routerName" -}}
{{- printf "%s-router" (include "pagoda.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pagoda.routerSelectorLabels" -}}
app.kubernetes.io/name: pagoda-router
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pagoda.routerLabels" -}}
{{ include "pagoda.routerSelectorLabels" . }}
app.kubernetes.io/component: router
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "pagoda.routerServiceAccountName" -}}
{{- if .Values.router.serviceAccount.create -}}{{ default (include "pagoda.routerName" .) .Values.router.serviceAccount.name }}
{{- else -}}{{ default "default" .Values.router.serviceAccount.name }}{{- end -}}
{{- end -}}

{{- /* The router ships in the operator image: router.image.* default to operator.image.*. */ -}}
{{- define "pagoda.routerImage" -}}
{{- $repository := .Values.router.image.repository | default .Values.operator.image.repository -}}
{{- $tag := .Values.router.image.tag | default .Values.operator.image.tag | default .Chart.AppVersion -}}
{{- printf "%s:%s" $repository $tag -}}
{{- end -}}
