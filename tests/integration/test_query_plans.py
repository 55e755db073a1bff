"""EXPLAIN guards on the claim queries: each one reaches its rows through its index, not
by reading the whole table, and claims them with ``FOR UPDATE ... SKIP LOCKED``.

The claim queries run on every poll of every worker; on a table that grew to millions
of settled rows, a sequential scan turns each poll into a full read of the table. The
plans are taken on a database where the planner has a choice: a large table of
finished rows (the history a deployment accumulates), a small share of live ones, and
fresh statistics (``ANALYZE``). The statements are the ones the workers run, read by
name through ``workers.io.sql``; ``EXPLAIN`` (without ``ANALYZE``) executes nothing.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, LiteralString

import psycopg
import psycopg.types.json
import pytest
from psycopg import sql as pg_sql

from tests.conftest import clone_database
from workers import provision
from workers.engine import retention as engine_retention
from workers.io import sql
from workers.participant import retention as participant_retention

ROWS = 20_000  # settled rows per table; one in a hundred is live
PARTICIPANT = "inventory"
# Tables that grow with the traffic: never read in full by a claim.
GROWING = {
    "instances",
    "operations",
    "attempts",
    "outbox",
    "successor_intents",
    "inbox",
    "receipt_inbox",
    "quarantine",
    "history",
    "node_states",
    "receipts",
}

# name -> (the index the claim must use, parameters, engine or participant schema)
CLAIMS: dict[str, tuple[str, dict[str, Any], str]] = {
    "outbox_claim": (
        "outbox_pending",
        {"holder": "plan-test", "ttl": 30, "held": False, "limit": 50},
        "engine",
    ),
    "p_outbox_claim": (
        "outbox_pending",
        {"holder": "plan-test", "ttl": 30, "limit": 50},
        "participant",
    ),
    "p_exec_claim": (
        "inbox_open",
        {"ttl": 30, "token": "00000000-0000-0000-0000-00000000beef", "limit": 50},
        "participant",
    ),
    "successor_claim": ("successor_intents_pending", {"limit": 50}, "engine"),
    "operations_overdue": ("operations_open", {"limit": 50}, "engine"),
    "queries_overdue": ("operations_open", {"limit": 50}, "engine"),
    "retries_due": ("operations_open", {"limit": 50}, "engine"),
    "unknown_due": ("operations_open", {"base": 5, "limit": 50}, "engine"),
}


def _id(prefix: int) -> LiteralString:
    """A deterministic uuid per row of generate_series(g): ``<prefix>-...-<g in hex>``."""
    return f"('{prefix:08x}-0000-0000-0000-' || lpad(to_hex(g), 12, '0'))::uuid"


# a row's age: one in a hundred just past the 30-day horizon, the others younger
_AGE_G: LiteralString = (
    "(CASE WHEN g % 100 = 50 THEN interval '31 days' ELSE (g % 97) * interval '7 hours' END)"
)


def _age(key: LiteralString) -> LiteralString:
    """The same ages, for an update of existing rows, drawn from the row's ``key``."""
    return (
        f"(CASE WHEN abs(hashtext({key}::text)) % 100 = 50 THEN interval '31 days'"
        f" ELSE (abs(hashtext({key}::text)) % 97) * interval '7 hours' END)"
    )


