"""The committer's transitions, as units: the round trips and statements a batch of
successors, or a run of starts, costs, and the wake-ups it sends.

At light load each round trip a unit waits for is a wake-up of the worker and of its
Postgres backend (the bench's light-load legs), so an instance's three operations pay
for every one. The seed: "Workflow transition: node state, history event, operation +
attempt, outbox row" commit together, each successor judged by its instance as locked
with the intent; the reads that depend on the claimed intents still run after the
locks were taken.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any, LiteralString

import psycopg
import pytest

from contracts import codec
from contracts.models import StartRequest
from tests.conftest import Env, wait_until
from tests.harness import (
    InProcessFleet,
    RoundTrips,
    Statements,
    held_instances,
    order,
    publish_starts,
    role_database,
)
from workers import errors
from workers.core import lifecycle, process, records
from workers.engine import activate, committer
from workers.io import broker, db
from workers.runtime import supervisor

ORDERS = 5


async def _until(env: Env, query: LiteralString, n: int, what: str) -> None:
    async def reached() -> bool:
        return bool(await env.scalar(query) == n)

    await wait_until(reached, 60, what=what)


async def _pending_successors(env: Env) -> None:
    """Every reserve applied, its successor intent left for a committer (``ORDERS``): the
    instances' rows held meanwhile, which the receipt consumer does not wait for."""
    fleet = InProcessFleet(env)
    starter = fleet.start("committer")
    fleet.start("publisher")
    fleet.start("inventory")
    try:
        await publish_starts(env.settings, [order(i) for i in range(ORDERS)])
        await _until(
            env,
            "SELECT count(*) FROM custody.operations WHERE node = 'reserve'",
            ORDERS,
            "every reserve created",
        )
        await fleet.stop(starter)  # the successors wait for the committer under test
        async with held_instances(env):  # so the receipt consumer leaves them pending
            fleet.start("receipts")
            await _until(
                env,
                "SELECT count(*) FROM custody.successor_intents WHERE status = 'pending'",
                ORDERS,
                "every reserve's successor intent",
            )
            fleet.check_alive()
    finally:
        await fleet.stop_all()


@contextlib.asynccontextmanager
async def _committer(env: Env) -> AsyncIterator[committer.Committer]:
    """A committer under its own least-privilege role, holding its lease."""
    table, catalog = process.load_config(env.settings)
    async with role_database(env.settings.database_url, "custody_committer") as database:
        lease = db.Lease("committer", ttl_s=60)
        await database.acquire(lease)
        yield committer.Committer(env.settings, database, lease, table, catalog)


