"""The receipt consumer: owner of the *workflow receipt application* boundary.

A batch of receipts (and query answers, through the same path) is validated and
applied in one transaction: the result, the operation's status and owner revision,
the receipt's identity (so it applies at most once), and the successor intent. The
deliveries are acked only after that commit. Anything invalid is quarantined with
its reason in the same transaction, acked, and changes nothing else.

A successor whose instance the transaction could lock at once (``FOR UPDATE SKIP
LOCKED``, after the batch's operations: it never waits for an instance while holding
them) and found running is activated in that same transaction (``workers.engine.
activate``, the committer's *workflow transition*, its intent written done), and its
submit leaves from this process's own sender right after the commit, as the
committer's do. Every other intent is written pending, for the committer's claim.
``CUSTODY_RECEIPTS_ACTIVATE=false`` leaves them all to it.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from contracts import codec
from contracts.models import OperationReceipt, QueryAnswer
from workers import errors
from workers.core import activation, lifecycle, process, records, routes, tracing, validation
from workers.core import effects as effects_
from workers.core.reasons import Reason
from workers.engine import activate, context
from workers.io import broker, db
from workers.runtime import consume, faults, logs, metrics, otel, outbox, probes, supervisor
from workers.settings import Settings

ACTOR = "receipts"
AckPolicy = "ack after commit; invalid receipts are quarantined in that commit and acked"


@dataclass
class Writes:
    """Everything one batch writes, in the order the transaction writes it."""

    quarantine: list[records.Quarantine] = field(default_factory=list)
    receipts: list[records.ReceiptRecord] = field(default_factory=list)
    updates: list[records.OperationUpdate] = field(default_factory=list)
    nodes: list[records.NodeFinish] = field(default_factory=list)
    successors: list[records.SuccessorIntent] = field(default_factory=list)
    instance: list[records.InstanceChange] = field(default_factory=list)
    history: list[records.History] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    verdicts: list[str] = field(default_factory=list)

    def add(self, effects: effects_.Effects) -> None:
        self.updates.append(effects.update)
        self.history.extend(effects.history)
        self.instance.extend(effects.instance)
        if effects.node is not None:
            self.nodes.append(effects.node)
        if effects.successor is not None:
            self.successors.append(effects.successor)


@dataclass(frozen=True)
class Reads:
    """What a batch's successors are planned from, asked in its first round trip."""

    instances: db.Answer
    results: db.Answer
    activations: db.Answer


@dataclass
class Step:
    """The successors a batch activates itself: new nodes, and instances ended."""

    plans: list[activation.Plan] = field(default_factory=list)
    finishes: list[activate.Finish] = field(default_factory=list)