ENGINE_ROWS: list[LiteralString] = [
    "INSERT INTO custody.instances (id, tenant, start_request_id, process, process_version,"
    " input, status, requested_by, routes)"
    f" SELECT {_id(1)}, 'acme', {_id(2)}, 'order-fulfilment', 1, '{{}}',"
    " (CASE WHEN g % 100 < 5 THEN 'running' ELSE 'completed' END)::custody.instance_status,"
    f" 'plan-test', '{{}}' FROM generate_series(1, {ROWS}) g",
    "INSERT INTO custody.operations (id, tenant, instance_id, node, activation, operation,"
    " route, owner, principal, binding, input, lineage, attempt, digest, status,"
    " deadline_seconds, deadline_at, retry_at, updated_at)"
    f" SELECT {_id(3)}, 'acme', {_id(1)}, 'n', 1, 'inventory.reserve', 'r', 'inventory',"
    " 'custody-inventory', 'b', '{}', '{}', 1, 'digest',"
    " (CASE g % 100 WHEN 0 THEN 'pending' WHEN 1 THEN 'dispatched' WHEN 2 THEN 'retry_waiting'"
    "  WHEN 3 THEN 'outcome_unknown' WHEN 4 THEN 'reconcile_pending' ELSE 'succeeded' END)"
    "::custody.operation_status,"
    " 60, now() - interval '1 minute', now() - interval '1 minute', now() - interval '1 hour'"
    f" FROM generate_series(1, {ROWS}) g",
    "INSERT INTO custody.attempts (request_id, operation_id, attempt, kind, digest)"
    f" SELECT {_id(4)}, {_id(3)}, 1, 'submit', 'digest' FROM generate_series(1, {ROWS}) g",
    "INSERT INTO custody.outbox (id, kind, exchange, routing_key, body, operation_id, status,"
    " next_attempt_at)"
    f" SELECT {_id(4)}, 'submit', 'custody.commands', 'inventory', '\\x00', {_id(3)},"
    " CASE WHEN g % 100 = 0 THEN 'pending' ELSE 'published' END, now() - interval '1 second'"
    f" FROM generate_series(1, {ROWS}) g",
    "INSERT INTO custody.successor_intents (instance_id, from_operation_id, outcome, status)"
    f" SELECT {_id(1)}, {_id(3)}, 'succeeded',"
    " CASE WHEN g % 100 = 0 THEN 'pending' ELSE 'done' END"
    f" FROM generate_series(1, {ROWS}) g",
    # The data lifecycle as it stands between two cleanups: what is settled finished over
    # the last 30 days, and one row in a hundred has just passed the 30-day horizon.
    f"UPDATE custody.instances SET finished_at = now() - {_age('id')} WHERE status <> 'running'",
    f"UPDATE custody.operations SET finished_at = now() - {_age('id')}"
    " WHERE status IN ('succeeded', 'failed', 'cancelled')",
    f"UPDATE custody.outbox SET published_at = now() - {_age('id')} WHERE status = 'published'",
    f"UPDATE custody.outbox SET status = 'retired', created_at = now() - {_age('id')}"
    " WHERE status = 'published' AND right(id::text, 2) = '07'",
    "INSERT INTO custody.receipt_inbox (receipt_id, operation_id, attempt, owner_revision,"
    f" status, content_hash, decision, received_at) SELECT {_id(6)}, {_id(3)}, 1, 1,"
    f" 'succeeded', 'h', 'applied', now() - {_AGE_G} FROM generate_series(1, {ROWS}) g",
    "INSERT INTO custody.quarantine (source, reason, detail, tenant, body, worker, received_at)"
    " SELECT 'custody.receipts', 'wrong_tenant', 'x', 'acme', '\\x00', 'receipts',"
    f" now() - {_AGE_G} FROM generate_series(1, {ROWS}) g",
    "INSERT INTO custody.history (instance_id, operation_id, event, actor)"
    f" SELECT {_id(1)}, {_id(3)}, 'operation.succeeded', 'plan-test'"
    f" FROM generate_series(1, {ROWS}) g",
    "INSERT INTO custody.node_states (instance_id, node, activation, operation_id, status)"
    f" SELECT {_id(1)}, 'n', 1, {_id(3)}, 'done' FROM generate_series(1, {ROWS}) g",
    # the archive a deployment's retention filled (as many instances again, moved there)
    "INSERT INTO custody_archive.instances SELECT * FROM custody.instances",
]

PARTICIPANT_ROWS: list[LiteralString] = [
    "INSERT INTO inbox (request_id, tenant, operation_id, attempt, operation, digest, command,"
    " status, effect, owner_revision)"
    f" SELECT {_id(4)}, 'acme', {_id(3)}, 1, 'inventory.reserve', 'digest', '{{}}',"
    " CASE WHEN g % 100 = 0 THEN 'accepted' ELSE 'succeeded' END,"
    " CASE WHEN g % 100 = 0 THEN 'none' ELSE 'applied' END, 1"
    f" FROM generate_series(1, {ROWS}) g",
    "INSERT INTO outbox (id, exchange, routing_key, body, operation_id, status, next_attempt_at)"
    f" SELECT {_id(5)}, 'custody.receipts', 'receipt', '\\x00', {_id(3)},"
    " CASE WHEN g % 100 = 0 THEN 'pending' ELSE 'published' END, now() - interval '1 second'"
    f" FROM generate_series(1, {ROWS}) g",
    "INSERT INTO receipts (receipt_id, request_id, owner_revision, body)"
    f" SELECT {_id(7)}, {_id(4)}, 1, '\\x00' FROM generate_series(1, {ROWS}) g",
    f"UPDATE inbox SET completed_at = now() - {_age('request_id')} WHERE status <> 'accepted'",
    f"UPDATE outbox SET published_at = now() - {_age('id')} WHERE status = 'published'",
]


@pytest.fixture(scope="module")
def databases(templates: tuple[str, str]) -> Iterator[dict[str, tuple[str, str]]]:
    """An engine and a participant database of their own (clones of the session's
    templates, no broker needed), filled and analysed: kind -> (url, search_path)."""
    engine_tpl, part_tpl = templates
    schema = provision.participant_schema(PARTICIPANT)
    with (
        clone_database(engine_tpl, "custody_plan") as engine_url,
        clone_database(part_tpl, "custody_pplan") as part_url,
    ):
        with psycopg.connect(engine_url, autocommit=True) as conn:
            for statement in ENGINE_ROWS:
                conn.execute(statement)
            conn.execute("ANALYZE")
        with psycopg.connect(part_url, autocommit=True) as conn:
            conn.execute(pg_sql.SQL("SET search_path = {}").format(pg_sql.Identifier(schema)))
            for statement in PARTICIPANT_ROWS:
                conn.execute(statement)
            conn.execute("ANALYZE")
        yield {"engine": (engine_url, "custody"), "participant": (part_url, schema)}


def nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every node of a plan tree (subplans and init plans included)."""
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)


def explain(
    url: str,
    schema: str,
    statement: LiteralString,
    params: dict[str, Any],
    claimed: str | None = None,
) -> Any:
    """The JSON plan of a statement with these parameters (bound client-side, so the plan
    is the one chosen for those values); ``claimed``: in a session where successor_claim
    claimed that instance (custody.claimed_instances)."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(pg_sql.SQL("SET search_path = {}").format(pg_sql.Identifier(schema)))
        if claimed is not None:
            conn.execute("SELECT set_config('custody.claimed_instances', %s, false)", [claimed])
        cur = psycopg.ClientCursor(conn)
        cur.execute("EXPLAIN (FORMAT JSON) " + statement, params)
        row = cur.fetchone()
        assert row is not None
        return row[0][0]["Plan"]


