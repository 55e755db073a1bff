"""Every Prometheus collector custody exports, declared once, each with the worker
types that own it. Workers call the small recording functions below; nobody formats
metrics text by hand.

Ownership: a family is registered only in the processes of the worker types that
record it (:data:`FAMILIES`, :func:`register`), so a process never exports a family
it does not own: a gauge another worker samples (``custody_successor_intents_pending``,
the reconciler's) is absent from the committer's /metrics instead of a 0 that a
scaler would read as "no backlog" while the reconciler is down. The collectors are
created unregistered; ``custody run`` registers its worker's families.

Vocabulary: :attr:`Family.values` says, per label, which values the code records
(from the enums and constants that produce them), so the deploy checks
(``python -m deploycheck``) can refuse a matcher on a label value that never exists.
The ``worker`` label is :mod:`workers.core.names`' (``participant-inventory``, as in
the logs); ``owner`` is an outbox's owner (``engine`` or a participant's name).
"""

from __future__ import annotations

import importlib.metadata
import platform
import threading
import weakref
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal, get_args

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from workers import errors
from workers.core import acceptance, lifecycle, names, validation
from workers.core.reasons import Reason
from workers.io import broker
from workers.settings import ROOT

C: Final = "committer"
P: Final = "publisher"
R: Final = "receipts"
X: Final = "reconciler"
PART: Final = names.PARTICIPANT
ENGINE_OWNER: Final = "engine"  # the ``owner`` of the engine's outbox

TransitionKind = Literal["start", "successor", "deadline"]
PauseScope = Literal["global", "publisher", "committer", "receipts"]


@dataclass(frozen=True)
class Fleet:
    """What a deployment names, for the label values that depend on it: its
    participants (the owners of its routes) and its route names."""

    participants: frozenset[str]
    routes: frozenset[str] = frozenset()


Values = Callable[[Fleet], Collection[str]]


@dataclass(frozen=True)
class Family:
    """One metric family: its collector, the worker types (:data:`names.KINDS`) whose
    processes export it, and per label the values the code records (``None``: not a
    closed set, so no matcher on it can be checked)."""

    collector: Counter | Gauge | Histogram
    owners: frozenset[str]
    values: Mapping[str, Values | None] = field(default_factory=dict)

    @property
    def name(self) -> str:
        [family] = self.collector.describe()
        return str(family.name)

    @property
    def kind(self) -> str:
        [family] = self.collector.describe()
        return str(family.type)

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(self.collector._labelnames)

    @property
    def samples(self) -> frozenset[str]:
        """The sample names a query can select (``_total``, ``_bucket``, ...)."""
        if self.kind == "counter":
            return frozenset({self.name + "_total"})
        if self.kind == "histogram":
            return frozenset(self.name + s for s in ("_bucket", "_sum", "_count"))
        return frozenset({self.name})

    def label_values(self, fleet: Fleet, label: str) -> frozenset[str] | None:
        """The values of ``label`` this family can carry in ``fleet`` (None: open)."""
        if label == "worker":
            return frozenset(
                w for w in names.worker_names(fleet.participants) if names.kind_of(w) in self.owners
            )
        if label == "owner":
            engine = {ENGINE_OWNER} if self.owners & set(names.ENGINE_WORKERS) else set()
            parts = fleet.participants if PART in self.owners else frozenset()
            return frozenset(engine | set(parts))
        source = self.values.get(label)
        return None if source is None else frozenset(source(fleet))


def _statuses(_: Fleet) -> list[str]:
    return [s.value for s in lifecycle.Status]


def _reasons(_: Fleet) -> list[str]:
    return [r.value for r in Reason]


def participant_source(owner: str) -> str:
    """The ``source`` of what a participant quarantines (refuses)."""
    return f"participant.{owner}"


def _sources(fleet: Fleet) -> list[str]:
    return [
        broker.QUEUE_REQUESTS,
        broker.QUEUE_RECEIPTS,
        *(participant_source(p) for p in fleet.participants),
    ]


def _verdicts(_: Fleet) -> Collection[str]:
    return validation.RECEIPT_LABELS


def _decisions(_: Fleet) -> list[str]:
    return [v.value for v in acceptance.Verdict]


def _retry_kinds(_: Fleet) -> list[str]:
    return [k.value for k in errors.Retry]


def _routes(fleet: Fleet) -> Collection[str]:
    return fleet.routes


def _literal(kind: object) -> Values:
    values = tuple(str(v) for v in get_args(kind))
    return lambda _: values


def _counter(name: str, doc: str, labels: Collection[str] = ()) -> Counter:
    return Counter(name, doc, list(labels), registry=None)


def _gauge(name: str, doc: str, labels: Collection[str] = ()) -> Gauge:
    return Gauge(name, doc, list(labels), registry=None)


