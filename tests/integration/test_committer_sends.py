"""The committer publishes the submits it commits (workers/engine/committer.py): each is
queued already claimed by the sender in its process, which publishes it right after the
commit and marks it once the broker confirmed it. Real Postgres, real RabbitMQ.

Issue 14 (light load: "a few fsync'd commits and two broker hops, not a poll
interval"): no NOTIFY, no wake-up of another process and no claim transaction stand
between a transition and its dispatch any more. What must not move:

- "Workflow transition | Node state, history, operation/attempt and dispatch intent
  commit together": the submit is published only after that commit;
- "Broker confirmation | The configured broker accepted the publication under its
  transport policy": the row is marked, and its operation dispatched, only after the
  confirm, under the sender's claim;
- "Before restoring a database, disable effect dispatch": while dispatch is paused the
  committer sends nothing; its submits wait unclaimed for the publisher's claim, which
  holds them until dispatch resumes;
- nothing is lost when the committer dies between its commit and its send, its publish
  and its confirm, or its confirm and its mark: the claim expires and the publisher
  worker sends the submit, under the same message id (tests/acceptance/
  test_commit_boundaries.py, a real process SIGKILLed at each point).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, cast

import psycopg
import pytest

from tests.conftest import Env, wait_until
from tests.harness import (
    client,
    drain,
    order,
    publish_starts,
    role_database,
    running,
)
from workers.io import broker, db
from workers.runtime import outbox, supervisor
from workers.runtime.outbox import OutboxPublisher

QUEUE = broker.command_queue("inventory.v1")  # the first node's (reserve) route


async def _outbox(env: Env) -> list[tuple[object, ...]]:
    return await env.sql(
        "SELECT id::text, kind, status, claimed_by, publish_attempts FROM custody.outbox"
        " ORDER BY created_at"
    )


async def _dispatched(env: Env, n: int) -> bool:
    return (
        await env.scalar("SELECT count(*) FROM custody.operations WHERE status = 'dispatched'") == n
    )


async def test_a_committed_submit_leaves_from_the_committer_and_is_marked_after_its_confirm(
    env: Env,
) -> None:
    """The dispatch intent commits with the transition, then the committer's own sender
    publishes it (no publisher worker runs here) and marks it only after the broker's
    confirm: the row published under one attempt, its operation dispatched, one history
    row for the dispatch; the participant's queue holds the command once, under the
    row's id. The insert of a row claimed this way wakes no publisher (no NOTIFY)."""
    async with (
        await psycopg.AsyncConnection.connect(env.settings.database_url, autocommit=True) as ear,
        running(env) as fleet,
    ):
        await ear.execute("LISTEN custody_outbox")
        fleet.start("committer")
        await publish_starts(env.settings, [order(i) for i in range(3)])
        await wait_until(lambda: _dispatched(env, 3), timeout=20, what="3 operations dispatched")
        fleet.check_alive()

        rows = await _outbox(env)
        assert [(k, s, c, a) for _, k, s, c, a in rows] == [("submit", "published", None, 1)] * 3
        assert (
            await env.scalar(
                "SELECT count(*) FROM custody.history WHERE event = 'operation.dispatched'"
            )
            == 3
        )
        delivered = await drain(env.settings, QUEUE)
        assert sorted(str(d.message_id) for d in delivered) == sorted(str(r[0]) for r in rows)
        notified = [n async for n in _pending_notifies(ear)]
        assert notified == [], "a submit the committer sends itself woke the publisher"


async def _pending_notifies(conn: psycopg.AsyncConnection[object]) -> AsyncIterator[str]:
    """The notifications already delivered to ``conn`` (none waited for)."""
    await conn.execute("SELECT 1")  # a round trip: what was sent before it has arrived
    async for n in conn.notifies(timeout=0.2):
        yield n.channel