class ReceiptConsumer:
    def __init__(
        self,
        settings: Settings,
        database: db.Database,
        lease: db.Lease | None,
        catalog: process.Catalog,
        table: routes.Routes | None = None,
    ) -> None:
        """``table``: the routes file, to activate successors in the receipt's own
        transaction (without it, every successor intent is left to the committer)."""
        self.settings = settings
        self.db = database
        self.lease = lease
        self.catalog = catalog
        self.activator = activate.Activator(table, catalog, ACTOR) if table is not None else None
        # this process's publisher of the submits its commits queue claimed by it
        # (None: every submit is left to the publisher worker's claim)
        self.sender: outbox.OutboxPublisher | None = None

    async def apply(self, deliveries: Sequence[broker.Delivery]) -> list[str]:
        """Validate and apply a batch in one transaction; returns each delivery's verdict.

        A unit that activated successors and failed for a reason a redo will not cure
        (a bug, a constraint, a grant missing from the deployment) is done again at once
        without activating any: the receipts apply and their intents wait for the
        committer, as they did before this worker activated them, instead of the
        receipts being dead-lettered for what their successors could not do."""
        if self.activator is None:
            return await self._apply(deliveries, activating=False)
        try:
            return await self._apply(deliveries, activating=True)
        except Exception as exc:
            if supervisor.transient(exc):  # redone as it is by the consume loop
                raise
            logs.event(
                "receipts.activation_failed",
                logging.ERROR,
                batch_size=len(deliveries),
                error=f"{type(exc).__name__}: {exc}"[:300],
                then="applied without activating: the committer activates the successors",
            )
            kind = exc.kind if isinstance(exc, errors.DatabaseError) else errors.Retry.FATAL
            metrics.UNIT_FAILURES.labels(ACTOR, kind.value).inc()
            return await self._apply(deliveries, activating=False)

    async def _apply(self, deliveries: Sequence[broker.Delivery], *, activating: bool) -> list[str]:
        w = Writes()
        decoded: list[tuple[int, broker.Delivery, OperationReceipt | QueryAnswer]] = []
        verdict_of: dict[int, str] = {}
        for i, d in enumerate(deliveries):
            try:
                message: OperationReceipt | QueryAnswer = codec.decode_receipt(
                    d.payload(), self.settings.max_message_bytes
                )
                decoded.append((i, d, message))
            except codec.DecodeError as exc:
                w.quarantine.append(_quarantine(d, Reason(exc.reason), exc.detail))
                w.verdicts.append("quarantine")
                verdict_of[i] = "quarantine"
        async with (
            otel.transaction("receipts", ACTOR) as span,
            self.db.transaction(self.lease) as tx,
        ):
            op_ids = list({m.operation_id for _, _, m in decoded})
            request_ids = list({x for _, _, m in decoded for x in (m.request_id, m.in_reply_to)})
            inner = [r for r in (_inner(m) for _, _, m in decoded) if r is not None]
            # the lock first, then what the receipts are judged by: sent together (none
            # depends on another's rows), run in this order, read in one round trip
            locked = await tx.ask("operations_lock", {"ids": op_ids})
            attempts = await tx.ask("attempts_for", {"ids": request_ids})
            receipts_seen = await tx.ask("receipts_seen", {"ids": [r.receipt_id for r in inner]})
            revisions_seen = await tx.ask(
                "revisions_seen",
                {
                    "operation_id": [r.operation_id for r in inner],
                    "attempt": [r.attempt for r in inner],
                    "owner_revision": [r.owner_revision for r in inner],
                },
            )
            # the instances a terminal receipt may move on, locked where free, with what
            # their successors are planned from (after the operations: never waiting)
            ending = list({r.operation_id for r in inner if r.status != "accepted"})
            reads = await self._instances(tx, ending) if activating and ending else None
            rows = {r.id: r for r in map(records.OperationRow.from_row, await locked.rows())}
            views = {k: r.view() for k, r in rows.items()}
            issued = {r["request_id"]: validation.IssuedRequest(**r) for r in await attempts.rows()}
            seen = {r["receipt_id"]: r["content_hash"] for r in await receipts_seen.rows()}
            revisions = {
                (r["operation_id"], r["attempt"], r["owner_revision"]): r["content_hash"]
                for r in await revisions_seen.rows()
            }
            await faults.point("receipts_locked")
            for i, d, message in decoded:
                with logs.bound(**_ids(d, message, rows)):
                    verdict_of[i] = self._one(d, message, views, rows, issued, (seen, revisions), w)
            step = await self._activate(reads, rows, w) if reads is not None else Step()
            await write(tx, w)
            # the ends with their history in one statement, not waited for: nothing of
            # this unit's is written after them but its new nodes, other instances'
            await activate.finish(tx, step.finishes, logged=True)
            queued = await activate.write_plans(tx, step.plans, sender=self.sender)
            if span.recording:
                span.set(
                    operation_id=op_ids,
                    instance_id=[r.instance_id for r in rows.values()],
                    message_id=[d.message_id for d in deliveries],
                    verdict=w.verdicts,
                )
        await activate.hand(queued, step.plans, self.sender)
        faults.crash_point("receipts_after_commit_before_ack")
        if step.plans or step.finishes:
            metrics.transitions("successor", len(step.plans) + len(step.finishes))
        context.quarantined(w.quarantine)
        for v in w.verdicts:
            metrics.RECEIPTS.labels(v).inc()
        for seconds in w.latencies:
            metrics.END_TO_END.observe(seconds)
        return [verdict_of[i] for i in range(len(deliveries))]

    async def _instances(self, tx: db.Tx, ending: list[str]) -> Reads:
        """The instances of these operations, locked where free, with the results and
        node activations their successors are planned from (sent, not yet read)."""
        return Reads(
            await tx.ask("receipt_instances_claim", {"ids": ending}),
            await tx.ask("instance_results"),
            await tx.ask("node_activations"),
        )

    async def _activate(
        self, reads: Reads, rows: dict[str, records.OperationRow], w: Writes
    ) -> Step:
        """The successors this batch can activate itself, planned, and their intents
        marked done: each one alone for its instance in the batch, whose row this
        transaction locked and found running, whose instance no other receipt of the
        batch changes, and whose pinned process version is loaded. Any other intent is
        written pending, for the committer (which suspends, suppresses, resumes or
        retries it, as it always did)."""
        assert self.activator is not None
        locked = {r["instance_id"]: r for r in await reads.instances.rows()}
        results: dict[Any, dict[str, Any]] = {}
        for r in await reads.results.rows():
            results.setdefault(r["instance_id"], {})[r["node"]] = r["result"]
        activations = {
            (r["instance_id"], r["node"]): r["activation"] for r in await reads.activations.rows()
        }
        # this batch's own results, not yet written when the reads ran
        for u in w.updates:
            row = rows.get(u.id)
            if row is not None and u.status is lifecycle.Status.SUCCEEDED:
                results.setdefault(row.instance_id, {})[row.node] = u.result
        per_instance = collections.Counter(s.instance_id for s in w.successors)
        changed = {c.instance_id for c in w.instance}
        step = Step()
        for n, intent in enumerate(w.successors):
            iid = intent.instance_id
            found = locked.get(iid)
            if (
                found is None
                or found["instance_status"] != lifecycle.InstanceStatus.RUNNING
                or per_instance[iid] > 1
                or iid in changed
            ):
                continue
            try:
                definition = self.catalog.get(found["process"], found["process_version"])
            except process.DefinitionError:
                continue  # the committer suspends the instance with the reason
            decided = self.activator.next(
                {**found, "next_node": intent.next_node},
                definition,
                results.get(iid, {}),
                activations,
            )
            if isinstance(decided, activate.Finish):
                step.finishes.append(decided)
            else:
                step.plans.append(decided)
            w.successors[n] = replace(intent, done=True)
        return step

    def _one(
        self,
        d: broker.Delivery,
        message: OperationReceipt | QueryAnswer,
        views: dict[str, validation.OperationView],
        rows: dict[str, records.OperationRow],
        issued: dict[str, validation.IssuedRequest],
        seen_maps: tuple[dict[str, str], dict[tuple[str, int, int], str]],
        w: Writes,
    ) -> str:
        """Judge one delivery (pure) and collect its writes."""
        seen, revisions = seen_maps
        row = rows.get(message.operation_id)
        op = views.get(message.operation_id)
        j = validation.judge(
            message,
            user_id=d.user_id,
            op=op,
            issued=issued,
            seen=seen,
            revisions=revisions,
            node=self._pinned(row),
            cancelling=row is not None
            and validation.settling(row.status, row.instance_status)
            and not faults.broken("skip_instance_recheck"),  # chaos self-test only
        )
        w.verdicts.extend(j.labels)
        if j.refused is not None:
            if j.definition_missing:
                _alert_definition_missing(row, j.refused.detail)
            w.quarantine.append(
                _quarantine(
                    d,
                    Reason(j.refused.reason),
                    j.refused.detail,
                    j.about,
                    instance_id=d.ids.get("instance_id"),
                )
            )
            return j.result
        assert op is not None and row is not None
        receipt, decision = j.receipt, j.decision
        if j.record and receipt is not None and decision is not None:
            key = (receipt.operation_id, receipt.attempt, receipt.owner_revision)
            seen[receipt.receipt_id] = decision.content_hash
            revisions[key] = decision.content_hash
            w.receipts.append(
                records.ReceiptRecord(
                    receipt_id=receipt.receipt_id,
                    operation_id=receipt.operation_id,
                    attempt=receipt.attempt,
                    owner_revision=receipt.owner_revision,
                    status=receipt.status,
                    content_hash=decision.content_hash,
                    decision=decision.verdict.value,
                )
            )
        if j.no_news is not None:
            news = effects_.of_no_news(row, op, j.no_news, j.fact, actor=ACTOR)
            views[op.id] = news.view
            w.add(news)
        elif j.applies and receipt is not None:
            if faults.broken("accepted_as_success") and decision is not None:
                j = _accepted_as_success(j, decision)  # chaos self-test only
            done = effects_.of_receipt(
                row,
                op,
                receipt,
                j,
                actor=ACTOR,
                recheck_instance=not faults.broken("skip_instance_recheck"),
            )
            views[op.id] = done.view
            w.add(done)
            if done.terminal:
                w.latencies.append((datetime.now(UTC) - row.created_at).total_seconds())
        return j.result

    def _pinned(self, row: records.OperationRow | None) -> validation.PinnedNode | None:
        """The operation's pinned node, as loaded (or why its version is not)."""
        if row is None:
            return None
        try:
            return validation.PinnedNode(row.node, self.catalog.get(*row.process))
        except process.DefinitionError as exc:
            return validation.PinnedNode(row.node, None, str(exc))


