"""The deployment artifacts under deploy/ say what the code does (pure: files only).

Every worker type has an image entry point, a Deployment with both probes, a
PodDisruptionBudget, a KEDA ScaledObject on the right queue or metric, and a compose
service; every CUSTODY_* variable they set is a real setting; every metric an alert,
panel or scaler reads is one the workers export. Least privilege: no worker connects
as an administrator, and each connects as its own Postgres role and broker user
(compose, the Kubernetes Secrets documented in docs/deploy.md); an operator connects
as its own Postgres login, and only the migration reads operators.toml (into
custody.operators, which the database authorizes from). The validators
themselves (hadolint, compose config, kubernetes-validate, promtool, ...) run in
scripts/lint-deploy.sh.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shlex
import tomllib
import urllib.parse
from collections.abc import Iterator
from dataclasses import fields
from functools import cache
from typing import Any

import psycopg
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from prometheus_client.metrics import MetricWrapperBase

from workers import provision
from workers.core import authz, routes
from workers.harness import fleet
from workers.io import broker
from workers.runtime import metrics
from workers.settings import PREFIX, ROOT, Settings

DEPLOY = ROOT / "deploy"
BASELINE = ROOT / "migrations" / "0001_baseline.sql"
OPERATORS = authz.load(DEPLOY / "operators.toml").operators
DOCS = ROOT / "docs" / "deploy.md"
K8S_BASE = DEPLOY / "k8s" / "base"
ROUTES = routes.load(DEPLOY / "routes.toml")
PARTICIPANTS = sorted({r.owner for r in ROUTES.by_name.values()})
ENGINE = list(fleet.ENGINE_WORKERS)
WORKER_TYPES = ENGINE + [f"participant-{name}" for name in PARTICIPANTS]
SETTINGS = {PREFIX + f.name.upper() for f in fields(Settings)}
# Read from the environment outside Settings: workers.io.db (where the SQL files live).
# (No operator name: an operator is the Postgres login of CUSTODY_DATABASE_URL.)
OTHER_VARIABLES = {"CUSTODY_SQL_DIR"}
# The administrators: only the migration connects as them.
ADMINS = {"postgres", "guest"}
URL_SETTINGS = (
    "CUSTODY_DATABASE_URL",
    "CUSTODY_PARTICIPANT_DATABASE_URL",
    "CUSTODY_AMQP_URL",
    "CUSTODY_AMQP_MANAGEMENT_URL",
)
# Broker metrics from rabbitmq_prometheus 3.10 (checked against a node's
# /metrics/detailed?family=queue_coarse_metrics&family=queue_consumer_count).
RABBITMQ_METRICS = {
    "rabbitmq_detailed_queue_messages",
    "rabbitmq_detailed_queue_messages_ready",
    "rabbitmq_detailed_queue_messages_unacked",
    "rabbitmq_detailed_queue_consumers",
    "rabbitmq_queue_messages",
}
# Read by a scaler but not exported yet: the committer's successor backlog (a gauge
# the reconciler should sample like custody_operations). Remove once it exists.
PENDING_METRICS: set[str] = set()


def _run_args(worker: str) -> list[str]:
    if worker.startswith("participant-"):
        return ["run", "participant", "--name", worker.removeprefix("participant-")]
    return ["run", worker]


# Dockerfile ------------------------------------------------------------------------


def _dockerfile() -> list[str]:
    """Instructions, continuation lines joined, comments dropped."""
    text = (DEPLOY / "Dockerfile").read_text()
    joined = re.sub(r"\\\n", " ", text)
    return [
        line.strip()
        for line in joined.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def _stages() -> list[list[str]]:
    stages: list[list[str]] = []
    for line in _dockerfile():
        if line.upper().startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


def _instructions(stage: list[str], name: str) -> list[str]:
    return [line.split(None, 1)[1] for line in stage if line.split(None, 1)[0].upper() == name]


def test_dockerfile_is_multi_stage_with_a_slim_python_3_11_final_stage() -> None:
    stages = _stages()
    assert len(stages) >= 2
    args = {
        m[0]: m[1]
        for m in re.findall(r"^ARG (\w+)=(\S+)$", (DEPLOY / "Dockerfile").read_text(), re.M)
    }
    base = _instructions(stages[-1], "FROM")[0].split()[0]
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    assert base.startswith("python:3.11-slim"), base


def test_dockerfile_final_stage_runs_as_a_numeric_user_with_an_exec_form_entrypoint() -> None:
    final = _stages()[-1]
    users = _instructions(final, "USER")
    assert users, "the final stage has no USER"
    assert re.fullmatch(r"[1-9][0-9]*(:[0-9]+)?", users[-1]), users[-1]
    [entrypoint] = _instructions(final, "ENTRYPOINT")
    assert json.loads(entrypoint) == ["custody"]
    [cmd] = _instructions(final, "CMD")
    assert json.loads(cmd) == ["run", "committer"]


def test_dockerfile_final_stage_installs_nothing_and_finds_its_sql() -> None:
    final = _stages()[-1]
    assert not _instructions(final, "RUN"), "build steps belong in the builder stage"
    env = " ".join(_instructions(final, "ENV"))
    assert "CUSTODY_SQL_DIR=/app" in env
    copies = _instructions(final, "COPY")
    assert all(c.startswith("--from=") for c in copies), copies
    builder = " ".join(_instructions(_stages()[0], "COPY"))
    for path in (
        "migrations/",
        "commands.sql",
        "transitions.sql",
        "queries.sql",
        "participant_schema.sql",
        "participants/",
        "deploy/routes.toml",
        "deploy/operators.toml",
        "deploy/processes/",
        "contracts/",
        "workers/",
    ):
        assert path in builder, path


def test_dockerignore_admits_everything_the_dockerfile_copies() -> None:
    allowed = [
        line[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    ]
    assert "*" in (ROOT / ".dockerignore").read_text().splitlines(), "an allow-list"
    for stage in _stages():
        for copy in _instructions(stage, "COPY"):
            if copy.startswith("--from="):
                continue
            for source in copy.split()[:-1]:
                assert source.rstrip("/") in allowed, f"{source} is excluded by .dockerignore"


LOCK = DEPLOY / "requirements.lock"


def _locked() -> dict[str, tuple[str, list[str]]]:
    """deploy/requirements.lock: normalised name -> (pinned version, its hashes). A
    requirement spans its continuation lines (``\\``); comments are ``# via`` notes."""
    text = LOCK.read_text().replace("\\\n", " ")
    pins: dict[str, tuple[str, list[str]]] = {}
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        requirement, *options = line.split()
        name, sep, version = requirement.partition("==")
        assert sep, f"not pinned with ==: {line}"
        hashes = [o.removeprefix("--hash=") for o in options if o.startswith("--hash=")]
        assert len(hashes) == len(options), f"an option other than --hash: {line}"
        pins[canonicalize_name(name)] = (version, hashes)
    return pins