@pytest.mark.parametrize("name", list(CLAIMS))
def test_a_claim_query_uses_its_index_and_skips_locked_rows(
    name: str, databases: dict[str, tuple[str, str]]
) -> None:
    index, params, kind = CLAIMS[name]
    url, schema = databases[kind]
    statement = sql.query(name)
    plan = explain(url, schema, statement, params)
    every = list(nodes(plan))
    shown = f"{name} plan: {plan}"
    full_reads = sorted(
        n["Relation Name"]
        for n in every
        if n["Node Type"] == "Seq Scan" and n.get("Relation Name") in GROWING
    )
    assert not full_reads, f"{name} reads {full_reads} in full; {shown}"
    used = {n["Index Name"] for n in every if "Index Name" in n}
    assert index in used, f"{name} does not use index {index} (uses {sorted(used)}); {shown}"
    assert "SKIP LOCKED" in " ".join(statement.upper().split()), f"{name} does not SKIP LOCKED"
    assert any(n["Node Type"] == "LockRows" for n in every), f"{name} locks no rows; {shown}"


# name -> (the index the sample must use, parameters, engine or participant schema)
SAMPLES: dict[str, tuple[str, dict[str, Any], str]] = {
    "operations_open_by_status": ("operations_open", {}, "engine"),
    "successor_intents_pending": ("successor_intents_pending", {}, "engine"),
    # the dispatch gauges: paused instances by their partial index, held submits among
    # the pending outbox rows only
    "dispatch_stats": ("instances_dispatch_paused", {}, "engine"),
    # the outbox gauges (the publisher's, every 5 s; a participant's too)
    "outbox_stats": ("outbox_pending", {}, "engine"),
    "outbox_stats ": ("outbox_pending", {}, "participant"),
}


@pytest.mark.parametrize("name", list(SAMPLES))
def test_a_metrics_sample_taken_every_poll_reads_only_the_live_rows(
    name: str, databases: dict[str, tuple[str, str]]
) -> None:
    """The reconciler samples its gauges on every poll: on a table of settled history
    (the bench's backlog run found the count over all of ``operations`` to be the
    busiest statement) a sample reads the live rows through their partial index."""
    index, params, kind = SAMPLES[name]
    url, schema = databases[kind]
    plan = explain(url, schema, sql.query(name.strip()), params)
    every = list(nodes(plan))
    full_reads = sorted(
        n["Relation Name"]
        for n in every
        if n["Node Type"] == "Seq Scan" and n.get("Relation Name") in GROWING
    )
    assert not full_reads, f"{name} reads {full_reads} in full; {plan}"
    used = {n["Index Name"] for n in every if "Index Name" in n}
    assert index in used, f"{name} does not use index {index} (uses {sorted(used)}); {plan}"


# Retention and archival (the reconciler's cleanup every minute, each participant's):
# name -> (the indexes the statement must use, engine or participant schema). A cleanup
# between two others finds one row in a hundred past its horizon: it reaches those
# through the index on their time column, oldest first, never reading the table in full.
RETENTION: dict[str, tuple[set[str], str]] = {
    "retention_receipts": ({"receipt_inbox_received"}, "engine"),
    "retention_outbox": ({"outbox_published"}, "engine"),
    "retention_outbox_retired": ({"outbox_retired"}, "engine"),
    "retention_quarantine": ({"quarantine_received"}, "engine"),
    "p_retention_inbox": ({"inbox_settled"}, "participant"),
    "retention_outbox ": ({"outbox_published"}, "participant"),  # the same query, its schema
}
HORIZON = {"horizon": 30 * 86400.0, "limit": 1000}


def test_every_retention_query_is_under_a_guard() -> None:
    """A retention pass added to the engine's or a participant's cleanup is guarded the
    day it is added (the archival has its own guard below)."""
    guarded = {(name.strip(), kind) for name, (_, kind) in RETENTION.items()}
    run = {(q, "engine") for _, q in engine_retention.DELETES}
    run |= {(q, "participant") for _, q in participant_retention.DELETES}
    assert run == guarded


def _full_reads(every: list[dict[str, Any]]) -> list[str]:
    return sorted(
        n["Relation Name"]
        for n in every
        if n["Node Type"] == "Seq Scan" and n.get("Relation Name") in GROWING
    )


@pytest.mark.parametrize("name", list(RETENTION))
def test_a_retention_delete_reaches_the_old_rows_through_their_time_index(
    name: str, databases: dict[str, tuple[str, str]]
) -> None:
    indexes, kind = RETENTION[name]
    url, schema = databases[kind]
    plan = explain(url, schema, sql.query(name.strip()), HORIZON)
    every = list(nodes(plan))
    assert not _full_reads(every), f"{name} reads {_full_reads(every)} in full; {plan}"
    used = {n["Index Name"] for n in every if "Index Name" in n}
    assert indexes <= used, f"{name} does not use {sorted(indexes)} (uses {sorted(used)}); {plan}"


