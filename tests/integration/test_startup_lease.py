"""A worker whose database restarts during its start-up waits for it, as at open.

docs/deploy.md: "A worker that starts while Postgres or RabbitMQ is unreachable (a
restart order, a rolling restart of the broker) does not exit: it stays live and
NotReady and keeps trying". The chaos runs showed a gap: an engine worker opened its
pool, was still waiting for the broker when a ``pg_restart`` fault restarted Postgres,
and its first use of the dead pooled connection, taking its lease, raised: the
committer and the receipts worker exited 2 at start-up (the fleet restarted them).
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg
import pytest

from tests.conftest import Env
from workers import errors
from workers.io import db, startup

NAME = "lease-probe"


def _terminate_backends(env: Env) -> int:
    """What a Postgres restart does to the probe's pooled connection: this test's own
    (its database's), never the same-named probe of a test running beside it on another
    test worker's database."""
    with psycopg.connect(env.settings.database_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE application_name = %s AND datname = current_database()",
            (f"custody-{NAME}",),
        ).fetchone()
    assert row is not None
    return int(row[0])


async def _opened(env: Env) -> db.Database:
    database = db.Database(
        env.settings.database_url, schema="custody", name=NAME, min_size=1, max_size=1
    )
    await database.open()
    return database


@pytest.mark.timeout(60)
async def test_a_lease_whose_connection_died_during_start_up_is_waited_for_not_a_crash(
    env: Env,
) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []

    def report(name: str, level: int = logging.INFO, **fields: Any) -> None:
        seen.append((name, fields))

    with startup.patient(startup.Patience(wait=True, report=report)):
        database = await _opened(env)
        try:
            assert _terminate_backends(env) == 1
            lease = db.Lease(NAME, ttl_s=30)
            epoch = await database.first_lease(lease)
        finally:
            await database.close()
    assert epoch >= 1 and lease.epoch == epoch
    retries = [f for name, f in seen if name == "database.connect_retry"]
    assert retries and retries[0]["phase"] == "lease", seen
    held = await env.scalar("SELECT epoch FROM custody.leases WHERE holder = %s", (lease.holder,))
    assert held == epoch


@pytest.mark.timeout(60)
async def test_a_command_that_takes_a_lease_still_fails_at_once(env: Env) -> None:
    """Outside a worker (no patience to wait), the failure is raised, not waited out."""
    database = await _opened(env)
    try:
        assert _terminate_backends(env) == 1
        with pytest.raises(errors.DatabaseError):
            await database.first_lease(db.Lease(NAME, ttl_s=30))
    finally:
        await database.close()
