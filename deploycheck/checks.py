"""The checks of ``python -m deploycheck check``, each a function of a deploy/ tree that
returns its problems (an empty list: the check passes), one line each, naming the file
and the object. tests/unit/test_deploy_checks.py breaks a copy of deploy/ on purpose
and expects each to complain."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from deploycheck import generate, promql
from deploycheck.sources import Deploy
from workers.io import broker
from workers.settings import Settings

CPU_MEMORY = ("cpu", "memory")
# KEDA's trigger metadata for the scalers custody uses: what must be there
RABBITMQ_REQUIRED = ("protocol", "mode", "value", "queueName", "vhostName")
PROMETHEUS_REQUIRED = ("serverAddress", "query", "threshold", "ignoreNullValues")


def promql_refs(deploy: Deploy) -> list[str]:
    """Every PromQL expression parses and reads only what the code exports."""
    return promql.check(deploy.expressions(), promql.vocabulary(deploy))


def expected_definitions(deploy: Deploy, vhost: str | None = None) -> dict[str, Any]:
    """deploy/rabbitmq/definitions.json as the code declares it: the topology plan of
    :func:`workers.io.broker.topology` for the routes, and the queue policy."""
    vhost = promql.custody_vhost() if vhost is None else vhost
    plan = broker.topology(deploy.routes.bindings())
    policy = broker.policy_definition(Settings().delivery_limit)
    return {
        "exchanges": [
            {
                "name": ex["name"],
                "vhost": vhost,
                "type": ex["type"],
                "durable": True,
                "auto_delete": False,
                "internal": False,
                "arguments": {},
            }
            for ex in plan["exchanges"]
        ],
        "queues": [
            {
                "name": name,
                "vhost": vhost,
                "durable": True,
                "auto_delete": False,
                "arguments": {"x-queue-type": "quorum"},
            }
            for name in plan["queues"]
        ],
        "bindings": [
            {
                "source": exchange,
                "vhost": vhost,
                "destination": queue,
                "destination_type": "queue",
                "routing_key": key,
                "arguments": {},
            }
            for exchange, queue, key in plan["bindings"]
        ],
        "policies": [{"vhost": vhost, "name": broker.POLICY_NAME, **policy}],
    }


def _key(kind: str, item: Mapping[str, Any]) -> str:
    if kind == "bindings":
        return f"{item.get('source')} -> {item.get('destination')} ({item.get('routing_key')!r})"
    return str(item.get("name"))


def definitions(deploy: Deploy) -> list[str]:
    """definitions.json declares exactly the code's topology: every exchange, queue,
    binding and policy, field by field, in the vhost custody uses."""
    where = deploy.rel(deploy.definitions_file)
    try:
        got = deploy.definitions()
    except ValueError as exc:
        return [f"{where}: not JSON: {exc}"]
    want = expected_definitions(deploy)
    problems = []
    vhost = promql.custody_vhost()
    for kind in ("exchanges", "queues", "bindings", "policies"):
        have = {_key(kind, i): i for i in got.get(kind, [])}
        need = {_key(kind, i): i for i in want[kind]}
        for name in sorted(need.keys() - have.keys()):
            problems.append(f"{where}: {kind}: {name} is missing (the code declares it)")
        for name in sorted(have.keys() - need.keys()):
            problems.append(f"{where}: {kind}: {name} is declared by no code")
        for name in sorted(need.keys() & have.keys()):
            for field in sorted(set(need[name]) | set(have[name])):
                if have[name].get(field) != need[name].get(field):
                    problems.append(
                        f"{where}: {kind}: {name}: {field} is {have[name].get(field)!r}, "
                        f"the code declares {need[name].get(field)!r}"
                    )
    for key in sorted(set(got) - {"exchanges", "queues", "bindings", "policies"}):
        problems.append(f"{where}: {key!r}: not part of custody's topology")
    if got.get("queues") and all(q.get("vhost") != vhost for q in got["queues"]):
        problems.append(f"{where}: no queue in vhost {vhost!r}, the vhost custody connects to")
    return problems


def keda(deploy: Deploy) -> list[str]:
    """Every ScaledObject: a ``fallback`` KEDA admits (a trigger that is not cpu or
    memory, each with metricType AverageValue), replicas within its bounds; each
    rabbitmq trigger on a queue of the topology in custody's vhost; each prometheus
    trigger erring (not 0) when its metric is absent, so that the fallback applies."""
    queues = set(broker.topology(deploy.routes.bindings())["queues"])
    vhost = promql.custody_vhost()
    problems: list[str] = []
    for path, so in deploy.scaled_objects():
        where = f"{deploy.rel(path)}: ScaledObject {so['metadata']['name']}"
        spec = so.get("spec", {})
        triggers = spec.get("triggers", [])
        fallback = spec.get("fallback")
        low, high = spec.get("minReplicaCount", 0), spec.get("maxReplicaCount", 100)
        if not fallback:
            problems.append(
                f"{where}: no fallback (a broken scaler would leave it at its HPA's last value)"
            )
        else:
            if int(fallback.get("failureThreshold", 0)) < 1:
                problems.append(f"{where}: fallback.failureThreshold must be at least 1")
            if not low <= int(fallback.get("replicas", -1)) <= high:
                problems.append(
                    f"{where}: fallback.replicas {fallback.get('replicas')} is outside "
                    f"[{low}, {high}]"
                )
            if all(t.get("type") in CPU_MEMORY for t in triggers):
                problems.append(
                    f"{where}: a fallback needs a trigger that is not cpu or memory "
                    "(KEDA's admission webhook refuses it)"
                )
        for t in triggers:
            name = f"{where} trigger {t.get('name')}"
            meta = t.get("metadata", {})
            kind = t.get("type")
            if kind not in CPU_MEMORY and t.get("metricType") != "AverageValue":
                problems.append(f"{name}: metricType must be AverageValue (the fallback's)")
            if kind == "rabbitmq":
                problems += [f"{name}: no {k}" for k in RABBITMQ_REQUIRED if k not in meta]
                if meta.get("queueName") not in queues:
                    problems.append(
                        f"{name}: queueName {meta.get('queueName')!r} is not a queue of the "
                        f"topology ({sorted(queues)})"
                    )
                if "vhostName" in meta and meta["vhostName"] != vhost:
                    problems.append(
                        f"{name}: vhostName {meta['vhostName']!r} is not custody's vhost {vhost!r}"
                    )
            elif kind == "prometheus":
                problems += [f"{name}: no {k}" for k in PROMETHEUS_REQUIRED if k not in meta]
                if meta.get("ignoreNullValues") != "false":
                    problems.append(
                        f'{name}: ignoreNullValues must be "false": an absent metric (its '
                        "owner down) must be a scaler error, and the fallback, not 0"
                    )
    return problems


def generated(deploy: Deploy) -> list[str]:
    """The generated manifests are what their sources generate."""
    return [
        f"{deploy.rel(path)}: differs from what {source} generates; run "
        "`.venv/bin/python -m deploycheck generate`"
        for path, source in generate.stale(deploy)
    ]


CHECKS: dict[str, Callable[[Deploy], list[str]]] = {
    "PromQL: parses, and reads only metrics, labels and values the code declares": promql_refs,
    "KEDA: fallbacks, queues and vhost of the topology, prometheus triggers": keda,
    "rabbitmq/definitions.json: the topology the code applies": definitions,
    "generated: PrometheusRule and dashboard ConfigMap": generated,
}
