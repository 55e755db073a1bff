"""Seed sentences whose earlier tests could not fail, each checked through the real
workers, the real broker and the operator CLI, so that breaking the rule turns a test red.

Every test here was run once against production code broken on purpose (in a scratch
worktree) and went red; the docstring quotes the seed sentence it holds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY

from contracts import codec, digest, identity
from contracts.models import (
    CancelCommand,
    OperationReceipt,
    QueryAnswer,
    QueryCommand,
    ReceiptError,
    SubmitCommand,
    Target,
)
from participants import samples
from tests.conftest import DEV_PASSWORD, MGMT, Env, wait_until
from tests.fixtures import processes
from tests.harness import InProcessFleet, Running, client, order, publish_raw, publish_starts
from tests.integration.test_recovery import custody
from tests.integration.test_trust_boundary import Op, receipt
from workers import provision
from workers.core.lifecycle import TRANSITIONS, Status
from workers.io import broker, db
from workers.participant import service
from workers.runtime import probes, supervisor
from workers.settings import ROOT

# --- helpers ---------------------------------------------------------------------------


def use_processes(env: Env, tmp_path: Path, **kw: Any) -> None:
    env.settings = dataclasses.replace(
        env.settings, processes_dir=str(processes.write(tmp_path / "processes", **kw))
    )


def running(fleet: InProcessFleet, name: str) -> Running:
    return next(r for r in fleet.running if r.name == name)


async def op_of(env: Env, start_id: str, node: str) -> dict[str, Any]:
    """The operation of ``node`` in the instance started by ``start_id`` (waits for it)."""
    query = (
        "SELECT o.id::text, o.tenant, o.attempt, o.digest, o.status::text AS status,"
        " o.effect::text AS effect, o.owner_revision, o.route, o.owner, o.principal,"
        " o.binding, o.instance_id::text, i.status::text AS instance_status"
        " FROM custody.operations o JOIN custody.instances i ON i.id = o.instance_id"
        " WHERE i.start_request_id = %s AND o.node = %s"
    )
    keys = [
        "id",
        "tenant",
        "attempt",
        "digest",
        "status",
        "effect",
        "owner_revision",
        "route",
        "owner",
        "principal",
        "binding",
        "instance_id",
        "instance_status",
    ]

    async def exists() -> bool:
        return bool(await env.sql(query, (start_id, node)))

    await wait_until(exists, what=f"operation {node} of start {start_id}")
    [row] = await env.sql(query, (start_id, node))
    return dict(zip(keys, row, strict=True))


async def until_op(env: Env, start_id: str, node: str, status: str, timeout: float = 30) -> None:
    async def reached() -> bool:
        return bool((await op_of(env, start_id, node))["status"] == status)

    await wait_until(reached, timeout=timeout, what=f"{node} of {start_id} {status}")


def as_op(row: Mapping[str, Any]) -> Op:
    return Op(
        row["id"],
        row["tenant"],
        row["attempt"],
        row["digest"],
        identity.request_id(row["id"], row["attempt"], "submit"),
    )


async def send(
    env: Env, body: bytes, *, as_user: str = "inventory", message_id: str | None = None
) -> str:
    """Publish one receipt message as a participant's broker user (user_id validated by
    RabbitMQ); returns its message id, which its quarantine row carries."""
    mid = message_id or str(uuid.uuid4())
    await publish_raw(
        env.participant_settings(as_user),
        broker.EXCHANGE_RECEIPTS,
        broker.RECEIPTS_KEY,
        [body],
        user_id=f"custody-{as_user}",
        message_id=mid,
    )
    return mid


async def quarantine_reason(env: Env, message_id: str, timeout: float = 15) -> str:
    async def seen() -> bool:
        return bool(
            await env.sql("SELECT 1 FROM custody.quarantine WHERE message_id = %s", (message_id,))
        )

    await wait_until(seen, timeout=timeout, what=f"message {message_id} quarantined")
    return str(
        await env.scalar(
            "SELECT reason FROM custody.quarantine WHERE message_id = %s", (message_id,)
        )
    )


def answer(op: Op, query_id: str, inner: OperationReceipt | None, **overrides: Any) -> QueryAnswer:
    """A query answer as the participant runtime builds it (service._answers)."""
    fields: dict[str, Any] = {
        "answer_id": identity.answer_id(query_id, inner.owner_revision if inner else 0),
        "tenant": op.tenant,
        "operation_id": op.id,
        "attempt": op.attempt,
        "request_id": op.request_id,
        "in_reply_to": query_id,
        "owner": "inventory",
        "principal": "custody-inventory",
        "receipt": inner,
        "emitted_at": datetime.now(UTC),
    }
    fields.update(overrides)
    return QueryAnswer.model_validate(fields)


async def outbox_commands(env: Env, operation_id: str, kind: str) -> list[tuple[str, Any]]:
    """(routing key, decoded command) of every outbox row of one kind, oldest first."""
    rows = await env.sql(
        "SELECT routing_key, body FROM custody.outbox WHERE operation_id = %s AND kind = %s"
        " ORDER BY created_at, id",
        (operation_id, kind),
    )
    return [(rk, codec.decode_command(bytes(body))) for rk, body in rows]


async def all_published(env: Env) -> bool:
    return bool(
        await env.scalar("SELECT count(*) FROM custody.outbox WHERE status = 'pending'") == 0
    )


def pinned_digest(command: SubmitCommand, attempt: int, target: Target) -> str:
    return digest.command_digest(
        tenant=command.tenant,
        operation_id=command.operation_id,
        attempt=attempt,
        operation=command.operation,
        route=target.route,
        owner=target.owner,
        binding=target.binding,
        input=command.input,
        lineage=command.lineage.model_dump(mode="json"),
    )


ALLOWED = {(s, t) for (s, _), t in TRANSITIONS.items() if isinstance(t, Status)}
STATUSES = {s.value for s in Status}


async def assert_history_follows_the_lifecycle(env: Env) -> int:
    """Walk every operation's history as the engine wrote it: each ``operation.<status>``
    event, from the status before it, is a transition of ``lifecycle.TRANSITIONS``, and
    the ``from`` it records is the status the operation was really in. Returns the
    number of status changes checked. History and rows are read in one snapshot: a
    receipt applied between two reads would otherwise look like a row ahead of its
    history."""
    async with (
        await psycopg.AsyncConnection.connect(env.settings.database_url) as conn,
        conn.transaction(),
    ):
        await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        cur = await conn.execute(
            "SELECT operation_id::text, event, detail->>'from' FROM custody.history"
            " WHERE operation_id IS NOT NULL AND event LIKE 'operation.%' ORDER BY id"
        )
        rows = await cur.fetchall()
        cur = await conn.execute("SELECT id::text, status::text FROM custody.operations")
        final: dict[str, str] = {str(k): str(v) for k, v in await cur.fetchall()}
    current: dict[str, Status] = {}
    bad: list[str] = []
    checked = 0
    for oid, event, recorded_from in rows:
        name = event.removeprefix("operation.")
        if name not in STATUSES:
            continue
        before = current.get(oid, Status.PENDING)
        to = Status(name)
        if recorded_from is not None and recorded_from != before.value:
            bad.append(f"{oid}: {event} records from={recorded_from}, was {before.value}")
        if (before, to) not in ALLOWED:
            bad.append(f"{oid}: {before.value} -> {to.value} is not in TRANSITIONS")
        current[oid] = to
        checked += 1
    assert not bad, bad
    for oid, status in current.items():
        assert final[oid] == status.value, f"{oid}: history ends {status}, row is {final[oid]}"
    return checked


# --- 1. query answers take the receipt validation path ----------------------------------


async def test_query_answers_with_an_invalid_inner_receipt_are_refused_like_any_receipt(
    env: Env, fleet: InProcessFleet, tmp_path: Path
) -> None:
    """ "Query results pass through the same receipt validation path as ordinary
    responses." The real receipts worker is handed query answers whose inner receipt
    names the wrong owner or principal, the wrong digest or an older owner revision,
    answers to a request that was never issued as a query, and an answer delivered by
    a broker user that is not its principal: each is quarantined with its reason (the
    older revision recorded stale), the operation stays reconcile_pending, and only
    the valid answer is applied."""
    use_processes(env, tmp_path, deadline_s=2)
    fleet.start_all(participants=())
    [start] = await publish_starts(env.settings, [order(1)])
    await until_op(env, start, "reserve", "outcome_unknown")
    # the deadline sweep has done its part; without it no query is timed out under us
    await fleet.stop(running(fleet, "reconciler"))
    op = as_op(await op_of(env, start, "reserve"))

    # the owner's revision 2 (failed, effect unknown): the operation stays unknown
    await send(
        env,
        codec.encode(
            receipt(
                op, 2, "failed", "unknown", error=ReceiptError(code="crashed", message="mid-way")
            )
        ),
    )

    async def at_revision_2() -> bool:
        return bool((await op_of(env, start, "reserve"))["owner_revision"] == 2)

    await wait_until(at_revision_2, what="owner revision 2 applied")

    async def reconcile() -> str:
        done = await custody(
            env, "reconcile", op.id, "--reason", "asking the owner again", "--json"
        )
        assert done.returncode == 0, done.stderr
        return str(json.loads(done.stdout)["query_request_id"])

    # an older owner revision inside an answer is recorded stale, never applied
    q1 = await reconcile()
    stale = receipt(op, 1, "succeeded", "applied")
    await send(env, codec.encode(answer(op, q1, stale)))

    async def recorded_stale() -> bool:
        rows = await env.sql(
            "SELECT decision FROM custody.receipt_inbox WHERE receipt_id = %s",
            (stale.receipt_id,),
        )
        return rows == [("stale",)]

    await wait_until(recorded_stale, what="the older revision recorded stale")
    await until_op(env, start, "reserve", "outcome_unknown")  # "nothing newer": no news
    after_stale = await op_of(env, start, "reserve")
    assert (after_stale["effect"], after_stale["owner_revision"]) == ("unknown", 2)

    q2 = await reconcile()
    rev3 = receipt(op, 3, "succeeded", "applied")
    payments_inner = receipt(op, 3, "succeeded", "applied", owner="payments")
    cases = {
        "inner-wrong-owner": (answer(op, q2, payments_inner), "inventory", "wrong_owner"),
        "inner-wrong-principal": (
            answer(op, q2, receipt(op, 3, "succeeded", "applied", principal="custody-payments")),
            "inventory",
            "principal_mismatch",
        ),
        "inner-wrong-digest": (
            answer(op, q2, receipt(op, 3, "succeeded", "applied", command_digest="f" * 64)),
            "inventory",
            "digest_mismatch",
        ),
        "reply-to-the-submit": (
            answer(op, q2, rev3, in_reply_to=op.request_id),
            "inventory",
            "unknown_request",
        ),
        "reply-to-nothing-issued": (
            answer(op, q2, rev3, in_reply_to=str(uuid.uuid4())),
            "inventory",
            "unknown_request",
        ),
        "delivered-by-another-user": (answer(op, q2, rev3), "payments", "principal_mismatch"),
    }
    sent = {
        name: await send(env, codec.encode(msg), as_user=user)
        for name, (msg, user, _) in cases.items()
    }
    reasons = {name: await quarantine_reason(env, mid) for name, mid in sent.items()}
    assert reasons == {name: reason for name, (_, _, reason) in cases.items()}
    now = await op_of(env, start, "reserve")
    assert (now["status"], now["effect"], now["owner_revision"]) == (
        "reconcile_pending",
        "unknown",
        2,
    )
    assert await env.scalar("SELECT count(*) FROM custody.receipt_inbox") == 2  # rev 2, stale
    assert await env.scalar("SELECT count(*) FROM custody.operations") == 1, "no successor"

    # the valid answer is applied, once, with its successor
    await send(env, codec.encode(answer(op, q2, rev3)))
    await until_op(env, start, "reserve", "succeeded")
    done = await op_of(env, start, "reserve")
    assert (done["effect"], done["owner_revision"]) == ("applied", 3)
    await op_of(env, start, "charge")
    fleet.check_alive()
    await assert_history_follows_the_lifecycle(env)


# --- 2. pinned routes: reconcile, cancel and retry-safe under a changed routes file -----


def moved_routes(path: Path) -> Path:
    """deploy/routes.toml with inventory and payments given to other owners, principals
    and bindings."""
    text = (ROOT / "deploy" / "routes.toml").read_text()
    for old, new in (("inventory", "warehouse"), ("payments", "billing")):
        text = text.replace(f'owner = "{old}"', f'owner = "{new}"')
        text = text.replace(f'principal = "custody-{old}"', f'principal = "custody-{new}"')
        text = text.replace(f'binding = "{old}.v1"', f'binding = "{new}.v1"')
    path.write_text(text)
    return path


@pytest.mark.timeout(180)
async def test_reconcile_cancel_and_retry_safe_use_the_pinned_route_after_the_file_changed(
    env: Env, fleet: InProcessFleet, tmp_path: Path
) -> None:
    """ "New configuration cannot silently redirect existing work to another owner" and
    "The runtime's IExecutorAdapter boundary defines Submit, Query and Cancel against
    the same immutable command and pinned route." With the routes file giving the
    routes to new owners, principals and bindings (workers restarted and the CLI run
    with it, the new queues and broker users created), every query, cancel and new
    submit goes to the pinned binding with the pinned target and the submit's digest;
    a receipt from the new owner is quarantined; the drift metric rises."""
    use_processes(env, tmp_path, deadline_s=2, retry_backoff_s=3600)
    fleet.start_all()
    [flaky] = await publish_starts(env.settings, [order(3, flaky=True)])
    await until_op(env, flaky, "charge", "retry_waiting")
    for name in ("inventory", "payments", "shipping"):
        await fleet.stop(running(fleet, name))
    to_reconcile, to_cancel = await publish_starts(env.settings, [order(1), order(2)])
    await until_op(env, to_reconcile, "reserve", "outcome_unknown")
    await until_op(env, to_cancel, "reserve", "outcome_unknown")
    await fleet.stop_all()
    pinned = {
        start: await op_of(env, start, node)
        for start, node in ((to_reconcile, "reserve"), (to_cancel, "reserve"), (flaky, "charge"))
    }

    moved = moved_routes(tmp_path / "routes.toml")
    env.settings = dataclasses.replace(env.settings, routes_file=str(moved))
    await provision.apply_topology(env.settings)  # the new bindings' queues exist too
    await provision.dev_users(env.settings, DEV_PASSWORD)  # new principals
    drift = {
        r: REGISTRY.get_sample_value("custody_route_drift_total", {"route": r}) or 0
        for r in ("inventory", "payments")
    }
    try:
        # every engine worker on the new file; no reconciler, so no query is timed out
        fleet.start_all(engine=("committer", "publisher", "receipts"), participants=())
        ops = {k: v["id"] for k, v in pinned.items()}
        for args in (
            ("reconcile", ops[to_reconcile], "--reason", "owner restarted, asking again"),
            ("cancel", pinned[to_cancel]["instance_id"], "--reason", "customer withdrew"),
            ("retry-safe", ops[flaky], "--reason", "gateway is back, retrying"),
        ):
            result = await custody(env, *args)  # CUSTODY_ROUTES_FILE is the new file
            assert result.returncode == 0, (args, result.stderr)
        await wait_until(lambda: all_published(env), what="every command published")

        def target(row: Mapping[str, Any]) -> Target:
            return Target(route=row["route"], owner=row["owner"], binding=row["binding"])

        assert target(pinned[to_reconcile]) == Target(
            route="inventory", owner="inventory", binding="inventory.v1"
        )
        [(rk, query)] = await outbox_commands(env, ops[to_reconcile], "query")
        assert isinstance(query, QueryCommand)
        assert (rk, query.target) == ("inventory.v1", target(pinned[to_reconcile]))
        assert query.digest == pinned[to_reconcile]["digest"]
        assert query.submit_request_id == as_op(pinned[to_reconcile]).request_id
        [(rk, cancel)] = await outbox_commands(env, ops[to_cancel], "cancel")
        assert isinstance(cancel, CancelCommand)
        assert (rk, cancel.target) == ("inventory.v1", target(pinned[to_cancel]))
        assert cancel.digest == pinned[to_cancel]["digest"]
        [(_, first), (rk, second)] = await outbox_commands(env, ops[flaky], "submit")
        assert isinstance(second, SubmitCommand) and second.attempt == 2
        payments = target(pinned[flaky])
        assert (rk, first.target, second.target) == ("payments.v1", payments, payments)
        assert second.digest == second.semantic_digest() == pinned_digest(first, 2, payments)
        keys = {k for (k,) in await env.sql("SELECT DISTINCT routing_key FROM custody.outbox")}
        assert keys == {"inventory.v1", "payments.v1"}, "nothing went to the new bindings"

        async def commands_in(binding: str) -> list[str | None]:
            """The commands held in a binding's queue, each item of an envelope one
            (the two submits of one commit travel in one), left in the queue."""
            queue = broker.command_queue(binding)
            async with client(env.settings, "browse") as amqp, amqp.browse(queue, 100, 0.5) as held:
                return sorted(d.message_id for d in held)

        async def queued() -> bool:
            return (
                len(await commands_in("inventory.v1")) == 4  # 2 submits, query, cancel
                and len(await commands_in("payments.v1")) == 1  # attempt 2
            )

        await wait_until(queued, timeout=30, what="the commands in the pinned queues")
        assert await commands_in("warehouse.v1") == []
        assert await commands_in("billing.v1") == []

        # the new owner speaks for the pinned work: refused, in a receipt and an answer
        op = as_op(pinned[to_reconcile])
        new_owner = {"owner": "warehouse", "principal": "custody-warehouse"}
        forged = receipt(op, 1, "succeeded", "applied", **new_owner)
        reasons = [
            await quarantine_reason(env, await send(env, codec.encode(m), as_user="warehouse"))
            for m in (forged, answer(op, query.request_id, forged, **new_owner))
        ]
        assert reasons == ["wrong_owner", "wrong_owner"]
        assert (await op_of(env, to_reconcile, "reserve"))["status"] == "reconcile_pending"

        # the pinned owner answers; the successor keeps the pinned route; drift is alerted
        fleet.start("inventory")
        await until_op(env, to_reconcile, "reserve", "succeeded")
        charge = await op_of(env, to_reconcile, "charge")
        assert (charge["owner"], charge["principal"], charge["binding"]) == (
            "payments",
            "custody-payments",
            "payments.v1",
        )
        for route, before in drift.items():
            after = REGISTRY.get_sample_value("custody_route_drift_total", {"route": route}) or 0
            assert after > before, f"route {route} drifted for pinned work: an alert"
        fleet.check_alive()
        await assert_history_follows_the_lifecycle(env)
    finally:
        for user in ("custody-warehouse", "custody-billing"):
            await broker.management(MGMT, "DELETE", f"/api/users/{user}")


# --- 3. restore: resume only after the owners answered ----------------------------------


async def test_restore_resume_is_refused_while_a_query_is_unanswered(
    env: Env, fleet: InProcessFleet
) -> None:
    """ "Reconcile source journals, owner receipts and task state before resuming."
    With the owner down its query stays unanswered: `restore resume` exits 3, effect
    dispatch stays paused, and the refusal is audited; `--force` proceeds. Once the
    owner answered, a normal resume works."""
    fleet.start_all(participants=())
    [start] = await publish_starts(env.settings, [order(1)])
    await until_op(env, start, "reserve", "dispatched")
    for step in ("mark-restored", "reconcile"):
        result = await custody(env, "restore", step, "--reason", "restored from the 02:00 dump")
        assert result.returncode == 0, result.stderr
    await until_op(env, start, "reserve", "reconcile_pending")

    async def paused() -> bool:
        return bool(await env.scalar("SELECT dispatch_paused FROM custody.control"))

    async def last_audit() -> tuple[Any, ...]:
        [row] = await env.sql(
            "SELECT action, outcome, inputs->>'force' FROM custody.audit ORDER BY id DESC LIMIT 1"
        )
        return row

    refused = await custody(env, "restore", "resume", "--reason", "it has been long enough")
    assert refused.returncode == 3, (refused.stdout, refused.stderr)
    assert "1 operation(s) still wait" in refused.stderr
    assert await paused()
    assert await last_audit() == ("resume", "refused", "false")
    report = await custody(env, "restore", "report")
    assert json.loads(report.stdout)["unanswered"] == 1

    forced = await custody(env, "restore", "resume", "--force", "--reason", "accepting the risk")
    assert forced.returncode == 0, forced.stderr
    assert not await paused()
    assert await last_audit() == ("resume", "done", "true")

    # the owner comes back and answers; after another restore mark, resume just works
    again = await custody(env, "restore", "mark-restored", "--reason", "restored once more")
    assert again.returncode == 0, again.stderr
    assert await paused()
    fleet.start("inventory")
    await until_op(env, start, "reserve", "succeeded")
    resumed = await custody(env, "restore", "resume", "--reason", "every query answered")
    assert resumed.returncode == 0, resumed.stderr
    assert not await paused()
    assert await last_audit() == ("resume", "done", "false")
    fleet.check_alive()


# --- 4. retry-safe keeps the operation and input identity -------------------------------


def start_payments(fleet: InProcessFleet, env: Env, charge: service.Handler) -> None:
    """The payments participant, as the harness starts it, with its own charge handler."""
    s = env.participant_settings("payments")
    s = dataclasses.replace(
        s,
        participant_database_url=db.with_user(
            s.participant_database_url, "custody_participant_payments"
        ),
    )
    me = service.Identity(
        owner="payments", principal="custody-payments", bindings=frozenset({"payments.v1"})
    )
    stop = supervisor.Stop(grace_s=10)
    coro = service.serve(
        me, {"payments.charge": charge}, s, stop, probes.Health(), schema="participant_payments"
    )
    fleet.running.append(Running("payments", stop, asyncio.create_task(coro, name="payments")))


def assert_same_work(submits: list[SubmitCommand]) -> None:
    """Same operation, input, lineage and target; attempt n, its own request id, and a
    digest that is the canonical digest of the same fields at attempt n."""
    first = submits[0]
    for n, s in enumerate(submits, start=1):
        assert (s.tenant, s.operation_id, s.operation) == (
            first.tenant,
            first.operation_id,
            first.operation,
        )
        assert s.input == first.input
        assert s.lineage == first.lineage
        assert s.target == first.target
        assert s.attempt == n
        assert s.request_id == identity.request_id(first.operation_id, n, "submit")
        assert s.digest == pinned_digest(first, n, first.target) == s.semantic_digest()
    assert len({s.request_id for s in submits}) == len(submits)
    assert len({s.digest for s in submits}) == len(submits)


async def test_retry_safe_retains_the_operation_and_input_identity_in_the_new_command(
    env: Env, fleet: InProcessFleet, tmp_path: Path
) -> None:
    """ "It retains the operation/input identity while creating the allowed new attempt
    and command." The submits actually sent for attempts 1 and 2 (decoded from the
    outbox) carry the same operation id, input, lineage and target; only attempt,
    request id and digest differ, and attempt 2's digest is the canonical digest of the
    same fields at attempt 2."""
    use_processes(env, tmp_path, deadline_s=30, retry_backoff_s=3600)
    fleet.start_all()
    [start] = await publish_starts(env.settings, [order(1, flaky=True)])
    await until_op(env, start, "charge", "retry_waiting")
    oid = (await op_of(env, start, "charge"))["id"]
    done = await custody(env, "retry-safe", oid, "--reason", "gateway is back, retrying", "--json")
    assert done.returncode == 0, done.stderr
    await until_op(env, start, "charge", "succeeded")
    sent = await outbox_commands(env, oid, "submit")
    assert [rk for rk, _ in sent] == ["payments.v1", "payments.v1"]
    submits = [c for _, c in sent]
    assert_same_work(submits)
    assert submits[1].request_id == json.loads(done.stdout)["request_id"]
    [(stored_input,)] = await env.sql("SELECT input FROM custody.operations WHERE id = %s", (oid,))
    assert submits[0].input == submits[1].input == stored_input
    charges = await env.sql(
        "SELECT operation_id::text, amount_cents FROM participant_payments.charges",
        participant=True,
    )
    assert charges == [(oid, submits[0].input["amount_cents"])]
    await assert_history_follows_the_lifecycle(env)


async def test_after_max_attempts_the_operation_fails_and_no_further_attempt_is_created(
    env: Env, fleet: InProcessFleet, tmp_path: Path
) -> None:
    """ "The action retry-safe requires authoritative RetryWaiting with effect none. It
    retains the operation/input identity while creating the allowed new attempt and
    command." The charge node allows 3 attempts: a gateway that never answers fails
    attempt 3 for good, the failure branch runs, and retry-safe then refuses and
    creates nothing."""
    use_processes(env, tmp_path, deadline_s=30, retry_backoff_s=3600)

    async def gateway_down(call: service.Call) -> Mapping[str, Any]:
        raise service.BusinessFailure("gateway_unavailable", "the card gateway is down")

    fleet.start_all(participants=("inventory", "shipping"))
    start_payments(fleet, env, gateway_down)
    [start] = await publish_starts(env.settings, [order(1)])
    oid = ""
    for attempt in (1, 2):
        await until_op(env, start, "charge", "retry_waiting")
        row = await op_of(env, start, "charge")
        oid = row["id"]
        assert (row["attempt"], row["effect"]) == (attempt, "none")
        done = await custody(env, "retry-safe", oid, "--reason", f"retry after attempt {attempt}")
        assert done.returncode == 0, done.stderr
    await until_op(env, start, "charge", "failed")
    row = await op_of(env, start, "charge")
    assert (row["attempt"], row["effect"]) == (3, "none")

    async def compensated() -> bool:
        return bool((await op_of(env, start, "release"))["instance_status"] == "failed")

    await wait_until(compensated, what="the release branch and the failed instance")
    refused = await custody(env, "retry-safe", oid, "--reason", "one more time please")
    assert refused.returncode == 3
    assert "retry_waiting with effect none" in refused.stderr
    submits = [c for _, c in await outbox_commands(env, oid, "submit")]
    assert len(submits) == 3
    assert_same_work(submits)
    assert (
        await env.scalar(
            "SELECT count(*) FROM custody.attempts WHERE operation_id = %s AND kind = 'submit'",
            (oid,),
        )
        == 3
    )
    assert (await op_of(env, start, "charge"))["attempt"] == 3
    assert (
        await env.scalar("SELECT count(*) FROM participant_payments.charges", participant=True) == 0
    )
    await assert_history_follows_the_lifecycle(env)


# --- the lifecycle table, as the engine writes it ---------------------------------------


@pytest.mark.timeout(180)
async def test_every_status_change_the_engine_writes_is_a_transition_of_the_table(
    env: Env, fleet: InProcessFleet, tmp_path: Path
) -> None:
    """Every transition the engine writes goes through the table: after a real run
    (successes, a declined charge and its compensation, a retry by policy, a deadline,
    a reconcile and a cancel), every ``operation.<status>`` history event is, from the
    status before it, a transition of ``lifecycle.TRANSITIONS``, its recorded ``from``
    is that status, and the history ends in each operation's stored status. Shipping
    runs a slow handler in the executor (not inline), so that its commands are answered
    ``accepted`` well before their terminal receipt and that transition is written
    too."""
    use_processes(env, tmp_path, deadline_s=2)

    async def slow_ship(call: service.Call) -> Mapping[str, Any]:
        await asyncio.sleep(0.5)
        return await samples.ship(call)

    fleet.start_all(participants=["inventory", "payments"])
    fleet.start(
        "shipping",
        dataclasses.replace(env.participant_settings("shipping"), participant_inline=False),
        handlers={"shipping.ship": slow_ship},
    )
    await publish_starts(
        env.settings, [order(1), order(2, amount_cents=500_000), order(3, flaky=True)]
    )

    async def finished(n: int) -> bool:
        done = await env.scalar(
            "SELECT count(*) FROM custody.instances"
            " WHERE status IN ('completed', 'failed', 'cancelled')"
        )
        return bool(done == n)

    await wait_until(lambda: finished(3), what="the first three instances")
    await fleet.stop(running(fleet, "inventory"))
    late, withdrawn = await publish_starts(env.settings, [order(4), order(5)])
    await until_op(env, late, "reserve", "outcome_unknown")
    await until_op(env, withdrawn, "reserve", "outcome_unknown")
    oid = (await op_of(env, late, "reserve"))["id"]
    assert (await custody(env, "reconcile", oid, "--reason", "inventory was down")).returncode == 0
    iid = (await op_of(env, withdrawn, "reserve"))["instance_id"]
    assert (await custody(env, "cancel", iid, "--reason", "customer withdrew")).returncode == 0
    fleet.start("inventory")
    await wait_until(lambda: finished(5), timeout=60, what="every instance finished")
    checked = await assert_history_follows_the_lifecycle(env)
    seen = {
        e
        for (e,) in await env.sql("SELECT DISTINCT event FROM custody.history")
        if e.removeprefix("operation.") in STATUSES
    }
    assert {
        "operation.dispatched",
        "operation.accepted",
        "operation.succeeded",
        "operation.failed",
        "operation.retry_waiting",
        "operation.pending",
        "operation.outcome_unknown",
        "operation.reconcile_pending",
        "operation.cancelling",
    } <= seen, seen
    assert checked >= 20
    fleet.check_alive()


_ = samples  # the sample handlers are the ones the harness runs