OUTBOX: Final = frozenset({P, PART})  # every outbox publisher: the engine's, a participant's
# every process that sends outbox rows: the outboxes' publishers, and the committer and
# the receipt consumer, which send the submits they commit (the publisher worker alone
# samples the engine's outbox)
SENDERS: Final = OUTBOX | {C, R}
CONSUMERS: Final = frozenset({C, R, PART})
LEASED: Final = frozenset(names.ENGINE_WORKERS)  # participants hold no lease
EVERYONE: Final = frozenset(names.KINDS)

OUTBOX_PENDING: Final = _gauge(
    "custody_outbox_pending_rows",
    "Outbox rows waiting to be sent or confirmed (submits held by a dispatch pause or a"
    " suspended instance excluded: custody_dispatch_held_submits)",
    ["owner"],
)
OUTBOX_OLDEST_AGE: Final = _gauge(
    "custody_outbox_oldest_pending_age_seconds",
    "Age of the oldest outbox row waiting to be sent or confirmed (held submits excluded)",
    ["owner"],
)
PUBLISHED: Final = _counter(
    "custody_outbox_published_total",
    "Outbox rows marked published after a broker confirm",
    ["owner"],
)
PUBLISH_FAILURES: Final = _counter(
    "custody_outbox_publish_failures_total",
    "Publishes not confirmed (nack, return, timeout, channel loss)",
    ["owner", "kind"],
)
CONFIRM_LATENCY: Final = Histogram(
    "custody_publish_confirm_latency_seconds",
    "Time from publishing a batch to its last confirm",
    ["owner"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    registry=None,
)
RECEIPTS: Final = _counter(
    "custody_receipts_total", "Receipts handled by the receipt consumer, by verdict", ["verdict"]
)
QUARANTINED: Final = _counter(
    "custody_quarantined_total", "Messages quarantined at the trust boundary", ["source", "reason"]
)
REDELIVERIES: Final = _counter(
    "custody_redeliveries_total",
    "Deliveries the broker flagged as redelivered (each item of a redelivered envelope)",
    ["worker"],
)
TRANSITIONS: Final = _counter(
    "custody_transitions_total", "Workflow transitions committed", ["kind"]
)
OPERATIONS: Final = _gauge("custody_operations", "Operations by status (sampled)", ["status"])
LEASE_LOSSES: Final = _counter(
    "custody_lease_losses_total",
    "Times a worker found its lease lost (expired or fenced) and took it back under a new"
    " epoch: one per loss, however many of its units the loss fenced",
    ["worker"],
)
# From the commit that created an operation to its terminal receipt: milliseconds on a
# happy path, hours for an outcome_unknown operation an operator reconciles.
END_TO_END_BUCKETS: Final = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
    120, 300, 600, 1800, 3600, 7200, 14400, 43200, 86400,
)  # fmt: skip
END_TO_END: Final = Histogram(
    "custody_operation_end_to_end_seconds",
    "From the transition commit that created an operation to its terminal receipt applied",
    buckets=END_TO_END_BUCKETS,
    registry=None,
)
PARTICIPANT_COMMANDS: Final = _counter(
    "custody_participant_commands_total",
    "Commands a participant runtime handled, by decision",
    ["owner", "decision"],
)
UNIT_FAILURES: Final = _counter(
    "custody_unit_failures_total",
    "Units of work that failed and will be redone",
    ["worker", "kind"],
)
ROUTE_DRIFT: Final = _counter(
    "custody_route_drift_total",
    "Successor activations whose pinned route differs from the current routes file",
    ["route"],
)
DEAD_LETTERED: Final = _counter(
    "custody_dead_lettered_total",
    "Poison deliveries sent to the dead-letter exchange after isolating them",
    ["worker"],
)
ACTIVATION_FAILURES: Final = _counter(
    "custody_activation_failures_total",
    "Node activations the committer or the receipt consumer could not make: the instance"
    " was failed or suspended",
    ["reason"],
)
SUCCESSOR_PENDING: Final = _gauge(
    "custody_successor_intents_pending", "Successor intents not yet committed by a committer"
)
UNDECODABLE: Final = _counter(
    "custody_undecodable_deliveries_total",
    "Deliveries whose AMQP properties could not be decoded, or envelopes that could not be "
    "split (isolated, never handled)",
    ["worker"],
)
DISPATCH_PAUSED: Final = _gauge(
    "custody_dispatch_paused",
    "1 while effect dispatch (submits) is paused fleet-wide: scope global is the database"
    " flag (custody dispatch pause), scope publisher, committer or receipts a process of"
    " that worker (the engine's senders of submits) started with CUSTODY_DISPATCH_PAUSED",
    ["owner", "scope"],
)
DISPATCH_PAUSED_INSTANCES: Final = _gauge(
    "custody_dispatch_paused_instances",
    "Unfinished instances whose dispatch is paused (custody dispatch pause --instance)",
)
DISPATCH_HELD: Final = _gauge(
    "custody_dispatch_held_submits",
    "Submits in the outbox held back by a dispatch pause or because their instance is not"
    " running (suspended): deliberate, never counted as a stuck outbox",
)
BUILD_INFO: Final = _gauge(
    "custody_build_info",
    "1, labelled with the running custody version, its source revision and Python",
    ["worker", "version", "revision", "python"],
)

