"""The deploy checks catch broken deploy files (pure: a copy of deploy/ under tmp_path).

Each test breaks one thing in a copy of the repository's deploy/ on purpose, the way a
hand edit would, and expects the check ``make lint`` runs (``python -m deploycheck
check``, and for the custom resources check-jsonschema with the vendored schemas, for
PromQL promtool) to fail and to name it. The untouched copy passes every check: so a
failure is the mutation's.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploycheck import checks, generate
from deploycheck.sources import Deploy
from workers.settings import ROOT

TOOLS = ROOT / ".venv-tools" / "bin"
HOW = "run `bash scripts/install-test-tools.sh` (it installs .venv-tools)"


@pytest.fixture
def copy(tmp_path: Path) -> Deploy:
    shutil.copytree(ROOT / "deploy", tmp_path / "deploy")
    return Deploy(tmp_path)


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{path}: {old!r} not found: the mutation no longer applies"
    path.write_text(text.replace(old, new, 1))


def problems(deploy: Deploy, check: Callable[[Deploy], list[str]]) -> str:
    found = check(deploy)
    assert found, f"{check.__name__} found nothing wrong"
    return "\n".join(found)


def test_the_repositorys_deploy_files_pass_every_check(copy: Deploy) -> None:
    for title, check in checks.CHECKS.items():
        assert check(copy) == [], title
    assert checks.CHECKS  # and the real tree, as make lint runs it
    for title, check in checks.CHECKS.items():
        assert check(Deploy(ROOT)) == [], title


# PromQL ------------------------------------------------------------------------------


def test_a_keda_query_with_an_unbalanced_parenthesis_fails(copy: Deploy) -> None:
    edit(
        copy.k8s_base / "committer.yaml",
        "query: max(custody_successor_intents_pending)",
        "query: max(custody_successor_intents_pending",
    )
    found = problems(copy, checks.promql_refs)
    assert "committer.yaml: ScaledObject custody-committer trigger successor-backlog" in found
    assert "does not parse" in found


def test_promtool_refuses_the_unbalanced_keda_query_too(copy: Deploy, tmp_path: Path) -> None:
    """The other half of lint's PromQL check: every expression through the real
    Prometheus parser (``deploycheck exprs`` then ``promtool check rules``)."""
    promtool = TOOLS / "promtool"
    assert promtool.exists(), f"{promtool} is missing: {HOW}"
    edit(
        copy.k8s_base / "publisher.yaml",
        'query: max(custody_outbox_pending_rows{owner="engine"})',
        'query: max(custody_outbox_pending_rows{owner="engine"}',
    )
    rules = tmp_path / "exprs.yaml"
    _deploycheck(copy, "exprs", str(rules))
    done = subprocess.run(
        [str(promtool), "check", "rules", str(rules)], capture_output=True, text=True, check=False
    )
    assert done.returncode != 0, done.stdout
    assert "unclosed left parenthesis" in done.stdout + done.stderr


def test_a_label_value_that_never_exists_fails(copy: Deploy) -> None:
    edit(
        copy.k8s_base / "publisher.yaml",
        'custody_outbox_pending_rows{owner="engine"}',
        'custody_outbox_pending_rows{owner="engines"}',
    )
    found = problems(copy, checks.promql_refs)
    assert "owner='engines' never exists" in found
    assert "'engine'" in found and "'inventory'" in found  # what it can be, from the code


def test_a_status_the_lifecycle_does_not_have_fails(copy: Deploy) -> None:
    edit(
        copy.alerts_file,
        'custody_operations{status="outcome_unknown"}',
        'custody_operations{status="unknown"}',
    )
    assert "status='unknown' never exists" in problems(copy, checks.promql_refs)


def test_a_worker_label_in_the_old_vocabulary_fails(copy: Deploy) -> None:
    """``worker`` is the worker name of the logs: participant-inventory, not inventory."""
    edit(
        copy.deploy / "grafana" / "dashboards" / "custody.json",
        "sum by (worker) (rate(custody_redeliveries_total[5m]))",
        'sum by (worker) (rate(custody_redeliveries_total{worker=\\"inventory\\"}[5m]))',
    )
    found = problems(copy, checks.promql_refs)
    assert "worker='inventory' never exists" in found and "participant-inventory" in found


def test_a_regex_that_matches_no_value_fails(copy: Deploy) -> None:
    edit(
        copy.k8s_base / "reconciler.yaml",
        'status!~"succeeded|failed|cancelled"',
        'status=~"succeded"',
    )
    assert "status=~'succeded' matches no value" in problems(copy, checks.promql_refs)


def test_a_metric_name_typo_fails_and_names_the_nearest(copy: Deploy) -> None:
    path = copy.deploy / "grafana" / "dashboards" / "custody.json"
    edit(path, "custody_receipts_total", "custody_receipt_total")
    found = problems(copy, checks.promql_refs)
    assert "no code exports 'custody_receipt_total'" in found
    assert "did you mean 'custody_receipts_total'" in found
    assert "custody.json: panel" in found


def test_a_label_the_metric_does_not_have_fails(copy: Deploy) -> None:
    edit(copy.alerts_file, "sum by (worker) (increase(", "sum by (wroker) (increase(")
    assert "`by (wroker)`: no operand has such a label" in problems(copy, checks.promql_refs)
    edit(
        copy.alerts_file,
        'custody_operations{status="outcome_unknown"}',
        'custody_operations{state="outcome_unknown"}',
    )
    assert "has no label 'state'" in problems(copy, checks.promql_refs)


def test_a_broker_queue_metric_on_a_queue_of_no_topology_fails(copy: Deploy) -> None:
    edit(copy.alerts_file, 'queue="custody.dead-letters"', 'queue="custody.deadletters"')
    assert "queue='custody.deadletters' never exists" in problems(copy, checks.promql_refs)


# KEDA --------------------------------------------------------------------------------


def test_a_vhost_custody_does_not_use_fails(copy: Deploy) -> None:
    edit(copy.k8s_base / "receipts.yaml", "vhostName: /", "vhostName: /nosuch")
    found = problems(copy, checks.keda)
    assert "receipts.yaml: ScaledObject custody-receipts trigger receipts-backlog" in found
    assert "vhostName '/nosuch' is not custody's vhost '/'" in found


def test_a_queue_of_no_topology_fails(copy: Deploy) -> None:
    edit(
        copy.k8s_base / "participant-payments.yaml",
        "queueName: custody.commands.payments.v1",
        "queueName: custody.commands.payment.v1",
    )
    assert "queueName 'custody.commands.payment.v1' is not a queue" in problems(copy, checks.keda)


def _scaled_object(deploy: Deploy, worker: str) -> tuple[Path, list[dict[str, Any]]]:
    path = deploy.k8s_base / f"{worker}.yaml"
    return path, list(yaml.safe_load_all(path.read_text()))


def _rewrite(deploy: Deploy, worker: str, change: Callable[[dict[str, Any]], None]) -> None:
    path, docs = _scaled_object(deploy, worker)
    for doc in docs:
        if doc and doc.get("kind") == "ScaledObject":
            change(doc)
    path.write_text(yaml.safe_dump_all(docs))


def test_a_scaled_object_without_a_fallback_fails(copy: Deploy) -> None:
    _rewrite(copy, "publisher", lambda so: so["spec"].pop("fallback"))
    assert "ScaledObject custody-publisher: no fallback" in problems(copy, checks.keda)


def test_a_fallback_keda_would_refuse_fails(copy: Deploy) -> None:
    """KEDA's admission webhook refuses a fallback whose triggers are all cpu or memory,
    and a fallback beyond the replica bounds is a typo."""

    def cpu_only(so: dict[str, Any]) -> None:
        spec = so["spec"]
        spec["triggers"] = [t for t in spec["triggers"] if t["type"] == "cpu"]
        spec["fallback"]["replicas"] = 9

    _rewrite(copy, "reconciler", cpu_only)
    found = problems(copy, checks.keda)
    assert "a fallback needs a trigger that is not cpu or memory" in found
    assert "fallback.replicas 9 is outside [1, 2]" in found


def test_a_prometheus_trigger_reading_an_absent_metric_as_zero_fails(copy: Deploy) -> None:
    """ignoreNullValues "true" turns "the reconciler is down" into a backlog of 0."""
    edit(copy.k8s_base / "committer.yaml", 'ignoreNullValues: "false"', 'ignoreNullValues: "true"')
    assert 'ignoreNullValues must be "false"' in problems(copy, checks.keda)


# definitions.json --------------------------------------------------------------------


def _definitions(deploy: Deploy, change: Callable[[dict[str, Any]], None]) -> None:
    data = deploy.definitions()
    change(data)
    deploy.definitions_file.write_text(json.dumps(data, indent=2) + "\n")


def test_a_queue_renamed_in_definitions_json_fails(copy: Deploy) -> None:
    edit(
        copy.definitions_file,
        '"name": "custody.commands.shipping.v1"',
        '"name": "custody.commands.shipment.v1"',
    )
    found = problems(copy, checks.definitions)
    assert "queues: custody.commands.shipping.v1 is missing" in found
    assert "queues: custody.commands.shipment.v1 is declared by no code" in found


def test_a_vhost_renamed_in_definitions_json_fails(copy: Deploy) -> None:
    copy.definitions_file.write_text(copy.definitions_file.read_text().replace('"/"', '"/nosuch"'))
    found = problems(copy, checks.definitions)
    assert "vhost is '/nosuch', the code declares '/'" in found
    assert "no queue in vhost '/'" in found


def test_an_exchange_a_binding_or_the_policy_changed_fails(copy: Deploy) -> None:
    def change(data: dict[str, Any]) -> None:
        data["exchanges"][0]["type"] = "topic"
        data["bindings"] = [b for b in data["bindings"] if b["routing_key"] != "cancel"]
        data["policies"][0]["definition"]["delivery-limit"] = 5

    _definitions(copy, change)
    found = problems(copy, checks.definitions)
    assert "exchanges: custody.commands: type is 'topic', the code declares 'direct'" in found
    assert "bindings: custody.requests -> custody.requests ('cancel') is missing" in found
    assert "policies: custody-queues: definition is" in found


# generated files and the custom resources' schemas --------------------------------


def test_an_alert_changed_without_regenerating_the_prometheus_rule_fails(copy: Deploy) -> None:
    edit(copy.alerts_file, "for: 5m", "for: 10m")
    assert "prometheusrule.yaml: differs from what deploy/prometheus/alerts.yaml" in problems(
        copy, checks.generated
    )
    generate.write(copy)
    assert checks.generated(copy) == []


def test_a_hand_edited_dashboard_configmap_fails(copy: Deploy) -> None:
    edit(copy.k8s_base / "grafana-dashboards.yaml", '"title": "custody"', '"title": "custodyy"')
    assert "grafana-dashboards.yaml: differs" in problems(copy, checks.generated)


def _check_jsonschema(
    schema: str, doc: dict[str, Any], tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    tool = TOOLS / "check-jsonschema"
    assert tool.exists(), f"{tool} is missing: {HOW}"
    path = tmp_path / "object.yaml"
    path.write_text(yaml.safe_dump(doc))
    return subprocess.run(
        [str(tool), "--schemafile", str(ROOT / "deploy" / "k8s" / "schemas" / schema), str(path)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


def _first(deploy: Deploy, kind: str) -> dict[str, Any]:
    return next(doc for _, doc in deploy.k8s_docs() if doc.get("kind") == kind)


@pytest.mark.parametrize(
    ("kind", "schema", "break_it", "complaint"),
    [
        (
            "PodMonitor",
            "podmonitor.schema.json",
            lambda d: d["spec"].update(podMetricsEndpoint=d["spec"].pop("podMetricsEndpoints")),
            "podMetricsEndpoint",
        ),
        (
            "PodMonitor",
            "podmonitor.schema.json",
            lambda d: d["spec"]["podMetricsEndpoints"][0].update(interval="15 seconds"),
            "15 seconds",
        ),
        (
            "PrometheusRule",
            "prometheusrule.schema.json",
            lambda d: d["spec"]["groups"][0]["rules"][0].update(fore="5m"),
            "fore",
        ),
        (
            "ScaledObject",
            "scaledobject.schema.json",
            lambda d: d["spec"]["fallback"].update(behaviour="static"),
            "behaviour",
        ),
    ],
)
def test_a_custom_resource_its_crd_would_refuse_fails_its_vendored_schema(
    copy: Deploy,
    tmp_path: Path,
    kind: str,
    schema: str,
    break_it: Callable[[dict[str, Any]], None],
    complaint: str,
) -> None:
    doc = _first(copy, kind)
    good = _check_jsonschema(schema, doc, tmp_path)
    assert good.returncode == 0, good.stdout + good.stderr
    break_it(doc)
    bad = _check_jsonschema(schema, doc, tmp_path)
    assert bad.returncode != 0, f"{kind} broken on purpose passed its schema"
    assert complaint in bad.stdout + bad.stderr


def _deploycheck(deploy: Deploy, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deploycheck", "--root", str(deploy.root), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def test_the_lint_command_exits_non_zero_on_a_broken_copy_and_zero_on_the_real_one(
    copy: Deploy,
) -> None:
    """What scripts/lint-deploy.sh runs: ``python -m deploycheck check``."""
    assert _deploycheck(copy, "check").returncode == 0
    edit(copy.k8s_base / "committer.yaml", "vhostName: /", "vhostName: /nosuch")
    done = _deploycheck(copy, "check")
    assert done.returncode == 1
    assert re.search(r"FAIL .*KEDA", done.stdout) and "/nosuch" in done.stdout
