{{/*
Names. The fullname is cut to 45 characters so that the longest name made from it
("<fullname>-triton-headless", and the Tritons' pod names) stays a DNS label (63).
*/}}
{{- define "fair-frontend.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 45 | trimSuffix "-" -}}
{{- end -}}

{{- define "fair-frontend.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 45 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Labels of every object: (dict "ctx" $ "component" "core") */}}
{{- define "fair-frontend.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" }}
{{ include "fair-frontend.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: fair-frontend
{{- end -}}

{{/* What selects a component's pods (Services, NetworkPolicies, PDBs). */}}
{{- define "fair-frontend.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fair-frontend.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Every container: no privilege, nothing written outside its emptyDirs. */}}
{{- define "fair-frontend.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}

{{- define "fair-frontend.image" -}}
{{- printf "%s:%s" .repository (toString .tag) -}}
{{- end -}}

{{/* ---- secrets ---------------------------------------------------------------------- */}}

{{- define "fair-frontend.coreSecretName" -}}
{{- default (printf "%s-core-secret" (include "fair-frontend.fullname" .)) .Values.coreSecret.existingSecret -}}
{{- end -}}

{{- /* The cores' keys as a checksum in their pod template: keys.data, or the named
Secret's data as lookup finds it when helm install/upgrade runs against the cluster, and
keys.revision. A change of any changes the template, so `helm upgrade` replaces the cores,
which read the keys as they start (rendered offline, lookup finds nothing: bump
keys.revision). */ -}}
{{- define "fair-frontend.keysChecksum" -}}
{{- $parts := dict "revision" (toString (.Values.keys.revision | default "")) -}}
{{- if .Values.keys.existingSecret -}}
{{- $found := lookup "v1" "Secret" .Release.Namespace .Values.keys.existingSecret | default dict -}}
{{- $_ := set $parts "secret" (get $found "data" | default dict) -}}
{{- else -}}
{{- $_ := set $parts "data" (.Values.keys.data | default dict) -}}
{{- end -}}
{{- toJson $parts | sha256sum -}}
{{- end -}}

{{- define "fair-frontend.keysSecretName" -}}
{{- default (printf "%s-keys" (include "fair-frontend.fullname" .)) .Values.keys.existingSecret -}}
{{- end -}}

{{/* Redis's password as {"name", "key"} of a Secret, or {} for an external Redis
without one. */}}
{{- define "fair-frontend.redisPasswordRef" -}}
{{- if .Values.redis.external.url -}}
{{- with .Values.redis.external.passwordSecret -}}
{{- if .name -}}{{- toJson (dict "name" .name "key" (default "password" .key)) -}}{{- else -}}{}{{- end -}}
{{- end -}}
{{- else -}}
{{- toJson (dict "name" (default (printf "%s-redis" (include "fair-frontend.fullname" .)) .Values.redis.auth.existingSecret) "key" "password") -}}
{{- end -}}
{{- end -}}

{{- define "fair-frontend.redisUrl" -}}
{{- default (printf "redis://%s-redis:6379/0" (include "fair-frontend.fullname" .)) .Values.redis.external.url -}}
{{- end -}}

{{/* A random value made once: the Secret's own where it exists (an upgrade), else new. */}}
{{- define "fair-frontend.keptRandom" -}}
{{- $found := lookup "v1" "Secret" .ctx.Release.Namespace .name -}}
{{- if and $found $found.data (hasKey $found.data .key) -}}
{{- index $found.data .key | b64dec -}}
{{- else -}}
{{- randAlphaNum 64 -}}
{{- end -}}
{{- end -}}

{{/* ---- Triton: the pool the core is given ------------------------------------------ */}}

{{- define "fair-frontend.tritonName" -}}
{{- printf "%s-triton" (include "fair-frontend.fullname" .) -}}
{{- end -}}

{{- define "fair-frontend.tritonHeadless" -}}
{{- printf "%s-triton-headless" (include "fair-frontend.fullname" .) -}}
{{- end -}}

{{/* How many Tritons the core lists: every pod KEDA may start, else the replicas. */}}
{{- define "fair-frontend.tritonPoolSize" -}}
{{- if .Values.triton.autoscaling.keda.enabled -}}
{{- int .Values.triton.maxReplicas -}}
{{- else -}}
{{- int .Values.triton.replicas -}}
{{- end -}}
{{- end -}}

{{/* The Tritons' stable names (StatefulSet pods behind the headless Service), JSON. */}}
{{- define "fair-frontend.tritonHosts" -}}
{{- $hosts := list -}}
{{- $name := include "fair-frontend.tritonName" . -}}
{{- $headless := include "fair-frontend.tritonHeadless" . -}}
{{- range $i := until (int (include "fair-frontend.tritonPoolSize" .)) -}}
{{- $hosts = append $hosts (printf "%s-%d.%s.%s.svc.%s" $name $i $headless $.Release.Namespace $.Values.clusterDomain) -}}
{{- end -}}
{{- toJson $hosts -}}
{{- end -}}

{{- define "fair-frontend.leaseName" -}}
{{- default (printf "%s-core" (include "fair-frontend.fullname" .)) .Values.core.leaseName -}}
{{- end -}}

{{/* ---- the config ------------------------------------------------------------------- */}}

{{/* The operator's config (values: config), parsed, as JSON. */}}
{{- define "fair-frontend.userConfig" -}}
{{- $config := fromYaml (toString .Values.config) -}}
{{- if hasKey $config "Error" -}}
{{- fail (printf "config: not valid YAML: %s" (get $config "Error")) -}}
{{- end -}}
{{- if not $config -}}
{{- fail "config: empty; set it to the frontend's config (YAML text; values.yaml has the default)" -}}
{{- end -}}
{{- toJson $config -}}
{{- end -}}

{{/* Which entries of the keys Secret the config reads:
{"files": [entry, ...] (api_keys_file under keys.mountPath), "env": [{"name": VAR,
"entry": tenant}, ...] (api_keys_env)}. */}}
{{- define "fair-frontend.keysPlan" -}}
{{- $config := include "fair-frontend.userConfig" . | fromJson -}}
{{- $mount := printf "%s/" (trimSuffix "/" .Values.keys.mountPath) -}}
{{- $files := list -}}
{{- $env := list -}}
{{- range $tenant, $t := (default dict $config.tenants) -}}
{{- $t = default dict $t -}}
{{- with $t.api_keys_file -}}
{{- $entry := trimPrefix $mount . -}}
{{- if or (not (hasPrefix $mount .)) (contains "/" $entry) -}}
{{- fail (printf "config: tenants.%s.api_keys_file %s: the chart mounts the keys Secret at %s (keys.mountPath); name a file there" $tenant . $mount) -}}
{{- end -}}
{{- $files = append $files $entry -}}
{{- end -}}
{{- with $t.api_keys_env -}}
{{- $env = append $env (dict "name" . "entry" $tenant) -}}
{{- end -}}
{{- end -}}
{{- toJson (dict "files" $files "env" $env) -}}
{{- end -}}

{{/* The config the core runs: the operator's, with the Tritons and Redis the chart made. */}}
{{- define "fair-frontend.config" -}}
{{- $config := include "fair-frontend.userConfig" . | fromJson -}}
{{- $triton := omit (default dict $config.triton) "url" "http_url" "metrics_url" "backends" -}}
{{- $backends := list -}}
{{- range $host := include "fair-frontend.tritonHosts" . | fromJsonArray -}}
{{- $backends = append $backends (dict "grpc_url" (printf "%s:8001" $host) "http_url" (printf "http://%s:8000" $host) "metrics_url" (printf "http://%s:8002/metrics" $host)) -}}
{{- end -}}
{{- $_ := set $triton "backends" $backends -}}
{{- $_ := set $config "triton" $triton -}}
{{- $limiting := omit (default dict $config.rate_limiting) "storage" "storage_password_env" "storage_password_file" -}}
{{- $_ := set $limiting "storage" (include "fair-frontend.redisUrl" .) -}}
{{- if (include "fair-frontend.redisPasswordRef" . | fromJson) -}}
{{- $_ := set $limiting "storage_password_file" "/run/secrets/redis/password" -}}
{{- end -}}
{{- $_ := set $config "rate_limiting" $limiting -}}
{{- toYaml $config -}}
{{- end -}}

{{/* ---- what the chart refuses --------------------------------------------------------- */}}

{{- define "fair-frontend.validate" -}}
{{- if .Values.ingress.enabled -}}
{{- if not (and .Values.ingress.httpHost .Values.ingress.grpcHost) -}}
{{- fail "ingress.enabled: ingress.httpHost and ingress.grpcHost are both needed (gRPC has a host of its own)" -}}
{{- end -}}
{{- if not .Values.ingress.tls.secretName -}}
{{- fail "ingress.enabled: ingress.tls.secretName is empty; the Ingresses are there to terminate TLS (keys would cross in clear)" -}}
{{- end -}}
{{- if and .Values.networkPolicy.enabled (not .Values.networkPolicy.gateway.ingressControllerNamespace) -}}
{{- fail "ingress.enabled: networkPolicy.gateway.ingressControllerNamespace is empty; the NetworkPolicies would keep the ingress controller from the shells" -}}
{{- end -}}
{{- end -}}
{{- if not (has .Values.core.election (list "redis" "kubernetes")) -}}
{{- fail (printf "core.election: %v; one of redis, kubernetes (with %d cores, none would make each a leader)" .Values.core.election (int .Values.core.replicas)) -}}
{{- end -}}
{{- if lt (int .Values.core.replicas) 1 -}}
{{- fail "core.replicas: at least 1 (2: one leads, one stands by)" -}}
{{- end -}}
{{- if lt (int .Values.triton.replicas) 1 -}}
{{- fail "triton.replicas: at least 1" -}}
{{- end -}}
{{- if and .Values.triton.autoscaling.keda.enabled (lt (int .Values.triton.maxReplicas) (int .Values.triton.replicas)) -}}
{{- fail (printf "triton.maxReplicas (%d) is below triton.replicas (%d): KEDA scales between them" (int .Values.triton.maxReplicas) (int .Values.triton.replicas)) -}}
{{- end -}}
{{- with .Values.redis.external.url -}}
{{- if not (or (hasPrefix "redis://" .) (hasPrefix "rediss://" .)) -}}
{{- fail (printf "redis.external.url %q: redis://host:port/db or rediss://..." .) -}}
{{- end -}}
{{- if contains "@" . -}}
{{- fail "redis.external.url holds credentials: give the password in a Secret (redis.external.passwordSecret), not in the URL" -}}
{{- end -}}
{{- end -}}
{{- $plan := include "fair-frontend.keysPlan" . | fromJson -}}
{{- $needed := list -}}
{{- range $plan.files }}{{ $needed = append $needed . }}{{ end -}}
{{- range $plan.env }}{{ $needed = append $needed .entry }}{{ end -}}
{{- if and .Values.keys.existingSecret .Values.keys.data -}}
{{- fail "keys: set existingSecret or data, not both" -}}
{{- end -}}
{{- if and $needed (not .Values.keys.existingSecret) -}}
{{- if not .Values.keys.data -}}
{{- fail (printf "keys: no API keys given. The config reads them from a Secret with the entries %s: set keys.existingSecret to a Secret of yours holding them, or keys.data.<entry> for each (\"sha256:<hex>\" from `fair-frontend hash-key KEY`, one per line in a file entry, comma-separated in a tenant's). Nothing ships with the chart." (join ", " $needed)) -}}
{{- end -}}
{{- $missing := list -}}
{{- range $needed }}{{ if not (index $.Values.keys.data .) }}{{ $missing = append $missing . }}{{ end }}{{ end -}}
{{- if $missing -}}
{{- fail (printf "keys.data: no value for %s (the config reads every one of %s)" (join ", " $missing) (join ", " $needed)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
