"""A participant's receipts are queued claimed by its own publisher and handed to it after
the commit (workers/runtime/outbox.py, ``p_outbox_insert``): no other publisher takes
them while the claim holds, the claim expires for one that died, and a stopping one gives
its unsent claims back.

The seed: "Participant completion: the business effect and terminal receipt are
authoritative", and the broker confirmation boundary: a receipt's row is done only when
a confirm marked it. A receipt queued and never sent must stay claimable by someone.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest

from tests.conftest import Env
from tests.harness import RoundTrips, role_database
from workers import errors
from workers.io import broker, db
from workers.runtime.outbox import OutboxPublisher

SCHEMA = "participant_inventory"


@pytest.fixture
async def database(env: Env) -> AsyncIterator[db.Database]:
    url, role = env.settings.participant_database_url, "custody_participant_inventory"
    async with role_database(url, role, schema=SCHEMA, name="test-handoff") as d:
        yield d


def _publisher(database: db.Database, ttl: float, lease: db.Lease | None = None) -> OutboxPublisher:
    """A publisher of a participant's outbox, or with a lease of the engine's; nothing
    is published here."""
    return OutboxPublisher(
        owner="inventory" if lease is None else "engine",
        database=database,
        lease=lease,
        publisher=cast(broker.Publisher, None),
        batch_size=10,
        claim_ttl_s=ttl,
        engine=lease is not None,
    )


async def _queue(database: db.Database, holder: str | None, ttl: float) -> list[dict[str, Any]]:
    rows = [
        {
            "id": str(uuid.uuid4()),
            "exchange": broker.EXCHANGE_RECEIPTS,
            "routing_key": broker.RECEIPTS_KEY,
            "body": b"{}",
            "headers": {},
            "operation_id": str(uuid.uuid4()),
        }
        for _ in range(3)
    ]
    async with database.transaction() as tx:
        mine = await tx.rows(
            "p_outbox_insert", {"rows": db.jsonb(rows), "holder": holder, "ttl": ttl}
        )
    assert {r["id"] for r in mine} == {r["id"] for r in rows}
    return rows


async def test_handed_receipts_are_held_while_claimed_and_given_back_at_a_stop(
    database: db.Database,
) -> None:
    """Receipts queued for our publisher are not claimed by another while the claim
    holds; given back at a stop, another publisher claims them at once."""
    ours, other = _publisher(database, ttl=60), _publisher(database, ttl=60)
    rows = await _queue(database, ours.holder, 60)
    assert await other.claim() == []  # held for the publisher they were handed to

    ours.hand([{**r, "publish_attempts": 1} for r in rows])
    await ours.release_handed()
    assert ours.handed == []
    assert {str(r["id"]) for r in await other.claim()} == {r["id"] for r in rows}


async def test_a_handed_receipt_whose_publisher_died_is_claimed_after_the_claim_expires(
    database: db.Database,
) -> None:
    """A participant that died between its commit and the send leaves its receipts
    claimed; once the claim expires, any publisher claims and sends them."""
    rows = await _queue(database, "a-dead-participant", 0.0)
    claimed = await _publisher(database, ttl=60).claim()
    assert {str(r["id"]) for r in claimed} == {r["id"] for r in rows}


async def test_without_a_holder_receipts_are_queued_for_any_publisher(
    database: db.Database,
) -> None:
    """A participant runtime without its own publisher (a test's, a tool's) queues its
    receipts unclaimed: the terminal receipt stays authoritative and any publisher
    sends it, counted as its first attempt."""
    rows = await _queue(database, None, 60)
    claimed = await _publisher(database, ttl=60).claim()
    assert {str(r["id"]) for r in claimed} == {r["id"] for r in rows}
    assert {r["publish_attempts"] for r in claimed} == {1}


async def test_a_claim_is_answered_with_its_commit_in_one_round_trip(
    database: db.Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker confirmation boundary: a row is published only once its claim
    committed. The claim's rows come back with its commit's answer: the claim costs one
    round trip (it cost two: the claim's rows, then the commit), and what it returns is
    already claimed for everyone else."""
    rows = await _queue(database, None, 0.0)  # claimable by any publisher
    ours, other = _publisher(database, ttl=60), _publisher(database, ttl=60)
    trips = RoundTrips(monkeypatch)
    claimed = await ours.claim()
    assert trips.n == 1
    assert {str(r["id"]) for r in claimed} == {r["id"] for r in rows}
    assert {r["publish_attempts"] for r in claimed} == {1}
    assert await other.claim() == []  # committed: held for the publisher that claimed


async def test_a_fenced_claim_reads_no_row_and_leaves_it_to_the_live_publisher(
    env: Env,
) -> None:
    """The broker confirmation boundary: a publisher paused past its lease (its epoch
    was taken back since) must not publish what it claimed. Its claim's rows are read
    only once the commit answered, so a fenced claim raises before any is read, and
    claims nothing: the live publisher claims the row at once."""
    await env.sql(
        "INSERT INTO custody.outbox (id, kind, exchange, routing_key, body)"
        " VALUES (gen_random_uuid(), 'query', 'custody.commands', 'payments.v1', '')"
    )
    async with role_database(env.settings.database_url, "custody_publisher") as engine:
        lease = db.Lease("publisher", ttl_s=60)
        await engine.acquire(lease)
        paused = _publisher(engine, 60, db.Lease("publisher", lease.holder, lease.epoch, 60))
        await engine.acquire(lease)  # taken back: the paused one's epoch is stale
        with pytest.raises(errors.Fenced):
            await paused.claim()
        live = await _publisher(engine, 60, lease).claim()
        assert [r["kind"] for r in live] == ["query"]
