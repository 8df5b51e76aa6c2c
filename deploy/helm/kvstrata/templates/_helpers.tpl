{{/* Names and labels. */}}
{{- define "kvstrata.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvstrata.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "kvstrata.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "kvstrata.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* The labels the router's discovery selects on: name and instance. */}}
{{- define "kvstrata.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvstrata.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kvstrata.labels" -}}
{{ include "kvstrata.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The label selector of `kvstrata router --discovery-label-selector`. */}}
{{- define "kvstrata.discoverySelector" -}}
app.kubernetes.io/instance={{ .Release.Name }},app.kubernetes.io/name={{ include "kvstrata.name" . }}
{{- end }}

{{- define "kvstrata.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The cluster key: a Secret of the user's, or the chart's own. */}}
{{- define "kvstrata.clusterKeySecret" -}}
{{- default (printf "%s-cluster-key" (include "kvstrata.fullname" .)) .Values.clusterKey.existingSecret }}
{{- end }}

{{- define "kvstrata.clusterKeyFile" -}}
{{- printf "%s/%s" .Values.clusterKey.mountDir .Values.clusterKey.secretKey }}
{{- end }}

{{- define "kvstrata.modelPath" -}}
{{- if eq .Values.model.source "fetch" }}
{{- printf "%s/%s" .Values.model.mountDir .Values.model.fetch.name }}
{{- else }}
{{- printf "%s/%s" .Values.model.mountDir .Values.model.subPath | trimSuffix "/" }}
{{- end }}
{{- end }}

{{- define "kvstrata.terminationGracePeriodSeconds" -}}
{{- add (ceil .Values.shutdown.graceS | int) .Values.shutdown.marginS }}
{{- end }}

{{/* Volumes of a pod that runs kvstrata: the key, and the model and the L3 directory when
`model` and `l3` are true in the dict passed ({"root": $, "model": bool, "l3": bool}). */}}
{{- define "kvstrata.volumes" -}}
{{- $v := .root.Values }}
- name: cluster-key
  secret:
    secretName: {{ include "kvstrata.clusterKeySecret" .root }}
    defaultMode: {{ $v.clusterKey.fileMode }}
    items:
      - key: {{ $v.clusterKey.secretKey }}
        path: {{ $v.clusterKey.secretKey }}
{{- if .model }}
- name: model
{{- if eq $v.model.source "fetch" }}
  emptyDir:
    sizeLimit: {{ $v.model.fetch.sizeLimit }}
{{- else if $v.model.claimName }}
  persistentVolumeClaim:
    claimName: {{ $v.model.claimName }}
    readOnly: true
{{- else if $v.model.hostPath }}
  hostPath:
    path: {{ $v.model.hostPath }}
    type: Directory
{{- else }}
{{- fail "model.source volume needs model.claimName or model.hostPath" }}
{{- end }}
{{- end }}
{{- if and .l3 (eq $v.l3.backend "file") }}
- name: l3
{{- if $v.l3.file.claimName }}
  persistentVolumeClaim:
    claimName: {{ $v.l3.file.claimName }}
{{- else if $v.l3.file.hostPath }}
  hostPath:
    path: {{ $v.l3.file.hostPath }}
    type: DirectoryOrCreate
{{- else }}
{{- fail "l3.backend file needs l3.file.claimName or l3.file.hostPath" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvstrata.volumeMounts" -}}
{{- $v := .root.Values }}
- name: cluster-key
  mountPath: {{ $v.clusterKey.mountDir }}
  readOnly: true
{{- if .model }}
- name: model
  mountPath: {{ $v.model.mountDir }}
  readOnly: true
{{- end }}
{{- if and .l3 (eq $v.l3.backend "file") }}
- name: l3
  mountPath: {{ $v.l3.file.mountDir }}
{{- end }}
{{- end }}

{{/* The init container that fetches the model into the emptyDir (model.source fetch). */}}
{{- define "kvstrata.initContainers" -}}
{{- if eq .Values.model.source "fetch" }}
initContainers:
  - name: fetch-model
    image: {{ include "kvstrata.image" . }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    securityContext:
      {{- toYaml .Values.securityContext | nindent 6 }}
    command: [kvstrata]
    args: [fetch-model, {{ .Values.model.fetch.name | quote }}, {{ include "kvstrata.modelPath" . | quote }}]
    volumeMounts:
      - name: model
        mountPath: {{ .Values.model.mountDir }}
{{- end }}
{{- end }}

{{/* Startup, readiness and liveness probes on /health. */}}
{{- define "kvstrata.probes" -}}
{{- range $kind := list "startup" "readiness" "liveness" }}
{{ $kind }}Probe:
  httpGet:
    path: /health
    port: http
  {{- toYaml (index $.Values.probes $kind) | nindent 2 }}
{{- end }}
{{- end }}

{{- define "kvstrata.podIPEnv" -}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- end }}

{{/* The mooncake master's Service and its addresses. */}}
{{- define "kvstrata.mooncakeMaster" -}}
{{- printf "%s-mooncake-master" (include "kvstrata.fullname" .) }}
{{- end }}

{{/* --hicache-storage-backend-extra-config of the Mooncake Store backend (JSON). */}}
{{- define "kvstrata.mooncakeStoreConfig" -}}
{{- $m := .Values.l3.mooncake }}
{{- $host := include "kvstrata.mooncakeMaster" . }}
{{- $own := dict
  "master_server_address" (printf "%s:%v" $host $m.master.rpcPort)
  "metadata_server" (printf "http://%s:%v/metadata" $host $m.master.metadataPort)
  "local_hostname" "$(POD_IP)" }}
{{- merge $own $m.config | toJson }}
{{- end }}
