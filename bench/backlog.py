"""The backlog: custody's tables as they look after a while in service, seeded with SQL
before a burst, so that the burst measures the hot queries on full tables, not on the
empty ones a fresh database gives.

The rows are copies of the run's own warm-up instances (real rows, written by the
workers a moment before), multiplied with ``generate_series`` in one ``INSERT ...
SELECT`` per table, every id remapped (``md5(copy || id)::uuid``, so every reference
between the tables stays consistent) and every timestamp moved into the past:

* **finished**: whole instances, completed or failed and compensated, with everything
  they left behind (node activations, operations, attempts, published outbox rows,
  history, receipt inbox rows, done successor intents), spread over the last 20 hours,
  until at least ``finished`` operations exist;
* **pending**: ``pending`` instances still running, each with one operation the
  participant has **accepted** and not finished yet (a long-running call: its submit
  published, its ``accepted`` receipt applied, its deadline two days away). They are in
  the partial indexes the workers read (``operations_open``, ``instances_status``), so
  the reconciler's deadline sweep, the receipts' and the publisher's lookups and the
  committer's have to index past them; nothing may touch them during the run.

Then ``VACUUM ANALYZE`` (the statistics and visibility map a table in service has) and a
``CHECKPOINT`` (so that the seeding's writes are not flushed inside the measured
window).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from bench.common import BenchFailure

TEMPLATE = "warm-%"  # the warm-up instances are the template
FINISHED_SPAN_S = 20 * 3600
PENDING_SPAN_S = 6 * 3600
PENDING_DEADLINE = "2 days"

# (table, which template rows, copied for finished / for pending copies)
_FINISHED_FROM = {
    "instances": "t.id IN (SELECT id FROM tmpl_i)",
    "node_states": "t.instance_id IN (SELECT id FROM tmpl_i)",
    "operations": "t.instance_id IN (SELECT id FROM tmpl_i)",
    "attempts": "t.operation_id IN (SELECT id FROM tmpl_o)",
    "outbox": "t.operation_id IN (SELECT id FROM tmpl_o)",
    "history": "t.instance_id IN (SELECT id FROM tmpl_i)",
    "receipt_inbox": "t.operation_id IN (SELECT id FROM tmpl_o)",
    "successor_intents": "t.instance_id IN (SELECT id FROM tmpl_i)",
}
_PENDING_FROM = {
    "instances": "t.id IN (SELECT instance_id FROM tmpl_p)",
    "node_states": "t.operation_id IN (SELECT id FROM tmpl_p)",
    "operations": "t.id IN (SELECT id FROM tmpl_p)",
    "attempts": "t.operation_id IN (SELECT id FROM tmpl_p)",
    "outbox": "t.operation_id IN (SELECT id FROM tmpl_p)",
    # what an instance waiting on an accepted call has recorded so far
    "history": "(t.operation_id IN (SELECT id FROM tmpl_p) AND t.event IN"
    " ('node.activated', 'operation.dispatched', 'operation.accepted'))"
    " OR (t.operation_id IS NULL AND t.event = 'instance.started'"
    " AND t.instance_id IN (SELECT instance_id FROM tmpl_p))",
    "receipt_inbox": "t.operation_id IN (SELECT id FROM tmpl_p) AND t.status = 'accepted'",
}
# columns set to what a pending row holds instead of the template's finished values
_PENDING_SET = {
    "instances": {"status": "'running'", "finished_at": "NULL"},
    "node_states": {"status": "'active'"},
    "operations": {
        "status": "'accepted'",
        "effect": "'unknown'",
        "owner_revision": "1",
        "result": "NULL",
        "error": "NULL",
        "retry_at": "NULL",
        "finished_at": "NULL",
        "deadline_seconds": "172800",
        "deadline_at": f"now() + interval '{PENDING_DEADLINE}' - g.shift",
    },
}


@dataclass
class Backlog:
    finished: int  # at least this many finished operations
    pending: int  # this many pending (accepted, far deadline) operations


@dataclass
class Seeded:
    backlog: Backlog
    finished_ops: int
    pending_ops: int
    rows: int  # every row inserted, all tables
    seconds: float  # seeding, VACUUM ANALYZE and CHECKPOINT
    database_mb: float  # the engine database's size afterwards
    instances: dict[str, int]  # status -> instances seeded
    succeeded: dict[str, int]  # operation -> succeeded operations seeded


async def _columns(conn: psycopg.AsyncConnection[tuple[Any, ...]], table: str) -> list[Any]:
    return await (
        await conn.execute(
            "SELECT column_name, data_type, coalesce(column_default, '')"
            " FROM information_schema.columns"
            " WHERE table_schema = 'custody' AND table_name = %s ORDER BY ordinal_position",
            (table,),
        )
    ).fetchall()


def _select_list(columns: list[Any], table: str, overrides: dict[str, str]) -> tuple[str, str]:
    """The column list and the SELECT expressions of one copy: uuids remapped, times
    moved back by the copy's shift, serial ids left to their sequence."""
    names, exprs = [], []
    for name, data_type, default in columns:
        if default.startswith("nextval("):
            continue
        col = f"t.{name}"
        if name in overrides:
            expr = overrides[name]
        elif data_type == "uuid":
            expr = f"md5(g.ns || {col}::text)::uuid"
        elif data_type == "timestamp with time zone":
            expr = f"{col} - g.shift"
        elif table == "instances" and name == "input":
            expr = f"jsonb_set({col}, '{{order_id}}', to_jsonb(g.ns || ({col}->>'order_id')))"
        elif name == "lineage":
            expr = (
                f"jsonb_set({col}, '{{instance_id}}',"
                " to_jsonb(md5(g.ns || t.instance_id::text)::uuid::text))"
            )
        else:
            expr = col
        if data_type == "USER-DEFINED" and name in overrides and overrides[name] != "NULL":
            expr = f"{expr}::custody.{_enum_of(table, name)}"
        names.append(name)
        exprs.append(expr)
    return ", ".join(names), ", ".join(exprs)