def test_the_lock_pins_every_line_with_hashes() -> None:
    pins = _locked()
    assert pins
    for name, (version, hashes) in pins.items():
        assert version and hashes, f"{name} has no --hash (pip install --require-hashes refuses)"
        assert all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for h in hashes), name


def test_the_lock_covers_every_runtime_dependency_of_pyproject() -> None:
    """Every [project].dependencies entry, the ``otel`` extra the image installs (tracing
    is one environment variable away), their extras' requirements (psycopg[binary] ->
    psycopg-binary, read from the installed distribution's metadata) and the build
    backend are pinned, at a version the specifier allows."""
    pins = _locked()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    wanted = [Requirement(r) for r in project["project"]["dependencies"]]
    wanted += [Requirement(r) for r in project["project"]["optional-dependencies"]["otel"]]
    wanted += [Requirement(r) for r in project["build-system"]["requires"]]
    for requirement in list(wanted):
        for extra in requirement.extras:
            for needed in importlib.metadata.requires(requirement.name) or []:
                inner = Requirement(needed)
                if inner.marker is not None and inner.marker.evaluate({"extra": extra}):
                    wanted.append(inner)
    for requirement in wanted:
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement} is not in {LOCK.name}: refresh it (README)"
        assert requirement.specifier.contains(pins[name][0], prereleases=True), (
            f"{LOCK.name} pins {name}=={pins[name][0]}, pyproject.toml wants {requirement}"
        )


def test_dockerfile_installs_the_lock_with_hashes_then_the_package_without_deps() -> None:
    builder = _stages()[0]
    runs = _instructions(builder, "RUN")
    locked = [i for i, r in enumerate(runs) if "--require-hashes" in r]
    assert locked, "no pip install --require-hashes"
    assert "-r deploy/requirements.lock" in runs[locked[0]]
    assert "deploy/requirements.lock" in " ".join(_instructions(builder, "COPY"))
    package = [i for i, r in enumerate(runs) if "--editable ." in r]
    assert package and package[0] > locked[0]
    # nothing else is fetched: no dependency resolution, no isolated build environment
    assert "--no-deps" in runs[package[0]] and "--no-build-isolation" in runs[package[0]]
    assert sum("pip install" in r for r in runs) == 2, runs


# Kubernetes ------------------------------------------------------------------------


@cache
def _k8s_docs() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted(K8S_BASE.glob("*.yaml")):
        if path.name in ("kustomization.yaml", "kustomizeconfig.yaml"):
            continue
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


def _by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in _k8s_docs() if d["kind"] == kind}


def _container(obj: dict[str, Any]) -> dict[str, Any]:
    [container] = obj["spec"]["template"]["spec"]["containers"]
    return dict(container)


def test_kustomization_lists_every_manifest() -> None:
    listed = set(yaml.safe_load((K8S_BASE / "kustomization.yaml").read_text())["resources"])
    present = {p.name for p in K8S_BASE.glob("*.yaml")} - {
        "kustomization.yaml",
        "kustomizeconfig.yaml",
    }
    assert listed == present


@pytest.mark.parametrize("worker", WORKER_TYPES)
def test_every_worker_type_has_a_deployment_with_both_probes(worker: str) -> None:
    deployment = _by_kind("Deployment")[f"custody-{worker}"]
    container = _container(deployment)
    assert container["args"] == _run_args(worker)
    assert container["image"] == "custody"
    ready = container["readinessProbe"]["httpGet"]
    alive = container["livenessProbe"]["httpGet"]
    assert ready["path"] == "/readyz"
    assert alive["path"] == "/healthz"
    assert ready["path"] != alive["path"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    [port] = container["ports"]
    assert ready["port"] == alive["port"] == port["name"]
    assert env["CUSTODY_METRICS_PORT"] == str(port["containerPort"])
    assert "replicas" not in deployment["spec"], "the ScaledObject owns the replica count"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()


@pytest.mark.parametrize("worker", WORKER_TYPES)
def test_every_deployment_is_locked_down_and_bounded(worker: str) -> None:
    deployment = _by_kind("Deployment")[f"custody-{worker}"]
    pod = deployment["spec"]["template"]["spec"]
    container = _container(deployment)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] > 0
    assert pod["automountServiceAccountToken"] is False
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(container["resources"][kind]), kind
    # the drain (CUSTODY_DRAIN_GRACE_S) fits in the grace period
    assert pod["terminationGracePeriodSeconds"] > Settings().drain_grace_s


