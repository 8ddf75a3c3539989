{{/*
Names. Every object is "<fullname>-<component>"; pools are "<fullname>-<pool name>" (the schema keeps pool
names DNS labels and refuses the component names, so the two never collide).
*/}}
{{- define "mosaic.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "mosaic.fullname" -}}
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

{{- define "mosaic.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of a GPU worker's pod template: "mosaic.labels" without the chart and app versions, so an
upgrade that leaves a pool's vLLM container alone does not restart its pods (each a model reload). */}}
{{- define "mosaic.stableLabels" -}}
{{ include "mosaic.selectorLabels" . }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: mosaic
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "mosaic.labels" -}}
helm.sh/chart: {{ include "mosaic.chart" . }}
{{ include "mosaic.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: mosaic
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The release's selector labels; each component adds app.kubernetes.io/component. */}}
{{- define "mosaic.selectorLabels" -}}
app.kubernetes.io/name: {{ include "mosaic.name" . }}
app.kubernetes.io/instance: {{ .Release.Name | quote }}
{{- end }}

{{- define "mosaic.gateway.fullname" -}}
{{- printf "%s-gateway" (include "mosaic.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "mosaic.controller.fullname" -}}
{{- printf "%s-controller" (include "mosaic.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "mosaic.gateway.selectorLabels" -}}
{{ include "mosaic.selectorLabels" . }}
app.kubernetes.io/component: gateway
{{- end }}

{{- define "mosaic.controller.selectorLabels" -}}
{{ include "mosaic.selectorLabels" . }}
app.kubernetes.io/component: controller
{{- end }}

{{- define "mosaic.gateway.serviceAccountName" -}}
{{- if .Values.gateway.serviceAccount.create }}
{{- default (include "mosaic.gateway.fullname" .) .Values.gateway.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.gateway.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "mosaic.controller.serviceAccountName" -}}
{{- if .Values.controller.serviceAccount.create }}
{{- default (include "mosaic.controller.fullname" .) .Values.controller.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.controller.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "mosaic.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "mosaic.configMapName" -}}
{{- printf "%s-config" (include "mosaic.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "mosaic.authSecretName" -}}
{{- if .Values.auth.existingSecret }}
{{- .Values.auth.existingSecret }}
{{- else }}
{{- printf "%s-api-keys" (include "mosaic.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "mosaic.hfSecretName" -}}
{{- if .Values.vllm.hfToken.existingSecret }}
{{- .Values.vllm.hfToken.existingSecret }}
{{- else }}
{{- printf "%s-hf-token" (include "mosaic.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* True ("true") when the HF token env var is wired: an existing Secret or a value the chart stores. */}}
{{- define "mosaic.hfTokenEnabled" -}}
{{- if or .Values.vllm.hfToken.existingSecret .Values.vllm.hfToken.value }}true{{ end }}
{{- end }}

{{/* Env entries for the gateway: each keyed pool's variable (`api_key_env` in the
config) from the pool's Secret, the same key its vLLM containers get as VLLM_API_KEY. */}}
{{- define "mosaic.poolApiKeyEnv" -}}
{{- range (include "mosaic.pools" . | fromYaml).pools }}
{{- if .apiKeyEnv }}
- name: {{ .apiKeyEnv }}
  valueFrom:
    secretKeyRef:
      name: {{ .apiKey.existingSecret }}
      key: {{ .apiKey.key }}
{{- end }}
{{- end }}
{{- end }}

{{/* Scrape annotations of the gateway and controller pods: the Prometheus operator CRDs replace them when
enabled. Worker pods carry theirs unconditionally (templates/pools.yaml): a toggle there would restart GPU pods. */}}
{{- define "mosaic.scrapeAnnotations" -}}
{{- $root := index . 0 -}}
{{- $port := index . 1 -}}
{{- if and $root.Values.monitoring.scrapeAnnotations (not $root.Values.monitoring.serviceMonitor.enabled) (not $root.Values.monitoring.podMonitor.enabled) }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ $port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end }}

{{/*
Pools, resolved: each entry of .Values.pools merged over .Values.poolDefaults, with the derived fields
the templates need (fullname, simulated, deployments). Returned as YAML ({pools: [...]}) so templates
call `fromYaml` once; invalid combinations fail the render with a message naming the pool.

`deployments`: what the pool renders as. A pool without `domains` is one Deployment named `fullname`
({name}); a pool with `domains` is one Deployment per network domain ({name, domain, replicas}), named
`<fullname>-<domain>` made a DNS-1123 label (lowercase, runs of other characters → `-`; over 63
characters: cut to 54 + `-` + 8 hex of its sha256), the pool's initial `replicas` split over them
(the first `replicas mod N` domains get one more).
*/}}
{{- define "mosaic.pools" -}}
{{- $root := . }}
{{- $fullname := include "mosaic.fullname" $root }}
{{- $resolved := list }}
{{- $seen := dict }}
{{- $owners := dict }}{{- /* Deployment name → the pool that renders it, across all pools */}}
{{- range $i, $p := $root.Values.pools }}
{{- $pool := mustMergeOverwrite (deepCopy $root.Values.poolDefaults) (deepCopy $p) }}
{{- if hasKey $seen $pool.name }}
{{- fail (printf "pools[%d]: pool name %q is used twice; pool names must be unique" $i $pool.name) }}
{{- end }}
{{- $_ := set $seen $pool.name true }}
{{- if has $pool.name (list "gateway" "controller") }}
{{- fail (printf "pools[%d]: pool name %q is reserved (the chart's own components use it); choose another" $i $pool.name) }}
{{- end }}
{{- $name := printf "%s-%s" $fullname $pool.name }}
{{- if gt (len $name) 63 }}
{{- fail (printf "pools[%d] (%s): object name %q is %d characters, over Kubernetes' 63; shorten the pool name or set fullnameOverride" $i $pool.name $name (len $name)) }}
{{- end }}
{{- if gt (int $pool.minReplicas) (int $pool.maxReplicas) }}
{{- fail (printf "pools[%d] (%s): minReplicas %d is above maxReplicas %d" $i $pool.name (int $pool.minReplicas) (int $pool.maxReplicas)) }}
{{- end }}
{{- if or (lt (int $pool.replicas) (int $pool.minReplicas)) (gt (int $pool.replicas) (int $pool.maxReplicas)) }}
{{- fail (printf "pools[%d] (%s): replicas %d is outside [minReplicas %d, maxReplicas %d]" $i $pool.name (int $pool.replicas) (int $pool.minReplicas) (int $pool.maxReplicas)) }}
{{- end }}
{{- $resync := int $root.Values.gateway.discovery.resyncSeconds }}
{{- if le (int $pool.drainSeconds) $resync }}
{{- fail (printf "pools[%d] (%s): drainSeconds %d must exceed gateway.discovery.resyncSeconds %d: the gateways learn that a worker is terminating at their next re-list, and keep routing to it until then, past its SIGTERM" $i $pool.name (int $pool.drainSeconds) $resync) }}
{{- end }}
{{- if ge (int $pool.drainSeconds) (int $pool.terminationGracePeriodSeconds) }}
{{- fail (printf "pools[%d] (%s): drainSeconds %d must be below terminationGracePeriodSeconds %d, or the kubelet kills the worker during its preStop sleep and in-flight requests die on every scale-in" $i $pool.name (int $pool.drainSeconds) (int $pool.terminationGracePeriodSeconds)) }}
{{- end }}
{{- /* the pool's own `simulated`, else poolDefaults', else the chart-wide switch */}}
{{- $sim := $root.Values.simulated }}
{{- if hasKey ($root.Values.poolDefaults | default dict) "simulated" }}{{ $sim = $root.Values.poolDefaults.simulated }}{{ end }}
{{- if hasKey $p "simulated" }}{{ $sim = $p.simulated }}{{ end }}
{{- $_ := set $pool "simulated" $sim }}
{{- /* Kubernetes refuses allowPrivilegeEscalation false beside privileged or CAP_SYS_ADMIN (a privileged
container always may escalate): a pool that asks for either does not inherit poolDefaults' false, and one
that sets both itself fails here rather than half-way through an install */}}
{{- $sc := $pool.securityContext | default dict }}
{{- if or $sc.privileged (has "CAP_SYS_ADMIN" (($sc.capabilities | default dict).add | default list)) }}
{{- $own := $p.securityContext | default dict }}
{{- if and (hasKey $own "allowPrivilegeEscalation") (not $own.allowPrivilegeEscalation) }}
{{- fail (printf "pools[%d] (%s): securityContext sets allowPrivilegeEscalation false beside privileged or capabilities.add CAP_SYS_ADMIN, which Kubernetes refuses; drop one of them" $i $pool.name) }}
{{- end }}
{{- $_ := set $sc "allowPrivilegeEscalation" true }}
{{- end }}
{{- if and $sim (not (hasKey $p "tolerations")) }}
{{- /* poolDefaults' tolerations are for GPU nodes' taints: a CPU-only simulated pod must not land there */}}
{{- $_ := set $pool "tolerations" list }}
{{- end }}
{{- if and $sim (not (hasKey $p "strategy")) }}
{{- /* poolDefaults' in-place rollout is for GPU pods: a simulated pool surges as any Deployment, unless it says */}}
{{- $_ := unset $pool "strategy" }}
{{- end }}
{{- with $pool.strategy }}
{{- $ru := .rollingUpdate | default dict }}
{{- if and (ne (.type | default "RollingUpdate") "Recreate") (has (toString ($ru.maxSurge | default 0)) (list "0" "0%")) (has (toString ($ru.maxUnavailable | default 0)) (list "0" "0%")) }}
{{- fail (printf "pools[%d] (%s): strategy.rollingUpdate has maxSurge 0 and maxUnavailable 0, which Kubernetes refuses (a rollout could never replace a pod); allow one of them" $i $pool.name) }}
{{- end }}
{{- end }}
{{- include "mosaic.pool.checkModel" (list $root $i $pool) }}
{{- include "mosaic.pool.checkGpu" (list $root $i $pool) }}
{{- include "mosaic.pool.checkParallelArgs" (list $root $i $pool (ternary (printf "pools[%d].extraArgs" $i) "poolDefaults.extraArgs" (hasKey $p "extraArgs"))) }}
{{- $lora := $pool.lora | default dict }}
{{- $_ := set $pool "loraOn" (or (not (empty $lora.modules)) (eq (toString $lora.runtimeUpdating) "true")) }}
{{- include "mosaic.pool.checkLora" (list $root $i $pool $p (ternary (printf "pools[%d].extraArgs" $i) "poolDefaults.extraArgs" (hasKey $p "extraArgs"))) }}
{{- $_ := set $pool "fullname" $name }}
{{- /* apiKey.existingSecret: the pool's vLLM servers require that key; the gateway reads it from `apiKeyEnv`. Pool names are DNS labels,
so upper-casing and `-` → `_` gives each pool its own variable name. */}}
{{- if ($pool.apiKey | default dict).existingSecret }}
{{- $_ := set $pool "apiKeyEnv" (printf "MOSAIC_POOL_%s_API_KEY" ($pool.name | upper | replace "-" "_")) }}
{{- end }}
{{- $deployments := list (dict "name" $name) }}
{{- with $pool.domains }}
{{- $label := $root.Values.gateway.discovery.domainLabel }}
{{- if not $label }}
{{- fail (printf "pools[%d] (%s): domains need gateway.discovery.domainLabel, the node label that names a node's domain" $i $pool.name) }}
{{- end }}
{{- if hasKey ($pool.nodeSelector | default dict) $label }}
{{- fail (printf "pools[%d] (%s): nodeSelector sets %s, which domains set per Deployment; remove it" $i $pool.name $label) }}
{{- end }}
{{- $deployments = list }}
{{- $names := dict }}
{{- $n := len . }}
{{- range $j, $d := . }}
{{- $slug := regexReplaceAll "[^a-z0-9-]+" (lower $d) "-" | trimAll "-" }}
{{- $dn := printf "%s-%s" $name $slug }}
{{- if gt (len $dn) 63 }}
{{- $dn = printf "%s-%s" (regexReplaceAll "-+$" (trunc 54 $dn) "") (trunc 8 (sha256sum $dn)) }}
{{- end }}
{{- if or (not $slug) (hasKey $names $dn) }}
{{- fail (printf "pools[%d] (%s): domain %q makes the Deployment name %q, which is empty or another domain's; domains must differ in letters and digits" $i $pool.name $d $dn) }}
{{- end }}
{{- $_ := set $names $dn true }}
{{- $share := div (int $pool.replicas) $n }}
{{- if lt $j (mod (int $pool.replicas) $n) }}{{ $share = add1 $share }}{{ end }}
{{- $deployments = append $deployments (dict "name" $dn "domain" $d "replicas" $share) }}
{{- end }}
{{- end }}
{{- range $dep := $deployments }}
{{- with index $owners $dep.name }}
{{- fail (printf "pools[%d] (%s): Deployment name %q is already pool %q's (a pool named <pool>-<domain> collides with that pool's Deployment for the domain); rename one" $i $pool.name $dep.name .) }}
{{- end }}
{{- $_ := set $owners $dep.name $pool.name }}
{{- end }}
{{- $_ := set $pool "deployments" $deployments }}
{{- $resolved = append $resolved $pool }}
{{- end }}
{{- include "mosaic.checkLoraNames" $resolved }}
{{- toYaml (dict "pools" $resolved) }}
{{- end }}

{{/*
A pool's model must resolve in Mosaic's catalog, or the gateway, the controller and simulated workers refuse
the config at start (server/config.py check_catalog: a crash loop after install): the model itself, or with
`config.models` set its entry's `spec` (else its name), case-insensitively among the built-in catalog's rows
and aliases (files/catalog-models.yaml, kept equal to placement/catalog.py by tests/chart) and the rows
under `catalog.models`. Arguments: (list root index pool).
*/}}
{{- define "mosaic.pool.checkModel" -}}
{{- $root := index . 0 }}
{{- $i := index . 1 }}
{{- $pool := index . 2 }}
{{- $builtin := $root.Files.Get "files/catalog-models.yaml" | fromYaml }}
{{- $known := dict }}
{{- range $builtin.models }}{{ $_ := set $known (lower .) true }}{{ end }}
{{- range $alias, $_ := $builtin.aliases }}{{ $_ := set $known (lower $alias) true }}{{ end }}
{{- range $name, $_ := ($root.Values.catalog.models | default dict) }}{{ $_ := set $known (lower $name) true }}{{ end }}
{{- $names := concat $builtin.models (keys ($root.Values.catalog.models | default dict) | sortAlpha) | join ", " }}
{{- $models := $root.Values.config.models | default list }}
{{- if $models }}
{{- $entry := dict }}
{{- range $models }}{{ if eq (toString .name) (toString $pool.model) }}{{ $entry = . }}{{ end }}{{ end }}
{{- if not $entry }}
{{- $listed := list }}
{{- range $models }}{{ $listed = append $listed (toString .name) }}{{ end }}
{{- fail (printf "pools[%d] (%s): model %q is not listed under config.models (%s); with config.models set the gateway serves only the models listed there: add {name: %q, spec: <catalog model>}" $i $pool.name (toString $pool.model) (join ", " $listed) (toString $pool.model)) }}
{{- end }}
{{- $spec := toString ($entry.spec | default $entry.name) }}
{{- if not (hasKey $known (lower $spec)) }}
{{- fail (printf "pools[%d] (%s): config.models entry %q has spec %q, which is not a model of Mosaic's catalog (%s, their Hugging Face names, or a row under catalog.models)" $i $pool.name (toString $pool.model) $spec $names) }}
{{- end }}
{{- else if not (hasKey $known (lower (toString $pool.model))) }}
{{- fail (printf "pools[%d] (%s): model %q is not a model of Mosaic's catalog (%s, their Hugging Face names, or a row under catalog.models); map it to one with config.models: [{name: %q, spec: <catalog model>}], or add its row under catalog.models" $i $pool.name (toString $pool.model) $names (toString $pool.model)) }}
{{- end }}
{{- end }}

{{/*
A pool's gpu must resolve in Mosaic's catalog, or the gateway and the controller refuse the config at start
(server/config.py check_catalog: `unknown GPU`, a crash loop): case-insensitively among the built-in catalog's
GPU rows and aliases (files/catalog-models.yaml) and the rows under `catalog.gpus`. A pool's own gpuProducts
place it on nodes, but the gateway still sizes it by its catalog row. Arguments: (list root index pool).
*/}}
{{- define "mosaic.pool.checkGpu" -}}
{{- $root := index . 0 }}
{{- $i := index . 1 }}
{{- $pool := index . 2 }}
{{- $builtin := $root.Files.Get "files/catalog-models.yaml" | fromYaml }}
{{- $known := dict }}
{{- range $builtin.gpus }}{{ $_ := set $known (lower .) true }}{{ end }}
{{- range $alias, $_ := $builtin.gpuAliases }}{{ $_ := set $known (lower $alias) true }}{{ end }}
{{- range $name, $_ := ($root.Values.catalog.gpus | default dict) }}{{ $_ := set $known (lower $name) true }}{{ end }}
{{- if not (hasKey $known (lower (toString $pool.gpu))) }}
{{- $names := concat $builtin.gpus (keys ($root.Values.catalog.gpus | default dict) | sortAlpha) | join ", " }}
{{- fail (printf "pools[%d] (%s): gpu %q is not a GPU of Mosaic's catalog (%s); add its row under catalog.gpus (memory_gb, hbm_gbps, tflops, cost_per_hour), which the gateway sizes the pool by" $i $pool.name (toString $pool.gpu) $names) }}
{{- end }}
{{- end }}

{{/*
A pool's tp and dp reach its workers only through the flags the chart writes from them (vLLM's
--tensor-parallel-size and --data-parallel-size, `mosaic worker`'s --tp and --data-parallel-size): the same
flag again in extraArgs would win (vLLM's parser and click keep the last), and the worker would run another
shape than the one its pod got GPUs for (tp × dp) and the gateway sizes, prices and books (a crash loop, or
wrong capacity). Pipeline and prefill context parallelism (--pipeline-parallel-size,
--prefill-context-parallel-size) are refused too: Mosaic does not model them, and as vLLM's world size is
tp × pp × pcp a replica would need tp × pp × dp or tp × pcp × dp GPUs while its pod gets tp × dp and the
gateway books that much capacity (--decode-context-parallel-size adds no GPU and passes). vLLM's parser also
takes `_` for `-` in a long name, `=value`, the short forms -tp, -dp, -pp and -pcp, and argparse's
abbreviations: every prefix of --tensor-parallel-size from --te, of --pipeline-parallel-size from --pi and of
--prefill-context-parallel-size from --prefill-c (vLLM 0.32 has no other option starting so;
--prefill-schedule-interval shares --prefill-), -t and -pc (its only short options starting so; not -t=N or
-pc=N, which argparse refuses), none of --data-parallel-size (each is a prefix of --data-parallel-size-local
too, ambiguous), of -dp, or -p (-pp or -pcp: ambiguous). tests/real_vllm/test_chart_vllm_args.py holds these
spellings to vLLM's own parser. A `--config FILE` in extraArgs (vLLM's YAML of options, which may set these
sizes too) lives in the container and cannot be read here (docs/deploy.md). A pool's extraArgs are checked
simulated or not (they are its vLLM arguments once it runs vLLM); simulator.extraArgs (click: exact names)
for each simulated pool. Arguments: (list root index pool extraArgsValuesPath).
*/}}
{{- define "mosaic.pool.checkParallelArgs" -}}
{{- $root := index . 0 }}
{{- $i := index . 1 }}
{{- $pool := index . 2 }}
{{- $path := index . 3 }}
{{- $why := "the gateway sizes, prices and books the pool by it, and a real pool's pod gets tp × dp GPUs" }}
{{- range ($pool.extraArgs | default list) }}
{{- $arg := toString . }}
{{- $name := index (splitList "=" $arg) 0 }}
{{- $key := "" }}
{{- if hasPrefix "--" $name }}
{{- $long := trimPrefix "--" $name | replace "_" "-" }}
{{- if and (ge (len $long) 2) (hasPrefix $long "tensor-parallel-size") }}{{ $key = "tp" }}{{ end }}
{{- if and (ge (len $long) 2) (hasPrefix $long "pipeline-parallel-size") }}{{ $key = "pp" }}{{ end }}
{{- if and (hasPrefix "prefill-c" $long) (hasPrefix $long "prefill-context-parallel-size") }}{{ $key = "pcp" }}{{ end }}
{{- if eq $long "data-parallel-size" }}{{ $key = "dp" }}{{ end }}
{{- else if or (eq $name "-tp") (eq $arg "-t") }}{{ $key = "tp" }}
{{- else if eq $name "-dp" }}{{ $key = "dp" }}
{{- else if eq $name "-pp" }}{{ $key = "pp" }}
{{- else if or (eq $name "-pcp") (eq $arg "-pc") }}{{ $key = "pcp" }}
{{- end }}
{{- if or (eq $key "pp") (eq $key "pcp") }}
{{- $flag := ternary "--pipeline-parallel-size" "--prefill-context-parallel-size" (eq $key "pp") }}
{{- fail (printf "pools[%d] (%s): %s has %q, vLLM's %s, which Mosaic does not model: a replica would need tp × %s × dp GPUs while its pod gets tp × dp and the gateway sizes, prices and books the pool by tp × dp; remove it and use pools[%d].tp" $i $pool.name $path $arg $flag $key $i) }}
{{- else if $key }}
{{- fail (printf "pools[%d] (%s): %s has %q, vLLM's %s, which the chart writes from the pool's %s (%s); remove it and set pools[%d].%s" $i $pool.name $path $arg (ternary "--tensor-parallel-size" "--data-parallel-size" (eq $key "tp")) $key $why $i $key) }}
{{- end }}
{{- end }}
{{- if $pool.simulated }}
{{- range ($root.Values.simulator.extraArgs | default list) }}
{{- $arg := toString . }}
{{- $name := index (splitList "=" $arg) 0 }}
{{- if has $name (list "--tp" "--data-parallel-size") }}
{{- $key := ternary "tp" "dp" (eq $name "--tp") }}
{{- fail (printf "pools[%d] (%s): simulator.extraArgs has %q, mosaic worker's %s, which the chart writes from the pool's %s (%s); remove it and set pools[%d].%s" $i $pool.name $arg $name $key $why $i $key) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
A pool's LoRA adapters (`lora`; `loraOn`: it has `modules` or `runtimeUpdating`), checked where vLLM 0.32 would
refuse them at start (a crash loop) or another value would override what the chart writes from them. The
schema holds each value alone (a name without `=`, `,`, blanks or a leading `-`: the chart writes
`--lora-modules name=path` and vLLM reads an item with a `,` as JSON; maxLoras >= 1; maxLoraRank one of
vllm/config/lora.py MaxLoRARanks); here the rules across values:
- a name twice in the pool ("The lora adapter '…' has already been loaded"), or the pool's served name, its
  `model` ("… conflicts with a served base model"): vLLM loads the static adapters at start and exits;
- the pool's own maxLoras or maxLoraRank with neither modules nor runtimeUpdating: LoRA stays off, say so;
- runtimeUpdating with dp > 1: vLLM starts one API server per engine (api_server_count defaults to the data
  parallel size) and refuses VLLM_ALLOW_RUNTIME_LORA_UPDATING with more than one (entrypoints/cli/serve.py),
  unless extraArgs set --api-server-count 1 (`_` for `-`, `=1`, an abbreviation from --api-s, -asc, -as but
  not -as=1, as vLLM's parser reads them);
- runtimeUpdating with VLLM_ALLOW_RUNTIME_LORA_UPDATING in env or vllm.env too (the later entry would win);
- with LoRA on, a flag the chart writes from `lora` again in extraArgs: vLLM keeps the last --max-loras,
  --max-lora-rank and --lora-modules (a later list replaces an earlier one), and --no-enable-lora turns LoRA
  off. As checkParallelArgs reads them: `_` for `-`, `=value` (not for the switches, which vLLM refuses with
  a value), and argparse's abbreviations vLLM 0.32 takes: --enable-lor…, --no-enable-lor…, --lora-m…,
  --max-lora-r… and --max-loras exactly (--max-lora is ambiguous); also vLLM's dotted form (`--lora-modules.name
  x`, read as JSON). tests/real_vllm/test_chart_vllm_args.py holds these spellings to vLLM's parser. For a
  simulated pool, simulator.extraArgs too (`mosaic worker` reads --lora-modules, --max-loras and
  --[no-]enable-lora by exact name). Without LoRA on, extraArgs may carry LoRA flags (the way before `lora`).
Arguments: (list root index pool poolValues extraArgsValuesPath).
*/}}
{{- define "mosaic.pool.checkLora" -}}
{{- $root := index . 0 }}
{{- $i := index . 1 }}
{{- $pool := index . 2 }}
{{- $own := (index . 3).lora | default dict }}
{{- $path := index . 4 }}
{{- $lora := $pool.lora | default dict }}
{{- $names := dict }}
{{- range $j, $m := ($lora.modules | default list) }}
{{- $name := toString $m.name }}
{{- if hasKey $names $name }}
{{- fail (printf "pools[%d] (%s): lora.modules[%d] names adapter %q, as lora.modules[%d] does; vLLM refuses an adapter name twice at start (\"The lora adapter '%s' has already been loaded\"): give each adapter its own name" $i $pool.name $j $name (get $names $name) $name) }}
{{- end }}
{{- $_ := set $names $name $j }}
{{- if eq $name (toString $pool.model) }}
{{- fail (printf "pools[%d] (%s): lora.modules[%d] names adapter %q, the pool's model (vLLM's --served-model-name); vLLM refuses it at start (\"The lora adapter '%s' conflicts with a served base model\"): rename the adapter" $i $pool.name $j $name $name) }}
{{- end }}
{{- end }}
{{- if not $pool.loraOn }}
{{- range $key := list "maxLoras" "maxLoraRank" }}
{{- if and (hasKey $own $key) (not (kindIs "invalid" (index $own $key))) }}
{{- fail (printf "pools[%d] (%s): lora.%s is set but the pool has no lora.modules and no lora.runtimeUpdating, so LoRA stays off and it does nothing; add the adapters (modules) or runtimeUpdating: true, or remove lora.%s" $i $pool.name $key $key) }}
{{- end }}
{{- end }}
{{- else }}
{{- $args := $pool.extraArgs | default list }}
{{- if and $lora.runtimeUpdating (gt (int $pool.dp) 1) }}
{{- $servers := "" }}
{{- range $k, $a := $args }}
{{- $arg := toString $a }}
{{- $name := index (splitList "=" $arg) 0 }}
{{- $long := trimPrefix "--" $name | replace "_" "-" }}
{{- if or (and (hasPrefix "--" $name) (ge (len $long) 5) (hasPrefix $long "api-server-count")) (eq $name "-asc") (eq $arg "-as") }}
{{- if contains "=" $arg }}{{ $servers = trimPrefix (printf "%s=" $name) $arg }}{{ else if lt (add1 $k) (len $args) }}{{ $servers = toString (index $args (add1 $k)) }}{{ end }}
{{- end }}
{{- end }}
{{- if ne $servers "1" }}
{{- fail (printf "pools[%d] (%s): lora.runtimeUpdating with dp %d: vLLM 0.32 starts one API server per engine and refuses VLLM_ALLOW_RUNTIME_LORA_UPDATING with more than one at start; add `--api-server-count 1` to pools[%d].extraArgs (one API server for the %d engines), or set runtimeUpdating: false and list the adapters in lora.modules" $i $pool.name (int $pool.dp) $i (int $pool.dp)) }}
{{- end }}
{{- end }}
{{- if $lora.runtimeUpdating }}
{{- range $from, $env := dict (printf "pools[%d].env" $i) ($pool.env | default list) "vllm.env" ($root.Values.vllm.env | default list) }}
{{- range $env }}
{{- if eq (toString .name) "VLLM_ALLOW_RUNTIME_LORA_UPDATING" }}
{{- fail (printf "pools[%d] (%s): %s sets VLLM_ALLOW_RUNTIME_LORA_UPDATING, which the chart writes from lora.runtimeUpdating (the later entry would win); remove it from %s" $i $pool.name $from $from) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- $writes := dict "lora-modules" "modules" "max-loras" "maxLoras" "max-lora-rank" "maxLoraRank" }}
{{- range $args }}
{{- $arg := toString . }}
{{- $name := index (splitList "." (index (splitList "=" $arg) 0)) 0 }}
{{- $flag := "" }}
{{- if hasPrefix "--" $name }}
{{- $long := trimPrefix "--" $name | replace "_" "-" }}
{{- $switch := and (not (contains "=" $arg)) (not (contains "." $arg)) }}
{{- if and $switch (ge (len $long) 10) (hasPrefix $long "enable-lora") }}{{ $flag = "enable-lora" }}{{ end }}
{{- if and $switch (ge (len $long) 13) (hasPrefix $long "no-enable-lora") }}{{ $flag = "no-enable-lora" }}{{ end }}
{{- if and (ge (len $long) 6) (hasPrefix $long "lora-modules") }}{{ $flag = "lora-modules" }}{{ end }}
{{- if eq $long "max-loras" }}{{ $flag = "max-loras" }}{{ end }}
{{- if and (ge (len $long) 10) (hasPrefix $long "max-lora-rank") }}{{ $flag = "max-lora-rank" }}{{ end }}
{{- end }}
{{- if eq $flag "enable-lora" }}
{{- fail (printf "pools[%d] (%s): %s has %q, vLLM's --enable-lora, which the chart writes for pools[%d].lora (its modules or runtimeUpdating); remove it" $i $pool.name $path $arg $i) }}
{{- else if eq $flag "no-enable-lora" }}
{{- fail (printf "pools[%d] (%s): %s has %q, vLLM's --no-enable-lora, which turns off the LoRA the chart turns on for pools[%d].lora (vLLM then refuses its adapters at start); remove it, or remove pools[%d].lora to serve no adapter" $i $pool.name $path $arg $i $i) }}
{{- else if $flag }}
{{- $key := get $writes $flag }}
{{- fail (printf "pools[%d] (%s): %s has %q, vLLM's --%s, which the chart writes from pools[%d].lora.%s (vLLM keeps the last of a repeated flag); remove it and set pools[%d].lora.%s" $i $pool.name $path $arg $flag $i $key $i $key) }}
{{- end }}
{{- end }}
{{- if $pool.simulated }}
{{- range ($root.Values.simulator.extraArgs | default list) }}
{{- $arg := toString . }}
{{- $name := index (splitList "=" $arg) 0 }}
{{- if has $name (list "--lora-modules" "--max-loras" "--enable-lora" "--no-enable-lora") }}
{{- fail (printf "pools[%d] (%s): simulator.extraArgs has %q, mosaic worker's %s (vLLM's), which the chart writes from pools[%d].lora for this simulated pool (the worker keeps the last of a repeated flag); remove it and set pools[%d].lora" $i $pool.name $arg $name $i $i) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
A LoRA pool's arguments, vLLM's flags: --enable-lora, --lora-modules name=path ... (a list that ends at the next
flag: in vLLM's line the chart's own --shutdown-timeout follows), --max-loras and, for vLLM (not `mosaic
worker`, which has no rank), --max-lora-rank, each when set. Arguments: (list lora forVllm); returns YAML list
items.
*/}}
{{- define "mosaic.pool.loraArgs" -}}
{{- $lora := index . 0 }}
- --enable-lora
{{- with $lora.modules }}
- --lora-modules
{{- range . }}
- {{ printf "%s=%s" (toString .name) (toString .path) | quote }}
{{- end }}
{{- end }}
{{- if not (kindIs "invalid" $lora.maxLoras) }}
- --max-loras
- {{ $lora.maxLoras | int | quote }}
{{- end }}
{{- if and (index . 1) (not (kindIs "invalid" $lora.maxLoraRank)) }}
- --max-lora-rank
- {{ $lora.maxLoraRank | int | quote }}
{{- end }}
{{- end }}

{{/*
LoRA adapter names across pools (arguments: the resolved pools). The gateway reads each worker's adapters from
its /v1/models and routes a request naming one as that worker's base model (server/registry.py
adapter_models): a pool's model name is always that model, never an adapter, so an adapter named like another
pool's model is unreachable through the gateway; and an adapter name is one adapter to a client, mapped to one
base model, so the same name on pools of two different models leaves one of them unreachable. The same adapter
name on several pools of one model is one adapter served by all of them.
*/}}
{{- define "mosaic.checkLoraNames" -}}
{{- $models := dict }}
{{- range $i, $p := . }}{{ $_ := set $models (toString $p.model) (printf "pools[%d] (%s)" $i $p.name) }}{{ end }}
{{- $adapters := dict }}
{{- range $i, $p := . }}
{{- if $p.loraOn }}
{{- range $j, $m := ($p.lora.modules | default list) }}
{{- $name := toString $m.name }}
{{- $where := printf "pools[%d] (%s): lora.modules[%d]" $i $p.name $j }}
{{- with get $models $name }}
{{- fail (printf "%s names adapter %q, the model of %s; the gateway routes that name to the model, never to this adapter: rename the adapter" $where $name .) }}
{{- end }}
{{- $seen := get $adapters $name }}
{{- if and $seen (ne (index $seen 0) (toString $p.model)) }}
{{- fail (printf "%s names adapter %q, as %s does for model %q; the gateway maps an adapter name to one base model, so one of them would be unreachable: give the %s adapter its own name" $where $name (index $seen 1) (index $seen 0) (toString $p.model)) }}
{{- end }}
{{- if not $seen }}{{ $_ := set $adapters $name (list (toString $p.model) (printf "pools[%d] (%s)" $i $p.name)) }}{{ end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
A real pool's affinity: the pool's own, with the chart's required GPU term (`vllm.gpuProductLabel` In the
pool's products) ANDed into each of its required nodeSelectorTerms (the only term when it has none); a term
that already matches on the product label is kept as written. Preferred terms and pod (anti-)affinity are
the pool's. No products (a pool that places itself by its own nodeAffinity): the pool's affinity as is.
Arguments: (list root pool products); returns YAML.
*/}}
{{- define "mosaic.pool.affinity" -}}
{{- $root := index . 0 }}
{{- $pool := index . 1 }}
{{- $products := index . 2 }}
{{- $affinity := deepCopy ($pool.affinity | default dict) }}
{{- if $products }}
{{- $label := $root.Values.vllm.gpuProductLabel }}
{{- $gpu := dict "key" $label "operator" "In" "values" $products }}
{{- $node := $affinity.nodeAffinity | default dict }}
{{- $required := get $node "requiredDuringSchedulingIgnoredDuringExecution" | default dict }}
{{- $terms := list }}
{{- range ($required.nodeSelectorTerms | default (list (dict))) }}
{{- $term := deepCopy . }}
{{- $expressions := $term.matchExpressions | default list }}
{{- $own := false }}
{{- range $expressions }}{{ if eq .key $label }}{{ $own = true }}{{ end }}{{ end }}
{{- if not $own }}
{{- $_ := set $term "matchExpressions" (append $expressions $gpu) }}
{{- end }}
{{- $terms = append $terms $term }}
{{- end }}
{{- $_ := set $required "nodeSelectorTerms" $terms }}
{{- $_ := set $node "requiredDuringSchedulingIgnoredDuringExecution" $required }}
{{- $_ := set $affinity "nodeAffinity" $node }}
{{- end }}
{{- toYaml $affinity }}
{{- end }}

{{/*
A probe: its handler (a dict such as {httpGet: …}) with every timing field of its values (periodSeconds,
failureThreshold, timeoutSeconds: whatever the schema's `probe` accepts), timeoutSeconds defaulting to
the third argument. Arguments: (list handler values defaultTimeout).
*/}}
{{- define "mosaic.probe" -}}
{{- $probe := mustMergeOverwrite (dict "timeoutSeconds" (index . 2)) (deepCopy (index . 1)) (index . 0) }}
{{- toYaml $probe }}
{{- end }}

{{/* Selector labels of one pool's pods: the labels Mosaic's Kubernetes discovery selects on. */}}
{{- define "mosaic.pool.selectorLabels" -}}
{{- $root := index . 0 -}}
{{- $pool := index . 1 -}}
{{ include "mosaic.selectorLabels" $root }}
app.kubernetes.io/component: worker
mosaic.dev/pool: {{ $pool.name | quote }}
{{- end }}

{{/* Labels a pool's objects add to "mosaic.labels": the discovery labels the gateway reads off each pod. */}}
{{- define "mosaic.pool.labels" -}}
{{- $pool := index . 1 -}}
app.kubernetes.io/component: worker
mosaic.dev/pool: {{ $pool.name | quote }}
mosaic.dev/role: {{ $pool.role | quote }}
mosaic.dev/gpu: {{ $pool.gpu | quote }}
mosaic.dev/simulated: {{ $pool.simulated | quote }}
{{- end }}

{{/* The label selector string the gateway config gives Kubernetes discovery for one pool: exactly the
pool's selector labels, as "k=v,k=v" in key order. */}}
{{- define "mosaic.pool.selectorString" -}}
{{- $labels := include "mosaic.pool.selectorLabels" . | fromYaml }}
{{- $pairs := list }}
{{- range $k := keys $labels | sortAlpha }}
{{- $pairs = append $pairs (printf "%s=%s" $k (get $labels $k)) }}
{{- end }}
{{- join "," $pairs }}
{{- end }}

{{/*
The gateway's config.yaml (server/config.py, INTERFACES.md §4): `.Values.config` plus the sections the chart
owns. Each pool is found through the Kubernetes API in the release namespace: by default the EndpointSlices
of the pool's Service (ready endpoints only), or with gateway.discovery.resource=pods the pool's pods by
their selector labels. `gateway.replicas` is the N of the 1/N KV share each gateway replica owns: with the
HPA it is maxReplicas, the pessimistic share; with gateway.peers.enabled (the default) only until a replica's
first listing of the gateway Service's EndpointSlices, after which N is the count listed (server/peers.py).
*/}}
{{- define "mosaic.gatewayConfig" -}}
{{- $root := . }}
{{- $cfg := deepCopy $root.Values.config }}
{{- include "mosaic.checkConfig" (list $root (include "mosaic.pools" $root | fromYaml).pools) }}
{{- $disc := $root.Values.gateway.discovery }}
{{- $pools := list }}
{{- range (include "mosaic.pools" $root | fromYaml).pools }}
{{- $selector := printf "kubernetes.io/service-name=%s" .fullname }}
{{- if eq $disc.resource "pods" }}
{{- $selector = include "mosaic.pool.selectorString" (list $root .) }}
{{- end }}
{{- $k8s := dict "namespace" $root.Release.Namespace "label_selector" $selector "port" (int $root.Values.vllm.port) "resource" $disc.resource "resync_s" (float64 $disc.resyncSeconds) "in_cluster" true "domain_label" $disc.domainLabel }}
{{- $entry := dict "name" .name "model" .model "gpu" .gpu "role" .role "tp" (int .tp) "dp" (int .dp) }}
{{- if eq (toString .runner) "pooling" }}
{{- $_ := set $entry "runner" "pooling" }}
{{- end }}
{{- $_ := set $entry "min_replicas" (int .minReplicas) }}
{{- $_ := set $entry "max_replicas" (int .maxReplicas) }}
{{- $_ := set $entry "max_num_seqs" (int .maxNumSeqs) }}
{{- $_ := set $entry "block_size" (int .blockSize) }}
{{- $_ := set $entry "gpu_memory_utilization" (float64 .gpuMemoryUtilization) }}
{{- if not (kindIs "invalid" .costPerHour) }}
{{- $_ := set $entry "cost_per_hour" (float64 .costPerHour) }}
{{- end }}
{{- with .apiKeyEnv }}
{{- $_ := set $entry "api_key_env" . }}
{{- end }}
{{- $_ := set $entry "endpoints" (dict "kubernetes" $k8s) }}
{{- $pools = append $pools $entry }}
{{- end }}
{{- $_ := set $cfg "pools" $pools }}
{{- /* The chart's pools are found through the Kubernetes API, never simulated in-process: `embedded`, the
gateway's default actuator, cannot scale them (the schema refuses it) and would make the gateway refuse the
config; kubernetes is the chart's default whether or not the controller runs. */}}
{{- if and $cfg.autoscaler (not (hasKey $cfg.autoscaler "actuator")) }}
{{- $_ := set $cfg "autoscaler" (merge (dict "actuator" "kubernetes") (deepCopy $cfg.autoscaler)) }}
{{- end }}
{{- if and (not $root.Values.controller.enabled) ($cfg.autoscaler | default dict).enabled (eq (($cfg.autoscaler | default dict).actuator | default "kubernetes") "kubernetes") }}
{{- fail "config.autoscaler.enabled with controller.enabled false: the kubernetes actuator runs in the controller (`mosaic autoscale`), so nothing would scale the pools; set controller.enabled: true, or config.autoscaler.actuator: dry-run for decisions only (in each gateway)" }}
{{- end }}
{{- /* The controller (`mosaic autoscale`) scales each pool's Deployment, <fullname>-<pool>, in this namespace. */}}
{{- if $root.Values.controller.enabled }}
{{- if and (hasKey ($cfg.autoscaler | default dict) "enabled") (not $cfg.autoscaler.enabled) }}
{{- fail "config.autoscaler.enabled: false does not stop the controller (`mosaic autoscale` scales the pools whatever it says); set controller.enabled: false to turn autoscaling off" }}
{{- end }}
{{- $as := deepCopy (default (dict) $cfg.autoscaler) }}
{{- /* A pool with domains is one Deployment per domain: autoscaler.kubernetes.domains, pool → {domain → Deployment}. */}}
{{- $deployments := dict }}
{{- $domains := dict }}
{{- range (include "mosaic.pools" $root | fromYaml).pools }}
{{- /* a pooling pool (embeddings) is not the autoscaler's: its signal, decode tokens/s, is one such a pool never produces */}}
{{- if eq (toString .runner) "pooling" }}
{{- else if .domains }}
{{- $by := dict }}
{{- range .deployments }}{{ $_ := set $by .domain .name }}{{ end }}
{{- $_ := set $domains .name $by }}
{{- else }}
{{- $_ := set $deployments .name .fullname }}
{{- end }}
{{- end }}
{{- $scaler := deepCopy (default (dict) $as.kubernetes) }}
{{- $_ := set $scaler "namespace" $root.Release.Namespace }}
{{- $_ := set $scaler "deployments" $deployments }}
{{- if $domains }}
{{- $_ := set $scaler "domains" $domains }}
{{- else }}
{{- $_ := unset $scaler "domains" }}
{{- end }}
{{- $_ := set $scaler "in_cluster" true }}
{{- if not (hasKey $as "actuator") }}
{{- $_ := set $as "actuator" "kubernetes" }}
{{- end }}
{{- /* It serves no traffic: it scrapes the release's gateway pods' /metrics for the gateway-side signals
(admission queue, TTFT/TPOT, arrivals), found by the gateway Deployment's pod labels (server/gateway_scrape.py). */}}
{{- $gm := $root.Values.controller.gatewayMetrics }}
{{- if and $gm.enabled (not (hasKey $as "gateways")) }}
{{- $labels := include "mosaic.gateway.selectorLabels" $root | fromYaml }}
{{- $pairs := list }}
{{- range $k := keys $labels | sortAlpha }}
{{- $pairs = append $pairs (printf "%s=%s" $k (get $labels $k)) }}
{{- end }}
{{- $pods := dict "namespace" $root.Release.Namespace "label_selector" (join "," $pairs) "port" (int $root.Values.gateway.port) "resource" "pods" "resync_s" (float64 $gm.resyncSeconds) "in_cluster" true "domain_label" nil }}
{{- $_ := set $as "gateways" (dict "kubernetes" $pods "interval_s" (float64 $gm.intervalSeconds)) }}
{{- end }}
{{- $_ := set $as "kubernetes" $scaler }}
{{- $_ := set $cfg "autoscaler" $as }}
{{- end }}
{{- $n := $root.Values.gateway.replicas }}
{{- if $root.Values.gateway.autoscaling.enabled }}{{ $n = $root.Values.gateway.autoscaling.maxReplicas }}{{ end }}
{{- /* at least 1: `gateway.replicas: 0` (the gateway scaled away for maintenance) must still give a config the
controller, which reads the same ConfigMap, accepts */}}
{{- $gw := dict "replicas" (max 1 (int $n)) "host" "0.0.0.0" "port" (int $root.Values.gateway.port) }}
{{- $peers := $root.Values.gateway.peers }}
{{- $kv := $cfg.kv | default dict }}
{{- if and $peers.enabled (not (kindIs "invalid" $kv.share)) (ne (toString (get $kv "enabled")) "false") }}
{{- fail (printf "config.kv.share and gateway.peers.enabled exclude each other (the gateway refuses both at start): with peers each gateway's share is 1/N of the replicas it lists; set gateway.peers.enabled: false to use the fixed share %v, or remove config.kv.share" $kv.share) }}
{{- end }}
{{- if $peers.enabled }}
{{- /* the gateway Service's EndpointSlices, port by the Service port's name: every replica, ready or not */}}
{{- $slices := dict "namespace" $root.Release.Namespace "label_selector" (printf "kubernetes.io/service-name=%s" (include "mosaic.gateway.fullname" $root)) "port" "http" "resource" "endpointslices" "resync_s" (float64 $peers.resyncSeconds) "in_cluster" true "domain_label" nil }}
{{- $_ := set $gw "peers" (dict "kubernetes" $slices "grow_back_after_s" (float64 $peers.growBackSeconds)) }}
{{- end }}
{{- $_ := set $cfg "gateway" $gw }}
{{- if $root.Values.auth.enabled }}
{{- $_ := set $cfg "auth" (dict "api_keys_env" "MOSAIC_API_KEYS" "admin_keys_env" "MOSAIC_ADMIN_KEYS") }}
{{- end }}
{{- if $root.Values.catalog }}
{{- $_ := set $cfg "catalog" "/etc/mosaic/catalog.yaml" }}
{{- end }}
{{- toYaml $cfg }}
{{- end }}

{{/*
What the gateway and the controller refuse at start in `config`, checked at render so that a bad value fails
`helm install` instead of leaving every gateway (or the controller) in CrashLoopBackOff with a one-line config
error. The bounds one schema keyword can hold (policy knobs, the policy's spelling) are in values.schema.json;
these are the rules across keys. Each cites the loader's own rule: keep them in step
(tests/chart/test_chart_startup_refusals.py). Arguments: (list root resolvedPools).
*/}}
{{- define "mosaic.checkConfig" -}}
{{- $root := index . 0 }}
{{- $pools := index . 1 }}
{{- $cfg := $root.Values.config | default dict }}
{{- include "mosaic.checkModelNames" $cfg }}
{{- include "mosaic.checkKvLease" $cfg }}
{{- include "mosaic.checkKnobsOnce" $cfg }}
{{- include "mosaic.checkBacklogLead" $cfg }}
{{- include "mosaic.checkPolicy" (list $cfg $pools) }}
{{- include "mosaic.checkPrefillOnly" $pools }}
{{- include "mosaic.checkRunners" $pools }}
{{- /* the chart writes autoscaler.kubernetes.domains, which the inventory is checked against, only for the controller */}}
{{- if $root.Values.controller.enabled }}
{{- include "mosaic.checkNodeDomains" (list $root $pools) }}
{{- end }}
{{- end }}

{{/* config.models[].name given twice: server/config.py MosaicConfig._cross_checks (`_unique`, "duplicate
model name"). Argument: the config values. */}}
{{- define "mosaic.checkModelNames" -}}
{{- $first := dict }}
{{- range $i, $m := .models | default list }}
{{- $name := toString $m.name }}
{{- if hasKey $first $name }}
{{- fail (printf "config.models[%d]: name %q is config.models[%d]'s too; the gateway refuses a model listed twice (models.%d.name: duplicate model name): keep one entry" $i $name (get $first $name) $i) }}
{{- end }}
{{- $_ := set $first $name $i }}
{{- end }}
{{- end }}

{{/* With the KV ledger on (kv.enabled, default true), kv.lease_s must exceed the longest a request holds its
pages without renewing them, or the sweep frees a live request's pages: server/config.py `_check_kv`
(`kv.lease_s <= max(total_timeout_s, first_token_timeout_s, stall_timeout_s)` is refused). The defaults are
the loader's: lease_s 900 (scheduler/kv/config.py KvConfig), total 600, first token 60, stall 60
(server/config.py LimitsConfig). Argument: the config values. */}}
{{- define "mosaic.checkKvLease" -}}
{{- $kv := .kv | default dict }}
{{- $limits := .limits | default dict }}
{{- if dig "enabled" true $kv }}
{{- $lease := float64 (dig "lease_s" 900 $kv) }}
{{- $longest := maxf (dig "total_timeout_s" 600 $limits) (dig "first_token_timeout_s" 60 $limits) (dig "stall_timeout_s" 60 $limits) }}
{{- if le $lease $longest }}
{{- fail (printf "config.kv.lease_s %v must exceed the longest a request holds KV pages without renewing them, max(config.limits.total_timeout_s, first_token_timeout_s, stall_timeout_s) = %v s (the gateway refuses it at start); raise config.kv.lease_s above it" $lease $longest) }}
{{- end }}
{{- end }}
{{- end }}

{{/* A policy knob set both directly under autoscaler and under autoscaler.knobs, with two values: the loader
refuses it (server/config.py `_flat_knobs`: which one wins would be a guess). Argument: the config values. */}}
{{- define "mosaic.checkKnobsOnce" -}}
{{- $a := .autoscaler | default dict }}
{{- $knobs := $a.knobs | default dict }}
{{- range $k := keys $knobs | sortAlpha }}
{{- if and (hasKey $a $k) (ne (toJson (get $a $k)) (toJson (get $knobs $k))) }}
{{- fail (printf "config.autoscaler.%s is set both under autoscaler (%v) and under autoscaler.knobs (%v); give it once (the gateway refuses it at start)" $k (get $a $k) (get $knobs $k)) }}
{{- end }}
{{- end }}
{{- end }}

{{/* A backlog lead needs the cold start (the starting instances' expected ready times): server/config.py
AutoscalerConfig._lead_needs_cold_start. The knob sits under autoscaler.knobs or directly under autoscaler
(both only with one value: mosaic.checkKnobsOnce). Argument: the config values. */}}
{{- define "mosaic.checkBacklogLead" -}}
{{- $a := .autoscaler | default dict }}
{{- $knobs := $a.knobs | default dict }}
{{- $path := "config.autoscaler.backlog_lead_s" }}
{{- $lead := float64 (dig "backlog_lead_s" 0 $a) }}
{{- if hasKey $knobs "backlog_lead_s" }}
{{- $path = "config.autoscaler.knobs.backlog_lead_s" }}
{{- $lead = float64 (get $knobs "backlog_lead_s") }}
{{- end }}
{{- if and (gt $lead 0.0) (le (float64 (dig "cold_start_s" 0 $a)) 0.0) }}
{{- fail (printf "%s %v needs config.autoscaler.cold_start_s > 0, a new instance's expected start-to-ready time (the gateway and the controller refuse the lead without it at start); set cold_start_s, or backlog_lead_s: 0" $path $lead) }}
{{- end }}
{{- end }}

{{/* autoscaler.policy's parameter, as scheduler/autoscaler/factory.py build_policy checks it when the
gateway loads its config (server/config.py `_check_autoscaler`, with check_bounds): hpa-util:T in (0, 1],
hpa-waiting:T and dynamo:I > 0 (`_positive`), static:POOL=N naming pools, each N within the pool's
minReplicas..maxReplicas (`_static_counts`). The schema's pattern holds the names and the parameters' shape.
Arguments: (list configValues resolvedPools). */}}
{{- define "mosaic.checkPolicy" -}}
{{- $cfg := index . 0 }}
{{- $pools := index . 1 }}
{{- $spec := toString (dig "policy" "mosaic" ($cfg.autoscaler | default dict)) }}
{{- $name := index (splitList ":" $spec) 0 }}
{{- $arg := trimPrefix $name $spec | trimPrefix ":" }}
{{- if and $arg (has $name (list "hpa-util" "hpa-waiting" "dynamo")) }}
{{- $v := float64 $arg }}{{- /* 0 also when out of float range (1e999), which the loader refuses as infinite */}}
{{- if or (le $v 0.0) (and (eq $name "hpa-util") (gt $v 1.0)) }}
{{- fail (printf "config.autoscaler.policy %q: the parameter must be a finite number %s (the gateway refuses it at start)" $spec (ternary "in (0, 1], a GPU-utilisation target" "> 0" (eq $name "hpa-util"))) }}
{{- end }}
{{- else if eq $name "static" }}
{{- $bounds := dict }}
{{- range $pools }}{{ $_ := set $bounds .name (list (int .minReplicas) (int .maxReplicas)) }}{{ end }}
{{- $seen := dict }}
{{- range (splitList "," $arg) }}
{{- if . }}
{{- $pool := index (splitList "=" .) 0 }}
{{- $n := atoi (trim (trimPrefix (printf "%s=" $pool) .)) }}
{{- if not (hasKey $bounds $pool) }}
{{- fail (printf "config.autoscaler.policy %q: %q is not a pool (pools: %s); the gateway refuses it at start" $spec $pool (keys $bounds | sortAlpha | join ", ")) }}
{{- end }}
{{- if hasKey $seen $pool }}
{{- fail (printf "config.autoscaler.policy %q: pool %s is given twice; the gateway refuses it at start" $spec $pool) }}
{{- end }}
{{- $_ := set $seen $pool true }}
{{- $b := get $bounds $pool }}
{{- if or (lt $n (index $b 0)) (gt $n (index $b 1)) }}
{{- fail (printf "config.autoscaler.policy %q: the count %d is outside pool %s's minReplicas..maxReplicas (%d..%d); the gateway refuses it at start" $spec $n $pool (index $b 0) (index $b 1)) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* A model whose every pool is a prefill pool: nothing would finish its requests; scheduler/fleet.py
`prefill_only_models`, which the gateway's config loader refuses. Argument: the resolved pools. */}}
{{- define "mosaic.checkPrefillOnly" -}}
{{- $byModel := dict }}
{{- $finishing := dict }}
{{- range . }}
{{- $model := toString .model }}
{{- $_ := set $byModel $model (append (get $byModel $model | default list) .name) }}
{{- if ne (toString .role) "prefill" }}{{ $_ := set $finishing $model true }}{{ end }}
{{- end }}
{{- range $model := keys $byModel | sortAlpha }}
{{- if not (hasKey $finishing $model) }}
{{- fail (printf "pools: model %q has only prefill pools (%s): a prefill worker does not finish a request; add a decode or mixed pool (the gateway refuses it at start)" $model (get $byModel $model | join ", ")) }}
{{- end }}
{{- end }}
{{- end }}

{{/* A pooling pool is role mixed and its model is served by pooling pools only: server/config.py
(`PoolConfig._replica_bounds`, `_check_one_runner_per_model`). Argument: the merged pools. */}}
{{- define "mosaic.checkRunners" -}}
{{- $runnerOf := dict }}
{{- range . }}
{{- $runner := toString (.runner | default "generate") }}
{{- if and (eq $runner "pooling") (ne (toString .role) "mixed") }}
{{- fail (printf "pools: %s has runner pooling and role %s: a pooling request ends at its prefill, so a pooling pool is role mixed" .name .role) }}
{{- end }}
{{- $model := toString .model }}
{{- if and (hasKey $runnerOf $model) (ne (index (get $runnerOf $model) 0) $runner) }}
{{- fail (printf "pools: model %q is served by %s with runner %s and by %s with runner %s; serve the embedding model under a name of its own (the gateway refuses it at start)" $model (index (get $runnerOf $model) 1) (index (get $runnerOf $model) 0) .name $runner) }}
{{- end }}
{{- if not (hasKey $runnerOf $model) }}{{ $_ := set $runnerOf $model (list $runner (toString .name)) }}{{ end }}
{{- end }}
{{- end }}

{{/* A GPU name in the catalog's spelling: its row (built-in or under catalog.gpus, any case), else the row its
built-in alias stands for, else the name as given; as placement/catalog.py `_canonical` resolves it.
Arguments: (list root name). */}}
{{- define "mosaic.canonicalGpu" -}}
{{- $root := index . 0 }}
{{- $name := toString (index . 1) }}
{{- $builtin := $root.Files.Get "files/catalog-models.yaml" | fromYaml }}
{{- $found := "" }}
{{- range concat $builtin.gpus (keys ($root.Values.catalog.gpus | default dict) | sortAlpha) }}
{{- if and (not $found) (eq (lower .) (lower $name)) }}{{ $found = . }}{{ end }}
{{- end }}
{{- range $alias, $target := $builtin.gpuAliases }}
{{- if and (not $found) (eq (lower $alias) (lower $name)) }}{{ $found = $target }}{{ end }}
{{- end }}
{{- default $name $found }}
{{- end }}

{{/*
An inline node inventory (config.autoscaler.nodes) against the pools with `domains`, which the chart writes as
autoscaler.kubernetes.domains: every domain of such a pool must be in the inventory, and every inventory domain
with nodes of the pool's GPU (catalog spelling) must be one of its domains, or the controller refuses the config
at start (server/autoscale_placement.py check_domains). A node without a domain is in "default", as
placement/topology.py nodes_from_dict reads it. A path (an inventory file) is not read here. Arguments: (list
root resolvedPools).
*/}}
{{- define "mosaic.checkNodeDomains" -}}
{{- $root := index . 0 }}
{{- $pools := index . 1 }}
{{- $inventory := dig "autoscaler" "nodes" "" ($root.Values.config | default dict) }}
{{- $nodes := list }}
{{- if kindIs "map" $inventory }}{{ $nodes = $inventory.nodes | default list }}{{ end }}
{{- /* no inventory: nothing to check (an empty or malformed one the controller refuses on its own terms) */}}
{{- if and (kindIs "slice" $nodes) $nodes }}
{{- $known := dict }}
{{- $byGpu := dict }}{{- /* lower-cased catalog GPU → {domain: true} */}}
{{- range $nodes }}
{{- if kindIs "map" . }}
{{- $d := toString (dig "domain" "default" .) }}
{{- $_ := set $known $d true }}
{{- $gpu := lower (include "mosaic.canonicalGpu" (list $root .gpu)) }}
{{- $_ := set $byGpu $gpu (set (get $byGpu $gpu | default dict) $d true) }}
{{- end }}
{{- end }}
{{- range $i, $pool := $pools }}
{{- with $pool.domains }}
{{- range . | sortAlpha }}
{{- if not (hasKey $known .) }}
{{- fail (printf "pools[%d] (%s): domain %q is not in config.autoscaler.nodes (domains: %s); the controller refuses it at start: add the domain's nodes to the inventory, or remove it from the pool" $i $pool.name . (keys $known | sortAlpha | join ", ")) }}
{{- end }}
{{- end }}
{{- $gpu := include "mosaic.canonicalGpu" (list $root $pool.gpu) }}
{{- $unmapped := list }}
{{- range $d, $_ := get $byGpu (lower $gpu) | default dict }}
{{- if not (has $d $pool.domains) }}{{ $unmapped = append $unmapped $d }}{{ end }}
{{- end }}
{{- if $unmapped }}
{{- fail (printf "config.autoscaler.nodes has %s nodes in %s, where pool %s (pools[%d]) has no Deployment; the topology solver may place the pool there and the controller refuses it at start: add them to pools[%d].domains, or take those nodes out of the inventory" $gpu ($unmapped | sortAlpha | join ", ") $pool.name $i $i) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Soft scale-in: on deletion the pod leaves its Service's EndpointSlice at once, and the gateway (resyncing
every gateway.discovery.resyncSeconds) stops sending it new requests; the worker keeps serving for
drainSeconds before SIGTERM, and in-flight streams get the rest of terminationGracePeriodSeconds.
*/}}
{{- define "mosaic.pool.preStop" -}}
lifecycle:
  preStop:
    exec:
      command: ["sleep", {{ .drainSeconds | int | toString | quote }}]
{{- end }}

{{/*
"true" when Kubernetes discovery reads nodes (server/discovery.py): the domain label is set and is either
not the zone label (which EndpointSlice endpoints carry themselves) or discovery lists pods (which carry
only spec.nodeName). Then the gateway and the controller need a ClusterRole to list nodes.
*/}}
{{- define "mosaic.discovery.readsNodes" -}}
{{- $disc := .Values.gateway.discovery }}
{{- if and $disc.domainLabel (or (eq $disc.resource "pods") (ne $disc.domainLabel "topology.kubernetes.io/zone")) -}}
true
{{- end }}
{{- end }}

{{/*
A monitor endpoint's `interval` and `scrapeTimeout` (argument: the monitor's settings). The timeout is left
out when unset, so Prometheus uses its global scrape_timeout capped at the interval; one set above the
interval fails the render, because the Prometheus operator drops such a monitor and the metrics silently go
unscraped. Both are single-unit durations (the schema's pattern).
*/}}
{{- define "mosaic.scrapeTiming" -}}
interval: {{ .interval }}
{{- with .scrapeTimeout }}
{{- if gt (include "mosaic.durationMs" .) (include "mosaic.durationMs" $.interval) }}
{{- fail (printf "monitoring: scrapeTimeout %s is longer than interval %s; the Prometheus operator drops such a monitor (set scrapeTimeout at most the interval, or leave it empty)" . $.interval) }}
{{- end }}
scrapeTimeout: {{ . }}
{{- end }}
{{- end }}

{{/* A duration such as 500ms, 15s, 2m or 1h in milliseconds, zero-padded to compare as text. */}}
{{- define "mosaic.durationMs" -}}
{{- $n := int (regexFind "^[0-9]+" .) }}
{{- $unit := regexFind "[a-z]+$" . }}
{{- $ms := dict "ms" 1 "s" 1000 "m" 60000 "h" 3600000 }}
{{- printf "%020d" (mul $n (index $ms $unit)) }}
{{- end }}

{{/*
The node-label values a real pool is placed by when it names none (`pools[].gpuProducts`): the row of
`vllm.gpuProducts` named as the pool's gpu, else the one its catalog name matches case-insensitively, else the
one of the GPU its catalog alias stands for (`H100` → `H100-SXM`, files/catalog-models.yaml), as the gateway
resolves the name. Arguments: (list root pool); returns YAML `{products: [...]}`.
*/}}
{{- define "mosaic.pool.gpuProducts" -}}
{{- $root := index . 0 }}
{{- $pool := index . 1 }}
{{- $table := $root.Values.vllm.gpuProducts | default dict }}
{{- $gpu := toString $pool.gpu }}
{{- $want := lower $gpu }}
{{- range $alias, $canonical := ($root.Files.Get "files/catalog-models.yaml" | fromYaml).gpuAliases }}
{{- if eq (lower $alias) $want }}{{ $want = lower $canonical }}{{ end }}
{{- end }}
{{- $found := get $table $gpu }}
{{- range $name := keys $table | sortAlpha }}
{{- if and (not $found) (or (eq (lower $name) (lower $gpu)) (eq (lower $name) $want)) }}{{ $found = get $table $name }}{{ end }}
{{- end }}
{{- dict "products" ($found | default list) | toYaml }}
{{- end }}

{{/* A Kubernetes quantity (a string or a number of the schema's `quantity` form) as a float, for comparing a
container's requests with its limits: 16Gi → 17179869184, 500m → 0.5, 1e3 → 1000, 4 → 4. */}}
{{- define "mosaic.quantity" -}}
{{- $s := toString . | trimPrefix "+" }}
{{- $suffix := regexFind "([KMGTPE]i|[numkMGTPE])$" $s }}
{{- $factors := dict "n" 1e-9 "u" 1e-6 "m" 1e-3 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 }}
{{- if $suffix }}
{{- mulf (float64 (trimSuffix $suffix $s)) (get $factors $suffix) }}
{{- else }}
{{- float64 $s }}
{{- end }}
{{- end }}

{{/* The API server refuses a pod whose container requests more of a resource than its limit ("must be less
than or equal to ... limit"), after the release has been half applied: refuse it at render. Arguments: where
(the values path), the resources, and a hint to add. */}}
{{- define "mosaic.checkResources" -}}
{{- $where := index . 0 }}
{{- $res := index . 1 | default dict }}
{{- $hint := index . 2 }}
{{- $limits := $res.limits | default dict }}
{{- range $k, $req := $res.requests | default dict }}
{{- $limit := get $limits $k }}
{{- if and (not (kindIs "invalid" $req)) (not (kindIs "invalid" $limit)) (ne (toString $limit) "") }}
{{- if gt (float64 (include "mosaic.quantity" $req)) (float64 (include "mosaic.quantity" $limit)) }}
{{- fail (printf "%s: resources.requests.%s %v is above resources.limits.%s %v, which Kubernetes refuses; raise the limit or lower the request%s" $where $k $req $k $limit $hint) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