FAMILIES: Final[tuple[Family, ...]] = (
    Family(OUTBOX_PENDING, OUTBOX),
    Family(OUTBOX_OLDEST_AGE, OUTBOX),
    Family(PUBLISHED, SENDERS),
    Family(PUBLISH_FAILURES, SENDERS, {"kind": None}),
    Family(CONFIRM_LATENCY, SENDERS),
    Family(RECEIPTS, frozenset({R}), {"verdict": _verdicts}),
    Family(QUARANTINED, CONSUMERS, {"source": _sources, "reason": _reasons}),
    Family(REDELIVERIES, CONSUMERS),
    Family(TRANSITIONS, frozenset({C, R, X}), {"kind": _literal(TransitionKind)}),
    Family(OPERATIONS, frozenset({X}), {"status": _statuses}),
    Family(LEASE_LOSSES, LEASED),
    Family(END_TO_END, frozenset({R})),
    Family(PARTICIPANT_COMMANDS, frozenset({PART}), {"decision": _decisions}),
    Family(UNIT_FAILURES, EVERYONE, {"kind": _retry_kinds}),
    Family(ROUTE_DRIFT, frozenset({C, R}), {"route": _routes}),
    Family(DEAD_LETTERED, CONSUMERS),
    Family(ACTIVATION_FAILURES, frozenset({C, R}), {"reason": _reasons}),
    Family(SUCCESSOR_PENDING, frozenset({X})),
    Family(UNDECODABLE, CONSUMERS),
    Family(DISPATCH_PAUSED, frozenset({X, P, C, R}), {"scope": _literal(PauseScope)}),
    Family(DISPATCH_PAUSED_INSTANCES, frozenset({X})),
    Family(DISPATCH_HELD, frozenset({X})),
    Family(BUILD_INFO, EVERYONE, {"version": None, "revision": None, "python": None}),
)


def owned(kind: str) -> tuple[Family, ...]:
    """The families the processes of worker type ``kind`` export."""
    if kind not in names.KINDS:
        raise ValueError(f"not a worker type: {kind!r}")
    return tuple(f for f in FAMILIES if kind in f.owners)


_lock = threading.Lock()
_registered: weakref.WeakKeyDictionary[CollectorRegistry, set[str]] = weakref.WeakKeyDictionary()


def _add(registry: CollectorRegistry, families: Collection[Family]) -> None:
    with _lock:
        done = _registered.setdefault(registry, set())
        for f in families:
            if f.name not in done:
                registry.register(f.collector)
                done.add(f.name)


def register(
    worker: str,
    *,
    dispatch_paused: bool = False,
    revision: str = "",
    registry: CollectorRegistry = REGISTRY,
) -> tuple[Family, ...]:
    """Export the families worker ``worker`` (a :mod:`workers.core.names` name) owns,
    and its build info; returns them. ``dispatch_paused``: the publisher's, the
    committer's or the receipt consumer's CUSTODY_DISPATCH_PAUSED; ``revision``:
    CUSTODY_GIT_REVISION (the image's build sets it; empty: a git checkout's HEAD, else
    ``unknown``)."""
    kind = names.kind_of(worker)
    families = owned(kind)
    _add(registry, families)
    built = revision or git_head(ROOT) or "unknown"
    BUILD_INFO.clear()  # one process, one build
    BUILD_INFO.labels(worker, version(), built, platform.python_version()).set(1)
    if kind in (P, C, R):  # the engine's senders of submits
        DISPATCH_PAUSED.labels(ENGINE_OWNER, kind).set(int(dispatch_paused))
    return families


def register_all(registry: CollectorRegistry = REGISTRY) -> None:
    """Export every family: for a process that runs several worker types at once (the
    in-process fleets of the tests)."""
    _add(registry, FAMILIES)


def version() -> str:
    try:
        return importlib.metadata.version("custody")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def git_head(root: Path) -> str | None:
    """The commit a git checkout at ``root`` has checked out, read from .git (no git
    process), or None."""
    git = root / ".git"
    try:
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head[:12] or None
        ref = head.removeprefix("ref: ")
        loose = git / ref
        if loose.exists():
            return loose.read_text().strip()[:12] or None
        for line in (git / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split(" ", 1)[0][:12]
    except OSError:
        return None
    return None


# -- recording --------------------------------------------------------------------------


def quarantined(source: str, reason: str) -> None:
    QUARANTINED.labels(source, reason).inc()


def transitions(kind: TransitionKind, n: int) -> None:
    TRANSITIONS.labels(kind).inc(n)


def dispatch(*, paused: bool, paused_instances: int, held: int) -> None:
    """The reconciler's sample of the engine's dispatch state."""
    DISPATCH_PAUSED.labels(ENGINE_OWNER, "global").set(int(paused))
    DISPATCH_PAUSED_INSTANCES.set(paused_instances)
    DISPATCH_HELD.set(held)
