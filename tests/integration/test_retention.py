"""The retention horizon: "Receipt retention and deduplication history must cover
every permitted retry, replay and restore horizon.\""""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator

import psycopg
import pytest
from psycopg import sql as pg_sql

from contracts import codec
from tests.conftest import Env, wait_until
from tests.harness import InProcessFleet, drain, order, publish_raw, publish_starts
from tests.integration.test_participant import submit
from tests.integration.test_recovery import custody
from workers.core import horizon, process
from workers.engine import retention
from workers.io import broker, db
from workers.settings import ROOT


def run_worker(env: Env, worker: str, **extra: str) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, "-m", "workers.cli", "run", worker]
    if worker == "participant":
        args += ["--name", "inventory"]
        extra.setdefault("CUSTODY_AMQP_URL", env.participant_amqp("inventory"))
    return subprocess.run(
        args,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env.fleet_env(), **extra},
    )


@pytest.mark.parametrize("worker", ["committer", "participant"])
def test_start_up_refuses_a_horizon_shorter_than_retry_replay_and_restore(
    env: Env, worker: str
) -> None:
    """A configuration whose horizon is shorter than the longest retry window plus the
    replay and restore horizon is refused at start-up, naming the numbers."""
    _, catalog = process.load_config(env.settings)
    window = horizon.longest_retry_window(catalog)
    assert window.where == "node 'charge' of order-fulfilment v1"  # 3 attempts of 60 s + 1 + 2
    assert window.seconds == 183
    result = run_worker(
        env,
        worker,
        CUSTODY_RETENTION_S="1000",
        CUSTODY_REPLAY_HORIZON_S="600",
        CUSTODY_RESTORE_HORIZON_S="1200",
    )
    assert result.returncode == 2, result.stderr
    # a participant says it on stderr before its logging starts; an engine worker's
    # refusal is its worker.crashed log line, on stdout with every log line
    assert (
        "CUSTODY_RETENTION_S=1000s is shorter than the longest retry window (183s, node "
        "'charge' of order-fulfilment v1) + CUSTODY_REPLAY_HORIZON_S (600s) + "
        "CUSTODY_RESTORE_HORIZON_S (1200s) = 1983s"
    ) in result.stderr + result.stdout


@pytest.fixture
async def inventory(env: Env) -> AsyncIterator[InProcessFleet]:
    f = InProcessFleet(env)
    f.start("inventory")
    yield f
    await f.stop_all()


async def test_a_replay_inside_the_horizon_is_deduplicated_after_cleanup(
    env: Env, inventory: InProcessFleet
) -> None:
    """Cleanup keeps everything younger than the horizon: a replay of a settled command
    is still answered with its receipt, and executes nothing."""
    cmd = submit()
    await publish_raw(env.settings, broker.EXCHANGE_COMMANDS, "inventory.v1", [codec.encode(cmd)])

    async def done() -> bool:
        return (
            await env.scalar(
                "SELECT count(*) FROM participant_inventory.inbox WHERE status = 'succeeded'",
                participant=True,
            )
            == 1
        )

    await wait_until(done, what="the command to complete")
    first = await drain(env.settings, broker.QUEUE_RECEIPTS, timeout=1.0)
    cleaned = await custody(env, "retention", "cleanup", "--participant", "inventory", "--json")
    assert cleaned.returncode == 0, cleaned.stderr
    assert '"inbox": 0' in cleaned.stdout
    await publish_raw(env.settings, broker.EXCHANGE_COMMANDS, "inventory.v1", [codec.encode(cmd)])
    again = await drain(env.settings, broker.QUEUE_RECEIPTS, timeout=2.0)
    assert [d.body for d in again] == [first[-1].body]
    assert (
        await env.scalar(
            "SELECT count(*) FROM participant_inventory.reservations", participant=True
        )
        == 1
    )


