"""Every Prometheus collector custody exports, declared once. Workers call the
small recording functions below; nobody formats metrics text by hand."""

from __future__ import annotations

from typing import Final

from prometheus_client import Counter, Gauge, Histogram

OUTBOX_PENDING: Final = Gauge(
    "custody_outbox_pending_rows", "Outbox rows not yet confirmed by the broker", ["owner"]
)
OUTBOX_OLDEST_AGE: Final = Gauge(
    "custody_outbox_oldest_pending_age_seconds",
    "Age of the oldest unconfirmed outbox row",
    ["owner"],
)
PUBLISHED: Final = Counter(
    "custody_outbox_published_total",
    "Outbox rows marked published after a broker confirm",
    ["owner"],
)
PUBLISH_FAILURES: Final = Counter(
    "custody_outbox_publish_failures_total",
    "Publishes not confirmed (nack, return, timeout, channel loss)",
    ["owner", "kind"],
)
CONFIRM_LATENCY: Final = Histogram(
    "custody_publish_confirm_latency_seconds",
    "Time from publishing a batch to its last confirm",
    ["owner"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
RECEIPTS: Final = Counter(
    "custody_receipts_total", "Receipts handled by the receipt consumer, by verdict", ["verdict"]
)
QUARANTINED: Final = Counter(
    "custody_quarantined_total", "Messages quarantined at the trust boundary", ["source", "reason"]
)
REDELIVERIES: Final = Counter(
    "custody_redeliveries_total", "Deliveries the broker flagged as redelivered", ["worker"]
)
TRANSITIONS: Final = Counter(
    "custody_transitions_total", "Workflow transitions committed", ["kind"]
)
OPERATIONS: Final = Gauge("custody_operations", "Operations by status (sampled)", ["status"])
LEASE_LOSSES: Final = Counter(
    "custody_lease_losses_total", "Times a worker found its lease expired or fenced", ["worker"]
)
END_TO_END: Final = Histogram(
    "custody_operation_end_to_end_seconds",
    "From the transition commit that created an operation to its terminal receipt applied",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
PARTICIPANT_COMMANDS: Final = Counter(
    "custody_participant_commands_total",
    "Commands a participant runtime handled, by decision",
    ["owner", "decision"],
)
UNIT_FAILURES: Final = Counter(
    "custody_unit_failures_total",
    "Units of work that failed and will be redone",
    ["worker", "kind"],
)


def quarantined(source: str, reason: str) -> None:
    QUARANTINED.labels(source, reason).inc()


ROUTE_DRIFT: Final = Counter(
    "custody_route_drift_total",
    "Successor activations whose pinned route differs from the current routes file",
    ["route"],
)
DEAD_LETTERED: Final = Counter(
    "custody_dead_lettered_total",
    "Poison deliveries sent to the dead-letter exchange after isolating them",
    ["worker"],
)
ACTIVATION_FAILURES: Final = Counter(
    "custody_activation_failures_total",
    "Node activations the committer could not make: the instance was failed or suspended",
    ["reason"],
)
SUCCESSOR_PENDING: Final = Gauge(
    "custody_successor_intents_pending", "Successor intents not yet committed by a committer"
)
UNDECODABLE: Final = Counter(
    "custody_undecodable_deliveries_total",
    "Deliveries whose AMQP properties could not be decoded (isolated, never handled)",
    ["worker"],
)
