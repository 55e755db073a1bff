"""The receipt consumer activates the successor of a receipt it applies, in the receipt's
own transaction (workers/engine/receipts.py, workers/engine/activate.py), where it
locked the instance without waiting and found it running; the submit leaves from its
own sender right after the commit. Real Postgres, real RabbitMQ.

Issue 14 (light load: "a few fsync'd commits and two broker hops, not a poll
interval"): no NOTIFY, no wake-up of the committer and no claim transaction stand
between a receipt and the next command any more. What must not move:

- "Workflow receipt application | A validated result and successor intent commit
  once": the intent is written, done, in the commit that applies the result;
- "Workflow transition | Node state, history, operation/attempt and dispatch intent
  commit together": the successor's rows commit in that same transaction;
- "A success that wins the race remains Succeeded on the operation, even when
  cancellation prevents further successors": an instance whose row someone else holds
  (a cancel, the committer) is not waited for; its intent is left pending to the
  committer, which judges it under the instance's lock, as always;
- "Before restoring a database, disable effect dispatch": a receipt consumer started
  paused sends nothing; its successors' submits wait unclaimed for the publisher.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
from collections.abc import Sequence

import pytest

from tests.conftest import Env, wait_until
from tests.harness import (
    PARTICIPANTS,
    InProcessFleet,
    RoundTrips,
    Statements,
    drain,
    held_instances,
    order,
    publish_starts,
    running,
)
from workers.engine import receipts
from workers.io import broker


async def _count(env: Env, sql: str) -> int:
    return int(await env.scalar(sql))


async def _is(env: Env, sql: str, n: int) -> bool:
    return await _count(env, sql) == n


async def _until(env: Env, sql: str, n: int, what: str, timeout: float = 20) -> None:
    """Wait until the count ``sql`` reads is ``n``."""
    await wait_until(lambda: _is(env, sql, n), timeout=timeout, what=what)


async def _first_operation_without_a_committer(env: Env, fleet: InProcessFleet) -> None:
    """One order started, its first operation created by the committer, which then stops
    (the participants run on): what follows is the receipt consumer's alone."""
    committer = fleet.start("committer")
    for p in PARTICIPANTS:
        fleet.start(p)
    await publish_starts(env.settings, [order(0)])
    await _until(env, "SELECT count(*) FROM custody.operations", 1, "the first operation")
    await fleet.stop(committer)


async def _committer_completes_it(env: Env, fleet: InProcessFleet) -> None:
    """The committer started again: the intent left pending is its, and the instance
    completes."""
    fleet.start("committer")
    await _until(
        env,
        "SELECT count(*) FROM custody.instances WHERE status = 'completed'",
        1,
        "the instance completed",
        timeout=30,
    )


async def _three_orders_through_receipts(env: Env, fleet: InProcessFleet) -> None:
    """Three orders started, their first operations created by the committer, which then
    stops: the receipt consumer alone takes each instance to its end."""
    committer = fleet.start("committer")
    for p in PARTICIPANTS:
        fleet.start(p)
    await publish_starts(env.settings, [order(i) for i in range(3)])
    await _until(env, "SELECT count(*) FROM custody.operations", 3, "3 first operations")
    await fleet.stop(committer)
    fleet.start("receipts")
    await _until(
        env,
        "SELECT count(*) FROM custody.instances WHERE status = 'completed'",
        3,
        "3 instances completed without a committer",
        timeout=30,
    )
    fleet.check_alive()