async def test_cleanup_removes_settled_history_older_than_the_horizon_in_batches(
    env: Env, inventory: InProcessFleet
) -> None:
    """Older than the horizon: the settled command's identity, receipts and published
    outbox rows go; an unsettled (accepted) command is never removed."""
    cmds = [submit() for _ in range(3)]
    await publish_raw(
        env.settings, broker.EXCHANGE_COMMANDS, "inventory.v1", [codec.encode(c) for c in cmds]
    )

    async def done() -> bool:
        return (
            await env.scalar(
                "SELECT count(*) FROM participant_inventory.inbox WHERE status = 'succeeded'",
                participant=True,
            )
            == 3
        )

    await wait_until(done, what="the commands to complete")

    async def published() -> bool:
        return (
            await env.scalar(
                "SELECT count(*) FROM participant_inventory.outbox WHERE status = 'pending'",
                participant=True,
            )
            == 0
        )

    await wait_until(published, what="the receipts published")
    # time passes (the test moves the settled rows' clocks back past the horizon)
    await env.sql(
        "UPDATE participant_inventory.inbox SET completed_at = now() - interval"
        " '40 days' WHERE request_id = %s",
        (cmds[0].request_id,),
        participant=True,
    )
    await env.sql(
        "UPDATE participant_inventory.outbox SET published_at = now() - interval '40 days'",
        participant=True,
    )
    cleaned = await custody(env, "retention", "cleanup", "--participant", "inventory", "--json")
    assert cleaned.returncode == 0, cleaned.stderr
    # one outbox row per command: the samples' handlers run inline, so there is no
    # accepted receipt and the terminal one is the row that was sent
    assert '"inbox": 1' in cleaned.stdout and '"outbox": 3' in cleaned.stdout
    left = await env.sql(
        "SELECT request_id::text FROM participant_inventory.inbox ORDER BY 1", participant=True
    )
    assert sorted(r for (r,) in left) == sorted(c.request_id for c in cmds[1:])
    assert (
        await env.scalar(
            "SELECT count(*) FROM participant_inventory.receipts WHERE request_id = %s",
            (cmds[0].request_id,),
            participant=True,
        )
        == 0
    )


# The data lifecycle: finished instances leave the hot tables -------------------------

DAY = 86400.0
HORIZON = 30 * DAY
TABLES = ["instances", "operations", "node_states", "attempts", "history", "successor_intents"]


