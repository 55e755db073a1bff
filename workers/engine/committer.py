"""The transition committer: owner of the *workflow transition* boundary.

It commits, in one transaction, node state, history, the operation and its attempt,
and the outbox row that is the dispatch intent. Inputs: start requests (AMQP, acked
after commit) and successor intents written by the receipt consumer (claimed with
``FOR UPDATE SKIP LOCKED``, woken by NOTIFY with a polling fallback). It never talks
to participants.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import pydantic

from contracts import codec, digest, identity
from contracts.models import CancelRequest, ExecutorRoute, Lineage, StartRequest
from workers.core import commands, process, routes, tracing
from workers.engine import context, transitions
from workers.io import broker, db
from workers.runtime import consume, faults, logs, metrics, probes, supervisor
from workers.settings import Settings

ACTOR = "committer"
AckPolicy = "ack after commit; malformed starts are quarantined and acked"
DEFINITION_MISSING = "definition_missing"  # instances.suspended_reason
# What building one activation can raise for one instance's data or definition: that
# instance fails (or its start is quarantined) with the reason; the worker goes on.
ACTIVATION_ERRORS = (
    process.InputError,
    digest.CanonicalFormError,
    KeyError,
    pydantic.ValidationError,
)


@dataclass(frozen=True)
class Plan:
    """The rows of one new node activation, decided without I/O."""

    node: dict[str, Any]
    operation: dict[str, Any]
    attempt: dict[str, Any]
    outbox: dict[str, Any]
    history: dict[str, Any]


def plan_activation(
    *,
    tenant: str,
    instance_id: str,
    definition: process.Definition,
    node_name: str,
    activation: int,
    instance_input: Mapping[str, Any],
    results: Mapping[str, Any],
    pinned: Mapping[str, ExecutorRoute],
    traceparent: str | None,
) -> Plan:
    """Everything one activation writes, on the route the instance pinned at start."""
    node = definition.node(node_name)
    route = pinned[node.route]
    op_id = identity.operation_id(tenant, instance_id, node_name, activation)
    op_input = process.render_input(node.input, instance_input, results)
    lineage = Lineage(
        instance_id=instance_id,
        process=definition.name,
        process_version=definition.version,
        node=node_name,
        activation=activation,
    ).model_dump(mode="json")
    command = commands.submit(
        commands.Pinned(
            operation_id=op_id,
            tenant=tenant,
            attempt=1,
            operation=node.operation,
            route=route.name,
            owner=route.owner,
            binding=route.binding,
            input=op_input,
            lineage=lineage,
        ),
        traceparent=traceparent,
    )
    return Plan(
        node={
            "instance_id": instance_id,
            "node": node_name,
            "activation": activation,
            "operation_id": op_id,
        },
        operation={
            "id": op_id,
            "tenant": tenant,
            "instance_id": instance_id,
            "node": node_name,
            "activation": activation,
            "operation": node.operation,
            "route": route.name,
            "owner": route.owner,
            "principal": route.principal,
            "binding": route.binding,
            "input": db.jsonb(op_input),
            "lineage": db.jsonb(lineage),
            "attempt": 1,
            "digest": command.digest,
            "deadline_seconds": node.deadline_seconds,
        },
        attempt=command.attempt_row,
        outbox=command.outbox_row,
        history={
            "instance_id": instance_id,
            "operation_id": op_id,
            "event": "node.activated",
            "detail": db.jsonb(
                {
                    "node": node_name,
                    "activation": activation,
                    "operation": node.operation,
                    "route": route.name,
                    "binding": route.binding,
                }
            ),
            "actor": ACTOR,
        },
    )


async def _write_plans(tx: db.Tx, plans: Sequence[Plan]) -> None:
    await tx.run_many("node_insert", [p.node for p in plans])
    await tx.run_many("operation_insert", [p.operation for p in plans])
    await tx.run_many("attempt_insert", [p.attempt for p in plans])
    await tx.run_many("outbox_insert", [p.outbox for p in plans])
    await tx.run_many("history_insert", [p.history for p in plans])


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

    async def commit_requests(self, deliveries: Sequence[broker.Delivery]) -> None:
        """Start and cancel requests, in queue order: each run of starts in one
        transaction, each cancel through the operator path (authorized as the
        delivery's broker-validated user, audited)."""
        run: list[tuple[broker.Delivery, StartRequest]] = []
        quarantine: list[dict[str, Any]] = []
        for d in deliveries:
            try:
                message = codec.decode_request(d.payload(), self.settings.max_message_bytes)
            except codec.DecodeError as exc:
                quarantine.append(_quarantine_row(d, exc.reason, exc.detail))
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
        quarantine: list[dict[str, Any]],
    ) -> None:
        """One transaction for a run of start requests; the caller acks after it."""
        if not valid and not quarantine:
            return
        async with self.db.transaction(self.lease) as tx:
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
            for _, s in late:
                await tx.run(
                    "start_tombstone_late",
                    {"tenant": s.tenant, "start_request_id": s.start_request_id},
                )
                logs.event(
                    "start.cancelled_before_start",
                    tenant=s.tenant,
                    start_request_id=s.start_request_id,
                )
            if valid:
                await faults.point("starts_locked")
            valid = [(d, s) for d, s in valid if (s.tenant, s.start_request_id) not in tombstoned]
            ids = [identity.instance_id(s.tenant, s.start_request_id) for _, s in valid]
            existing = {r["id"]: r for r in await tx.rows("instances_get", {"ids": ids})}
            instances, plans, seen = [], [], set()
            for (d, start), iid in zip(valid, ids, strict=True):
                old = existing.get(iid)
                if old is not None or iid in seen:
                    if old is not None and old["input"] != start.input:
                        quarantine.append(
                            _quarantine_row(
                                d,
                                "start_conflict",
                                "same start request id with different input",
                                tenant=start.tenant,
                            )
                        )
                    continue
                try:
                    definition = self.catalog.latest(start.process)
                except process.DefinitionError as exc:
                    quarantine.append(
                        _quarantine_row(d, "unknown_process", str(exc), tenant=start.tenant)
                    )
                    continue
                pinned = pin_routes(definition, self.routes)
                try:
                    traceparent = tracing.from_headers(d.headers)
                    plan = plan_activation(
                        tenant=start.tenant,
                        instance_id=iid,
                        definition=definition,
                        node_name=definition.start,
                        activation=1,
                        instance_input=start.input,
                        results={},
                        pinned=pinned,
                        traceparent=traceparent,
                    )
                except (process.InputError, digest.CanonicalFormError) as exc:
                    quarantine.append(
                        _quarantine_row(d, "bad_start_input", str(exc), tenant=start.tenant)
                    )
                    continue
                except ACTIVATION_ERRORS as exc:
                    # the definition cannot be activated for this start: kept, with why
                    metrics.ACTIVATION_FAILURES.labels("activation_failed").inc()
                    quarantine.append(
                        _quarantine_row(d, "activation_failed", str(exc), tenant=start.tenant)
                    )
                    continue
                seen.add(iid)
                instances.append(
                    {
                        "id": iid,
                        "tenant": start.tenant,
                        "start_request_id": start.start_request_id,
                        "process": definition.name,
                        "process_version": definition.version,
                        "input": orjson.dumps(start.input).decode(),
                        "requested_by": start.requested_by,
                        "traceparent": traceparent,
                        "routes": orjson.dumps(
                            {k: v.model_dump(mode="json") for k, v in pinned.items()}
                        ).decode(),
                    }
                )
                plans.append(plan)
            inserted = set()
            if instances:
                columns = (
                    "id",
                    "tenant",
                    "start_request_id",
                    "process",
                    "process_version",
                    "input",
                    "requested_by",
                    "traceparent",
                    "routes",
                )
                inserted = {
                    r["id"]
                    for r in await tx.rows(
                        "instance_insert", {c: [i[c] for i in instances] for c in columns}
                    )
                }
            instances = [i for i in instances if i["id"] in inserted]
            plans = [p for p in plans if p.node["instance_id"] in inserted]
            await tx.run_many(
                "history_insert",
                [
                    {
                        "instance_id": i["id"],
                        "operation_id": None,
                        "event": "instance.started",
                        "detail": db.jsonb(
                            {"process": i["process"], "version": i["process_version"]}
                        ),
                        "actor": ACTOR,
                    }
                    for i in instances
                ],
            )
            await _write_plans(tx, plans)
            await tx.run_many("quarantine_insert", quarantine)
            faults.crash_point("before_commit")
        metrics.TRANSITIONS.labels("start").inc(len(plans))
        for row in quarantine:
            metrics.quarantined(row["source"], row["reason"])

    async def commit_successors(self) -> int:
        """Claim a batch of successor intents and commit their transitions.

        Each intent's instance is locked with it, so the status it is judged by is the
        one its new work commits under. One instance that cannot be activated (its
        pinned version is not loaded, its data or definition does not fit the
        contracts) is suspended or failed with the reason; the others go on."""
        async with self.db.transaction(self.lease) as tx:
            intents = await tx.rows("successor_claim", {"limit": self.settings.batch_size})
            if not intents:
                return 0
            await faults.point("successor_claimed")
            ids = list({i["instance_id"] for i in intents})
            results: dict[Any, dict[str, Any]] = {}
            for r in await tx.rows("instance_results", {"ids": ids}):
                results.setdefault(r["instance_id"], {})[r["node"]] = r["result"]
            activations = {
                (r["instance_id"], r["node"]): r["activation"]
                for r in await tx.rows("node_activations", {"ids": ids})
            }
            plans: list[Plan] = []
            history: list[dict[str, Any]] = []
            done: list[Any] = []
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
                if status == "suspended":  # only a definition_missing one is claimed
                    await tx.run("instance_resume_from", {"id": iid, "reason": DEFINITION_MISSING})
                    history.append(
                        _history(iid, "instance.resumed", {"cause": "definition loaded"})
                    )
                    status = "running"
                if status != "running" and not faults.broken("skip_instance_recheck"):
                    history.append(
                        _history(iid, "successor.suppressed", {"instance_status": status})
                    )
                    continue
                if nxt in (process.END_COMPLETED, process.END_FAILED):
                    end = "completed" if nxt == process.END_COMPLETED else "failed"
                    if await tx.run("instance_finish", {"id": iid, "status": end}):
                        history.append(_history(iid, f"instance.{end}", {}))
                    continue
                pinned = {
                    k: ExecutorRoute.model_validate(v, strict=False)
                    for k, v in intent["routes"].items()
                }
                self._warn_drift(iid, pinned)
                activation = activations.get((iid, nxt), 0) + 1
                activations[(iid, nxt)] = activation
                try:
                    plans.append(
                        plan_activation(
                            tenant=intent["tenant"],
                            instance_id=str(iid),
                            definition=definition,
                            node_name=nxt,
                            activation=activation,
                            instance_input=intent["input"],
                            results=results.get(iid, {}),
                            pinned=pinned,
                            traceparent=intent["traceparent"],
                        )
                    )
                except ACTIVATION_ERRORS as exc:
                    metrics.ACTIVATION_FAILURES.labels("activation_failed").inc()
                    logs.event(
                        "instance.activation_failed",
                        logging.ERROR,
                        instance_id=str(iid),
                        node=nxt,
                        error=str(exc)[:300],
                    )
                    if await tx.run("instance_finish", {"id": iid, "status": "failed"}):
                        history.append(
                            _history(
                                iid,
                                "instance.failed",
                                {"reason": "activation_failed", "node": nxt, "error": str(exc)},
                            )
                        )
            await _write_plans(tx, plans)
            await tx.run_many("history_insert", history)
            await tx.run("successor_done", {"ids": done})
        metrics.TRANSITIONS.labels("successor").inc(len(done))
        return len(intents)

    async def _definition_missing(
        self, tx: db.Tx, intent: dict[str, Any], error: str, history: list[dict[str, Any]]
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
        await tx.run(
            "successor_defer", {"id": intent["id"], "delay": self.settings.definition_retry_s}
        )
        if await tx.run("instance_suspend_for", {"id": iid, "reason": DEFINITION_MISSING}):
            history.append(
                _history(
                    iid,
                    "instance.suspended",
                    {
                        "reason": DEFINITION_MISSING,
                        "process": intent["process"],
                        "version": intent["process_version"],
                    },
                )
            )

    def _warn_drift(self, instance_id: Any, pinned: Mapping[str, ExecutorRoute]) -> None:
        """A pinned route that the current file changed or removed is an alert, never a
        redirect: the instance keeps the binding it started with."""
        for name, route in pinned.items():
            current = self.routes.by_name.get(name)
            if current != route:
                metrics.ROUTE_DRIFT.labels(name).inc()
                logs.event(
                    "route.drift",
                    logging.WARNING,
                    instance_id=str(instance_id),
                    route=name,
                    pinned=route.binding,
                    current=current.binding if current else None,
                )


def pin_routes(definition: process.Definition, table: routes.Routes) -> dict[str, ExecutorRoute]:
    """The routes an instance of ``definition`` will use, as configured right now."""
    return {n.route: table.get(n.route) for n in definition.nodes.values()}


def _history(instance_id: Any, event: str, detail: dict[str, Any]) -> dict[str, Any]:
    return {
        "instance_id": instance_id,
        "operation_id": None,
        "event": event,
        "detail": db.jsonb(detail),
        "actor": ACTOR,
    }


def _quarantine_row(
    d: broker.Delivery, reason: str, detail: str, tenant: str | None = None
) -> dict[str, Any]:
    return {
        "source": broker.QUEUE_REQUESTS,
        "reason": reason,
        "detail": detail[:2000],
        "message_id": d.message_id,
        "user_id": d.user_id,
        "tenant": tenant,
        "operation_id": None,
        "body": d.body,
        "headers": db.jsonb(broker.safe_headers(d.headers)),
        "worker": ACTOR,
    }


async def main(settings: Settings, stop: supervisor.Stop, health: probes.Health) -> None:
    async with context.running(settings, ACTOR, health) as ctx:
        committer = Committer(settings, ctx.db, ctx.lease, ctx.routes, ctx.catalog)
        waker = supervisor.Waker(settings.poll_interval_s)

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
                    committer.commit_successors, worker=ACTOR, stop=stop, on_fenced=ctx.reacquire
                )
                if n < settings.batch_size:
                    await waker.wait()

        await supervisor.supervise(
            main=[starts(), successors()],
            side=[
                ctx.heartbeat(),
                waker.follow(lambda: ctx.db.listen("custody_successor"), worker=ACTOR),
            ],
        )
