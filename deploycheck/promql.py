"""PromQL of deploy/ against what the code declares: each expression parses, and each
selector names a metric that is exported, label names that metric has and label values
it can carry; each ``by``/``on`` list names labels its operands have.

The vocabulary comes from the code: custody's families and their label values from
:data:`workers.runtime.metrics.FAMILIES` (for the participants and routes of
deploy/routes.toml), the broker's per-queue metrics with the queues of
:func:`workers.io.broker.topology` and the vhost custody's URL names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import promql_parser as pq

from deploycheck.sources import Deploy, Expression
from workers.io import broker
from workers.runtime import metrics
from workers.settings import Settings

# Labels a scrape adds to every series (Prometheus, and a PodMonitor's relabelling);
# their values are the cluster's, not the code's.
TARGET_LABELS = frozenset(
    {"instance", "job", "namespace", "pod", "container", "endpoint", "service", "node"}
)
# rabbitmq_prometheus 3.10: the per-queue families the alerts and panels read
# (/metrics/detailed?family=queue_coarse_metrics&family=queue_consumer_count, and
# /metrics with per-object metrics on), each labelled with its vhost and queue.
RABBITMQ_QUEUE_METRICS = (
    "rabbitmq_detailed_queue_messages",
    "rabbitmq_detailed_queue_messages_ready",
    "rabbitmq_detailed_queue_messages_unacked",
    "rabbitmq_detailed_queue_consumers",
    "rabbitmq_queue_messages",
)


def custody_vhost() -> str:
    """The vhost custody's topology lives in: the one its broker URL names."""
    return broker.vhost_of(Settings().amqp_url)


@dataclass(frozen=True)
class Series:
    """What one sample name may carry: its labels, and per label its closed set of
    values (absent: any value)."""

    labels: frozenset[str]
    values: Mapping[str, frozenset[str]]


def vocabulary(deploy: Deploy) -> dict[str, Series]:
    """Every sample name a query may select, from the code."""
    table = deploy.routes
    fleet = metrics.Fleet(
        participants=frozenset(r.owner for r in table.by_name.values()),
        routes=frozenset(table.by_name),
    )
    out: dict[str, Series] = {}
    for family in metrics.FAMILIES:
        closed: dict[str, frozenset[str]] = {}
        for label in family.labels:
            values = family.label_values(fleet, label)
            if values is not None:
                closed[label] = values
        for sample in family.samples:
            extra = {"le"} if sample.endswith("_bucket") else set()
            out[sample] = Series(frozenset(family.labels) | extra, closed)
    queues = frozenset(broker.topology(table.bindings())["queues"])
    rabbit = Series(
        frozenset({"vhost", "queue"}), {"vhost": frozenset({custody_vhost()}), "queue": queues}
    )
    for name in RABBITMQ_QUEUE_METRICS:
        out[name] = rabbit
    return out


def parse(expression: Expression) -> tuple[pq.Expr | None, list[str]]:
    try:
        return pq.parse(expression.text), []
    except ValueError as exc:
        return None, [f"{expression.where}: does not parse: {exc}: {expression.text!r}"]


def check(expressions: Iterable[Expression], known: Mapping[str, Series]) -> list[str]:
    """Every problem of ``expressions``, one line each."""
    problems: list[str] = []
    for expression in expressions:
        tree, errors = parse(expression)
        problems += errors
        if tree is not None:
            problems += [f"{expression.where}: {p}" for p in _check_tree(tree, known)]
    return problems


def _check_tree(tree: pq.Expr, known: Mapping[str, Series]) -> list[str]:
    problems: list[str] = []

    def visit(node: pq.Expr) -> None:
        if isinstance(node, pq.VectorSelector):
            problems.extend(_check_selector(node, known))
        elif isinstance(node, pq.AggregateExpr) and node.modifier is not None:
            if node.modifier.type == pq.AggModifierType.By:
                has = _labels(node.expr, known)
                missing = sorted(set(node.modifier.labels) - has) if has is not None else []
                if missing:
                    problems.append(f"`by ({', '.join(missing)})`: no operand has such a label")
        elif isinstance(node, pq.BinaryExpr) and node.modifier is not None:
            matching = node.modifier.matching
            if matching is not None and matching.labels:
                lhs, rhs = _labels(node.lhs, known), _labels(node.rhs, known)
                has = None if lhs is None or rhs is None else lhs | rhs
                missing = sorted(set(matching.labels) - has) if has is not None else []
                if missing:
                    problems.append(f"`on/ignoring ({', '.join(missing)})`: no such label")

    pq.walk(tree, lambda node: visit(node))
    return problems


def _check_selector(node: pq.VectorSelector, known: Mapping[str, Series]) -> list[str]:
    name = node.name
    shown = str(node)
    if name is None:
        return [f"{shown}: a selector without a metric name"]
    series = known.get(name)
    if series is None:
        near = _nearest(name, known)
        return [
            f"{shown}: no code exports {name!r}" + (f" (did you mean {near!r}?)" if near else "")
        ]
    problems = []
    for m in node.matchers.matchers:
        if m.name == "__name__":
            continue
        if m.name not in series.labels and m.name not in TARGET_LABELS:
            problems.append(f"{shown}: {name} has no label {m.name!r} ({sorted(series.labels)})")
            continue
        values = series.values.get(m.name)
        if values is None or m.value == "":
            continue
        if m.op in (pq.MatchOp.Equal, pq.MatchOp.NotEqual):
            if m.value not in values:
                problems.append(
                    f"{shown}: {m.name}={m.value!r} never exists; {name} has {m.name} in "
                    f"{sorted(values)}"
                )
        else:
            try:
                pattern = re.compile(m.value)
            except re.error as exc:
                problems.append(
                    f"{shown}: {m.name}=~{m.value!r} is not a regular expression: {exc}"
                )
                continue
            if not any(pattern.fullmatch(v) for v in values):
                problems.append(
                    f"{shown}: {m.name}=~{m.value!r} matches no value {name} has ({sorted(values)})"
                )
    return problems


def _labels(node: pq.Expr, known: Mapping[str, Series]) -> set[str] | None:
    """The labels ``node``'s result series may carry (None: unknown, anything goes)."""
    if isinstance(node, pq.VectorSelector):
        series = known.get(node.name or "")
        return None if series is None else set(series.labels) | TARGET_LABELS
    if isinstance(node, pq.MatrixSelector):
        return _labels(node.vector_selector, known)
    if isinstance(node, (pq.ParenExpr, pq.UnaryExpr, pq.SubqueryExpr)):
        return _labels(node.expr, known)
    if isinstance(node, pq.AggregateExpr):
        inner = _labels(node.expr, known)
        if node.modifier is None:
            return inner if str(node.op) in ("topk", "bottomk", "limitk") else set()
        if node.modifier.type == pq.AggModifierType.By:
            return set(node.modifier.labels)
        return None if inner is None else inner - set(node.modifier.labels)
    if isinstance(node, pq.BinaryExpr):
        lhs, rhs = _labels(node.lhs, known), _labels(node.rhs, known)
        return None if lhs is None or rhs is None else lhs | rhs
    if isinstance(node, pq.Call):
        found: set[str] = set()
        for arg in node.args:
            labels = _labels(arg, known)
            if labels is None:
                return None
            found |= labels
        strings = [a.val for a in node.args if isinstance(a, pq.StringLiteral)]
        if node.func.name in ("label_replace", "label_join") and strings:
            found.add(strings[0])
        return found
    return set()  # number and string literals


def _nearest(name: str, known: Iterable[str]) -> str | None:
    import difflib

    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.8)
    return close[0] if close else None