async def write(tx: db.Tx, w: Writes) -> None:
    """The batch's writes, in one transaction, in an order that each depends on."""
    await tx.send_many("quarantine_insert", [q.params(db.jsonb) for q in w.quarantine])
    if w.successors:
        faults.crash_point("receipts_between_result_and_successor")
    if w.receipts or w.updates or w.nodes or w.successors:
        # one call: an operation changed under its row lock fails it (CU004), and with
        # it the unit, which is redone: nothing here waits for its row count
        await tx.send(
            "receipt_writes",
            {
                "receipts": db.jsonb([r.params() for r in w.receipts]),
                "updates": db.jsonb([u.params(db.jsonb) for u in records.fold_updates(w.updates)]),
                "nodes": db.jsonb([n.params() for n in w.nodes]),
                "successors": db.jsonb([s.params() for s in w.successors]),
            },
        )
    for event, query in records.INSTANCE_QUERIES.items():
        changes = [c for c in w.instance if c.event is event]
        await tx.send_many(query, [c.params() for c in changes if c.history is None])
        for c in changes:
            if c.history is not None and await tx.run(query, c.params()):
                await tx.send("history_insert", c.history.params(db.jsonb))
    await tx.send_many("history_insert", [h.params(db.jsonb) for h in w.history])


def _alert_definition_missing(row: records.OperationRow | None, error: str) -> None:
    """A validated receipt whose pinned process version is not loaded: an alert (the
    receipt is kept in quarantine; see ``validation.judge``)."""
    assert row is not None
    metrics.ACTIVATION_FAILURES.labels(Reason.DEFINITION_MISSING).inc()
    logs.event(
        "instance.definition_missing",
        logging.ERROR,
        instance_id=str(row.instance_id),
        operation_id=row.id,
        error=error[:300],
    )