def _enum_of(table: str, column: str) -> str:
    return {
        ("instances", "status"): "instance_status",
        ("operations", "status"): "operation_status",
        ("operations", "effect"): "effect",
    }[(table, column)]


async def _counts(conn: psycopg.AsyncConnection[tuple[Any, ...]]) -> tuple[dict[str, int], ...]:
    inst = await (
        await conn.execute("SELECT status::text, count(*) FROM custody.instances GROUP BY 1")
    ).fetchall()
    ops = await (
        await conn.execute(
            "SELECT operation, count(*) FROM custody.operations"
            " WHERE status = 'succeeded' GROUP BY 1"
        )
    ).fetchall()
    return {str(k): int(v) for k, v in inst}, {str(k): int(v) for k, v in ops}


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


async def seed(engine_url: str, backlog: Backlog, template: str = TEMPLATE) -> Seeded:
    started = time.monotonic()
    async with await psycopg.AsyncConnection.connect(
        engine_url, autocommit=True, application_name="bench-seed"
    ) as conn:
        inst_before, ops_before = await _counts(conn)
        rows = 0
        async with conn.transaction():
            await conn.execute(
                "CREATE TEMP TABLE tmpl_i ON COMMIT DROP AS SELECT id FROM custody.instances"
                " WHERE input->>'order_id' LIKE %s AND finished_at IS NOT NULL",
                (template,),
            )
            await conn.execute(
                "CREATE TEMP TABLE tmpl_o ON COMMIT DROP AS SELECT id FROM custody.operations"
                " WHERE instance_id IN (SELECT id FROM tmpl_i)"
            )
            # a pending instance: the first operation of a template instance, accepted
            await conn.execute(
                "CREATE TEMP TABLE tmpl_p ON COMMIT DROP AS"
                " SELECT DISTINCT ON (instance_id) id, instance_id FROM custody.operations"
                " WHERE instance_id IN (SELECT id FROM tmpl_i) ORDER BY instance_id, created_at"
            )
            counts = await (
                await conn.execute(
                    "SELECT (SELECT count(*) FROM tmpl_o), (SELECT count(*) FROM tmpl_p)"
                )
            ).fetchone()
            assert counts is not None
            per_copy_ops, per_copy_pending = int(counts[0]), int(counts[1])
            if not per_copy_ops or not per_copy_pending:
                raise BenchFailure("backlog: no finished warm-up instance to copy")
            finished_copies = math.ceil(backlog.finished / per_copy_ops)
            pending_copies = math.ceil(backlog.pending / per_copy_pending)
            for kind, copies, span, sources in (
                ("f", finished_copies, FINISHED_SPAN_S, _FINISHED_FROM),
                ("p", pending_copies, PENDING_SPAN_S, _PENDING_FROM),
            ):
                for table, where in sources.items():
                    columns = await _columns(conn, table)
                    overrides = _PENDING_SET.get(table, {}) if kind == "p" else {}
                    names, exprs = _select_list(columns, table, overrides)
                    statement = (
                        f"INSERT INTO custody.{table} ({names})"
                        f" SELECT {exprs} FROM custody.{table} t CROSS JOIN ("
                        f"  SELECT '{kind}' || n || '/' AS ns,"
                        f"   make_interval(secs => ({copies} - n + 1) * {span / copies:.3f}) AS"
                        f"   shift FROM generate_series(1, {copies}) n) g"
                        f" WHERE {where}"
                    )
                    cur = await conn.execute(sql.SQL(statement))
                    rows += max(0, cur.rowcount)
        tables = ", ".join(f"custody.{t}" for t in _FINISHED_FROM)
        await conn.execute(sql.SQL(f"VACUUM (ANALYZE) {tables}"))
        # a role without pg_checkpoint: the seeding's writes are flushed later
        with contextlib.suppress(psycopg.errors.InsufficientPrivilege):
            await conn.execute("CHECKPOINT")
        inst_after, ops_after = await _counts(conn)
        size = await (
            await conn.execute("SELECT pg_database_size(current_database()) / 1048576.0")
        ).fetchone()
    instances = _delta(inst_after, inst_before)
    succeeded = _delta(ops_after, ops_before)
    return Seeded(
        backlog=backlog,
        finished_ops=finished_copies * per_copy_ops,
        pending_ops=pending_copies * per_copy_pending,
        rows=rows,
        seconds=time.monotonic() - started,
        database_mb=float(size[0]) if size else 0.0,
        instances=instances,
        succeeded=succeeded,
    )
