"""The receipt consumer applies a batch with set-based statements (one ``operation_apply``
and one ``node_finish`` for all its rows): a batch that holds an operation's
``accepted`` receipt and its terminal receipt applies them as they would apply one
after the other.

The seed: "Successful application records the result and next-step intent atomically"
and "Older owner revisions cannot roll state backward." The fold of two changes of one
operation (``records.fold_updates``) must keep the first change's guard, the last
one's state and the result, and record both receipts once.

The batch is built without timing luck: the participant runs its handlers after
acceptance (inline off), so it sends two receipts per operation, and the receipt
consumer starts only once all of them wait in its queue; receipts recorded in one
transaction share its transaction id (``xmin``), which shows that both receipts of an
operation were in one batch.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.conftest import Env, wait_until
from tests.harness import InProcessFleet, RoundTrips, order, publish_starts, role_database
from tests.integration.test_least_privilege import _row
from workers import errors
from workers.core import lifecycle, records
from workers.engine import receipts
from workers.io import db

ORDERS = 12


async def _published_receipts(env: Env) -> int:
    return int(
        await env.scalar(
            "SELECT count(*) FROM participant_inventory.outbox WHERE status = 'published'",
            participant=True,
        )
    )


async def test_an_accepted_and_a_terminal_receipt_in_one_batch_apply_as_in_sequence(
    env: Env,
) -> None:
    """Successful application records the result and next-step intent atomically, and
    older owner revisions cannot roll state backward: an operation's accepted and
    succeeded receipts applied in one set-based batch leave it succeeded (revision 2,
    effect applied, result kept, finished), its node finished, one successor intent,
    both receipts recorded once and both status changes in its history."""
    fleet = InProcessFleet(env)
    fleet.start_all(engine=("committer", "publisher"), participants=())
    fleet.start(
        "inventory",
        dataclasses.replace(env.participant_settings("inventory"), participant_inline=False),
    )
    try:
        await publish_starts(env.settings, [order(i) for i in range(ORDERS)])

        # two receipts per reserve (accepted, then succeeded), all waiting in the queue
        async def all_sent() -> bool:
            return await _published_receipts(env) == 2 * ORDERS

        await wait_until(all_sent, 60, what="both receipts of every reserve sent")
        fleet.start("receipts")

        async def all_applied() -> bool:
            n = await env.scalar(
                "SELECT count(*) FROM custody.operations"
                " WHERE node = 'reserve' AND status = 'succeeded'"
            )
            return bool(n == ORDERS)

        await wait_until(all_applied, 60, what="every reserve applied")
        fleet.check_alive()
    finally:
        await fleet.stop_all()

    rows = await env.sql(
        "SELECT o.owner_revision, o.effect::text, o.result IS NOT NULL, o.finished_at IS NOT NULL,"
        "       (SELECT status FROM custody.node_states n WHERE n.operation_id = o.id),"
        "       (SELECT count(*) FROM custody.successor_intents s"
        "         WHERE s.from_operation_id = o.id),"
        "       (SELECT array_agg(event ORDER BY id) FROM custody.history h"
        "         WHERE h.operation_id = o.id AND h.event IN"
        "               ('operation.accepted', 'operation.succeeded'))"
        "  FROM custody.operations o WHERE o.node = 'reserve'"
    )
    assert len(rows) == ORDERS
    for row in rows:
        assert row == (
            2,
            "applied",
            True,
            True,
            "succeeded",
            1,
            ["operation.accepted", "operation.succeeded"],
        )
    # each receipt recorded once; both of an operation in one transaction for at least
    # one operation, so the fold was exercised (one batch took the whole queue)
    recorded = await env.sql(
        "SELECT operation_id, count(*), count(DISTINCT owner_revision),"
        "       count(DISTINCT xmin::text)"
        "  FROM custody.receipt_inbox r"
        " WHERE operation_id IN (SELECT id FROM custody.operations WHERE node = 'reserve')"
        " GROUP BY operation_id"
    )
    assert len(recorded) == ORDERS
    assert all(n == 2 and revisions == 2 for _, n, revisions, _ in recorded)
    assert any(transactions == 1 for *_, transactions in recorded)


def _accepted(oid: str, expected: lifecycle.Status) -> records.OperationUpdate:
    return records.OperationUpdate(
        id=oid,
        expected=expected,
        status=lifecycle.Status.ACCEPTED,
        effect=lifecycle.Effect.UNKNOWN,
        owner_revision=1,
        receipt_hash="h",
    )


async def test_a_change_whose_operation_moved_under_its_lock_fails_its_unit_whole(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Successful application records the result and next-step intent atomically: each
    change of a batch is guarded by the status its receipt was judged from. The batch's
    one statement raises when a change's operation is no longer in that status (it
    changed under its row lock: CU004, the unit is redone, re-reading everything), so
    the unit keeps nothing it sent, and the receipt consumer does not wait for the
    statement's row count: the consumer's writes of a batch and its commit cost one
    round trip, under the receipt consumer's own role."""
    moved, kept = _row(env, "operations", "dispatched"), _row(env, "operations", "dispatched")

    async def apply(database: db.Database, oid: str, judged: lifecycle.Status) -> None:
        """The receipt consumer's writes of a batch (``receipts.write``), in a unit."""
        iid = await env.scalar("SELECT instance_id FROM custody.operations WHERE id = %s", (oid,))
        writes = receipts.Writes(
            updates=[_accepted(oid, judged)],
            history=[records.History(iid, "operation.accepted", "receipts", operation_id=oid)],
        )
        async with database.transaction() as tx:
            await receipts.write(tx, writes)

    async with role_database(env.settings.database_url, "custody_receipts") as database:
        with pytest.raises(errors.DatabaseError) as failed:
            await apply(database, moved, lifecycle.Status.PENDING)
        assert failed.value.sqlstate == errors.ROW_CHANGED_SQLSTATE
        assert failed.value.kind is errors.Retry.RETRY

        trips = RoundTrips(monkeypatch)
        await apply(database, kept, lifecycle.Status.DISPATCHED)
        assert trips.n == 1

    rows = await env.sql(
        "SELECT o.id::text, o.status::text,"
        " (SELECT count(*) FROM custody.history h WHERE h.operation_id = o.id)"
        " FROM custody.operations o WHERE o.id = ANY(%s::uuid[])",
        ([moved, kept],),
    )
    assert sorted(rows) == sorted([(kept, "accepted", 1), (moved, "dispatched", 0)])