def _inner(message: OperationReceipt | QueryAnswer) -> OperationReceipt | None:
    return message.receipt if isinstance(message, QueryAnswer) else message


def _ids(
    d: broker.Delivery,
    message: OperationReceipt | QueryAnswer,
    rows: dict[str, records.OperationRow],
) -> dict[str, str | None]:
    """The ids of one receipt's judgement, bound while it is judged and kept on the
    delivery for the consumer's lines after the commit."""
    row = rows.get(message.operation_id)
    d.ids["operation_id"] = message.operation_id
    if row is not None:
        d.ids["instance_id"] = str(row.instance_id)
    return {
        "message_id": d.message_id,
        "trace_id": tracing.trace_id_of(d.headers),
        **d.ids,
    }


def _quarantine(
    d: broker.Delivery,
    reason: Reason,
    detail: str,
    message: OperationReceipt | QueryAnswer | None = None,
    instance_id: str | None = None,
) -> records.Quarantine:
    return context.quarantine(
        d,
        source=broker.QUEUE_RECEIPTS,
        worker=ACTOR,
        reason=reason,
        detail=detail,
        tenant=message.tenant if message else None,
        operation_id=message.operation_id if message else None,
        instance_id=instance_id,
    )


async def main(settings: Settings, stop: supervisor.Stop, health: probes.Health) -> None:
    async with context.running(settings, ACTOR, health) as ctx:
        receipt_consumer = ReceiptConsumer(
            settings,
            ctx.db,
            ctx.lease,
            ctx.catalog,
            ctx.routes if settings.receipts_activate else None,
        )
        # the submits of the successors it activates leave from here, right after their
        # commit; the publisher worker claims what they leave behind (claims expired)
        receipt_consumer.sender = await ctx.engine_outbox()

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

        try:
            await supervisor.supervise(
                main=[receipts_in(), ctx.sending(receipt_consumer.sender, stop)],
                side=[ctx.heartbeat()],
            )
        finally:
            # a batch that was committing when the stop came hands its submits over after
            # the sender's loop may have ended: their claims are given back here
            await receipt_consumer.sender.release_handed()


def _accepted_as_success(
    j: validation.Judgement, decision: validation.Decision
) -> validation.Judgement:
    """The chaos checker's deliberately broken build: an acceptance read as a success."""
    if decision.status is not lifecycle.Status.ACCEPTED:
        return j
    wrong = replace(decision, status=lifecycle.Status.SUCCEEDED, effect=lifecycle.Effect.APPLIED)
    return replace(j, decision=wrong)