async def test_a_receipts_successor_is_activated_and_sent_in_its_own_transaction(
    env: Env,
) -> None:
    """With the committer stopped once the first operation is on its way (and no
    publisher running), instances still run to completion: each successor is activated
    by the receipt consumer in the transaction that applied its predecessor's receipt
    (the intent written done at that commit's time, the new operation created then), its
    submit published by the receipt consumer's sender and marked after the confirm, and
    the instance ended there too. No successor intent ever waited for the committer."""
    async with running(env) as fleet:
        await _three_orders_through_receipts(env, fleet)

        intents = await env.sql(
            "SELECT status, done_at = created_at FROM custody.successor_intents"
        )
        assert intents and set(intents) == {("done", True)}, intents
        # every later operation was created in the transaction that applied the receipt of
        # its predecessor, and dispatched by the receipt consumer's own confirm mark
        later = await env.sql(
            "SELECT o.status::text, o.created_at = s.done_at"
            "  FROM custody.operations o JOIN custody.successor_intents s"
            "    ON s.instance_id = o.instance_id AND s.next_node = o.node"
        )
        assert len(later) == 6 and set(later) == {("succeeded", True)}, later
        rows = await env.sql(
            "SELECT status, claimed_by, publish_attempts FROM custody.outbox WHERE kind = 'submit'"
        )
        assert rows == [("published", None, 1)] * 9
        actors = await env.sql(
            "SELECT DISTINCT actor FROM custody.history WHERE event = 'instance.completed'"
        )
        assert actors == [("receipts",)]


async def test_an_instance_someone_else_holds_is_not_waited_for_and_is_left_to_the_committer(
    env: Env,
) -> None:
    """While a transaction holds the instance's row (here a plain lock, as a cancel or
    the committer's claim holds it), the receipt is still applied and acked, without
    waiting: its result commits, and its successor intent is written pending. Once the
    lock is gone, the committer activates it (so nothing is lost, and the instance's
    status is judged under its lock, by whoever holds it)."""
    async with running(env) as fleet:
        await _first_operation_without_a_committer(env, fleet)
        async with held_instances(env):  # as a cancel or the committer's claim holds it
            fleet.start("receipts")
            await _until(
                env,
                "SELECT count(*) FROM custody.successor_intents WHERE status = 'pending'",
                1,
                "the successor intent written pending",
            )
            assert await env.scalar("SELECT status::text FROM custody.operations") == "succeeded"
            assert await _count(env, "SELECT count(*) FROM custody.operations") == 1
        await asyncio.sleep(0.5)
        assert await _count(env, "SELECT count(*) FROM custody.operations") == 1
        await _committer_completes_it(env, fleet)
        fleet.check_alive()


async def test_a_cancel_that_commits_first_is_seen_and_the_successor_is_not_activated(
    env: Env,
) -> None:
    """A success that wins the race remains Succeeded on the operation, even when
    cancellation prevents further successors: an instance that turned cancelling after
    its operation was sent, before the receipt is applied, gets the result recorded and
    no new operation; nothing more is sent."""
    async with running(env) as fleet:
        committer = fleet.start("committer")
        await publish_starts(env.settings, [order(0)])
        await _until(env, "SELECT count(*) FROM custody.operations", 1, "the first operation")
        await fleet.stop(committer)
        # the cancel commits first (as custody.cancel_in sets it); the participant then
        # answers the submit it already has
        await env.sql("UPDATE custody.instances SET status = 'cancelling'")
        for p in PARTICIPANTS:
            fleet.start(p)
        fleet.start("receipts")
        await _until(
            env,
            "SELECT count(*) FROM custody.operations WHERE status = 'succeeded'",
            1,
            "the success recorded",
        )
        await asyncio.sleep(0.5)
        fleet.check_alive()
        assert await _count(env, "SELECT count(*) FROM custody.operations") == 1
        assert await env.sql("SELECT status FROM custody.successor_intents") in ([], [("pending",)])
        assert await env.scalar("SELECT status::text FROM custody.instances") in (
            "cancelling",
            "cancelled",
        )


