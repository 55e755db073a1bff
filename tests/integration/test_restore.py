"""The restore runbook, for real: a pg_dump taken mid-run, work continuing (effects
commit at participants), the engine database restored from the dump, the runbook.

The seed: "Before restoring a database, disable effect dispatch. Reconcile source
journals, owner receipts and task state before resuming. A restored engine can
predate an effect that already committed elsewhere."
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from tests.conftest import PG_ADMIN, Env, wait_until
from tests.harness import InProcessFleet, order, publish_starts
from tests.integration.test_recovery import custody


@pytest.fixture
async def fleet(env: Env) -> AsyncIterator[InProcessFleet]:
    f = InProcessFleet(env)
    yield f
    await f.stop_all()


async def completed(env: Env) -> int:
    return int(
        await env.scalar("SELECT count(*) FROM custody.instances WHERE status = 'completed'")
    )


def restore_from(env: Env, dump: Path) -> None:
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(env.engine_db)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(env.engine_db)))
    subprocess.run(
        ["pg_restore", "--no-owner", "-d", env.settings.database_url, str(dump)],
        check=True,
        capture_output=True,
        timeout=120,
    )


@pytest.mark.timeout(240)
async def test_the_restore_runbook_loses_nothing_doubles_nothing_and_reports_the_lost_future(
    env: Env, fleet: InProcessFleet, tmp_path: Path
) -> None:
    s = env.settings
    fleet.start_all()
    await publish_starts(s, [order(i) for i in range(10)])  # A: settled before the dump

    async def a_done() -> bool:
        return await completed(env) == 10

    await wait_until(a_done, what="batch A")
    payments = next(r for r in fleet.running if r.name == "payments")
    await fleet.stop(payments)
    await publish_starts(s, [order(i) for i in range(100, 110)])  # B: in flight at the dump

    async def b_at_charge() -> bool:
        return (
            await env.scalar(
                "SELECT count(*) FROM custody.operations"
                " WHERE node = 'charge' AND status = 'dispatched'"
            )
            == 10
        )

    await wait_until(b_at_charge, what="batch B waiting at charge")
    dump = tmp_path / "engine.dump"
    subprocess.run(
        ["pg_dump", "-Fc", "-f", str(dump), s.database_url],
        check=True,
        capture_output=True,
        timeout=120,
    )

    fleet.start("payments")  # the lost future: B completes, C starts and completes
    await publish_starts(s, [order(i) for i in range(200, 205)])  # C

    async def all_done() -> bool:
        return await completed(env) == 25

    await wait_until(all_done, timeout=60, what="B and C to complete after the dump")
    await fleet.stop_all()

    restore_from(env, dump)  # the engine forgets B's progress and C entirely
    assert await completed(env) == 10

    held = dataclasses.replace(s, dispatch_paused=True)  # the start-up switch
    fleet.start_all(engine=("committer", "receipts", "reconciler"))
    fleet.start("publisher", held)
    for step in ("mark-restored", "reconcile"):
        result = custody(env, "restore", step, "--reason", "restored from last night's dump")
        assert result.returncode == 0, result.stderr

    async def answered() -> bool:
        return (
            await env.scalar(
                "SELECT count(*) FROM custody.operations"
                " WHERE status IN ('reconcile_pending', 'dispatched')"
            )
            == 0
        )

    await wait_until(answered, timeout=60, what="every reconcile query answered")
    # B's charges are proven by the payments journal; their successors were re-created
    # with the same identities, but effect dispatch is still held
    assert (
        await env.scalar(
            "SELECT count(*) FROM custody.operations WHERE node = 'charge' AND status = 'succeeded'"
        )
        == 20
    )
    held_submits = await env.scalar(
        "SELECT count(*) FROM custody.outbox WHERE kind = 'submit' AND status = 'pending'"
    )
    assert held_submits == 10

    report = custody(env, "restore", "report")
    assert report.returncode == 0, report.stderr
    lost = json.loads(report.stdout)
    unknown = {(r["participant"], r["operation"]) for r in lost["unknown_to_engine"]}
    assert unknown == {
        ("inventory", "inventory.reserve"),
        ("payments", "payments.charge"),
        ("shipping", "shipping.ship"),
    }
    assert lost["effects_unknown_to_engine"] == 15  # C's 5 instances x 3 effects
    assert lost["unanswered"] == 0

    early = custody(env, "dispatch", "resume", "--reason", "not through the runbook")
    assert early.returncode == 0  # clears the database flag only: the start-up switch holds
    assert (
        await env.scalar(
            "SELECT count(*) FROM custody.outbox WHERE kind = 'submit' AND status = 'pending'"
        )
        == 10
    )
    result = custody(env, "restore", "resume", "--reason", "journals reconciled")
    assert result.returncode == 0, result.stderr
    publisher = next(r for r in fleet.running if r.name == "publisher")
    await fleet.stop(publisher)
    fleet.start("publisher")

    async def b_done() -> bool:
        return await completed(env) == 20

    await wait_until(b_done, timeout=60, what="batch B to complete after resume")
    for schema, table in (
        ("inventory", "reservations"),
        ("payments", "charges"),
        ("shipping", "shipments"),
    ):
        rows = await env.sql(
            f"SELECT count(*), count(DISTINCT operation_id) FROM participant_{schema}.{table}",
            participant=True,
        )
        assert rows == [(25, 25)], f"{schema}.{table}: no effect executed twice"
    assert await env.scalar("SELECT restore_generation FROM custody.control") == 2
    audit = [a for (a,) in await env.sql("SELECT action FROM custody.audit ORDER BY id")]
    assert audit == ["restore", "restore", "resume", "resume"]
