"""Operator commands by filter (``custody reconcile|retry-safe|cancel|dispatch pause|resume
--status … --since … --yes``), as Temporal's batch operations and ServicePulse's group
retries do.

The filter runs as the operator's own login, so row-level security confines it to
the operator's tenants: a batch never sees, counts or touches another tenant's rows.
Each selected target then goes through the very command an operator would run by
hand (``transitions.Operator``: the same authorization, lifecycle checks and audit
row), each in its own transaction, so one refusal does not stop the batch. The batch
gets one audit row of its own (``custody.batch_audit``), whose counts the database
reads from the per-target audit rows.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from workers.engine import transitions
from workers.io import db

MAX_BATCH: Final = 10_000

# per action: the targets it selects (the filter query) and the command it runs
OPERATIONS: Final = "batch_operations"
INSTANCES: Final = "batch_instances"


@dataclass(frozen=True)
class Filter:
    query: str  # OPERATIONS or INSTANCES
    status: str | None = None
    route: str | None = None
    tenant: str | None = None
    process: str | None = None
    since_s: float | None = None
    since: str | None = None  # as typed, for the audit row
    limit: int = 1000

    def params(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "route": self.route,
            "tenant": self.tenant,
            "process": self.process,
            "since": self.since_s,
            "limit": self.limit,
        }

    def describe(self) -> dict[str, Any]:
        """The filter as the operator gave it (the audit row's ``filter``)."""
        given = {
            "status": self.status,
            "route": self.route,
            "tenant": self.tenant,
            "process": self.process,
            "since": self.since,
        }
        return {k: v for k, v in given.items() if v is not None} | {"limit": self.limit}


@dataclass(frozen=True)
class Selection:
    matched: int  # the whole filtered set the login can see
    rows: list[dict[str, Any]]  # at most the filter's limit, oldest first


async def select(database: db.Database, flt: Filter) -> Selection:
    async with database.transaction() as tx:
        rows = await tx.rows(flt.query, flt.params())
    matched = int(rows[0]["matched"]) if rows else 0
    return Selection(matched, [{k: v for k, v in r.items() if k != "matched"} for r in rows])


@dataclass(frozen=True)
class Summary:
    counts: Mapping[str, int]  # per result (done, refused, not_found)
    batch: transitions.Outcome  # the batch audit row's outcome

    @property
    def refused(self) -> int:
        return self.counts.get("refused", 0) + self.counts.get("not_found", 0)


Command = Callable[[transitions.Operator, str], Awaitable[transitions.Outcome]]
Progress = Callable[[int, int, str, transitions.Outcome], None]


async def run(
    database: db.Database,
    action: str,
    flt: Filter,
    targets: list[str],
    reason: str,
    command: Command,
    progress: Progress,
) -> Summary:
    """Run ``command`` for each target (one transaction each), then the batch audit row."""
    operator = transitions.Operator(database)
    async with database.transaction() as tx:
        started = await tx.one("batch_started")
    assert started is not None
    counts: Counter[str] = Counter()
    for i, target in enumerate(targets, 1):
        outcome = await command(operator, target)
        counts[outcome.result.value] += 1
        progress(i, len(targets), target, outcome)
    batch = await operator.call(
        "batch_audit",
        None,
        {
            "action": action,
            "filter": db.jsonb(flt.describe()),
            "reason": reason,
            "targets": targets,
            "started": started["at"],
        },
    )
    return Summary(dict(counts), batch)
