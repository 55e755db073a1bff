"""A successor's activation, decided and written: shared by the two boundaries that
commit workflow transitions from a successor intent.

The committer claims pending intents (its *workflow transition* boundary). The receipt
consumer activates, in the transaction that applies a receipt, the successor of an
instance whose row it could lock at once and found running (issue 14): the validated
result, the successor intent (written done) and the transition (node state, history,
operation, attempt, dispatch intent) commit together, and no wake-up or claim stands
between a receipt and the next command. Every other intent is left pending, for the
committer, exactly as before.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from contracts.models import ExecutorRoute
from workers.core import activation, lifecycle, process, records, routes
from workers.core.reasons import Reason
from workers.io import db
from workers.runtime import faults, logs, metrics, outbox

IE = lifecycle.InstanceEvent
PINNED_ROUTES_KEPT = 1024  # distinct pinned route sets parsed once (a deployment has few)


@dataclass(frozen=True)
class Finish:
    """An instance's end: what the guarded UPDATE (WHERE status = 'running') sets, and
    the history row to write if it did end it."""

    instance_id: Any
    status: lifecycle.InstanceStatus
    history: records.History


class Activator:
    """Decides an intent's activation: the next node's plan, or the instance's end."""

    def __init__(self, table: routes.Routes, catalog: process.Catalog, actor: str) -> None:
        self.routes = table
        self.catalog = catalog
        self.actor = actor
        # an instance's pinned routes, parsed, with the names the current file changed
        # or removed, by their JSON: most instances pin the same routes
        self._pinned: dict[bytes, tuple[dict[str, ExecutorRoute], tuple[str, ...]]] = {}

    def history(self, instance_id: Any, event: str, **detail: Any) -> records.History:
        return records.History(
            instance_id=instance_id, event=event, actor=self.actor, detail=detail
        )

    def next(
        self,
        intent: Mapping[str, Any],
        definition: process.Definition,
        results: Mapping[str, Any],
        activations: dict[tuple[Any, str], int],
    ) -> activation.Plan | Finish:
        """The intent's next node activated (its activation number counted in
        ``activations``), or its instance's end: completed or failed by the process, or
        failed because the activation does not fit the contracts (an alert)."""
        iid, nxt = intent["instance_id"], intent["next_node"]
        if nxt in (process.END_COMPLETED, process.END_FAILED):
            end = lifecycle.instance_target(
                IE.COMPLETE if nxt == process.END_COMPLETED else IE.FAIL
            )
            return Finish(iid, end, self.history(iid, f"instance.{end.value}"))
        number = activations.get((iid, nxt), 0) + 1
        try:
            pinned = self.pinned_routes(iid, intent["routes"])
            plan = activation.plan_activation(
                tenant=intent["tenant"],
                instance_id=str(iid),
                definition=definition,
                node_name=nxt,
                activation=number,
                instance_input=intent["input"],
                results=results,
                pinned=pinned,
                traceparent=intent["traceparent"],
                actor=self.actor,
            )
        except activation.ACTIVATION_ERRORS as exc:
            metrics.ACTIVATION_FAILURES.labels(Reason.ACTIVATION_FAILED).inc()
            logs.event(
                "instance.activation_failed",
                logging.ERROR,
                instance_id=str(iid),
                node=nxt,
                error=str(exc)[:300],
            )
            failed = lifecycle.instance_target(IE.FAIL)
            return Finish(
                iid,
                failed,
                self.history(
                    iid,
                    f"instance.{failed.value}",
                    reason=Reason.ACTIVATION_FAILED,
                    node=nxt,
                    error=str(exc),
                ),
            )
        activations[(iid, nxt)] = number
        return plan

    def pinned_routes(self, instance_id: Any, raw: Mapping[str, Any]) -> dict[str, ExecutorRoute]:
        """The instance's pinned routes. A pinned route that the current file changed or
        removed is an alert, never a redirect: the instance keeps the binding it started
        with."""
        key = orjson.dumps(raw, option=orjson.OPT_SORT_KEYS)
        known = self._pinned.get(key)
        if known is None:
            pinned = {k: ExecutorRoute.model_validate(v, strict=False) for k, v in raw.items()}
            drifted = tuple(n for n, r in pinned.items() if self.routes.by_name.get(n) != r)
            known = (pinned, drifted)
            if len(self._pinned) < PINNED_ROUTES_KEPT:
                self._pinned[key] = known
        pinned, drifted = known
        for name in drifted:
            current = self.routes.by_name.get(name)
            metrics.ROUTE_DRIFT.labels(name).inc()
            logs.event(
                "route.drift",
                logging.WARNING,
                instance_id=str(instance_id),
                route=name,
                pinned=pinned[name].binding,
                current=current.binding if current else None,
            )
        return pinned


async def finish(
    tx: db.Tx, finishes: Sequence[Finish], *, logged: bool = False
) -> list[records.History]:
    """The batch's ends in one guarded UPDATE (WHERE status = 'running'); returns the
    history of each end it did make, for the caller to write in its order. ``logged``:
    the statement writes that history itself, right after the unit's writes before it,
    and the unit does not wait for its answer (returns none)."""
    if not finishes:
        return []
    if logged:
        rows = [
            # the history row as history_insert takes it, its detail a plain object
            {"id": f.instance_id, "status": f.status.value, "history": f.history.params(dict)}
            for f in finishes
        ]
        await tx.send_many("instance_finish", rows)
        return []
    rows = [{"id": f.instance_id, "status": f.status.value} for f in finishes]
    ended = {r["id"] for r in await tx.rows("instance_finish", {"rows": db.jsonb(rows)})}
    return [f.history for f in finishes if f.instance_id in ended]


async def write_plans(
    tx: db.Tx,
    plans: Sequence[activation.Plan],
    before: Sequence[records.History] = (),
    after: Sequence[records.History] = (),
    sender: outbox.OutboxPublisher | None = None,
) -> db.Answer | None:
    """The plans' rows and the unit's history (``before``, the plans' own, ``after``, in
    that order) in one statement, sent without waiting. Its submits are queued claimed
    by ``sender`` where the publisher's claim would take them now: the answer names
    those, to hand to it once the commit is durable (read with the commit's answer)."""
    history = [*before, *(p.history for p in plans), *after]
    if not plans:
        await tx.send_many("history_insert", [h.params(db.jsonb) for h in history])
        return None
    return await tx.ask(
        "activation_insert",
        {
            "nodes": db.jsonb([p.node for p in plans]),
            "operations": db.jsonb([p.operation.params(db.jsonb) for p in plans]),
            "attempts": db.jsonb([p.attempt for p in plans]),
            "outbox": db.jsonb([{**p.outbox, "instance_id": p.instance_id} for p in plans]),
            "history": db.jsonb([h.params(db.jsonb) for h in history]),
            "holder": sender.holder if sender else None,
            "ttl": sender.claim_ttl_s if sender else 0,
            "held": sender.hold_submits if sender else True,
        },
    )


async def hand(
    queued: db.Answer | None,
    plans: Sequence[activation.Plan],
    sender: outbox.OutboxPublisher | None,
) -> None:
    """After a commit: the submits it queued claimed by ``sender`` go to it."""
    if queued is None or sender is None:
        return
    mine = {r["id"] for r in await queued.rows()}
    if mine:
        faults.crash_point("after_commit_before_send")
    await sender.hand_over([p.outbox for p in plans if p.outbox["id"] in mine])
