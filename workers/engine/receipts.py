"""The receipt consumer: owner of the *workflow receipt application* boundary.

A batch of receipts (and query answers, through the same path) is validated and
applied in one transaction: the result, the operation's status and owner revision,
the receipt's identity (so it applies at most once), and the successor intent. The
deliveries are acked only after that commit. Anything invalid is quarantined with
its reason in the same transaction, acked, and changes nothing else.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from contracts import codec
from contracts.models import OperationReceipt, QueryAnswer
from workers.core import lifecycle, process, validation
from workers.engine import context
from workers.io import broker, db
from workers.runtime import consume, faults, logs, metrics, probes, supervisor
from workers.settings import Settings

ACTOR = "receipts"
AckPolicy = "ack after commit; invalid receipts are quarantined in that commit and acked"


@dataclass
class _Writes:
    quarantine: list[dict[str, Any]]
    records: list[dict[str, Any]]
    updates: list[dict[str, Any]]
    history: list[dict[str, Any]]
    nodes: list[dict[str, Any]]
    successors: list[dict[str, Any]]
    suspend: list[dict[str, Any]]
    unsuspend: list[dict[str, Any]]
    settle: list[dict[str, Any]]
    cancelling: list[dict[str, Any]]
    latencies: list[float]
    verdicts: list[str]


def _view(row: dict[str, Any]) -> validation.OperationView:
    return validation.OperationView(
        id=str(row["id"]),
        tenant=row["tenant"],
        owner=row["owner"],
        principal=row["principal"],
        attempt=row["attempt"],
        status=lifecycle.Status(row["status"]),
        effect=lifecycle.Effect(row["effect"]),
        owner_revision=row["owner_revision"],
        receipt_hash=row["receipt_hash"],
    )


class ReceiptConsumer:
    def __init__(
        self,
        settings: Settings,
        database: db.Database,
        lease: db.Lease | None,
        catalog: process.Catalog,
    ) -> None:
        self.settings = settings
        self.db = database
        self.lease = lease
        self.catalog = catalog

    async def apply(self, deliveries: Sequence[broker.Delivery]) -> list[str]:
        """Validate and apply a batch in one transaction; returns each delivery's verdict."""
        w = _Writes([], [], [], [], [], [], [], [], [], [], [], [])
        decoded: list[tuple[int, broker.Delivery, OperationReceipt | QueryAnswer]] = []
        verdict_of: dict[int, str] = {}
        for i, d in enumerate(deliveries):
            try:
                decoded.append(
                    (i, d, codec.decode_receipt(d.payload(), self.settings.max_message_bytes))
                )
            except codec.DecodeError as exc:
                w.quarantine.append(_quarantine(d, exc.reason, exc.detail))
                w.verdicts.append("quarantine")
                verdict_of[i] = "quarantine"
        async with self.db.transaction(self.lease) as tx:
            op_ids = list({m.operation_id for _, _, m in decoded})
            rows = {str(r["id"]): r for r in await tx.rows("operations_lock", {"ids": op_ids})}
            views = {k: _view(r) for k, r in rows.items()}
            request_ids = list({x for _, _, m in decoded for x in (m.request_id, m.in_reply_to)})
            issued = {
                r["request_id"]: validation.IssuedRequest(**r)
                for r in await tx.rows("attempts_for", {"ids": request_ids})
            }
            receipt_ids = [
                r.receipt_id for r in (_inner(m) for _, _, m in decoded) if r is not None
            ]
            seen = {
                r["receipt_id"]: r["content_hash"]
                for r in await tx.rows("receipts_seen", {"ids": receipt_ids})
            }
            inner = [r for r in (_inner(m) for _, _, m in decoded) if r is not None]
            revisions = {
                (r["operation_id"], r["attempt"], r["owner_revision"]): r["content_hash"]
                for r in await tx.rows(
                    "revisions_seen",
                    {
                        "operation_id": [r.operation_id for r in inner],
                        "attempt": [r.attempt for r in inner],
                        "owner_revision": [r.owner_revision for r in inner],
                    },
                )
            }
            await faults.point("receipts_locked")
            for i, d, message in decoded:
                verdict_of[i] = self._one(d, message, views, rows, issued, (seen, revisions), w)
            await tx.run_many("quarantine_insert", w.quarantine)
            await tx.run_many("receipt_record", w.records)
            changed = await tx.run_many("operation_apply", w.updates)
            if changed != len(w.updates):
                raise RuntimeError("an operation changed under its row lock")
            if w.successors:
                faults.crash_point("receipts_between_result_and_successor")
            await tx.run_many("node_finish", w.nodes)
            await tx.run_many("successor_insert", w.successors)
            await tx.run_many("instance_suspend", w.suspend)
            await tx.run_many("instance_unsuspend", w.unsuspend)
            for cancelling in w.cancelling:
                if await tx.run("instance_set_cancelling", cancelling):
                    await tx.run(
                        "history_insert",
                        _instance_event(
                            cancelling["id"],
                            "instance.cancelling",
                            {"cause": "the owner cancelled an operation"},
                        ),
                    )
            for settle in w.settle:
                if await tx.run("instance_settle_cancel", settle):
                    await tx.run(
                        "history_insert", _instance_event(settle["id"], "instance.cancelled", {})
                    )
            await tx.run_many("history_insert", w.history)
        faults.crash_point("receipts_after_commit_before_ack")
        for row in w.quarantine:
            metrics.quarantined(row["source"], row["reason"])
        for v in w.verdicts:
            metrics.RECEIPTS.labels(v).inc()
        for seconds in w.latencies:
            metrics.END_TO_END.observe(seconds)
        return [verdict_of[i] for i in range(len(deliveries))]

    def _one(
        self,
        d: broker.Delivery,
        message: OperationReceipt | QueryAnswer,
        views: dict[str, validation.OperationView],
        rows: dict[str, dict[str, Any]],
        issued: dict[str, validation.IssuedRequest],
        seen_maps: tuple[dict[str, str], dict[tuple[str, int, int], str]],
        w: _Writes,
    ) -> str:
        seen, revisions = seen_maps
        op = views.get(message.operation_id)
        answer: QueryAnswer | None = None
        if isinstance(message, QueryAnswer):
            refusal = _answer_refusal(message, d.user_id, op, issued)
            if refusal:
                w.quarantine.append(_quarantine(d, refusal[0], refusal[1], message))
                w.verdicts.append("quarantine")
                return "quarantine"
            assert op is not None
            answer = message
            if message.receipt is None:
                return self._no_news(op, rows[op.id], w, "query answered: no receipt")
            receipt = message.receipt
        else:
            receipt = message
        row = rows.get(receipt.operation_id)
        revision_key = (receipt.operation_id, receipt.attempt, receipt.owner_revision)

        def decide(retryable: bool) -> validation.Decision:
            return validation.decide(
                receipt,
                user_id=d.user_id,
                op=op,
                issued=issued,
                seen_hash=seen.get(receipt.receipt_id),
                retryable=retryable,
                seen_revision_hash=revisions.get(revision_key),
                answer=answer is not None,
            )

        # the node's definition is consulted only for a receipt that passed every trust
        # check, and only where it decides something: a retry, or a successor
        settling = row is not None and (
            row["status"] == lifecycle.Status.CANCELLING or row["instance_status"] == "cancelling"
        )
        decision = decide(False)
        if (
            decision.verdict is validation.Verdict.APPLY
            and receipt.status == "failed"
            and receipt.effect == "none"
        ):
            try:
                if self._retryable(row, receipt):
                    decision = decide(True)
            except process.DefinitionError as exc:
                if not settling:
                    return self._definition_missing(d, receipt, row, str(exc), w)
        w.verdicts.append(decision.verdict.value)
        if decision.verdict is validation.Verdict.QUARANTINE:
            w.quarantine.append(_quarantine(d, decision.reason, decision.detail, receipt))
            return "quarantine"
        assert op is not None
        if decision.verdict is validation.Verdict.DUPLICATE:
            if answer is not None:
                return self._no_news(op, rows[op.id], w, "query answered: nothing newer")
            return "duplicate"
        diverted = (
            answer is not None
            and decision.verdict is validation.Verdict.APPLY
            and decision.status
            not in lifecycle.TERMINAL
            | {lifecycle.Status.RETRY_WAITING, lifecycle.Status.OUTCOME_UNKNOWN}
        )
        if diverted:
            # the owner holds it but has not settled it: still no authoritative outcome.
            # Not recorded: the receipt itself, delivered directly, still applies once.
            return self._no_news(op, rows[op.id], w, f"query answered: {receipt.status}")
        if (
            decision.verdict is validation.Verdict.APPLY
            and decision.status in lifecycle.TERMINAL
            and not settling
        ):
            try:
                self._successor(rows[op.id], decision.status)  # the definition is needed
            except process.DefinitionError as exc:
                return self._definition_missing(d, receipt, rows[op.id], str(exc), w)
        seen[receipt.receipt_id] = decision.content_hash
        revisions[revision_key] = decision.content_hash
        w.records.append(
            {
                "receipt_id": receipt.receipt_id,
                "operation_id": receipt.operation_id,
                "attempt": receipt.attempt,
                "owner_revision": receipt.owner_revision,
                "status": receipt.status,
                "content_hash": decision.content_hash,
                "decision": decision.verdict.value,
            }
        )
        if decision.verdict is not validation.Verdict.APPLY:
            if answer is not None:
                return self._no_news(op, rows[op.id], w, f"query answered: {decision.verdict}")
            return decision.verdict.value
        self._apply(op, rows[op.id], receipt, decision, views, w)
        return "apply"

    def _apply(
        self,
        op: validation.OperationView,
        row: dict[str, Any],
        receipt: OperationReceipt,
        decision: validation.Decision,
        views: dict[str, validation.OperationView],
        w: _Writes,
    ) -> None:
        assert decision.status is not None and decision.effect is not None
        terminal = decision.status in lifecycle.TERMINAL
        retry_at = None
        if decision.status is lifecycle.Status.RETRY_WAITING:
            node = self._node(row)
            assert node.retry is not None
            retry_at = node.retry.delay(op.attempt)
        w.updates.append(
            {
                "id": op.id,
                "expected": op.status.value,
                "status": decision.status.value,
                "effect": decision.effect.value,
                "owner_revision": receipt.owner_revision,
                "receipt_hash": decision.content_hash,
                "result": db.jsonb(receipt.result) if receipt.result is not None else None,
                "error": db.jsonb(receipt.error.model_dump()) if receipt.error else None,
                "terminal": terminal,
                "retry_in": retry_at,
            }
        )
        views[op.id] = replace(
            op,
            status=decision.status,
            effect=decision.effect,
            owner_revision=receipt.owner_revision,
            receipt_hash=decision.content_hash,
        )
        w.history.append(
            {
                "instance_id": row["instance_id"],
                "operation_id": op.id,
                "event": f"operation.{decision.status.value}",
                "detail": db.jsonb(
                    {
                        "from": op.status.value,
                        "owner_revision": receipt.owner_revision,
                        "effect": decision.effect.value,
                        "receipt_id": receipt.receipt_id,
                        "attempt": receipt.attempt,
                    }
                ),
                "actor": ACTOR,
            }
        )
        if decision.status is lifecycle.Status.OUTCOME_UNKNOWN:
            w.suspend.append({"id": row["instance_id"]})
        elif op.status in _UNKNOWN:
            w.unsuspend.append({"id": row["instance_id"]})
        if terminal:
            w.latencies.append((datetime.now(UTC) - row["created_at"]).total_seconds())
            w.nodes.append({"operation_id": op.id, "status": decision.status.value})
            if decision.status is lifecycle.Status.CANCELLED and op.status is not (
                lifecycle.Status.CANCELLING
            ):
                # the owner settled the work as cancelled under a cancel this engine does
                # not hold (it predates it): the instance was being cancelled
                w.cancelling.append({"id": row["instance_id"]})
            if (
                op.status is lifecycle.Status.CANCELLING
                or decision.status is lifecycle.Status.CANCELLED
                or row["instance_status"] == "cancelling"
            ):
                # a success that wins the race stays succeeded, but the cancelled
                # instance gets no successors; it settles once all its work has
                w.settle.append({"id": row["instance_id"]})
                return
            nxt = self._successor(row, decision.status)
            if nxt is not None:
                w.successors.append(
                    {
                        "instance_id": row["instance_id"],
                        "from_operation_id": op.id,
                        "outcome": decision.status.value,
                        "next_node": nxt,
                    }
                )

    def _node(self, row: dict[str, Any]) -> process.Node:
        lineage = row["lineage"]
        definition = self.catalog.get(lineage["process"], lineage["process_version"])
        return definition.node(row["node"])

    def _retryable(self, row: dict[str, Any] | None, receipt: OperationReceipt) -> bool:
        if row is None or receipt.status != "failed" or receipt.effect != "none":
            return False
        policy = self._node(row).retry
        code = receipt.error.code if receipt.error else None
        return policy is not None and policy.allows(receipt.attempt, code)

    def _successor(self, row: dict[str, Any], status: lifecycle.Status) -> str | None:
        if status is lifecycle.Status.CANCELLED:
            return None
        lineage = row["lineage"]
        definition = self.catalog.get(lineage["process"], lineage["process_version"])
        return definition.successor(row["node"], status.value)

    def _definition_missing(
        self,
        d: broker.Delivery,
        receipt: OperationReceipt,
        row: dict[str, Any] | None,
        error: str,
        w: _Writes,
    ) -> str:
        """The operation's pinned process version is not loaded, so what follows this
        (validated) receipt cannot be decided. Not a poison message and not a crash: the
        receipt is kept in quarantine with the reason and an alert is raised; the
        operation is left as it is, so its deadline runs out as usual (outcome_unknown,
        its instance suspended) and reconcile asks the owner again — whose journal keeps
        the receipt — once the version is deployed again."""
        assert row is not None
        metrics.ACTIVATION_FAILURES.labels("definition_missing").inc()
        logs.event(
            "instance.definition_missing",
            logging.ERROR,
            instance_id=str(row["instance_id"]),
            operation_id=str(row["id"]),
            error=error[:300],
        )
        w.quarantine.append(_quarantine(d, "definition_missing", error, receipt))
        w.verdicts.append("quarantine")
        return "quarantine"

    def _no_news(
        self, op: validation.OperationView, row: dict[str, Any], w: _Writes, fact: str
    ) -> str:
        """A query found no authoritative outcome. That proves nothing about the
        effect: the operation goes back to outcome_unknown, and the fact is recorded."""
        w.verdicts.append("no_news")
        try:
            target = lifecycle.next_status(op.status, lifecycle.Event.QUERY_NONE)
        except lifecycle.IllegalTransition:
            return "ignored"
        if target is lifecycle.IGNORE:
            return "ignored"
        w.updates.append(
            {
                "id": op.id,
                "expected": op.status.value,
                "status": target.value,
                "effect": op.effect.value,
                "owner_revision": op.owner_revision,
                "receipt_hash": op.receipt_hash,
                "result": None,
                "error": None,
                "terminal": False,
                "retry_in": None,
            }
        )
        w.history.append(
            {
                "instance_id": row["instance_id"],
                "operation_id": op.id,
                "event": f"operation.{target.value}",
                "detail": db.jsonb({"from": op.status.value, "fact": fact}),
                "actor": ACTOR,
            }
        )
        return "apply"