async def test_while_dispatch_is_paused_the_committer_sends_nothing_and_the_publisher_holds_it(
    env: Env,
) -> None:
    """Before restoring a database, disable effect dispatch: with dispatch paused, the
    committer commits the transition but queues its submit unclaimed and sends nothing;
    the publisher's claim holds it too. Once dispatch resumes, the publisher sends it,
    once, and the operation is dispatched."""
    await env.sql("UPDATE custody.control SET dispatch_paused = true")
    async with running(env) as fleet:
        fleet.start("committer")
        fleet.start("publisher")
        await publish_starts(env.settings, [order(0)])

        async def queued() -> bool:
            return len(await _outbox(env)) == 1

        await wait_until(queued, timeout=20, what="the submit queued")
        [(_, kind, status, claimed_by, attempts)] = await _outbox(env)
        assert (kind, status, claimed_by, attempts) == ("submit", "pending", None, 0)
        assert await drain(env.settings, QUEUE, timeout=1.0) == []
        assert await env.scalar("SELECT status::text FROM custody.operations") == "pending"

        await env.sql("UPDATE custody.control SET dispatch_paused = false")
        await wait_until(lambda: _dispatched(env, 1), timeout=20, what="the operation dispatched")
        fleet.check_alive()
        [row] = await _outbox(env)
        assert row[2:] == ("published", None, 1)
        assert [d.message_id for d in await drain(env.settings, QUEUE)] == [row[0]]


async def test_a_committer_started_with_the_switch_sends_nothing_whatever_the_database_says(
    env: Env,
) -> None:
    """The restore runbook: "Before restoring a database, disable effect dispatch", in a
    way the restore cannot undo: the start-up switch (``CUSTODY_DISPATCH_PAUSED``),
    which the committer obeys as the publisher does. With the database flag clear (as
    a restored database may have it), a committer started with the switch commits the
    transition and sends nothing: its submit waits unclaimed."""
    held = dataclasses.replace(env.settings, dispatch_paused=True)
    async with running(env) as fleet:
        fleet.start("committer", held)
        await publish_starts(env.settings, [order(0)])

        async def queued() -> bool:
            return len(await _outbox(env)) == 1

        await wait_until(queued, timeout=20, what="the submit queued")
        fleet.check_alive()
        [(_, kind, status, claimed_by, attempts)] = await _outbox(env)
        assert (kind, status, claimed_by, attempts) == ("submit", "pending", None, 0)
        assert await drain(env.settings, QUEUE, timeout=1.0) == []


class _Recorder:
    """A broker publisher that confirms every message at once and keeps their ids."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    async def publish_many(self, outgoing: Sequence[broker.Outgoing]) -> list[broker.Outcome]:
        self.sent.extend(o.message_id for o in outgoing)
        return [broker.Outcome(o.message_id, True) for o in outgoing]


async def _claimed(env: Env, holder: str, ids: Sequence[str]) -> list[dict[str, Any]]:
    """Outbox rows queued already claimed by ``holder`` (as a commit queues them), and
    each as the commit hands it to its sender."""
    for i in ids:
        await env.sql(
            "INSERT INTO custody.outbox (id, kind, exchange, routing_key, body, claimed_by,"
            " claim_expires_at, publish_attempts)"
            " VALUES (%s, 'query', %s, 'inventory.v1', '{}', %s,"
            " clock_timestamp() + interval '1 minute', 1)",
            (i, broker.EXCHANGE_COMMANDS, holder),
        )
    return [
        {
            "id": i,
            "exchange": broker.EXCHANGE_COMMANDS,
            "routing_key": "inventory.v1",
            "body": b"{}",
            "headers": {},
            "publish_attempts": 1,
        }
        for i in ids
    ]


def _sender(
    database: db.Database, recorder: _Recorder | broker.Publisher, holder: str, ttl: float
) -> OutboxPublisher:
    """An engine sender of ``holder``'s claims that publishes through ``recorder`` (one
    that records what it publishes, or the broker's)."""
    sender = OutboxPublisher(
        owner="engine",
        database=database,
        lease=None,
        publisher=cast(broker.Publisher, recorder),
        batch_size=10,
        claim_ttl_s=ttl,
        engine=True,
        worker="committer",
    )
    sender.holder = holder
    return sender