async def test_a_receipt_consumer_started_paused_sends_no_submit(env: Env) -> None:
    """Before restoring a database, disable effect dispatch: a receipt consumer started
    with CUSTODY_DISPATCH_PAUSED still activates the successor in the receipt's
    transaction, but queues its submit unclaimed and sends nothing."""
    async with running(env) as fleet:
        await _first_operation_without_a_committer(env, fleet)
        fleet.start("receipts", dataclasses.replace(env.settings, dispatch_paused=True))
        await _until(env, "SELECT count(*) FROM custody.operations", 2, "the successor activated")
        await asyncio.sleep(0.5)
        fleet.check_alive()
        second = await env.sql(
            "SELECT x.status, x.claimed_by, x.publish_attempts"
            "  FROM custody.outbox x JOIN custody.operations o ON o.id = x.operation_id"
            " WHERE x.kind = 'submit' AND o.status = 'pending'"
        )
        assert second == [("pending", None, 0)]
        assert await drain(env.settings, broker.command_queue("payments.v1"), timeout=1.0) == []


async def test_a_failed_activation_never_costs_the_receipt_its_application(env: Env) -> None:
    """A unit whose activation fails for a reason a redo will not cure (here a grant the
    deployment lacks: the receipt consumer may not insert into the outbox) is applied
    again at once without activating: "A validated result and successor intent commit
    once" still holds (the result and a pending intent), nothing is dead-lettered, and
    the committer activates the successor once it runs."""
    await env.sql("REVOKE INSERT ON custody.outbox FROM custody_receipts")
    try:
        async with running(env) as fleet:
            await _first_operation_without_a_committer(env, fleet)
            fleet.start("receipts")
            await _until(
                env,
                "SELECT count(*) FROM custody.successor_intents WHERE status = 'pending'",
                1,
                "the successor intent written pending",
            )
            fleet.check_alive()
            assert await env.scalar("SELECT status::text FROM custody.operations") == "succeeded"
            assert await _count(env, "SELECT count(*) FROM custody.operations") == 1
            assert await drain(env.settings, broker.QUEUE_DEAD, timeout=0.5) == []
            await env.sql("GRANT INSERT ON custody.outbox TO custody_receipts")
            await _committer_completes_it(env, fleet)
    finally:
        await env.sql("GRANT INSERT ON custody.outbox TO custody_receipts")


async def test_each_receipt_unit_costs_two_round_trips_and_13_statements_activating_or_ending(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 14's light load ("a few fsync'd commits and two broker hops"): a receipt
    consumer's unit waits for Postgres twice, its reads (the operations locked, what the
    receipts are judged by, the instances and what their successors are planned from)
    and its COMMIT's flight, whether it activates a successor or ends the instance (an
    end's history is written by the end's own statement, where waiting for which
    instances it ended cost a third), and sends at most thirteen statements (a batch's
    writes are one call: each statement costs the worker about 65 µs of its client
    path). "Workflow receipt application | A validated result and successor intent
    commit once": each instance still completes through it."""
    inside: contextvars.ContextVar[bool] = contextvars.ContextVar("inside", default=False)
    trips = RoundTrips(monkeypatch, where=inside.get)  # the receipt units' alone
    statements = Statements(monkeypatch, where=inside.get)
    costs: list[int] = []
    sent: list[int] = []
    apply = receipts.ReceiptConsumer.apply

    async def counted(
        self: receipts.ReceiptConsumer, deliveries: Sequence[broker.Delivery]
    ) -> list[str]:
        # the consumer's units run one after another: each one's count is its own
        before, before_sent = trips.n, statements.n
        token = inside.set(True)
        try:
            return await apply(self, deliveries)
        finally:
            inside.reset(token)
            costs.append(trips.n - before)
            sent.append(statements.n - before_sent)

    monkeypatch.setattr(receipts.ReceiptConsumer, "apply", counted)
    async with running(env) as fleet:
        await _three_orders_through_receipts(env, fleet)
    assert costs and set(costs) == {2}, costs
    # BEGIN, the seven reads; the writes in one call, the history, the activation or the
    # end, the fence, the COMMIT (sixteen when the writes were four statements)
    assert sent and max(sent) <= 13, sent
    ended = await env.sql(
        "SELECT DISTINCT actor FROM custody.history WHERE event = 'instance.completed'"
    )
    assert ended == [("receipts",)]