_UNKNOWN = frozenset({lifecycle.Status.OUTCOME_UNKNOWN, lifecycle.Status.RECONCILE_PENDING})


def _instance_event(instance_id: Any, event: str, detail: dict[str, Any]) -> dict[str, Any]:
    return {
        "instance_id": instance_id,
        "operation_id": None,
        "event": event,
        "detail": db.jsonb(detail),
        "actor": ACTOR,
    }


def _inner(message: OperationReceipt | QueryAnswer) -> OperationReceipt | None:
    return message.receipt if isinstance(message, QueryAnswer) else message


def _answer_refusal(
    answer: QueryAnswer,
    user_id: str | None,
    op: validation.OperationView | None,
    issued: dict[str, validation.IssuedRequest],
) -> tuple[str, str] | None:
    if op is not None and op.tenant != answer.tenant:
        return "wrong_tenant", "answer tenant is not the operation's"
    if not user_id or user_id != answer.principal:
        return "principal_mismatch", f"delivered by {user_id!r}, claims {answer.principal!r}"
    if op is None:
        return "unknown_operation", f"no operation {answer.operation_id}"
    if (answer.owner, answer.principal) != (op.owner, op.principal):
        return "wrong_owner", "answer is not from the pinned owner"
    query = issued.get(answer.in_reply_to)
    if query is None or query.kind != "query" or query.operation_id != op.id:
        return "unknown_request", "in_reply_to is not a query issued for this operation"
    if answer.receipt is not None and answer.receipt.operation_id != answer.operation_id:
        return "schema", "the answer's receipt is about another operation"
    return None


def _quarantine(
    d: broker.Delivery,
    reason: str,
    detail: str,
    message: OperationReceipt | QueryAnswer | None = None,
) -> dict[str, Any]:
    return {
        "source": broker.QUEUE_RECEIPTS,
        "reason": reason,
        "detail": detail[:2000],
        "message_id": d.message_id,
        "user_id": d.user_id,
        "tenant": message.tenant if message else None,
        "operation_id": message.operation_id if message else None,
        "body": d.body,
        "headers": db.jsonb(broker.safe_headers(d.headers)),
        "worker": ACTOR,
    }


async def main(settings: Settings, stop: supervisor.Stop, health: probes.Health) -> None:
    async with context.running(settings, ACTOR, health) as ctx:
        receipt_consumer = ReceiptConsumer(settings, ctx.db, ctx.lease, ctx.catalog)

        async def receipts_in() -> None:
            await consume.run(
                ctx.broker,
                [broker.QUEUE_RECEIPTS],
                settings=settings,
                stop=stop,
                worker=ACTOR,
                handle=receipt_consumer.apply,
                on_fenced=ctx.reacquire,
            )

        await supervisor.supervise(main=[receipts_in()], side=[ctx.heartbeat()])