@contextlib.asynccontextmanager
async def _waiting(
    sender: OutboxPublisher,
) -> AsyncIterator[tuple[supervisor.Stop, supervisor.Waker, asyncio.Task[None]]]:
    """The sender's loop, running and waiting for work (a hand-over sends at once); its
    stop and its task, ended on the way out."""
    stop = supervisor.Stop(grace_s=1)
    waker = supervisor.Waker(poll_s=30)

    async def nothing() -> None:
        return None

    loop = asyncio.create_task(outbox.loop(sender, stop, waker, nothing, "committer"))
    try:
        await wait_until(
            lambda: _true(sender._looping), timeout=5, what="the sender waiting for work"
        )
        yield stop, waker, loop
    finally:
        stop.event.set()
        waker.kick()
        await asyncio.wait_for(loop, 5)


async def test_a_submit_handed_over_half_a_claim_ago_is_left_to_the_publishers_claim(
    env: Env,
) -> None:
    """A send must start well inside its claim: once the claim expired, the row may have
    been retired (its operation settled or cancelling), or be held by a pause or a
    suspension, which only a claim checks. A row handed to the sender more than half
    its claim's life ago (the broker stalled, the process was paused) is not published
    from there: it stays pending and claimed until its claim expires, then the
    publisher claims it. A fresh one is sent and marked."""
    holder, ttl = "committer-test", 0.4
    ids = [str(uuid.uuid4()) for _ in range(2)]
    rows = await _claimed(env, holder, ids)
    recorder = _Recorder()
    async with role_database(env.settings.database_url, "custody_committer") as database:
        sender = _sender(database, recorder, holder, ttl)
        stale, fresh = rows
        sender.hand([stale])
        await asyncio.sleep(ttl / 2 + 0.05)  # the condition itself: half the claim's life
        sender.hand([fresh])
        assert await sender.run_once(claim=False) == 1
        assert await sender.run_once(claim=False) == 0
        assert sender.handed == []
    assert recorder.sent == [fresh["id"]]
    left = {
        str(r[0]): r[1:]
        for r in await env.sql(
            "SELECT id, status, claimed_by FROM custody.outbox WHERE id = ANY(%s)", (ids,)
        )
    }
    assert left == {stale["id"]: ("pending", holder), fresh["id"]: ("published", None)}


async def test_a_publish_whose_claim_got_too_old_waiting_for_the_window_is_not_sent(
    env: Env,
) -> None:
    """A batch's publishes wait for room in the confirm window; a broker slow to confirm
    must not make one leave after its claim may have expired (retired, or held by a
    pause, since): a message past its ``not_after`` is not sent, its outcome a failure
    (``unsent``), which releases its row for a later claim. One inside it is sent."""
    late, due = str(uuid.uuid4()), str(uuid.uuid4())
    async with client(env.settings) as amqp:
        publisher = await amqp.publisher(window=1, timeout_s=5, user_id=None)
        outcomes = await publisher.publish_many(
            [
                broker.Outgoing(
                    late,
                    broker.EXCHANGE_COMMANDS,
                    "inventory.v1",
                    b"{}",
                    not_after=time.monotonic() - 0.001,
                ),
                broker.Outgoing(
                    due,
                    broker.EXCHANGE_COMMANDS,
                    "inventory.v1",
                    b"{}",
                    not_after=time.monotonic() + 60,
                ),
            ]
        )
    assert [(o.message_id, o.ok, o.error.split(":")[0]) for o in outcomes] == [
        (late, False, broker.UNSENT),
        (due, True, ""),
    ]
    assert [d.message_id for d in await drain(env.settings, QUEUE)] == [due]


