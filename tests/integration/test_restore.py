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
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from tests.conftest import PG_ADMIN, Env, wait_until
from tests.harness import InProcessFleet, order, publish_starts
from tests.integration.test_recovery import custody


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
    fleet.start_all(engine=("reconciler",))
    # the committer and the receipt consumer send the submits they commit
    for w in ("committer", "receipts", "publisher"):
        fleet.start(w, held)
    for step in ("mark-restored", "reconcile"):
        result = await custody(env, "restore", step, "--reason", "restored from last night's dump")
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

    report = await custody(env, "restore", "report")
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

    early = await custody(env, "dispatch", "resume", "--reason", "not through the runbook")
    assert early.returncode == 0  # clears the database flag only: the start-up switch holds
    assert (
        await env.scalar(
            "SELECT count(*) FROM custody.outbox WHERE kind = 'submit' AND status = 'pending'"
        )
        == 10
    )
    result = await custody(env, "restore", "resume", "--reason", "journals reconciled")
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


async def _dump(env: Env, dump: Path) -> None:
    subprocess.run(
        ["pg_dump", "-Fc", "-f", str(dump), env.settings.database_url],
        check=True,
        capture_output=True,
        timeout=120,
    )


async def _instance_settles(env: Env, status: str, timeout: float = 40) -> None:
    async def reached() -> bool:
        rows = await env.sql(
            "SELECT i.status::text, bool_and(o.status::text IN"
            " ('succeeded', 'failed', 'cancelled'))"
            " FROM custody.instances i JOIN custody.operations o ON o.instance_id = i.id"
            " GROUP BY i.status"
        )
        return rows == [(status, True)]

    await wait_until(reached, timeout=timeout, what=f"the instance {status}, its work settled")


async def _one_operation_held(env: Env, fleet: InProcessFleet) -> None:
    """The whole fleet, dispatch paused, one instance whose first submit is held."""
    fleet.start_all()
    paused = await custody(env, "dispatch", "pause", "--reason", "hold the submit")
    assert paused.returncode == 0, paused.stderr
    await publish_starts(env.settings, [order(1)])

    async def created() -> bool:
        return await env.scalar("SELECT count(*) FROM custody.operations") == 1

    await wait_until(created, what="the operation, its submit held")


async def _restore_and_reconcile(env: Env, fleet: InProcessFleet, dump: Path) -> None:
    await fleet.stop_all()
    restore_from(env, dump)
    held = dataclasses.replace(env.settings, dispatch_paused=True)  # the start-up switch
    fleet.start_all(engine=("reconciler",))
    # the committer and the receipt consumer send the submits they commit
    for w in ("committer", "receipts", "publisher"):
        fleet.start(w, held)
    for step in ("mark-restored", "reconcile"):
        result = await custody(env, "restore", step, "--reason", "restored from the dump")
        assert result.returncode == 0, result.stderr


@pytest.mark.timeout(180)
async def test_a_cancelling_operation_is_reconciled_after_a_restore(
    env: Env, fleet: InProcessFleet, tmp_path: Path
) -> None:
    """The seed: "Reconcile source journals, owner receipts and task state before
    resuming." The dump holds an operation ``cancelling``; the cancel's answer was
    consumed after the dump (in the lost future). The restore reconciles it like
    every non-terminal operation: the owner's journal says cancelled, the operation
    and the instance settle, and the report then counts nothing unanswered."""
    await _one_operation_held(env, fleet)
    inventory = next(r for r in fleet.running if r.name == "inventory")
    await fleet.stop(inventory)  # the cancel waits in the broker
    iid = await env.scalar("SELECT id::text FROM custody.instances")
    cancelled = await custody(env, "cancel", iid, "--reason", "customer withdrew")
    assert cancelled.returncode == 0, cancelled.stderr

    async def cancel_sent() -> bool:
        return (
            await env.scalar("SELECT status FROM custody.outbox WHERE kind = 'cancel'")
            == "published"
        )

    await wait_until(cancel_sent, what="the cancel confirmed by the broker")
    dump = tmp_path / "engine.dump"
    await _dump(env, dump)  # the operation is cancelling, its cancel already sent
    fleet.start("inventory")
    await _instance_settles(env, "cancelled")  # the lost future

    await _restore_and_reconcile(env, fleet, dump)
    await _instance_settles(env, "cancelled")
    report = await custody(env, "restore", "report")
    assert report.returncode == 0, report.stderr
    assert json.loads(report.stdout)["unanswered"] == 0
    resumed = await custody(env, "restore", "resume", "--reason", "journals reconciled")
    assert resumed.returncode == 0, resumed.stderr
    rows = await env.sql(
        "SELECT count(*) FROM participant_inventory.reservations", participant=True
    )
    assert rows == [(0,)], "a cancelled order reserves nothing"


@pytest.mark.timeout(180)
async def test_a_cancel_from_the_lost_future_is_evidence_for_the_restored_engine(
    env: Env, fleet: InProcessFleet, tmp_path: Path
) -> None:
    """The seed: "A restored engine can predate an effect that already committed
    elsewhere." The dump predates the cancel: the restored engine holds the operation
    in flight with its submit held, while the owner's journal says it was cancelled
    (under a cancel command the restored engine never issued). The reconcile answer
    is evidence: validated, it settles the operation and the instance as cancelled (no
    quarantine as unknown_request or illegal_transition), and the held submit is
    retired, never sent."""
    await _one_operation_held(env, fleet)
    dump = tmp_path / "engine.dump"
    await _dump(env, dump)  # before the cancel
    iid = await env.scalar("SELECT id::text FROM custody.instances")
    cancelled = await custody(env, "cancel", iid, "--reason", "customer withdrew")
    assert cancelled.returncode == 0, cancelled.stderr
    await _instance_settles(env, "cancelled")  # the lost future

    await _restore_and_reconcile(env, fleet, dump)
    await _instance_settles(env, "cancelled")
    assert await env.scalar("SELECT count(*) FROM custody.quarantine") == 0
    resumed = await custody(env, "restore", "resume", "--reason", "journals reconciled")
    assert resumed.returncode == 0, resumed.stderr
    publisher = next(r for r in fleet.running if r.name == "publisher")
    await fleet.stop(publisher)
    fleet.start("publisher")

    async def retired() -> bool:
        return (
            await env.scalar("SELECT status FROM custody.outbox WHERE kind = 'submit'") == "retired"
        )

    await wait_until(retired, timeout=20, what="the held submit retired")
    rows = await env.sql(
        "SELECT count(*) FROM participant_inventory.reservations", participant=True
    )
    assert rows == [(0,)], "a cancelled order reserves nothing"