def _instance(
    env: Env,
    *,
    status: str = "completed",
    finished_days: float | None = 40,
    op_status: str = "succeeded",
    tenant: str = "acme",
) -> tuple[str, str]:
    """An instance with one operation, its node state, attempt, history and successor
    intent, finished (if ``finished_days``) that many days ago: (instance, operation)."""
    iid, oid = str(uuid.uuid4()), str(uuid.uuid4())
    finished = None if finished_days is None else f"{finished_days} days"
    with psycopg.connect(env.settings.database_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO custody.instances (id, tenant, start_request_id, process,"
            " process_version, input, status, requested_by, routes, finished_at)"
            " VALUES (%s, %s, gen_random_uuid(), 'order-fulfilment', 1, '{}', %s, 'test', '{}',"
            " now() - %s::interval)",
            (iid, tenant, status, finished),
        )
        conn.execute(
            "INSERT INTO custody.operations (id, tenant, instance_id, node, activation,"
            " operation, route, owner, principal, binding, input, lineage, attempt, digest,"
            " status, deadline_seconds, finished_at) VALUES (%s, %s, %s, 'reserve', 1,"
            " 'inventory.reserve', 'inventory', 'inventory', 'custody-inventory',"
            " 'inventory.v1', '{}', '{}', 1, 'x', %s, 60, now() - %s::interval)",
            (oid, tenant, iid, op_status, finished),
        )
        conn.execute(
            "INSERT INTO custody.node_states (instance_id, node, activation, operation_id,"
            " status) VALUES (%s, 'reserve', 1, %s, 'succeeded')",
            (iid, oid),
        )
        conn.execute(
            "INSERT INTO custody.attempts (request_id, operation_id, attempt, kind, digest)"
            " VALUES (gen_random_uuid(), %s, 1, 'submit', 'x')",
            (oid,),
        )
        conn.execute(
            "INSERT INTO custody.history (instance_id, operation_id, event, actor)"
            " VALUES (%s, %s, 'operation.succeeded', 'receipts'),"
            "        (%s, NULL, 'instance.completed', 'committer')",
            (iid, oid, iid),
        )
        conn.execute(
            "INSERT INTO custody.successor_intents (instance_id, from_operation_id, outcome,"
            " status) VALUES (%s, %s, 'succeeded', 'done')",
            (iid, oid),
        )
    return iid, oid


def _rows(env: Env, schema: str, iid: str) -> dict[str, list[str]]:
    """Every row of the instance in ``schema`` (custody or custody_archive), per table,
    as JSON text."""
    by_instance = {
        "instances": "id = %(i)s",
        "operations": "instance_id = %(i)s",
        "node_states": "instance_id = %(i)s",
        "attempts": "operation_id IN (SELECT id FROM {s}.operations WHERE instance_id = %(i)s)",
        "history": "instance_id = %(i)s",
        "successor_intents": "instance_id = %(i)s",
    }
    found: dict[str, list[str]] = {}
    with psycopg.connect(env.settings.database_url) as conn:
        for table, where in by_instance.items():
            query = pg_sql.SQL("SELECT to_jsonb(x)::text FROM {}.{} x WHERE {} ORDER BY 1").format(
                pg_sql.Identifier(schema),
                pg_sql.Identifier(table),
                pg_sql.SQL(where.replace("{s}", schema)),  # type: ignore[arg-type]
            )
            found[table] = [r for (r,) in conn.execute(query, {"i": iid}).fetchall()]
    return found


async def _cleanup_as_reconciler(env: Env) -> dict[str, int]:
    """The reconciler's cleanup, under the reconciler's own role."""
    url = db.with_user(env.settings.database_url, "custody_reconciler")
    async with db.connected(url, schema="custody", name="reconciler") as database:
        return await retention.cleanup(database, HORIZON, archive_s=HORIZON)


async def test_finished_instances_past_the_horizon_move_to_the_archive_and_nothing_else(
    env: Env,
) -> None:
    """Past the horizon, a finished instance leaves the hot tables with its operations,
    node states, attempts, history and successor intents, and the archive holds the very
    same rows; a younger one, an unfinished one, one whose operation is unsettled, and
    one whose receipt is still kept for deduplication all stay. Audit rows stay."""
    old, old_op = _instance(env)
    young, _ = _instance(env, finished_days=10)
    running, _ = _instance(env, status="running", finished_days=None, op_status="accepted")
    unsettled, _ = _instance(env, status="failed", op_status="outcome_unknown")
    # a receipt of this operation came a day ago: its deduplication row is kept for the
    # retention horizon, and a repeat of it could still arrive
    receipt_kept, receipt_op = _instance(env)
    await env.sql(
        "INSERT INTO custody.receipt_inbox (receipt_id, operation_id, attempt, owner_revision,"
        " status, content_hash, decision, received_at)"
        " VALUES (gen_random_uuid(), %s, 1, 2, 'succeeded', 'h', 'duplicate',"
        " now() - interval '1 day')",
        (receipt_op,),
    )
    # a command sent for it is still kept in the outbox (published five days ago)
    outbox_kept, outbox_op = _instance(env)
    await env.sql(
        "INSERT INTO custody.outbox (id, kind, exchange, routing_key, body, operation_id,"
        " status, published_at) VALUES (gen_random_uuid(), 'query', 'custody.commands',"
        " 'inventory.v1', '', %s, 'published', now() - interval '5 days')",
        (outbox_op,),
    )
    await env.sql(
        "INSERT INTO custody.audit (actor, action, tenant, target, reason, outcome)"
        " VALUES ('oncall', 'reconcile', 'acme', %s, 'asked the owner', 'done')",
        (old_op,),
    )
    before = _rows(env, "custody", old)
    assert all(before.values())

    removed = await _cleanup_as_reconciler(env)

    assert removed["archived_instances"] == 1
    assert _rows(env, "custody_archive", old) == before
    assert not any(_rows(env, "custody", old).values())
    for kept in (young, running, unsettled, receipt_kept, outbox_kept):
        assert all(_rows(env, "custody", kept).values()), kept
        assert not any(_rows(env, "custody_archive", kept).values()), kept
    assert await env.scalar("SELECT count(*) FROM custody.audit WHERE target = %s", (old_op,)) == 1

    # idempotent: a second pass moves nothing and changes nothing
    again = await _cleanup_as_reconciler(env)
    assert again["archived_instances"] == 0
    assert _rows(env, "custody_archive", old) == before

    # time passes for the kept receipt and outbox row: the same pass removes them first,
    # then archives their instances
    await env.sql("UPDATE custody.receipt_inbox SET received_at = now() - interval '31 days'")
    await env.sql("UPDATE custody.outbox SET published_at = now() - interval '31 days'")
    later = await _cleanup_as_reconciler(env)
    assert later["receipt_inbox"] == 1 and later["outbox"] == 1
    assert later["archived_instances"] == 2
    for moved in (receipt_kept, outbox_kept):
        assert not any(_rows(env, "custody", moved).values())
        assert all(_rows(env, "custody_archive", moved).values())


async def test_the_archival_is_bounded_per_transaction(env: Env) -> None:
    """One call moves at most its batch; the cleanup repeats until none is left."""
    for _ in range(5):
        _instance(env)
    [(first,)] = await env.sql("SELECT custody_archive.move_finished(%s, 2)", (HORIZON,))
    assert first == 2
    assert await env.scalar("SELECT count(*) FROM custody_archive.instances") == 2
    assert await env.scalar("SELECT count(*) FROM custody_archive.operations") == 2
    url = db.with_user(env.settings.database_url, "custody_reconciler")
    async with db.connected(url, schema="custody", name="reconciler") as database:
        assert await retention.archive(database, HORIZON) == 3
    assert await env.scalar("SELECT count(*) FROM custody.instances") == 0


def test_the_archiver_may_delete_only_settled_instances_and_operations(env: Env) -> None:
    """Whatever query runs as the archive's owner, row-level security lets it delete only
    finished instances and settled operations: a live one is invisible to its DELETE."""
    running, op = _instance(env, status="running", finished_days=None, op_status="accepted")
    with psycopg.connect(env.settings.database_url) as conn:
        conn.execute("SET ROLE custody_archiver")
        assert conn.execute("DELETE FROM custody.attempts WHERE operation_id = %s", (op,)).rowcount
        assert conn.execute("DELETE FROM custody.operations WHERE id = %s", (op,)).rowcount == 0
        assert conn.execute("DELETE FROM custody.instances WHERE id = %s", (running,)).rowcount == 0
        conn.rollback()


def test_the_archive_tables_have_the_hot_tables_columns_in_order(env: Env) -> None:
    """The archival copies rows with ``SELECT *``: a column added to a hot table and not
    to its archive table (or in another place) fails here, not in production."""
    with psycopg.connect(env.settings.database_url) as conn:
        columns = conn.execute(
            "SELECT n.nspname::text, c.relname::text,"
            " array_agg(a.attname::text || ' ' || format_type(a.atttypid, a.atttypmod)"
            "           ORDER BY a.attnum)"
            " FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid"
            " JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname IN ('custody', 'custody_archive') AND c.relkind = 'r'"
            " AND a.attnum > 0 AND NOT a.attisdropped GROUP BY 1, 2"
        ).fetchall()
    by_schema: dict[str, dict[str, list[str]]] = {}
    for schema, table, cols in columns:
        by_schema.setdefault(schema, {})[table] = cols
    assert set(by_schema["custody_archive"]) == set(TABLES)
    for table in TABLES:
        assert by_schema["custody_archive"][table] == by_schema["custody"][table], table


async def test_an_operator_reads_only_its_tenants_archived_rows(env: Env) -> None:
    """Row-level security holds in the archive as in the hot tables: acme-support reads
    acme's archived instances, operations, history, node states, attempts and successor
    intents, none of globex's; an operator of every tenant reads them all."""
    mine, _ = _instance(env, tenant="acme")
    theirs, _ = _instance(env, tenant="globex")
    assert (await _cleanup_as_reconciler(env))["archived_instances"] == 2
    for table in TABLES:
        query = pg_sql.SQL("SELECT count(*) FROM custody_archive.{}").format(
            pg_sql.Identifier(table)
        )
        with psycopg.connect(env.settings.database_url) as conn:
            [(everything,)] = conn.execute(query).fetchall()
        assert everything >= 2, table
        acme = db.with_user(env.settings.database_url, "acme-support")
        with psycopg.connect(acme) as conn:
            [(seen,)] = conn.execute(query).fetchall()
        assert 0 < seen < everything, table
        with psycopg.connect(db.with_user(env.settings.database_url, "oncall")) as conn:
            [(wide,)] = conn.execute(query).fetchall()
        assert wide == everything, table
    acme = db.with_user(env.settings.database_url, "acme-support")
    with psycopg.connect(acme) as conn:
        ids = [r for (r,) in conn.execute("SELECT id::text FROM custody_archive.instances")]
    assert ids == [mine] and theirs not in ids


async def test_a_start_replayed_after_its_instance_was_archived_creates_nothing(env: Env) -> None:
    """Deduplication history must cover every permitted replay: archiving a finished
    instance does not forget its start request. The same start, sent again once its
    instance lives in the archive, creates no second instance (and no second run of its
    effects), under the committer's own role; a new start in the same batch does."""
    archived, _ = _instance(env)
    [start_id] = await env.sql(
        "SELECT start_request_id::text FROM custody.instances WHERE id = %s", (archived,)
    )
    assert (await _cleanup_as_reconciler(env))["archived_instances"] == 1
    fleet = InProcessFleet(env)
    fleet.start_all(engine=("committer",), participants=())
    try:
        [again, fresh] = await publish_starts(
            env.settings,
            [order(1), order(2)],
            start_request_ids=[start_id[0], str(uuid.uuid4())],
        )

        async def fresh_started() -> bool:
            return bool(
                await env.scalar(
                    "SELECT count(*) FROM custody.instances WHERE start_request_id = %s",
                    (fresh,),
                )
            )

        await wait_until(fresh_started, what="the new start's instance")
        assert await drain(env.settings, broker.QUEUE_REQUESTS, timeout=0.5) == []
    finally:
        await fleet.stop_all()
    assert (
        await env.scalar(
            "SELECT count(*) FROM custody.instances WHERE start_request_id = %s", (again,)
        )
        == 0
    )
    assert await env.scalar("SELECT count(*) FROM custody.quarantine") == 0


async def test_an_instance_whose_start_is_being_committed_is_left_for_the_next_pass(
    env: Env,
) -> None:
    """The archival takes the lock a start of the same request takes: while a start
    holds it, that instance stays in the hot tables (the start then sees it and creates
    nothing); once it is released, the next pass moves it."""
    iid, _ = _instance(env)
    [(tenant, start_id)] = await env.sql(
        "SELECT tenant, start_request_id::text FROM custody.instances WHERE id = %s", (iid,)
    )
    async with await psycopg.AsyncConnection.connect(env.settings.database_url) as holder:
        await holder.execute(
            "SELECT pg_advisory_xact_lock(hashtext(%s || '/' || %s))", (tenant, start_id)
        )
        assert (await _cleanup_as_reconciler(env))["archived_instances"] == 0
        await holder.rollback()
    assert (await _cleanup_as_reconciler(env))["archived_instances"] == 1
