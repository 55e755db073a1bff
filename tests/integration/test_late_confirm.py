"""A broker confirm dispatches only the attempt whose submit it confirms
(workers/runtime/outbox.py).

The seed: "Workflow separates the intent to execute an operation from transport
acceptance" and "It does not interpret timeout as permission to create a new
operation." The confirm of attempt n's submit is transport acceptance of attempt n's
command, and nothing else: arriving after retry-safe created attempt n+1 (status back
to pending, its own submit not yet sent), it must not mark attempt n+1 dispatched and
start its deadline, or attempt n+1 could reach outcome_unknown without its command
ever having been published.

The race is built without timing luck: only the committer runs, held by the start-up
switch (``CUSTODY_DISPATCH_PAUSED``, so that it sends nothing itself), so attempt 1's
submit waits in the outbox; the engine's real OutboxPublisher (in the least-privilege
publisher role) claims it, as if it were now publishing it; the operation is put in
authoritative retry_waiting with effect none (test setup, as the superuser: the receipt
that would say so is not the subject here); the operator's real retry-safe creates
attempt 2, whose submit the publisher claims too; then the confirms are marked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest

from tests.conftest import Env
from tests.harness import InProcessFleet, order, publish_starts, role_database
from tests.integration.test_recovery import custody, op_id, until_status
from workers.io import broker, db
from workers.runtime.outbox import OutboxPublisher


async def _operation(env: Env, oid: str) -> tuple[Any, ...]:
    [row] = await env.sql(
        "SELECT status::text, attempt, deadline_at IS NULL FROM custody.operations WHERE id = %s",
        (oid,),
    )
    return row


async def _dispatched_events(env: Env, oid: str) -> int:
    return int(
        await env.scalar(
            "SELECT count(*) FROM custody.history"
            " WHERE operation_id = %s AND event = 'operation.dispatched'",
            (oid,),
        )
    )


@pytest.fixture
async def publisher(env: Env) -> AsyncIterator[OutboxPublisher]:
    """The engine's outbox publisher, as the custody_publisher role, without a broker
    (claim and mark never publish: the test plays the broker's confirms)."""
    async with role_database(env.settings.database_url, "custody_publisher") as database:
        lease = db.Lease("publisher", ttl_s=30)
        await database.acquire(lease)
        yield OutboxPublisher(
            owner="engine",
            database=database,
            lease=lease,
            publisher=cast(broker.Publisher, None),
            batch_size=10,
            claim_ttl_s=60,
            engine=True,
        )


async def _attempt_two_while_one_is_in_flight(
    env: Env, pub: OutboxPublisher
) -> tuple[str, dict[int, str], list[dict[str, Any]]]:
    """Attempt 1's submit claimed (being published), then attempt 2 created by
    retry-safe and its submit claimed: the operation id, the submits' request ids by
    attempt, and the claimed outbox rows."""
    fleet = InProcessFleet(env)
    # held by the start-up switch, the committer leaves its submit in the outbox
    fleet.start("committer", dataclasses.replace(env.settings, dispatch_paused=True))
    try:
        await publish_starts(env.settings, [order(1)])
        await until_status(env, "reserve", "pending")
    finally:
        await fleet.stop_all()
    oid = await op_id(env, "reserve")
    first = await pub.claim()
    await env.sql(
        "UPDATE custody.operations SET status = 'retry_waiting', effect = 'none' WHERE id = %s",
        (oid,),
    )
    done = await custody(env, "retry-safe", oid, "--reason", "gateway is back, retrying")
    assert done.returncode == 0, done.stderr
    assert await _operation(env, oid) == ("pending", 2, True)
    second = await pub.claim()
    submits = dict(
        await env.sql(
            "SELECT attempt, request_id::text FROM custody.attempts"
            " WHERE operation_id = %s AND kind = 'submit'",
            (oid,),
        )
    )
    assert [str(r["id"]) for r in first] == [submits[1]]
    assert [str(r["id"]) for r in second] == [submits[2]]
    return oid, submits, first + second


async def test_a_late_confirm_of_attempt_one_does_not_dispatch_attempt_two(
    env: Env, publisher: OutboxPublisher
) -> None:
    """Workflow separates the intent to execute an operation from transport acceptance;
    it does not interpret timeout as permission to create a new operation: a confirm
    of attempt 1's submit arriving after attempt 2 exists leaves attempt 2 pending with
    no deadline; only the confirm of attempt 2's own submit dispatches it."""
    oid, submits, rows = await _attempt_two_while_one_is_in_flight(env, publisher)

    await publisher.mark(rows, [broker.Outcome(submits[1], ok=True)])  # the late confirm
    assert (
        await env.scalar("SELECT status FROM custody.outbox WHERE id = %s", (submits[1],))
        == "published"
    )
    assert await _operation(env, oid) == ("pending", 2, True)
    assert await _dispatched_events(env, oid) == 0

    await publisher.mark(rows, [broker.Outcome(submits[2], ok=True)])
    assert await _operation(env, oid) == ("dispatched", 2, False)
    assert await _dispatched_events(env, oid) == 1


async def test_confirms_of_both_attempts_in_one_batch_dispatch_the_current_one(
    env: Env, publisher: OutboxPublisher
) -> None:
    """Transport acceptance of the current attempt's submit dispatches it even when the
    same mark also confirms an older attempt's submit (once: one history row)."""
    oid, submits, rows = await _attempt_two_while_one_is_in_flight(env, publisher)
    await publisher.mark(rows, [broker.Outcome(submits[n], ok=True) for n in (1, 2)])
    assert await _operation(env, oid) == ("dispatched", 2, False)
    assert await _dispatched_events(env, oid) == 1