async def test_a_submit_handed_to_a_waiting_sender_leaves_at_once_and_is_marked_after_its_confirm(
    env: Env,
) -> None:
    """Issue 14's light load ("two broker hops, not a poll interval"): a commit's submit
    handed to its sender while the sender waits for work is published from the
    committing task's own turn of the event loop, ahead of that unit's acks and of the
    sender's wake-up; the sender's next cycle marks it, only after its confirm ("Broker
    confirmation"). Handed to a sender whose loop is not waiting, nothing leaves before
    a cycle runs. A sender asked to stop while such a publish is out ends its loop only
    once it is settled and marked: it is not sent a second time after its claim is
    given back."""
    holder = "committer-test"
    ids = [str(uuid.uuid4()) for _ in range(3)]
    rows = await _claimed(env, holder, ids)
    idle, waiting, stopped = rows
    idle_id, waiting_id, stopped_id = ids

    async def status(i: str) -> tuple[object, ...]:
        [row] = await env.sql("SELECT status, claimed_by FROM custody.outbox WHERE id = %s", (i,))
        return row

    recorder = _Recorder()
    # the publisher's role: these are query rows, which a committer's role never holds
    async with role_database(env.settings.database_url, "custody_publisher") as database:
        sender = _sender(database, recorder, holder, 60)
        # no loop waits: it leaves with the next cycle, not before
        sender.hand([idle])
        for _ in range(5):
            await asyncio.sleep(0)
        assert recorder.sent == []
        assert await sender.run_once(claim=False) == 1
        assert recorder.sent == [idle_id]
        assert await status(idle_id) == ("published", None)

        async with _waiting(sender) as (stop, waker, loop):
            sender.hand([waiting])
            await asyncio.sleep(0)  # one turn: the sender's own wake-up takes several
            assert recorder.sent == [idle_id, waiting_id]
            await wait_until(lambda: _is_published(env, waiting_id), timeout=5, what="its mark")
            assert await status(waiting_id) == ("published", None)
            await wait_until(
                lambda: _true(sender._looping), timeout=5, what="the sender waiting again"
            )
            stop.event.set()
            sender.hand([stopped])  # sent at once, while the stop is under way
            waker.kick()
            await loop
        await sender.release_handed()
    assert recorder.sent == [idle_id, waiting_id, stopped_id]
    assert await status(stopped_id) == ("published", None)


async def _true(value: bool) -> bool:
    return value


async def _is_published(env: Env, i: str) -> bool:
    return await env.scalar("SELECT status FROM custody.outbox WHERE id = %s", (i,)) == "published"


async def test_a_handed_over_submit_is_on_the_wire_before_the_committing_unit_goes_on(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 14, light load ("a few fsync'd commits and two broker hops"): a submit
    handed over to a sender that waits for work is written to the broker's socket
    before ``hand_over`` returns, so the committing unit's tail (its acks, metrics and
    logs) runs after it, not in front of it; every hop of an operation's way waited for
    that tail. The row, committed before it was handed over, is then marked published
    by the sender once the broker confirmed it ("Broker confirmation | The configured
    broker accepted the publication under its transport policy")."""
    holder = "committer-test"
    [row_id] = ids = [str(uuid.uuid4())]
    [row] = await _claimed(env, holder, ids)
    written: list[bytes] = []
    real = asyncio.selector_events._SelectorSocketTransport.write  # type: ignore[attr-defined]

    def recorded(self: Any, data: Any) -> None:
        written.append(bytes(data))
        real(self, data)

    async with (
        client(env.settings, "hand-over") as amqp,
        role_database(env.settings.database_url, "custody_publisher") as database,
    ):
        publisher = await amqp.publisher(window=8, timeout_s=10, user_id=None)
        await publisher._ready()  # its channel open, as a running worker's is
        sender = _sender(database, publisher, holder, 60)
        async with _waiting(sender):
            monkeypatch.setattr(
                asyncio.selector_events._SelectorSocketTransport,  # type: ignore[attr-defined]
                "write",
                recorded,
            )
            await sender.hand_over([row])
            on_the_wire = any(row_id.encode() in w for w in written)
            monkeypatch.undo()
            assert on_the_wire, "the handed-over submit was not written before hand_over returned"
            # marked only once confirmed, as before
            await wait_until(lambda: _is_published(env, row_id), timeout=5, what="its mark")
        await sender.release_handed()
    got = await drain(env.settings, QUEUE, timeout=1.0)
    assert [d.message_id for d in got] == [row_id]
