"""The transition committer: owner of the *workflow transition* boundary.

It commits, in one transaction, node state, history, the operation and its attempt,
and the outbox row that is the dispatch intent. Inputs: start requests (AMQP, acked
after commit) and successor intents written by the receipt consumer (claimed with
``FOR UPDATE SKIP LOCKED``, woken by NOTIFY with a polling fallback).

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
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from contracts import codec, identity
from contracts.models import CancelRequest, ExecutorRoute, StartRequest
from workers.core import activation, lifecycle, process, records, routes, tracing
from workers.core.reasons import Reason
from workers.engine import context, transitions
from workers.io import broker, db
from workers.runtime import consume, faults, logs, metrics, otel, outbox, probes, supervisor
from workers.settings import Settings

ACTOR = "committer"
AckPolicy = "ack after commit; malformed starts are quarantined and acked"
DEFINITION_MISSING = Reason.DEFINITION_MISSING.value  # instances.suspended_reason
IE, IS = lifecycle.InstanceEvent, lifecycle.InstanceStatus


async def _write_plans(
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


PINNED_ROUTES_KEPT = 1024  # distinct pinned route sets parsed once (a deployment has few)


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
        # an instance's pinned routes, parsed, with the names the current file changed
        # or removed, by their JSON: most instances pin the same routes
        self._pinned: dict[bytes, tuple[dict[str, ExecutorRoute], tuple[str, ...]]] = {}
        # this process's publisher of the submits its commits queue claimed by it
        # (None: every submit is left to the publisher worker's claim)
        self.sender: outbox.OutboxPublisher | None = None

    async def _hand(self, queued: db.Answer | None, plans: Sequence[activation.Plan]) -> None:
        """After a commit: the submits it queued claimed by our sender go to it."""
        if queued is None or self.sender is None:
            return
        mine = {r["id"] for r in await queued.rows()}
        if mine:
            faults.crash_point("after_commit_before_send")
        self.sender.hand([p.outbox for p in plans if p.outbox["id"] in mine])

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
            await tx.rows("start_locks", keys)
            tombstoned = {
                (r["tenant"], r["start_request_id"])
                for r in await tx.rows("start_tombstones_for", keys)
            }
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
            ids = [identity.instance_id(s.tenant, s.start_request_id) for _, s in valid]
            existing = {r["id"]: r for r in await tx.rows("instances_get", {"ids": ids})}
            instances: list[dict[str, Any]] = []
            plans: list[activation.Plan] = []
            seen: set[str] = set()
            for (d, start), iid in zip(valid, ids, strict=True):
                d.ids["instance_id"] = iid
                old = existing.get(iid)
                if old is not None or iid in seen:
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
            inserted = set()
            if instances:
                inserted = {
                    r["id"] for r in await tx.rows("instance_insert", {"rows": db.jsonb(instances)})
                }
            instances = [i for i in instances if i["id"] in inserted]
            plans = [p for p in plans if p.instance_id in inserted]
            started = [
                _history(
                    i["id"], "instance.started", process=i["process"], version=i["process_version"]
                )
                for i in instances
            ]
            queued = await _write_plans(tx, plans, before=started, sender=self.sender)
            await tx.send_many("quarantine_insert", [q.params(db.jsonb) for q in quarantine])
            if span.recording:
                _traced(span, plans, [d.message_id for d, _ in valid])
            faults.crash_point("before_commit")
        await self._hand(queued, plans)
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
            finishes: list[tuple[Any, lifecycle.InstanceStatus, records.History]] = []
            for intent in intents:
                iid = intent["instance_id"]
                nxt = intent["next_node"]
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
                if nxt in (process.END_COMPLETED, process.END_FAILED):
                    # what the guarded UPDATE (WHERE status = 'running') sets
                    end = lifecycle.instance_target(
                        IE.COMPLETE if nxt == process.END_COMPLETED else IE.FAIL
                    )
                    finishes.append((iid, end, _history(iid, f"instance.{end.value}")))
                    continue
                pinned = self._pinned_routes(iid, intent["routes"])
                number = activations.get((iid, nxt), 0) + 1
                activations[(iid, nxt)] = number
                try:
                    plans.append(
                        activation.plan_activation(
                            tenant=intent["tenant"],
                            instance_id=str(iid),
                            definition=definition,
                            node_name=nxt,
                            activation=number,
                            instance_input=intent["input"],
                            results=results.get(iid, {}),
                            pinned=pinned,
                            traceparent=intent["traceparent"],
                            actor=ACTOR,
                        )
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
                    finishes.append(
                        (
                            iid,
                            failed,
                            _history(
                                iid,
                                f"instance.{failed.value}",
                                reason=Reason.ACTIVATION_FAILED,
                                node=nxt,
                                error=str(exc),
                            ),
                        )
                    )
            # the batch's ends in one guarded UPDATE (WHERE status = 'running'): the
            # history of an end only for an instance it did end
            ended: set[Any] = set()
            if finishes:
                rows = [{"id": i, "status": e.value} for i, e, _ in finishes]
                ended = {
                    r["id"] for r in await tx.rows("instance_finish", {"rows": db.jsonb(rows)})
                }
            history.extend(h for i, _, h in finishes if i in ended)
            queued = await _write_plans(tx, plans, after=history, sender=self.sender)
            await tx.send("successor_done", {"ids": done})
            if isinstance(span, otel.Claimed):
                span.parent(intents[0]["traceparent"])
                _traced(span, plans, [])
        await self._hand(queued, plans)
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

    def _pinned_routes(self, instance_id: Any, raw: Mapping[str, Any]) -> dict[str, ExecutorRoute]:
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
                    outbox.loop(
                        committer.sender,
                        stop,
                        supervisor.Waker(settings.poll_interval_s),
                        ctx.reacquire,
                        ACTOR,
                        claims=False,
                    ),
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