async def test_a_batch_of_successors_commits_in_two_round_trips_and_eight_statements(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "Workflow transition": a batch of successor intents is claimed with its
    instances, the instances' results and node activations read, and the new operations
    with their attempts, outbox rows and history committed, in two round trips (the
    claim and the reads that depend on it; the writes and the COMMIT), where the reads
    cost one of their own; and in eight statements (BEGIN, the claim, its two reads, the
    activations' rows in one, the intents done, the fence, COMMIT), where the nodes,
    operations, attempts, outbox rows and history took one each. At light load each
    statement is a worker's client path, on the new operation's way. The new work is
    what it was: one charge per order, each its first activation, built from the
    reserve's result."""
    await _pending_successors(env)
    async with _committer(env) as c:
        trips = RoundTrips(monkeypatch)
        statements = Statements(monkeypatch)
        assert await c.commit_successors() == ORDERS
        assert trips.n == 2, f"{trips.n} round trips"
        assert statements.n == 8, f"{statements.n} statements"

    rows = await env.sql(
        "SELECT o.activation, o.input->>'reservation' = r.id::text"
        "  FROM custody.operations o JOIN custody.operations r"
        "    ON r.instance_id = o.instance_id AND r.node = 'reserve'"
        " WHERE o.node = 'charge'"
    )
    assert rows == [(1, True)] * ORDERS
    # each charge with its node, its attempt, its submit and its history, once
    for what, query in (
        ("nodes", "SELECT count(*) FROM custody.node_states WHERE node = 'charge'"),
        (
            "attempts",
            "SELECT count(*) FROM custody.attempts a JOIN custody.operations o"
            " ON o.id = a.operation_id WHERE o.node = 'charge'",
        ),
        (
            "history",
            "SELECT count(*) FROM custody.history"
            " WHERE event = 'node.activated' AND detail->>'node' = 'charge'",
        ),
    ):
        assert await env.scalar(query) == ORDERS, what
    assert (
        await env.scalar("SELECT count(*) FROM custody.successor_intents WHERE status = 'pending'")
        == 0
    )
    assert (
        await env.scalar("SELECT count(*) FROM custody.outbox WHERE kind = 'submit'") == 2 * ORDERS
    )


async def test_a_batch_with_no_new_work_wakes_no_publisher(
    env: Env,
) -> None:
    """ "Workflow transition": a batch whose intents create no operation (their instances
    are being cancelled: each successor suppressed, with its history) inserts no outbox
    row, so the outbox's wake-up (a NOTIFY from its statement trigger, which fires even
    for an INSERT of no row) is not sent: every publisher would wake and poll for
    nothing."""
    await _pending_successors(env)
    await env.sql("UPDATE custody.instances SET status = 'cancelling'")
    woken: list[str] = []
    async with (
        await psycopg.AsyncConnection.connect(env.settings.database_url, autocommit=True) as ear,
        _committer(env) as c,
    ):
        await ear.execute("LISTEN custody_outbox")
        assert await c.commit_successors() == ORDERS
        async for note in ear.notifies(timeout=0.5):
            woken.append(note.channel)
    assert woken == []
    suppressed = await env.scalar(
        "SELECT count(*) FROM custody.history WHERE event = 'successor.suppressed'"
    )
    assert suppressed == ORDERS
    assert await env.scalar("SELECT count(*) FROM custody.operations WHERE node = 'charge'") == 0


def _start_deliveries(n: int) -> list[tuple[broker.Delivery, StartRequest]]:
    """``n`` start requests as the committer's consumer hands them over."""
    starts = []
    for i in range(n):
        request = StartRequest(
            tenant="acme",
            start_request_id=str(uuid.uuid4()),
            process="order-fulfilment",
            input=order(i),
            requested_by="test",
        )
        delivery = broker.Delivery(
            body=codec.encode(request),
            message_id=request.start_request_id,
            user_id="test",
            headers={},
            redelivered=False,
            routing_key="",
            _message=None,  # type: ignore[arg-type]  # never acked here
        )
        starts.append((delivery, request))
    return starts


async def test_a_run_of_start_requests_commits_in_two_round_trips(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "Workflow transition" at a start: a run of start requests is serialised with
    their cancellations (the advisory locks), judged by their tombstones, by the
    instances that exist already and by the archived ones, and the instances with their
    first operations committed, in two round trips: the locks with the three reads (sent
    together, run in that order, so the reads still see what the locks serialise), then
    the instances' insert with the writes and the COMMIT. The insert's answer is not
    waited for (it said which instances were new, a third round trip on every instance's
    way at light load): under their locks every one is new. A start already tombstoned
    is still refused, a start already made is still a duplicate, and so is a start whose
    instance finished long ago and was archived (no second instance)."""
    async with _committer(env) as c:
        first = _start_deliveries(1)
        await c.commit_starts(first, [])  # made before: a duplicate below
        tombstoned = _start_deliveries(1)
        await env.sql(
            "INSERT INTO custody.start_tombstones (tenant, start_request_id, actor, reason)"
            " VALUES ('acme', %s, 'test', 'test')",
            (tombstoned[0][1].start_request_id,),
        )
        archived = _start_deliveries(1)
        await env.sql(  # first's instance, copied to the archive as archived's
            "INSERT INTO custody_archive.instances SELECT (jsonb_populate_record("
            " NULL::custody_archive.instances, to_jsonb(i) || jsonb_build_object("
            " 'id', gen_random_uuid(), 'start_request_id', %s::text, 'status', 'completed',"
            " 'finished_at', now()))).* FROM custody.instances i",
            (archived[0][1].start_request_id,),
        )
        fresh = _start_deliveries(ORDERS)
        trips = RoundTrips(monkeypatch)
        await c.commit_starts([*first, *tombstoned, *archived, *fresh], [])
        assert trips.n == 2, f"{trips.n} round trips"
    assert first[0][0].ids["outcome"] == "duplicate"
    assert archived[0][0].ids["outcome"] == "duplicate"
    assert tombstoned[0][0].ids["outcome"] == "cancelled_before_start"
    assert {d.ids["outcome"] for d, _ in fresh} == {"started"}
    assert await env.scalar("SELECT count(*) FROM custody.instances") == 1 + ORDERS
    assert await env.scalar("SELECT count(*) FROM custody.operations") == 1 + ORDERS


async def test_a_start_whose_instance_is_there_after_all_fails_its_unit_and_writes_nothing(
    env: Env,
) -> None:
    """The run of starts does not wait for its insert's answer, so the insert itself
    refuses a batch in which an instance is there after all (none can be while its start
    lock is held, the instances read under it: a guard, not a path): the statement fails
    with CU004, classified as a unit to redo (the consume loop's redo re-reads everything:
    tests/unit/test_redo.py), and nothing of the batch is written. Under the committer's
    own role."""
    async with _committer(env) as c:
        [made] = _start_deliveries(1)
        await c.commit_starts([made], [])
    [there] = await env.sql(
        "SELECT id::text, tenant, start_request_id::text, process, process_version, input,"
        " requested_by, traceparent, routes FROM custody.instances"
    )
    keys = ("id", "tenant", "start_request_id", "process", "process_version", "input")
    old = dict(zip((*keys, "requested_by", "traceparent", "routes"), there, strict=True))
    new = {**old, "id": str(uuid.uuid4()), "start_request_id": str(uuid.uuid4())}
    async with role_database(env.settings.database_url, "custody_committer") as database:
        with pytest.raises(errors.DatabaseError) as failed:
            async with database.transaction() as tx:
                await tx.send_many("instance_insert", [new, old])
        assert failed.value.sqlstate == errors.ROW_CHANGED_SQLSTATE
        assert failed.value.kind is errors.Retry.RETRY
    assert await env.scalar("SELECT count(*) FROM custody.instances") == 1


async def test_a_start_whose_insert_finds_its_instance_is_redone_and_made_once(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The insert guard's path end to end, as the committer's consume loop runs a unit
    (``supervisor.redo``): a start made already is offered again, and its unit's first
    read is made to miss the instance once (what the start locks rule out: a read that
    raced the insert). The insert finds the instance there and fails the unit (CU004),
    which is redone whole; the second attempt reads the instance and counts the start a
    duplicate. "Duplicate deliveries never turn into a doubled effect": one instance,
    one first operation."""
    async with _committer(env) as c:
        [made] = _start_deliveries(1)
        await c.commit_starts([made], [])
        reads: list[str] = []
        ask = db.Tx.ask

        async def missing_once(tx: db.Tx, name: str, params: Any = None) -> db.Answer:
            if name == "instances_get":
                reads.append(name)
                if len(reads) == 1:
                    params = {"ids": []}  # this attempt does not see the instance
            return await ask(tx, name, params)

        monkeypatch.setattr(db.Tx, "ask", missing_once)
        await supervisor.redo(
            lambda: c.commit_starts([made], []),
            worker="committer",
            stop=supervisor.Stop(grace_s=5),
            on_fenced=lambda: asyncio.sleep(0),
        )
    assert reads == ["instances_get", "instances_get"], reads  # the unit ran twice
    assert made[0].ids["outcome"] == "duplicate"
    assert await env.scalar("SELECT count(*) FROM custody.instances") == 1
    assert await env.scalar("SELECT count(*) FROM custody.operations") == 1


async def test_an_end_a_receipt_makes_writes_its_history_without_a_round_trip_of_its_own(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "Workflow receipt application" at an instance's last receipt: the end (only from
    running) and its history commit together with the receipt, and the unit waits for
    nothing in between: its history is written by the end's own statement, only for an
    instance it did end, so the unit costs its COMMIT's flight alone, where waiting for
    which instances ended cost one more on the instance's way. An instance that is no
    longer running is not ended and gets no history."""
    async with _committer(env) as c:
        starts = _start_deliveries(2)
        await c.commit_starts(starts, [])
    running_id, gone_id = (d.ids["instance_id"] for d, _ in starts)
    await env.sql("UPDATE custody.instances SET status = 'cancelling' WHERE id = %s", (gone_id,))
    ends = [
        activate.Finish(
            iid,
            lifecycle.InstanceStatus.COMPLETED,
            records.History(iid, "instance.completed", "receipts", {"test": True}),
        )
        for iid in (running_id, gone_id)
    ]
    async with role_database(env.settings.database_url, "custody_receipts") as database:
        trips = RoundTrips(monkeypatch)
        async with database.transaction() as tx:
            assert await activate.finish(tx, ends, logged=True) == []
        assert trips.n == 1, f"{trips.n} round trips"
    rows = await env.sql(
        "SELECT i.id::text, i.status::text, i.finished_at IS NOT NULL, h.actor, h.detail"
        "  FROM custody.instances i LEFT JOIN custody.history h"
        "    ON h.instance_id = i.id AND h.event = 'instance.completed'"
        " ORDER BY i.status"
    )
    assert sorted(rows) == sorted(
        [
            (running_id, "completed", True, "receipts", {"test": True}),
            (gone_id, "cancelling", False, None, None),
        ]
    ), rows