def nested_plans(
    url: str,
    schema: str,
    statement: LiteralString,
    params: dict[str, Any],
    claimed: str | None = None,
    setup: tuple[LiteralString, ...] = (),
) -> list[dict[str, Any]]:
    """The plans of every statement a call runs, the function bodies' included
    (auto_explain, reported to this session), in a transaction rolled back; ``claimed``:
    as in :func:`explain`; ``setup``: statements run first in that transaction."""
    messages: list[str] = []
    with psycopg.connect(url) as conn:
        conn.add_notice_handler(lambda d: messages.append(d.message_primary or ""))
        conn.execute(pg_sql.SQL("SET search_path = {}").format(pg_sql.Identifier(schema)))
        if claimed is not None:
            conn.execute("SELECT set_config('custody.claimed_instances', %s, false)", [claimed])
        for statement_first in setup:
            conn.execute(statement_first)
        _explain_nested(conn)
        psycopg.ClientCursor(conn).execute(statement, params)
        conn.rollback()
    return _plans(messages)


def _explain_nested(conn: psycopg.Connection[Any]) -> None:
    """From now on this session reports the plan of every statement it runs, the ones in
    function bodies included, as a notice (auto_explain)."""
    conn.execute("LOAD 'auto_explain'")
    conn.execute("SET auto_explain.log_min_duration = 0")
    conn.execute("SET auto_explain.log_nested_statements = on")
    conn.execute("SET auto_explain.log_format = 'json'")
    conn.execute("SET auto_explain.log_level = 'notice'")


def _plans(notices: list[str]) -> list[dict[str, Any]]:
    """The plans auto_explain reported among a session's notices."""
    return [json.loads(m[m.index("{") :]) for m in notices if "plan:" in m]


def test_the_archival_reaches_finished_instances_through_their_index(
    databases: dict[str, tuple[str, str]],
) -> None:
    """The archive pass (custody_archive.move_finished, run as its SQL function runs it)
    finds the instances finished before the horizon through ``instances_finished``, and
    each one's operations, receipts, outbox rows, history, node states and attempts by
    their keys: no table that grows with the traffic is read in full."""
    url, schema = databases["engine"]
    params = {"horizon": HORIZON["horizon"], "limit": engine_retention.ARCHIVE_BATCH}
    plans = nested_plans(url, schema, sql.query(engine_retention.ARCHIVE), params)
    [body] = [p for p in plans if "WITH candidates AS" in p["Query Text"]]
    every = list(nodes(body["Plan"]))
    assert not _full_reads(every), f"the archival reads {_full_reads(every)} in full; {body}"
    used = {n["Index Name"] for n in every if "Index Name" in n}
    assert "instances_finished" in used, f"uses {sorted(used)}; {body}"


# name -> (relation, the only index it may be read through, parameters): the statements
# of the hot path that reach a row of a table by its key
BY_KEY: dict[str, tuple[str, str, dict[str, Any]]] = {
    "outbox_claim": (
        "instances",
        "instances_pkey",
        {"holder": "plan-test", "ttl": 30, "held": False, "limit": 50},
    ),
    # the committer's start reads the archived instances of its run: the archive holds
    # every instance the retention moved, and grows for as long as the deployment runs
    "start_archived_for": (
        "instances",
        "instances_start",
        {"tenant": ["acme"], "start_request_id": [uuid.uuid4()]},
    ),
    # (the receipts' reads planned once are held to the same: KEYED below)
}


@pytest.fixture(scope="module")
def young(templates: tuple[str, str]) -> Iterator[str]:
    """An engine database as a deployment's first seconds find it: its tables empty and
    never analysed (the plans a worker caches then are the ones it keeps while the
    tables grow, until autovacuum analyses them)."""
    with clone_database(templates[0], "custody_young") as url:
        yield url