@pytest.mark.parametrize("worker", WORKER_TYPES)
def test_secrets_reach_workers_as_files_from_a_mounted_secret(worker: str) -> None:
    deployment = _by_kind("Deployment")[f"custody-{worker}"]
    container = _container(deployment)
    env = {e["name"]: e.get("value") for e in container["env"]}
    secret_vars = {k: v for k, v in env.items() if k.endswith("_FILE") and "URL" in k}
    expected = (
        {"CUSTODY_PARTICIPANT_DATABASE_URL_FILE", "CUSTODY_AMQP_URL_FILE"}
        if worker.startswith("participant-")
        else {"CUSTODY_DATABASE_URL_FILE", "CUSTODY_AMQP_URL_FILE"}
    )
    assert set(secret_vars) == expected
    assert not any(k.endswith("_URL") for k in env), "a URL with a password in plain env"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert "secret" in volumes["secrets"]
    for path in secret_vars.values():
        assert path.startswith(mounts["secrets"] + "/"), path
    # one Secret per worker type: its own Postgres role and broker user
    assert volumes["secrets"]["secret"]["secretName"] == f"custody-{worker}"


@pytest.mark.parametrize("worker", WORKER_TYPES)
def test_every_deployment_has_a_disruption_budget(worker: str) -> None:
    pdb = _by_kind("PodDisruptionBudget")[f"custody-{worker}"]
    deployment = _by_kind("Deployment")[f"custody-{worker}"]
    assert pdb["spec"]["selector"] == deployment["spec"]["selector"]
    assert pdb["spec"].get("maxUnavailable") == 1


def _expected_queue(worker: str) -> str | None:
    if worker == "committer":
        return broker.QUEUE_REQUESTS
    if worker == "receipts":
        return broker.QUEUE_RECEIPTS
    if worker.startswith("participant-"):
        [binding] = {r.binding for r in ROUTES.owned_by(worker.removeprefix("participant-"))}
        return broker.command_queue(binding)
    return None


@pytest.mark.parametrize("worker", WORKER_TYPES)
def test_every_worker_type_has_a_scaled_object_on_its_backlog(worker: str) -> None:
    scaled = _by_kind("ScaledObject")[f"custody-{worker}"]
    spec = scaled["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": f"custody-{worker}",
    }
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    triggers = spec["triggers"]
    for t in triggers:
        assert all(isinstance(v, str) for v in t["metadata"].values()), t
    queue = _expected_queue(worker)
    rabbit = [t for t in triggers if t["type"] == "rabbitmq"]
    prom = [t for t in triggers if t["type"] == "prometheus"]
    if queue is not None:
        [trigger] = rabbit
        assert trigger["metadata"]["queueName"] == queue
        assert trigger["metadata"]["mode"] == "QueueLength"
        assert trigger["authenticationRef"]["name"] in _by_kind("TriggerAuthentication")
    if worker == "publisher":
        [trigger] = prom
        assert "custody_outbox_pending_rows" in trigger["metadata"]["query"]
    if worker == "committer":
        assert len(prom) == 1, "the committer's second trigger: its Postgres backlog"


@pytest.mark.parametrize("worker", WORKER_TYPES)
def test_every_worker_type_falls_back_when_its_scaler_fails(worker: str) -> None:
    """A fallback on every ScaledObject (KEDA's rules for it: python -m deploycheck)."""
    spec = _by_kind("ScaledObject")[f"custody-{worker}"]["spec"]
    fallback = spec["fallback"]
    assert fallback["failureThreshold"] >= 1
    assert spec["minReplicaCount"] <= fallback["replicas"] <= spec["maxReplicaCount"]
    assert fallback["behavior"] == "currentReplicasIfHigher", "a Prometheus outage scales down"
    for trigger in spec["triggers"]:
        if trigger["type"] == "prometheus":
            assert trigger["metadata"]["ignoreNullValues"] == "false", trigger["name"]


