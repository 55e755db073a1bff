"""The transition committer: owner of the *workflow transition* boundary.

It commits, in one transaction, node state, history, the operation and its attempt,
and the outbox row that is the dispatch intent. Inputs: start requests (AMQP, acked
after commit) and the successor intents the receipt consumer wrote pending (claimed
with ``FOR UPDATE SKIP LOCKED``, woken by NOTIFY with a polling fallback): those it did
not activate in the receipt's own transaction (an instance someone else held, not
running, changed by the same batch, or whose version it does not hold;
``workers.engine.receipts``).

Its submits leave from this process: the commit queues each one already claimed by the
process's own outbox publisher (``workers.runtime.outbox``, the *broker confirmation*
boundary, in its own transactions), which publishes it right after the commit and marks
it once confirmed; no NOTIFY, wake-up or claim transaction stands between a transition
and its dispatch. A submit its sender does not mark is the publisher worker's: once its
claim expires (the process died, or was paused, or its sender left it after half the
claim's life), or at once with a backoff (the broker nacked or returned it: released,
as the publisher releases its own), as is every command the committer does not queue
claimed (retries, queries, cancels, a submit held by a pause).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from contracts import codec, identity
from contracts.models import CancelRequest, StartRequest
from workers.core import activation, lifecycle, process, records, routes, tracing
from workers.core.reasons import Reason
from workers.engine import activate, context, transitions
from workers.io import broker, db
from workers.runtime import consume, faults, logs, metrics, otel, outbox, probes, supervisor
from workers.settings import Settings

ACTOR = "committer"
AckPolicy = "ack after commit; malformed starts are quarantined and acked"
DEFINITION_MISSING = Reason.DEFINITION_MISSING.value  # instances.suspended_reason
IE, IS = lifecycle.InstanceEvent, lifecycle.InstanceStatus


class Committer:
    def __init__(
        self,
        settings: Settings,
        database: db.Database,
        lease: db.Lease,
        table: routes.Routes,
        catalog: process.Catalog,
    ) -> None:
        self.operators = transitions.Operator(database, lease)
        self.settings = settings
        self.db = database
        self.lease = lease
        self.routes = table
        self.catalog = catalog
        self.activator = activate.Activator(table, catalog, ACTOR)
        # this process's publisher of the submits its commits queue claimed by it
        # (None: every submit is left to the publisher worker's claim)
        self.sender: outbox.OutboxPublisher | None = None

    async def commit_requests(self, deliveries: Sequence[broker.Delivery]) -> None:
        """Start and cancel requests, in queue order: each run of starts in one
        transaction, each cancel through the operator path (authorized as the
        delivery's broker-validated user, audited)."""
        run: list[tuple[broker.Delivery, StartRequest]] = []
        quarantine: list[records.Quarantine] = []
        for d in deliveries:
            try:
                message: StartRequest | CancelRequest = codec.decode_request(
                    d.payload(), self.settings.max_message_bytes
                )
            except codec.DecodeError as exc:
                quarantine.append(_quarantine_row(d, Reason(exc.reason), exc.detail))
                d.ids["outcome"] = "quarantine"
                continue
            if isinstance(message, StartRequest):
                run.append((d, message))
                continue
            await self.commit_starts(run, quarantine)
            run, quarantine = [], []
            await self.cancel(d, message)
        await self.commit_starts(run, quarantine)

    async def cancel(self, d: broker.Delivery, request: CancelRequest) -> None:
        actor = d.user_id or "(no broker user id)"
        if d.user_id != request.requested_by:
            actor = f"{actor} claiming {request.requested_by}"
        outcome = await self.operators.cancel_start(
            actor, request.tenant, request.start_request_id, request.reason
        )
        d.ids["outcome"] = f"cancel_{outcome.result.value}"
        logs.event(
            "request.cancel",
            tenant=request.tenant,
            actor=actor,
            start_request_id=request.start_request_id,
            result=outcome.result.value,
            message=outcome.message,
        )

    async def commit_starts(
        self,
        valid: Sequence[tuple[broker.Delivery, StartRequest]],
        quarantine: list[records.Quarantine],
    ) -> None:
        """One transaction for a run of start requests; the caller acks after it."""
        if not valid and not quarantine:
            return
        async with (
            otel.transaction("starts", ACTOR) as span,
            self.db.transaction(self.lease) as tx,
        ):
            keys = {
                "tenant": [s.tenant for _, s in valid],
                "start_request_id": [s.start_request_id for _, s in valid],
            }
            # the locks, then what the starts are judged by under them: sent together
            # (run in this order, answered in one round trip); the instances of every
            # start, tombstoned or not, which the tombstones' answer need not wait for,
            # and the archived ones
            await tx.send("start_locks", keys)
            tombstones = await tx.ask("start_tombstones_for", keys)
            ids_of = {
                (s.tenant, s.start_request_id): identity.instance_id(s.tenant, s.start_request_id)
                for _, s in valid
            }
            instances_of = await tx.ask("instances_get", {"ids": list(ids_of.values())})
            archived_of = await tx.ask("start_archived_for", keys)
            tombstoned = {(r["tenant"], r["start_request_id"]) for r in await tombstones.rows()}
            late = [(d, s) for d, s in valid if (s.tenant, s.start_request_id) in tombstoned]
            for d, s in late:
                await tx.send(
                    "start_tombstone_late",
                    {"tenant": s.tenant, "start_request_id": s.start_request_id},
                )
                d.ids["outcome"] = "cancelled_before_start"
                logs.event(
                    "start.cancelled_before_start",
                    message_id=d.message_id,
                    trace_id=tracing.trace_id_of(d.headers),
                    tenant=s.tenant,
                    start_request_id=s.start_request_id,
                )
            if valid:
                await faults.point("starts_locked")
            valid = [(d, s) for d, s in valid if (s.tenant, s.start_request_id) not in tombstoned]
            ids = [ids_of[(s.tenant, s.start_request_id)] for _, s in valid]
            existing = {r["id"]: r for r in await instances_of.rows()}
            archived = {(r["tenant"], r["start_request_id"]) for r in await archived_of.rows()}
            instances: list[dict[str, Any]] = []
            plans: list[activation.Plan] = []
            seen: set[str] = set()
            for (d, start), iid in zip(valid, ids, strict=True):
                d.ids["instance_id"] = iid
                old = existing.get(iid)
                if (
                    old is not None
                    or iid in seen
                    or (start.tenant, start.start_request_id) in archived
                ):
                    conflict = activation.start_conflict(old["input"], start) if old else None
                    if conflict is not None:
                        quarantine.append(
                            _quarantine_row(d, conflict.reason, conflict.detail, start.tenant, iid)
                        )
                    d.ids["outcome"] = "duplicate" if conflict is None else "quarantine"
                    continue
                # tracing on: the delivery's consume span, so that the instance's
                # successors continue a span that was exported
                traceparent = otel.delivery_context(d) or tracing.from_headers(d.headers)
                decided = activation.plan_start(
                    start,
                    instance_id=iid,
                    catalog=self.catalog,
                    table=self.routes,
                    traceparent=traceparent,
                    actor=ACTOR,
                )
                if isinstance(decided, activation.StartRefused):
                    if decided.reason is Reason.ACTIVATION_FAILED:
                        metrics.ACTIVATION_FAILURES.labels(decided.reason).inc()
                    quarantine.append(
                        _quarantine_row(d, decided.reason, decided.detail, start.tenant, iid)
                    )
                    d.ids["outcome"] = "quarantine"
                    continue
                definition, pinned = decided.definition, decided.pinned
                seen.add(iid)
                instances.append(
                    {
                        "id": iid,
                        "tenant": start.tenant,
                        "start_request_id": start.start_request_id,
                        "process": definition.name,
                        "process_version": definition.version,
                        "input": start.input,
                        "requested_by": start.requested_by,
                        "traceparent": traceparent,
                        "routes": {k: v.model_dump(mode="json") for k, v in pinned.items()},
                    }
                )
                plans.append(decided.plan)
                d.ids.update(operation_id=decided.plan.operation.id, outcome="started")
            # every one new (under its lock), or the statement fails and the unit is
            # redone: not waited for, it leaves with the writes and the COMMIT
            await tx.send_many("instance_insert", instances)
            started = [
                _history(
                    i["id"], "instance.started", process=i["process"], version=i["process_version"]
                )
                for i in instances
            ]
            queued = await activate.write_plans(tx, plans, before=started, sender=self.sender)
            await tx.send_many("quarantine_insert", [q.params(db.jsonb) for q in quarantine])
            if span.recording:
                _traced(span, plans, [d.message_id for d, _ in valid])
            faults.crash_point("before_commit")
        await activate.hand(queued, plans, self.sender)
        metrics.transitions("start", len(plans))
        context.quarantined(quarantine)

    async def commit_successors(self) -> int:
        """Claim a batch of successor intents and commit their transitions.

        Each intent's instance is locked with it, so the status it is judged by is the
        one its new work commits under. One instance that cannot be activated (its
        pinned version is not loaded, its data or definition does not fit the
        contracts) is suspended or failed with the reason; the others go on."""
        async with (
            otel.claimed("successors", ACTOR) as span,
            self.db.transaction(self.lease) as tx,
        ):
            # the claim and the two reads of the instances it locked (their ids kept in
            # the transaction: custody.claimed_instances) leave and are answered together,
            # each read under a snapshot taken after the claim's locks
            claimed = await tx.ask("successor_claim", {"limit": self.settings.batch_size})
            finished = await tx.ask("instance_results")
            activated = await tx.ask("node_activations")
            intents = await claimed.rows()
            if not intents:
                return 0
            await faults.point("successor_claimed")
            results: dict[Any, dict[str, Any]] = {}
            for r in await finished.rows():
                results.setdefault(r["instance_id"], {})[r["node"]] = r["result"]
            activations = {
                (r["instance_id"], r["node"]): r["activation"] for r in await activated.rows()
            }
            plans: list[activation.Plan] = []
            history: list[records.History] = []
            done: list[Any] = []
            finishes: list[activate.Finish] = []
            for intent in intents:
                iid = intent["instance_id"]
                status = intent["instance_status"]
                try:
                    definition = self.catalog.get(intent["process"], intent["process_version"])
                except process.DefinitionError as exc:
                    await self._definition_missing(tx, intent, str(exc), history)
                    continue  # the intent stays pending, tried again later
                done.append(intent["id"])
                if status == IS.SUSPENDED:  # only a definition_missing one is claimed
                    status = lifecycle.next_instance_status(status, IE.RESUME)
                    await tx.send("instance_resume_from", {"id": iid, "reason": DEFINITION_MISSING})
                    history.append(_history(iid, "instance.resumed", cause="definition loaded"))
                if status != IS.RUNNING and not faults.broken("skip_instance_recheck"):
                    history.append(_history(iid, "successor.suppressed", instance_status=status))
                    continue
                decided = self.activator.next(intent, definition, results.get(iid, {}), activations)
                if isinstance(decided, activate.Finish):
                    finishes.append(decided)
                else:
                    plans.append(decided)
            # the batch's ends in one guarded UPDATE (WHERE status = 'running'): the
            # history of an end only for an instance it did end
            history.extend(await activate.finish(tx, finishes))
            queued = await activate.write_plans(tx, plans, after=history, sender=self.sender)
            await tx.send("successor_done", {"ids": done})
            if isinstance(span, otel.Claimed):
                span.parent(intents[0]["traceparent"])
                _traced(span, plans, [])
        await activate.hand(queued, plans, self.sender)
        metrics.transitions("successor", len(done))
        return len(intents)

    async def _definition_missing(
        self, tx: db.Tx, intent: dict[str, Any], error: str, history: list[records.History]
    ) -> None:
        """The instance's pinned process version is not loaded: an alert and a
        suspended instance (never a redirect to another version, never a crash). The
        intent waits; once a deployment loads the version again, it goes on."""
        iid = intent["instance_id"]
        metrics.ACTIVATION_FAILURES.labels(DEFINITION_MISSING).inc()
        logs.event(
            "instance.definition_missing",
            logging.ERROR,
            instance_id=str(iid),
            process=intent["process"],
            version=intent["process_version"],
            error=error[:300],
        )
        await tx.send(
            "successor_defer", {"id": intent["id"], "delay": self.settings.definition_retry_s}
        )
        if await tx.run("instance_suspend_for", {"id": iid, "reason": DEFINITION_MISSING}):
            history.append(
                _history(
                    iid,
                    f"instance.{lifecycle.instance_target(IE.SUSPEND).value}",
                    reason=DEFINITION_MISSING,
                    process=intent["process"],
                    version=intent["process_version"],
                )
            )


def _traced(span: otel.Traced, plans: Sequence[activation.Plan], ids: Any) -> None:
    span.set(
        operation_id=[p.operation.id for p in plans],
        instance_id=[p.instance_id for p in plans],
        message_id=ids,
    )


def _history(instance_id: Any, event: str, **detail: Any) -> records.History:
    return records.History(instance_id=instance_id, event=event, actor=ACTOR, detail=detail)


def _quarantine_row(
    d: broker.Delivery,
    reason: Reason,
    detail: str,
    tenant: str | None = None,
    instance_id: str | None = None,
) -> records.Quarantine:
    return context.quarantine(
        d,
        source=broker.QUEUE_REQUESTS,
        worker=ACTOR,
        reason=reason,
        detail=detail,
        tenant=tenant,
        instance_id=instance_id,
    )


async def main(settings: Settings, stop: supervisor.Stop, health: probes.Health) -> None:
    async with context.running(settings, ACTOR, health) as ctx:
        committer = Committer(settings, ctx.db, ctx.lease, ctx.routes, ctx.catalog)
        waker = supervisor.Waker(settings.poll_interval_s)
        # the submits it commits leave from here, right after their commit; the
        # publisher worker claims what they leave behind (their claims expired)
        committer.sender = await ctx.engine_outbox()

        async def starts() -> None:
            await consume.run(
                ctx.broker,
                [broker.QUEUE_REQUESTS],
                settings=settings,
                stop=stop,
                worker=ACTOR,
                handle=committer.commit_requests,
                on_fenced=ctx.reacquire,
            )

        async def successors() -> None:
            while not stop.requested:
                n = await supervisor.redo(
                    committer.commit_successors,
                    worker=ACTOR,
                    stop=stop,
                    on_fenced=ctx.reacquire,
                    name="committer.successors",
                )
                if n < settings.batch_size:
                    await waker.wait()

        try:
            await supervisor.supervise(
                main=[
                    starts(),
                    successors(),
                    ctx.sending(committer.sender, stop),
                ],
                side=[
                    ctx.heartbeat(),
                    waker.follow(lambda: ctx.db.listen("custody_successor"), worker=ACTOR),
                ],
            )
        finally:
            # a unit that was committing when the stop came hands its submits over after
            # the sender's loop may have ended: their claims are given back here, once
            # nothing can hand more, so that the publisher claims them at its next poll
            # instead of after the claims' expiry
            await committer.sender.release_handed()