def generic_plan(url: str, statement: LiteralString, params: dict[str, Any]) -> Any:
    """The generic plan of a statement (parameters bound server-side, as the workers'
    prepared statements are once psycopg has prepared them)."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET search_path = custody")
        conn.execute("SET plan_cache_mode = force_generic_plan")
        row = conn.execute("EXPLAIN (FORMAT JSON) " + statement, params).fetchone()
        assert row is not None
        return row[0][0]["Plan"]


@pytest.mark.parametrize("name", list(BY_KEY))
def test_a_hot_path_statement_reaches_a_row_by_its_key_whatever_the_statistics(
    name: str, databases: dict[str, tuple[str, str]], young: str
) -> None:
    """The bench found the publisher's claim reading every running instance through
    ``instances_status`` once per claimed submit, in the plan its prepared statement had
    cached while the tables were young: O(running instances) per row, the busiest
    statement of a long burst. Written to leave the planner no such choice, the statement
    reads the table only through its key, on young tables (a generic plan) and on a
    large analysed history alike."""
    relation, index, params = BY_KEY[name]
    _reads_only_by(index, relation, name.strip(), params, databases, young)


def _reads_only_by(
    index: str,
    relation: str,
    name: str,
    params: dict[str, Any],
    databases: dict[str, tuple[str, str]],
    young: str,
) -> None:
    """The statement reads ``relation`` through ``index`` alone, in its generic plan on
    young tables and in its plan on the large analysed history."""
    statement = sql.query(name)
    plans = {
        "young, generic": generic_plan(young, statement, params),
        "large, analysed": explain(*databases["engine"], statement, params),
    }
    for kind, plan in plans.items():
        reads = {
            n.get("Index Name", n["Node Type"])
            for n in nodes(plan)
            if n.get("Relation Name") == relation and n["Node Type"] != "ModifyTable"
        }
        assert reads == {index}, f"{name} ({kind}) reads {relation} through {reads}: {plan}"


# An instance's status changes (suspend, resume, cancel, settle), by the instance's key.
INSTANCE_CHANGES = [
    "instance_suspend",
    "instance_suspend_for",
    "instance_resume_from",
    "instance_unsuspend",
    "instance_set_cancelling",
    "instance_settle_cancel",
]


@pytest.mark.parametrize("name", INSTANCE_CHANGES)
def test_an_instance_status_change_reaches_its_instance_by_its_key_whatever_the_statistics(
    name: str, databases: dict[str, tuple[str, str]], young: str
) -> None:
    """An instance's status change names the instance and the status it must be in. With
    the live statuses behind the partial index ``instances_status``, the planner read
    the instance through that index whenever the statistics said the status was rare:
    every suspended instance for each resume, every cancelling one for each settle (on
    the analysed history here, where none is; and on young tables, each suspend read
    every running instance). Statistics lag exactly when it matters: a participant's
    outage suspends thousands of instances, a bulk cancel makes thousands cancelling,
    far below the share of a large table that makes autovacuum analyse it again, and
    each resume or settle would read them all, O(n) per instance while they recover.
    The status is compared as text, which no index serves: the instance is reached by
    its primary key, on young tables (a generic plan) and on a large analysed history
    alike."""
    params = {"id": uuid.uuid4(), "reason": "participant outage"}
    _reads_only_by("instances_pkey", "instances", name, params, databases, young)


@pytest.mark.parametrize("expected", ["accepted", "cancelling", "dispatched"])
def test_the_reconcilers_status_change_reaches_its_operation_by_its_key_whatever_the_statistics(
    expected: str, databases: dict[str, tuple[str, str]], young: str
) -> None:
    """The same for an operation: the reconciler's sweeps move each overdue operation
    from the status it was locked in (``operation_set_status``). For a status the
    statistics call rare (none is ``accepted`` or ``cancelling`` in the analysed history
    here) the planner read every operation of that status through the partial index
    ``operations_open``, once per operation swept: after an outage that left thousands
    accepted and overdue, O(n) per operation of the sweep. By its key, always."""
    params = {"id": uuid.uuid4(), "status": "reconcile_pending", "expected": expected}
    _reads_only_by(
        "operations_pkey", "operations", "operation_set_status", params, databases, young
    )


@pytest.fixture(scope="module")
def stale(templates: tuple[str, str]) -> Iterator[str]:
    """An engine database whose statistics were taken while its operations were open and
    overdue (analysed in an outage, or at the peak of a burst), settled since: every
    operation succeeded, the table vacuumed, its statistics not taken again (autovacuum
    analyses a table after a tenth of it changed, and is off here)."""
    with clone_database(templates[0], "custody_stale") as url:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("ALTER TABLE custody.operations SET (autovacuum_enabled = false)")
            conn.execute(ENGINE_ROWS[0])
            conn.execute(
                "INSERT INTO custody.operations (id, tenant, instance_id, node, activation,"
                " operation, route, owner, principal, binding, input, lineage, attempt, digest,"
                " status, deadline_seconds, deadline_at)"
                f" SELECT {_id(3)}, 'acme', {_id(1)}, 'n', 1, 'inventory.reserve', 'r',"
                " 'inventory', 'custody-inventory', 'b', '{}', '{}', 1, 'digest', 'accepted',"
                f" 60, now() - interval '1 minute' FROM generate_series(1, {ROWS}) g"
            )
            conn.execute("VACUUM ANALYZE custody.operations")
            conn.execute("UPDATE custody.operations SET status = 'succeeded'")
            conn.execute("VACUUM custody.operations")
        yield url


def executed_plan(url: str, statement: LiteralString, params: dict[str, Any], mode: str) -> Any:
    """The plan a statement ran with (``EXPLAIN ANALYZE``, parameters bound server-side,
    ``plan_cache_mode`` as given), in a transaction rolled back."""
    with psycopg.connect(url) as conn:
        conn.execute("SET search_path = custody")
        conn.execute(pg_sql.SQL("SET plan_cache_mode = {}").format(pg_sql.Identifier(mode)))
        row = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + statement, params).fetchone()
        conn.rollback()
        assert row is not None
        return row[0][0]["Plan"]


@pytest.mark.parametrize("mode", ["force_custom_plan", "force_generic_plan"])
def test_the_deadline_sweep_reads_only_the_operations_it_takes_whatever_the_statistics(
    mode: str, databases: dict[str, tuple[str, str]], stale: str
) -> None:
    """Seed: "A timeout can produce OutcomeUnknown." The reconciler's deadline sweep
    (``operations_overdue``) takes a batch of overdue in-flight operations on every poll.
    With the three statuses in one ``IN`` list no index gives deadline order: the planner
    read every overdue operation and sorted them for each batch (O(overdue) per batch:
    the 400 overdue of the analysed history for a batch of 50, the thousands an outage
    leaves for each 200), and where the statistics said most operations were open it read
    the whole table (the bench's backlog run: 120,080 rows read and sorted on every
    poll, 36 to 58 ms, while none was overdue). Whatever the statistics, the sweep reads
    ``operations`` only through ``operations_open`` in deadline order, and no scan
    returns more rows than the batch."""
    limit = 50
    urls = {"analysed history": databases["engine"][0], "stale statistics": stale}
    for kind, url in urls.items():
        plan = executed_plan(url, sql.query("operations_overdue"), {"limit": limit}, mode)
        reads = [n for n in nodes(plan) if n.get("Relation Name") == "operations"]
        shown = f"operations_overdue ({kind}, {mode}): {plan}"
        assert reads, shown
        assert {(n["Node Type"], n.get("Index Name")) for n in reads} == {
            ("Index Scan", "operations_open")
        }, shown
        assert max(n["Actual Rows"] for n in reads) <= limit, shown


@pytest.mark.parametrize("name", ["instance_results", "node_activations"])
def test_the_claimed_instances_are_read_once_per_statement_never_per_row(
    name: str, databases: dict[str, tuple[str, str]], young: str
) -> None:
    """The committer's reads of the instances its successor claim locked take their ids
    from the transaction (``custody.claimed_instances()``, up to a batch of ids as text).
    Called in a filter, the function parsed every id again for each row a scan passed: in
    some bursts the planner chose a full scan of ``node_states`` (a table not yet
    analysed), the statement ran on the CPU for 0.3 to 0.7 of a backend on average and
    the committer's backend spent 1.2 ms per operation instead of 0.15 (456 ms for 7,500
    rows and 200 ids, measured alone). Read once, as an init plan, the ids cost the same
    whatever the plan: no scan, join or filter of either statement calls the function."""
    statement = sql.query(name)
    plans = {
        "young, generic": generic_plan(young, statement, {}),
        "large, analysed": explain(*databases["engine"], statement, {}),
    }
    if name in KEYED:  # the plan its function keeps (generic there by its own settings)
        plans = {
            "young, generic": body_plan(young, name, {}),
            "large, analysed": body_plan(databases["engine"][0], name, {}),
        }
    for kind, plan in plans.items():
        per_row = [
            n["Node Type"]
            for n in nodes(plan)
            if n.get("Parent Relationship") != "InitPlan"
            and any(
                "current_setting" in str(n.get(k, ""))
                for k in ("Filter", "Index Cond", "Recheck Cond", "Join Filter")
            )
        ]
        assert not per_row, f"{name} ({kind}) calls custody.claimed_instances() in {per_row}"


def _batch_rows(**row: Any) -> Any:
    return psycopg.types.json.Jsonb([row])


# name -> (relation, the only index it may be read through, parameters): the statements
# a unit of one item (light load) runs on rows of a growing table by their keys, beside
# the ones planned once (KEYED): the committer's reads of the instance it claimed
ONE_ITEM: dict[str, tuple[str, str, dict[str, Any]]] = {
    "node_activations": ("node_states", "node_states_pkey", {}),
}
MIDDLE_ROWS = 5_000  # rows per table: a small deployment, or the bench after its burst


@pytest.fixture(scope="module")
def middle(templates: tuple[str, str]) -> Iterator[str]:
    """An engine database whose tables hold a few thousand rows, not analysed yet (a
    small deployment; the bench's light phase, after its burst on a new database)."""
    with clone_database(templates[0], "custody_middle") as url:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("SET session_replication_role = replica")  # rows without parents
            grown = ("instances ", "operations ", "node_states ")
            for statement in ENGINE_ROWS:
                if any(f"custody.{t}" in statement for t in grown):
                    conn.execute(statement.replace(f"1, {ROWS})", f"1, {MIDDLE_ROWS})"))
        yield url


_FIRST = "00000001-0000-0000-0000-000000000001"  # the first instance of ENGINE_ROWS


@pytest.mark.parametrize("name", list(ONE_ITEM))
def test_a_unit_of_one_item_reaches_its_rows_by_their_keys_on_a_table_of_any_size(
    name: str, middle: str
) -> None:
    """Seen with ``auto_explain`` in the bench's light phase (one instance at a time,
    after a burst on a new database): the receipt consumer's ``operation_apply`` read the
    whole ``operations`` table for its one receipt (a hash join, 0.46 ms of its backend
    per receipt at 1,300 operations and growing with the table), ``node_finish`` the
    whole ``node_states`` and the committer's ``instance_finish`` the whole
    ``instances``, on every light-load operation (those three are planned once now, a
    row at a time by its key: ``KEYED``). The committer's reads of the instance it
    claimed, on a table of a few thousand rows not analysed yet (a small deployment, or
    any deployment's first hour), reach it by its key too."""
    relation, index, params = ONE_ITEM[name]
    plan = explain(middle, "custody", sql.query(name), params, claimed=_FIRST)
    _read_by_key(name, plan, relation, index)


# The rows a write planned once changes, made in the transaction that calls it (rolled
# back): a loop's statements run, and so are planned and shown, only for rows that are
# there. Outside ENGINE_ROWS's keys; without their parents' checks (the plans are the
# point, not the transitions).
_INSTANCE = "0000000a-0000-0000-0000-000000000001"
_OPERATION = "0000000b-0000-0000-0000-000000000001"
_REQUEST = "0000000c-0000-0000-0000-000000000001"
WRITTEN_ROWS: tuple[LiteralString, ...] = (
    "SET LOCAL session_replication_role = replica",
    "INSERT INTO custody.instances (id, tenant, start_request_id, process, process_version,"
    f" input, status, requested_by, routes) VALUES ('{_INSTANCE}', 'acme',"
    " gen_random_uuid(), 'order-fulfilment', 1, '{}', 'running', 'plan-test', '{}')",
    "INSERT INTO custody.operations (id, tenant, instance_id, node, activation, operation,"
    " route, owner, principal, binding, input, lineage, attempt, digest, status,"
    f" deadline_seconds) VALUES ('{_OPERATION}', 'acme', '{_INSTANCE}', 'n', 1,"
    " 'inventory.reserve', 'r', 'inventory', 'custody-inventory', 'b', '{}', '{}', 1, 'x',"
    " 'pending', 60)",
    "INSERT INTO custody.attempts (request_id, operation_id, attempt, kind, digest)"
    f" VALUES ('{_REQUEST}', '{_OPERATION}', 1, 'submit', 'x')",
    "INSERT INTO custody.outbox (id, kind, exchange, routing_key, body, operation_id,"
    f" status, claimed_by) VALUES ('{_REQUEST}', 'submit', 'custody.commands', 'inventory',"
    f" '\\x00', '{_OPERATION}', 'pending', 'plan-test')",
    "INSERT INTO custody.node_states (instance_id, node, activation, operation_id, status)"
    f" VALUES ('{_INSTANCE}', 'n', 1, '{_OPERATION}', 'active')",
)


@dataclass(frozen=True)
class Keyed:
    """A statement planned once (queries.sql calls a function of its name in
    transitions.sql, whose settings make the plans it keeps generic ones by keys): its
    parameters, and what each statement of its function's body reads, as
    (a piece of that statement's text, relation, the only index it may be read
    through); ``writes``: it changes the rows of WRITTEN_ROWS."""

    params: dict[str, Any]
    reads: list[tuple[str, str, str]]
    writes: bool = False

    @property
    def setup(self) -> tuple[LiteralString, ...]:
        return WRITTEN_ROWS if self.writes else ()


# The receipt consumer's reads and writes, the ends of instances and the engine's confirm
# mark: name -> what its function reads, and through which index
KEYED: dict[str, Keyed] = {
    "operations_lock": Keyed(
        {"ids": [uuid.uuid4()]},
        [
            ("FOR UPDATE OF o", "operations", "operations_pkey"),
            ("FOR UPDATE OF o", "instances", "instances_pkey"),
        ],
    ),
    "revisions_seen": Keyed(
        {"operation_id": [uuid.uuid4()], "attempt": [1], "owner_revision": [2]},
        [("FROM custody.receipt_inbox r", "receipt_inbox", "receipt_inbox_revision")],
    ),
    # the instances of a receipt batch's operations, locked where free
    "receipt_instances_claim": Keyed(
        {"ids": [uuid.uuid4()]},
        [
            ("FOR UPDATE OF i SKIP LOCKED", "operations", "operations_pkey"),
            ("FOR UPDATE OF i SKIP LOCKED", "instances", "instances_pkey"),
        ],
    ),
    # the instances claimed in the transaction (custody.claimed_instances): by an index on
    # the instance (the key (instance, node, activation) also gives the rows in order)
    "instance_results": Keyed(
        {},
        [
            (
                "SELECT o.instance_id, o.node, o.result",
                "operations",
                "operations_instance_id_node_activation_key|operations_instance",
            )
        ],
    ),
    # a receipt batch's writes: the operations' changes, each guarded by the status it
    # was judged from (operation_apply), and their finished nodes (node_finish)
    "receipt_writes": Keyed(
        {
            "receipts": psycopg.types.json.Jsonb([]),
            "updates": _batch_rows(
                id=_OPERATION,
                expected="pending",
                status="dispatched",
                effect="unknown",
                owner_revision=0,
                terminal=False,
            ),
            "nodes": _batch_rows(operation_id=_OPERATION, status="done"),
            "successors": psycopg.types.json.Jsonb([]),
        },
        [
            ("UPDATE custody.operations o", "operations", "operations_pkey"),
            ("UPDATE custody.node_states n", "node_states", "node_states_operation"),
        ],
        writes=True,
    ),
    # the ends of a batch's instances: prepared on young tables as one statement, it read
    # every running instance through instances_status, or all of them (a hash join)
    "instance_finish": Keyed(
        {
            "rows": _batch_rows(
                id=_INSTANCE,
                status="completed",
                history={"event": "instance.completed", "actor": "committer"},
            )
        },
        [("UPDATE custody.instances i", "instances", "instances_pkey")],
        writes=True,
    ),
    # the engine's confirm mark, the confirmed submit dispatching its operation
    "outbox_mark_dispatched": Keyed(
        {"ids": [_REQUEST], "holder": "plan-test", "actor": "publisher"},
        [
            ("FROM custody.outbox b", "outbox", "outbox_pkey"),
            ("UPDATE custody.outbox b", "outbox", "outbox_pkey"),
            ("UPDATE custody.operations o", "operations", "operations_pkey"),
            ("UPDATE custody.operations o", "attempts", "attempts_pkey|attempts_operation"),
        ],
        writes=True,
    ),
}


def _check_keyed(name: str, plans: list[dict[str, Any]], seen: str) -> None:
    """Each statement of the function's body reads what KEYED says, by its keys (``seen``:
    on which tables, for the message)."""
    for mark, relation, index in KEYED[name].reads:
        found = [p["Plan"] for p in plans if mark in p["Query Text"]]
        assert found, f"{name} ({seen}): no plan of its statement {mark!r} among {plans}"
        for plan in found:
            _read_by_key(f"{name} ({seen})", plan, relation, index)


def body_plan(url: str, name: str, params: dict[str, Any], claimed: str | None = None) -> Any:
    """The plan of the (first) statement of a function planned once that KEYED names,
    planned as the function plans it (its own settings), seen through auto_explain."""
    mark = KEYED[name].reads[0][0]
    plans = nested_plans(url, "custody", sql.query(name), params, claimed)
    [body] = [p for p in plans if mark in p["Query Text"]]
    return body["Plan"]


@pytest.mark.parametrize("name", list(KEYED))
def test_a_statement_planned_once_reaches_its_rows_by_their_keys_on_tables_of_any_size(
    name: str, young: str, middle: str, stale: str, databases: dict[str, tuple[str, str]]
) -> None:
    """The receipt consumer's reads and writes on every receipt's way (the operations it
    locks, the revisions it has seen, the instances it claims and their results; the
    operations it changes, their nodes, the instances it ends) and the engine's confirm
    mark were planned for each execution, so that a plan made while the tables were young
    would not be kept as they grew: parsed and planned again for every receipt, a tenth
    of a millisecond and more of the backend's time each, on every light-load
    operation's way. Each is now a function that plans its statements once per session
    and keeps them, with the settings that make those plans generic ones reaching every
    table by its keys (the writes one row at a time, by its key: a generic plan joining a
    table to the whole batch read the table whole): the same plans on the empty tables of
    a deployment's first seconds (the ones a worker would keep), on a few thousand rows
    not yet analysed, on a large analysed history, and on statistics taken while the
    operations were open."""
    keyed = KEYED[name]
    urls = {
        "young": young,
        "middle": middle,
        "large, analysed": databases["engine"][0],
        "stale statistics": stale,
    }
    for kind, url in urls.items():
        plans = nested_plans(
            url, "custody", sql.query(name), keyed.params, claimed=_FIRST, setup=keyed.setup
        )
        _check_keyed(name, plans, kind)


def test_a_statement_planned_once_keeps_its_plan_by_keys_while_its_tables_grow(
    growing: str,
) -> None:
    """The plans a worker's session makes while the tables are young are the ones it
    keeps (its calls prepared, as psycopg prepares them past its threshold): once the
    tables have grown (and are not analysed yet), the same session still reaches every
    row by its keys."""
    messages: list[str] = []
    with psycopg.connect(growing) as conn:  # one session, as a worker's connection is
        conn.add_notice_handler(lambda d: messages.append(d.message_primary or ""))
        conn.execute("SET search_path = custody")
        conn.execute("SELECT set_config('custody.claimed_instances', %s, false)", [_FIRST])
        for _ in range(8):
            for name, keyed in KEYED.items():
                for statement in keyed.setup:
                    conn.execute(statement)
                conn.execute(sql.query(name), keyed.params, prepare=True)
                conn.rollback()
        with psycopg.connect(growing, autocommit=True) as other:
            other.execute("SET session_replication_role = replica")  # rows without parents
            grown = (
                "instances ",
                "operations ",
                "receipt_inbox ",
                "node_states ",
                "outbox ",
                "attempts ",
            )
            for statement in ENGINE_ROWS:
                if any(f"custody.{t}" in statement for t in grown):
                    other.execute(statement)
        _explain_nested(conn)
        conn.commit()  # the settings kept by the session, past each call's rollback
        for name, keyed in KEYED.items():
            messages.clear()
            for statement in keyed.setup:
                conn.execute(statement)
            conn.execute(sql.query(name), keyed.params, prepare=True)
            conn.rollback()
            _check_keyed(name, _plans(messages), "grown")


def _read_by_key(name: str, plan: Any, relation: str, index: str) -> None:
    """The plan reads ``relation`` through one of the ``|``-separated indexes, never in
    full (its own indexes are named after it; a bitmap scan's index node names the index
    only)."""
    every = list(nodes(plan))
    full = [n for n in every if n["Node Type"] == "Seq Scan" and n["Relation Name"] == relation]
    scans = [n for n in every if n.get("Index Name", "").startswith(relation)]
    used = {n["Index Name"] for n in scans}
    assert not full and len(used) == 1 and used <= set(index.split("|")), (
        f"{name} reads {relation} through {used or 'a full scan'}: {plan}"
    )
    # by its keys: an index read whole (no condition) is a full read in key order
    whole = [n["Index Name"] for n in scans if "Index Cond" not in n]
    assert not whole, f"{name} reads all of {whole}, with no key: {plan}"


@pytest.fixture
def growing(templates: tuple[str, str]) -> Iterator[str]:
    """An engine database of its own, young (empty, never analysed), for a test that
    then fills it."""
    with clone_database(templates[0], "custody_growing") as url:
        yield url
