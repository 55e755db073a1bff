"""Checks and generators for deploy/: what ``make lint`` runs beside the validators of
scripts/lint-deploy.sh (hadolint, kubernetes-validate, promtool, check-jsonschema).

The validators know the formats; these checks know custody. Every PromQL expression of
deploy/ (alerts, dashboard panels, KEDA triggers) parses, and reads only metric names,
label names and label values that the code declares (:mod:`workers.runtime.metrics`,
:mod:`workers.core.names`, the broker topology of :mod:`workers.io.broker` and the
routes file); every KEDA ScaledObject falls back on a broken scaler the way KEDA
admits; deploy/rabbitmq/definitions.json is the topology ``custody topology apply``
declares; and the generated manifests (the PrometheusRule from
deploy/prometheus/alerts.yaml, the Grafana dashboard ConfigMap) are what their
sources generate.

    .venv/bin/python -m deploycheck check              # every check; exit 1 on a problem
    .venv/bin/python -m deploycheck generate [--check] # write (or compare) generated files

It sits beside the production packages, not in them: nothing in workers/ imports it.
"""