@pytest.mark.parametrize("worker", WORKER_TYPES)
def test_every_worker_type_has_a_pod_monitor_on_its_metrics_port(worker: str) -> None:
    """The Prometheus Operator scrapes what a PodMonitor selects (not prometheus.io/*
    annotations): the worker type's pods, on the port its CUSTODY_METRICS_PORT serves."""
    monitor = _by_kind("PodMonitor")[f"custody-{worker}"]
    deployment = _by_kind("Deployment")[f"custody-{worker}"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    assert selector["app.kubernetes.io/component"] == worker  # this type's pods only
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    [port] = _container(deployment)["ports"]
    assert endpoint["port"] == port["name"]
    assert endpoint["path"] == "/metrics"
    env = {e["name"]: e.get("value") for e in _container(deployment)["env"]}
    assert env["CUSTODY_METRICS_PORT"] == str(port["containerPort"])


def test_the_alerts_and_the_dashboards_are_shipped_for_the_operator_and_the_sidecar() -> None:
    """The PrometheusRule carries alerts.yaml's groups unchanged and the dashboard
    ConfigMap the dashboard's JSON, labelled for the Grafana sidecar, small enough for
    `kubectl apply` (its last-applied annotation)."""
    [rule] = _by_kind("PrometheusRule").values()
    alerts = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"]
    [dashboards] = [
        c for c in _by_kind("ConfigMap").values() if "grafana_dashboard" in c["metadata"]["labels"]
    ]
    assert dashboards["metadata"]["labels"]["grafana_dashboard"] == "1"
    source = DEPLOY / "grafana" / "dashboards" / "custody.json"
    assert json.loads(dashboards["data"]["custody.json"]) == json.loads(source.read_text())
    size = len(yaml.safe_dump(dashboards).encode())
    assert size < 262_144, f"{size} bytes: over kubectl apply's annotation limit"


def test_migration_job_migrates_then_applies_the_topology() -> None:
    job = _by_kind("Job")["custody-migrate"]
    container = _container(job)
    script = " ".join(container["command"] + container["args"])
    # the status gate fails the Job if a migration is still pending, before any topology
    assert (
        "custody db migrate --participants && custody db status && custody topology apply" in script
    )
    # a deployment's DBA creates the operator logins, with their own authentication
    assert "--create-logins" not in script
    env = {e["name"] for e in container["env"]}
    assert {
        "CUSTODY_DATABASE_URL_FILE",
        "CUSTODY_PARTICIPANT_DATABASE_URL_FILE",
        "CUSTODY_AMQP_URL_FILE",
        "CUSTODY_AMQP_MANAGEMENT_URL_FILE",
    } <= env


def test_configmap_sources_are_the_deploy_files() -> None:
    config = K8S_BASE / "config"
    assert (config / "routes.toml").read_bytes() == (DEPLOY / "routes.toml").read_bytes()
    assert (config / "operators.toml").read_bytes() == (DEPLOY / "operators.toml").read_bytes()
    ours = {p.name: p.read_bytes() for p in (DEPLOY / "processes").glob("*.toml")}
    copies = {p.name: p.read_bytes() for p in (config / "processes").glob("*.toml")}
    assert copies == ours
    generators = yaml.safe_load((K8S_BASE / "kustomization.yaml").read_text())["configMapGenerator"]
    files = {f for g in generators for f in g.get("files", [])}
    assert {f"config/processes/{name}" for name in ours} <= files
    assert "operators.toml=config/operators.toml" in files


def test_only_the_migration_job_gets_administrator_credentials() -> None:
    """Workers mount their own Secret; the migration's Secret and the management URL
    (an administrator's) reach the migration Job only."""
    for name, deployment in _by_kind("Deployment").items():
        volumes = deployment["spec"]["template"]["spec"]["volumes"]
        secrets = {v["secret"]["secretName"] for v in volumes if "secret" in v}
        assert "custody-migrate" not in secrets, name
        env = {e["name"] for e in _container(deployment)["env"]}
        assert not {"CUSTODY_AMQP_MANAGEMENT_URL", "CUSTODY_AMQP_MANAGEMENT_URL_FILE"} & env, name
    job = _by_kind("Job")["custody-migrate"]
    volumes = job["spec"]["template"]["spec"]["volumes"]
    assert {v["secret"]["secretName"] for v in volumes if "secret" in v} == {"custody-migrate"}


def _operators_mount(obj: dict[str, Any]) -> str | None:
    """Where ``obj`` mounts the custody-operators ConfigMap (None: it doesn't)."""
    volumes = obj["spec"]["template"]["spec"]["volumes"]
    names = [
        v["name"] for v in volumes if v.get("configMap", {}).get("name") == "custody-operators"
    ]
    if not names:
        return None
    [name] = names
    [path] = [m["mountPath"] for m in _container(obj)["volumeMounts"] if m["name"] == name]
    return str(path)


def test_the_migration_job_syncs_operators_toml_from_its_configmap() -> None:
    """`custody db migrate` copies CUSTODY_OPERATORS_FILE into custody.operators, from
    which the database authorizes every operator command and cancel request."""
    job = _by_kind("Job")["custody-migrate"]
    env = {e["name"]: e.get("value") for e in _container(job)["env"]}
    mount = _operators_mount(job)
    assert mount is not None, "the migration Job does not mount custody-operators"
    assert env["CUSTODY_OPERATORS_FILE"] == f"{mount}/operators.toml"


@pytest.mark.parametrize("worker", WORKER_TYPES)
def test_no_worker_reads_operators_toml(worker: str) -> None:
    """The committer authorizes cancel requests through a database function that reads
    custody.operators; no worker needs the file (a stale copy could only mislead)."""
    deployment = _by_kind("Deployment")[f"custody-{worker}"]
    assert _operators_mount(deployment) is None
    env = {e["name"] for e in _container(deployment)["env"]}
    assert "CUSTODY_OPERATORS_FILE" not in env
    compose = _compose()["services"][worker]
    assert "CUSTODY_OPERATORS_FILE" not in compose["environment"]
    assert not any("operators.toml" in v for v in compose.get("volumes", []))


# Compose ---------------------------------------------------------------------------


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return data


def test_compose_runs_every_worker_type_after_a_one_off_migrate() -> None:
    services = _compose()["services"]
    for worker in WORKER_TYPES:
        service = services[worker]
        assert service["command"] == _run_args(worker), worker
        assert service["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        assert "healthcheck" in service, worker
        assert "/readyz" in " ".join(service["healthcheck"]["test"]), worker
        assert service["environment"]["CUSTODY_METRICS_PORT"] == "8080"
    migrate = services["migrate"]
    script = " ".join(migrate["entrypoint"] + migrate["command"])
    for step in (
        "custody db migrate --participants",
        "custody db status",
        "custody operators apply --create-logins",
        "custody topology apply",
        "custody broker dev-users",
    ):
        assert step in script
    # the dev operator logins are created after the schema (custody_operators) exists
    assert script.index("custody db migrate") < script.index("custody operators apply")
    for dependency in ("postgres", "rabbitmq"):
        assert migrate["depends_on"][dependency]["condition"] == "service_healthy"
        assert "healthcheck" in services[dependency]


def test_compose_migrate_syncs_the_mounted_operators_toml() -> None:
    """The compose migrate reads deploy/operators.toml itself (mounted, not the image's
    copy), so an edit takes effect on the next migrate, without a rebuild."""
    migrate = _compose()["services"]["migrate"]
    path = migrate["environment"]["CUSTODY_OPERATORS_FILE"]
    assert f"./operators.toml:{path}:ro" in migrate["volumes"]
    for name, service in _custody_services().items():
        if name != "migrate":
            assert "CUSTODY_OPERATORS_FILE" not in (service.get("environment") or {}), name
            assert not any("operators.toml" in v for v in service.get("volumes", [])), name


@pytest.mark.parametrize("name", PARTICIPANTS)
def test_compose_participants_connect_as_their_own_broker_user(name: str) -> None:
    env = _compose()["services"][f"participant-{name}"]["environment"]
    [principal] = {r.principal for r in ROUTES.owned_by(name)}
    assert broker.user_of(env["CUSTODY_AMQP_URL"]) == principal == f"custody-{name}"
    password = re.match(r"amqp://[^:]+:([^@]+)@", env["CUSTODY_AMQP_URL"])
    assert password is not None
    assert password.group(1) == "custody-dev"


def _enabled_plugins() -> set[str]:
    """deploy/rabbitmq/enabled_plugins: one Erlang list term, ``[a,b].``"""
    text = (DEPLOY / "rabbitmq" / "enabled_plugins").read_text().strip()
    match = re.fullmatch(r"\[\s*([a-z_]+(?:\s*,\s*[a-z_]+)*)\s*\]\s*\.", text)
    assert match, f"not an Erlang list term: {text!r}"
    return {name.strip() for name in match.group(1).split(",")}


def test_compose_rabbitmq_enables_the_shovel_plugins_the_move_messages_step_needs() -> None:
    """Moving messages between queues (the runbook's step, docs/deploy.md) is a dynamic
    shovel; the file the compose broker mounts enables it, and its management tab."""
    rabbit = _compose()["services"]["rabbitmq"]
    assert "./rabbitmq/enabled_plugins:/etc/rabbitmq/enabled_plugins:ro" in rabbit["volumes"]
    assert {
        "rabbitmq_management",
        "rabbitmq_prometheus",
        "rabbitmq_shovel",
        "rabbitmq_shovel_management",
    } <= _enabled_plugins()


def test_compose_rabbitmq_enables_prometheus_and_prometheus_scrapes_everything() -> None:
    compose = _compose()
    rabbit = compose["services"]["rabbitmq"]
    assert rabbit["image"].startswith("rabbitmq:3.10-management")
    assert any(v.startswith("./rabbitmq/enabled_plugins:") for v in rabbit["volumes"])
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    names = {n for sd in jobs["custody"]["dns_sd_configs"] for n in sd["names"]}
    assert names == set(WORKER_TYPES)
    assert {sd["port"] for sd in jobs["custody"]["dns_sd_configs"]} == {8080}
    rabbit_targets = {
        t
        for job in jobs.values()
        if job["job_name"].startswith("rabbitmq")
        for sc in job["static_configs"]
        for t in sc["targets"]
    }
    assert rabbit_targets == {"rabbitmq:15692"}
    assert jobs["rabbitmq-queues"]["metrics_path"] == "/metrics/detailed"
    grafana = compose["services"]["grafana"]
    assert any(v.startswith("./grafana/dashboards:") for v in grafana["volumes"])


def _custody_services() -> dict[str, dict[str, Any]]:
    """The compose services that run the custody image."""
    return {n: s for n, s in _compose()["services"].items() if "build" in s}


def _user(url: str) -> str:
    if url.startswith(("postgresql://", "postgres://")):
        return str(psycopg.conninfo.conninfo_to_dict(url).get("user", ""))
    return urllib.parse.unquote(urllib.parse.urlparse(url).username or "")


def _password(url: str) -> str:
    return urllib.parse.unquote(urllib.parse.urlparse(url).password or "")


def _urls(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    return {k: v for k, v in env.items() if k in URL_SETTINGS}


def test_no_compose_service_but_migrate_connects_as_an_administrator() -> None:
    services = _custody_services()
    assert set(WORKER_TYPES) | {"migrate", "operator"} <= set(services)
    for name, service in services.items():
        urls = _urls(service)
        if name == "migrate":
            # it creates the roles and users the others connect as
            assert {_user(u) for u in urls.values()} == ADMINS
            continue
        assert "CUSTODY_AMQP_MANAGEMENT_URL" not in urls, name
        for key, url in urls.items():
            assert _user(url) not in ADMINS, (name, key, url)


@pytest.mark.parametrize("worker", [*WORKER_TYPES, "operator"])
def test_every_compose_worker_sets_every_url_it_uses(worker: str) -> None:
    """A URL left unset falls back to the Settings default: an administrator."""
    defaults = Settings()
    assert _user(defaults.database_url) in ADMINS and _user(defaults.amqp_url) in ADMINS
    wanted = {
        "operator": {"CUSTODY_DATABASE_URL"},
        **{w: {"CUSTODY_DATABASE_URL", "CUSTODY_AMQP_URL"} for w in ENGINE},
    }.get(worker, {"CUSTODY_PARTICIPANT_DATABASE_URL", "CUSTODY_AMQP_URL"})
    assert set(_urls(_custody_services()[worker])) == wanted


def _worker_roles() -> set[str]:
    """The LOGIN roles the baseline migration creates (its "Least privilege" section)."""
    text = BASELINE.read_text()
    match = re.search(r"FOREACH r IN ARRAY ARRAY\[(.*?)\] LOOP", text, re.S)
    assert match, "the baseline no longer creates its roles in one FOREACH loop"
    assert "EXECUTE format('CREATE ROLE %I LOGIN', r)" in text[match.end() :]
    return set(re.findall(r"'([a-z_]+)'", match.group(1)))


def _group_roles() -> dict[str, str]:
    """The roles transitions.sql (and the baseline's archive) create by name, with their
    LOGIN or NOLOGIN."""
    text = (ROOT / "transitions.sql").read_text() + BASELINE.read_text()
    return dict(re.findall(r"CREATE ROLE ([a-z_]+) (LOGIN|NOLOGIN)\b", text))


def _schema_roles() -> set[str]:
    """Every role the migration's SQL (the baseline, transitions.sql) creates."""
    return _worker_roles() | set(_group_roles())


def test_schema_sql_creates_one_role_per_engine_worker_and_transitions_sql_the_groups() -> None:
    assert _worker_roles() == {f"custody_{w}" for w in ENGINE}
    # the operators' group, the operator functions' owner and the archive's owner
    # (the baseline): nobody logs in as any of them
    assert _group_roles() == {
        "custody_operators": "NOLOGIN",
        "custody_definer": "NOLOGIN",
        "custody_archiver": "NOLOGIN",
    }
    for sql in ("migrations/0001_baseline.sql", "commands.sql", "transitions.sql"):
        text = (ROOT / sql).read_text()
        assert not re.search(r"CREATE ROLE\s+custody_operator\b", text), sql


def test_operators_toml_names_no_role_of_custodys_own() -> None:
    """An operator is its own login; the migration refuses custody's roles as names."""
    assert OPERATORS
    assert not set(OPERATORS) & (_schema_roles() | {"postgres"} | ADMINS)
    assert not any(name.startswith("custody_") for name in OPERATORS)


def _admin_env() -> dict[str, str]:
    env: dict[str, str] = _custody_services()["migrate"]["environment"]
    return env


@pytest.mark.parametrize("worker", ENGINE)
def test_compose_engine_workers_connect_as_their_own_role_and_broker_user(worker: str) -> None:
    urls = _urls(_custody_services()[worker])
    assert _user(urls["CUSTODY_DATABASE_URL"]) == f"custody_{worker}"
    assert f"custody_{worker}" in _schema_roles()
    assert _user(urls["CUSTODY_AMQP_URL"]) == f"custody-{worker}"
    assert f"custody-{worker}" in broker.permissions({})
    assert _password(urls["CUSTODY_AMQP_URL"]) == fleet.DEV_PASSWORD
    # exactly how the demo and the tests connect it (workers.harness.fleet.role_env)
    expected = fleet.role_env(worker, None, _admin_env())
    conninfo = psycopg.conninfo.conninfo_to_dict
    assert conninfo(urls["CUSTODY_DATABASE_URL"]) == conninfo(expected["CUSTODY_DATABASE_URL"])
    assert urls["CUSTODY_AMQP_URL"] == expected["CUSTODY_AMQP_URL"]


@pytest.mark.parametrize("name", PARTICIPANTS)
def test_compose_participants_connect_as_their_own_role_and_broker_user(name: str) -> None:
    urls = _urls(_custody_services()[f"participant-{name}"])
    [principal] = {r.principal for r in ROUTES.owned_by(name)}
    assert _user(urls["CUSTODY_PARTICIPANT_DATABASE_URL"]) == provision.participant_role(name)
    assert _user(urls["CUSTODY_AMQP_URL"]) == principal
    expected = fleet.role_env("participant", name, _admin_env())
    conninfo = psycopg.conninfo.conninfo_to_dict
    assert conninfo(urls["CUSTODY_PARTICIPANT_DATABASE_URL"]) == conninfo(
        expected["CUSTODY_PARTICIPANT_DATABASE_URL"]
    )
    assert urls["CUSTODY_AMQP_URL"] == expected["CUSTODY_AMQP_URL"]


def _operator_logins() -> set[str]:
    """The operators of operators.toml that log in to Postgres (not broker-only ones,
    such as the workflow front end's broker user)."""
    broker_users = set(
        broker.permissions({r.principal: r.binding for r in ROUTES.by_name.values()})
    )
    return set(OPERATORS) - broker_users


def test_compose_operator_is_an_operators_own_login_and_dev_users_use_the_workers_password() -> (
    None
):
    services = _custody_services()
    operator = services["operator"]
    # the actor is the login: no operator name beside it (CUSTODY_* checks the rest)
    assert set(operator["environment"]) == {"CUSTODY_DATABASE_URL"}
    login = _user(operator["environment"]["CUSTODY_DATABASE_URL"])
    assert login == "oncall"
    assert login in _operator_logins() and OPERATORS[login].actions
    assert login not in _schema_roles()
    assert operator["profiles"] == ["tools"], "a one-off, not started by `up`"
    assert operator["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    script = " ".join(services["migrate"]["entrypoint"] + services["migrate"]["command"])
    assert f"custody broker dev-users --password {fleet.DEV_PASSWORD}" in script


# Settings names --------------------------------------------------------------------


def _env_names() -> Iterator[tuple[str, str]]:
    for doc in _k8s_docs():
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        for container in spec.get("containers", []):
            for e in container.get("env", []):
                yield doc["metadata"]["name"], e["name"]
    for name, service in _compose()["services"].items():
        for key in service.get("environment") or {}:
            yield name, key
    generators = yaml.safe_load((K8S_BASE / "kustomization.yaml").read_text())["configMapGenerator"]
    overlay = yaml.safe_load(
        (DEPLOY / "k8s" / "overlays" / "prod" / "kustomization.yaml").read_text()
    )
    for g in generators + overlay.get("configMapGenerator", []):
        for literal in g.get("literals", []):
            yield g["name"], literal.split("=", 1)[0]
    for line in _instructions(_stages()[-1], "ENV"):
        for word in shlex.split(line):
            yield "Dockerfile", word.split("=", 1)[0]


def test_every_custody_variable_is_a_setting() -> None:
    unknown = sorted(
        {
            (where, key)
            for where, key in _env_names()
            if key.startswith(PREFIX)
            and key not in SETTINGS | OTHER_VARIABLES
            and key.removesuffix("_FILE") not in SETTINGS
        }
    )
    assert not unknown, f"CUSTODY_* names that workers.settings.Settings does not read: {unknown}"


# docs/deploy.md --------------------------------------------------------------------


def _documented_secrets() -> list[tuple[str, dict[str, str]]]:
    """Every `kubectl create secret generic NAME --from-literal=KEY=VALUE ...` in the docs."""
    text = DOCS.read_text().replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        match = re.search(r"create secret generic (\S+)(.*)$", line)
        if match:
            literals = re.findall(
                r"--from-literal=([a-z-]+)=(?:'([^']*)'|\"([^\"]*)\")", match.group(2)
            )
            found.append((match.group(1), {k: a or b for k, a, b in literals}))
    return found


def test_documented_secrets_name_each_workers_own_role_and_broker_user() -> None:
    secrets = _documented_secrets()
    names = {name for name, _ in secrets}
    for worker in ENGINE:
        mine = [keys for name, keys in secrets if name == f"custody-{worker}"]
        assert mine, f"docs/deploy.md creates no Secret custody-{worker}"
        for keys in mine:
            assert set(keys) == {"database-url", "amqp-url"}, (worker, keys)
            assert _user(keys["database-url"]) == f"custody_{worker}", keys
            assert _user(keys["amqp-url"]) == f"custody-{worker}", keys
    for participant in PARTICIPANTS:
        [principal] = {r.principal for r in ROUTES.owned_by(participant)}
        mine = [keys for name, keys in secrets if name == f"custody-participant-{participant}"]
        assert mine, participant
        for keys in mine:
            assert set(keys) == {"participant-database-url", "amqp-url"}, keys
            assert _user(keys["participant-database-url"]) == provision.participant_role(
                participant
            )
            assert _user(keys["amqp-url"]) == principal
    # one Secret per operator login, custody-operator-<login>; no shared one
    assert "custody-operator" not in names
    operators = {
        name.removeprefix("custody-operator-"): keys
        for name, keys in secrets
        if name.startswith("custody-operator-")
    }
    assert set(operators) == _operator_logins()
    for login, keys in operators.items():
        assert set(keys) == {"database-url"}, (login, keys)
        assert _user(keys["database-url"]) == login, keys
    worker_users = {f"custody_{w}" for w in ENGINE} | {f"custody-{w}" for w in ENGINE}
    for name, keys in secrets:
        for url in keys.values():
            assert _user(url) not in ADMINS, (name, url)
            if name in ("custody-migrate", "custody-keda"):
                assert _user(url) not in worker_users, (name, url)
    # every Secret the manifests mount is documented, with the keys they read
    referenced = {
        t["name"]
        for ta in _by_kind("TriggerAuthentication").values()
        for t in ta["spec"]["secretTargetRef"]
    }
    for name, obj in {**_by_kind("Deployment"), **_by_kind("Job")}.items():
        container = _container(obj)
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        for volume in obj["spec"]["template"]["spec"]["volumes"]:
            if "secret" not in volume:
                continue
            secret = volume["secret"]["secretName"]
            referenced.add(secret)
            files = {
                e["value"].removeprefix(mounts[volume["name"]] + "/")
                for e in container["env"]
                if e["name"].endswith("_FILE")
                and e["value"].startswith(mounts[volume["name"]] + "/")
            }
            documented = [keys for n, keys in secrets if n == secret]
            assert documented, f"{name} mounts Secret {secret}, which docs/deploy.md never creates"
            for keys in documented:
                assert files <= set(keys), (name, secret, files - set(keys))
    assert referenced <= names


def _table(heading: str) -> list[list[str]]:
    """The rows of the first table after ``heading``, cells unquoted (`\\|` unescaped)."""
    text = DOCS.read_text()
    section = text[text.index(heading) :]
    rows = []
    for line in section.splitlines()[1:]:
        if line.startswith("#"):
            break
        if line.startswith("|") and not line.startswith("|---"):
            cells = [
                c.strip().strip("`").replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]
            ]
            rows.append(cells)
        elif rows and not line.startswith("|"):
            break
    return rows[1:]  # without the header


def test_documented_roles_are_the_roles_the_migration_creates() -> None:
    roles = {row[0] for row in _table("### Postgres roles")}
    placeholders = {"custody_participant_<name>", "<operator>"}
    assert roles - placeholders == _schema_roles()
    assert placeholders <= roles
    assert provision.participant_role("<name>") == "custody_participant_<name>"
    # the DBA's statements: a login per operator, and no shared operator role any more
    created = set(re.findall(r'^CREATE ROLE "?([a-z_-]+)"?\s+LOGIN\b', DOCS.read_text(), re.M))
    assert _operator_logins() <= created
    assert {f"custody_{w}" for w in ENGINE} <= created
    assert "custody_operator" not in created


def test_documented_broker_permissions_are_workers_broker_permissions() -> None:
    documented = {row[0]: (row[1], row[2], row[3]) for row in _table("### RabbitMQ users")}
    assert documented == broker.permissions(
        {r.principal: r.binding for r in ROUTES.by_name.values()}
    )


def _documented_operator_pod() -> dict[str, Any]:
    text = DOCS.read_text()
    match = re.search(r"operator_pod\(\) \{\n  cat <<EOF\n(.*?)\nEOF\n", text, re.S)
    assert match, "docs/deploy.md: no operator_pod heredoc"
    pod: dict[str, Any] = json.loads(match.group(1))
    return pod


def _documented_custody_op() -> str:
    match = re.search(r"^custody_op\(\) \{\n(.*?)\n\}\n", DOCS.read_text(), re.S | re.M)
    assert match, "docs/deploy.md: no custody_op function"
    return match.group(1)


def test_documented_operator_pod_is_the_operators_own_login() -> None:
    """``operator_pod LOGIN`` mounts that login's own Secret, and nothing names an
    operator but the database URL in it: the actor is the Postgres login."""
    spec = _documented_operator_pod()["spec"]
    [container] = spec["containers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert volumes["secrets"]["secret"]["secretName"] == "custody-operator-$1"
    assert set(volumes) == set(mounts) == {"secrets"}, "no operators.toml: the database has it"
    env = {e["name"]: e["value"] for e in container["env"]}
    for key in env:
        assert key in SETTINGS or key.removesuffix("_FILE") in SETTINGS, key
    assert env == {"CUSTODY_DATABASE_URL_FILE": mounts["secrets"] + "/database-url"}
    # `kubectl run NAME` names its container NAME: the override must merge into it
    assert container["name"] == "custody-operator-$1"
    body = _documented_custody_op()
    assert 'run "custody-operator-$login"' in body
    assert '--overrides="$(operator_pod "$login")"' in body
    assert "--env" not in body, "the pod gets nothing but its login's Secret"
    # every login the docs run it as has its documented Secret
    used = set(re.findall(r"^custody_op ([a-z-]+) ", DOCS.read_text(), re.M))
    documented = {n.removeprefix("custody-operator-") for n, _ in _documented_secrets()}
    assert used and used <= documented & _operator_logins()
    # the namespace's `restricted` Pod Security profile
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert spec["automountServiceAccountToken"] is False


# Metrics, alerts, dashboard --------------------------------------------------------


def _exported() -> set[str]:
    names: set[str] = set()
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            for family in value.describe():
                if family.type == "counter":
                    names.add(family.name + "_total")
                elif family.type == "histogram":
                    names.update(family.name + s for s in ("_bucket", "_sum", "_count"))
                else:
                    names.add(family.name)
    return names


def _alerts() -> list[dict[str, Any]]:
    groups = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())["groups"]
    return [r for g in groups for r in g["rules"]]


def _panel_exprs() -> dict[str, dict[str, Any]]:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "custody.json").read_text())
    return {t["expr"]: p for p in dashboard["panels"] for t in p.get("targets", [])}


def _metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b((?:custody|rabbitmq)_[a-z0-9_]+)\b", expr))


def test_every_metric_read_by_alerts_panels_and_scalers_is_exported() -> None:
    exprs = [r["expr"] for r in _alerts()] + list(_panel_exprs())
    exprs += [
        t["metadata"]["query"]
        for so in _by_kind("ScaledObject").values()
        for t in so["spec"]["triggers"]
        if t["type"] == "prometheus"
    ]
    known = _exported() | RABBITMQ_METRICS | PENDING_METRICS
    used = set().union(*(_metric_names(e) for e in exprs))
    assert not used - known, f"metrics nobody exports: {sorted(used - known)}"
    assert not PENDING_METRICS & _exported(), "exported now: drop it from PENDING_METRICS"


def test_the_alerts_cover_the_custody_failure_modes() -> None:
    by_name = {r["alert"]: r["expr"] for r in _alerts()}
    wanted = {
        "CustodyOutboxStuck": "custody_outbox_oldest_pending_age_seconds",
        "CustodyOutcomeUnknown": 'custody_operations{status="outcome_unknown"}',
        "CustodyQuarantineGrowing": "custody_quarantined_total",
        "CustodyDeadLetters": 'queue="custody.dead-letters"',
        "CustodyLeaseLost": "custody_lease_losses_total",
    }
    for alert, needle in wanted.items():
        assert needle in by_name[alert], alert
    tests = yaml.safe_load((DEPLOY / "prometheus" / "tests" / "alerts_test.yaml").read_text())
    cases = [c for t in tests["tests"] for c in t.get("alert_rule_test", [])]
    for alert in by_name:
        mine = [c for c in cases if c["alertname"] == alert]
        assert any(c["exp_alerts"] for c in mine), f"{alert}: no firing case"
        assert any(not c["exp_alerts"] for c in mine), f"{alert}: no quiet case"


def test_every_alert_signal_is_a_dashboard_panel() -> None:
    panels = _panel_exprs()
    for rule in _alerts():
        signal, _, threshold = rule["expr"].rpartition(" > ")
        assert signal, f"{rule['alert']}: expr must be `<signal> > <threshold>`"
        assert signal in panels, f"{rule['alert']}: no panel plots {signal!r}"
        steps = panels[signal]["fieldConfig"]["defaults"]["thresholds"]["steps"]
        assert any(s["value"] is not None for s in steps), rule["alert"]
        float(threshold)


def test_dashboard_panels_use_the_datasource_variable() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "custody.json").read_text())
    assert dashboard["uid"] == "custody-overview"
    [variable] = dashboard["templating"]["list"]
    assert (variable["type"], variable["name"], variable["query"]) == (
        "datasource",
        "datasource",
        "prometheus",
    )
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"]
    wanted = [
        "custody_outbox_published_total",
        "custody_publish_confirm_latency_seconds_bucket",
        "custody_operation_end_to_end_seconds_bucket",
        "custody_receipts_total",
        "custody_quarantined_total",
    ]
    exprs = " ".join(_panel_exprs())
    for name in wanted:
        assert name in exprs, name


def test_grafana_provisioning_points_at_the_mounted_dashboards() -> None:
    provider = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "dashboards" / "custody.yaml").read_text()
    )
    path = provider["providers"][0]["options"]["path"]
    mounts = _compose()["services"]["grafana"]["volumes"]
    assert f"./grafana/dashboards:{path}:ro" in mounts


def test_pyproject_console_script_is_the_image_entrypoint() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["custody"] == "workers.cli:main"
