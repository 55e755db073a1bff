"""Operators are who they say, act only through the controlled commands, and see only
their tenants: each enforced by the database, not by the CLI.

The seed: "Operators use controlled recovery commands rather than editing runtime rows
directly", and "Authorization and audit apply to every transition". Each operator logs
in as its own Postgres role (deploy/operators.toml's name); the actor of every command
and audit row is that login (``session_user``), which no argument can change.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest

from tests.conftest import Env, world
from tests.harness import seed_unknown_operation
from tests.integration.test_recovery import custody
from workers.io import db

OPERATORS = ["oncall", "acme-support", "auditor"]

# every kind of hand edit of a runtime row, and of the operators' own grants
DIRECT_EDITS = [
    "UPDATE custody.operations SET status = 'succeeded'",
    "UPDATE custody.operations SET status = 'reconcile_pending'",
    "UPDATE custody.operations SET attempt = attempt + 1",
    "UPDATE custody.instances SET status = 'cancelling'",
    "UPDATE custody.instances SET dispatch_paused = false",
    "UPDATE custody.control SET dispatch_paused = false",
    "UPDATE custody.successor_intents SET status = 'done'",
    "UPDATE custody.outbox SET status = 'retired'",
    "DELETE FROM custody.receipt_inbox",
    "DELETE FROM custody.quarantine",
    "DELETE FROM custody.outbox",
    "DELETE FROM custody.history",
    "DELETE FROM custody.audit",
    "UPDATE custody.audit SET outcome = 'done'",
    "INSERT INTO custody.audit (actor, action, reason, outcome)"
    " VALUES ('oncall', 'reconcile', 'forged entry', 'done')",
    "INSERT INTO custody.history (instance_id, event, actor)"
    " VALUES (gen_random_uuid(), 'operation.succeeded', 'oncall')",
    "INSERT INTO custody.attempts (request_id, operation_id, attempt, kind, digest)"
    " VALUES (gen_random_uuid(), gen_random_uuid(), 2, 'submit', 'x')",
    "INSERT INTO custody.outbox (id, kind, exchange, routing_key, body)"
    " VALUES (gen_random_uuid(), 'submit', 'custody.commands', 'payments.v1', '')",
    "INSERT INTO custody.start_tombstones (tenant, start_request_id, actor, reason)"
    " VALUES ('acme', gen_random_uuid(), 'oncall', 'forged tombstone')",
    "UPDATE custody.operators SET tenants = '{*}'",
    "INSERT INTO custody.operators (name, actions, tenants) VALUES ('mallory', '{cancel}', '{*}')",
    "TRUNCATE custody.outbox",
    # the internal functions: the workers' policies and the building blocks
    "SELECT custody.t_reconcile('oncall', gen_random_uuid()::text, 'forged actor here')",
    "SELECT custody.t_cancel('policy', gen_random_uuid()::text, 'forged actor here')",
    "SELECT custody.t_retire_submits('policy', NULL)",
    "SELECT custody.cancel_in('oncall', gen_random_uuid(), 'no checks at all')",
    "SELECT custody.history_add(gen_random_uuid(), NULL, 'x', 'oncall', '{}')",
    "SELECT custody.issue_command(gen_random_uuid(), 'submit', 1, NULL)",
    "SET ROLE custody_definer",
    "SET ROLE custody_reconciler",
    # the archive: operators read it, nobody but the archiver's function writes it
    "SELECT custody_archive.move_finished(0, 1000)",
    "DELETE FROM custody_archive.instances",
    "INSERT INTO custody_archive.instances SELECT * FROM custody.instances",
    "SET ROLE custody_archiver",
]


def _as(env: Env, login: str) -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(db.with_user(env.settings.database_url, login), autocommit=True)


def _seed(env: Env) -> dict[str, str]:
    """One instance and operation per tenant (acme, globex), with history, a start
    tombstone, quarantine and audit rows of each, and a global audit row."""
    ids: dict[str, str] = {}
    with psycopg.connect(env.settings.database_url, autocommit=True) as conn:
        for tenant in ("acme", "globex"):
            iid, oid = seed_unknown_operation(conn, tenant)
            ids[tenant] = oid
            ids[f"{tenant}-instance"] = iid
            conn.execute(
                "INSERT INTO custody.history (instance_id, operation_id, event, actor)"
                " VALUES (%s, %s, 'operation.outcome_unknown', 'custody-reconciler')",
                (iid, oid),
            )
            conn.execute(
                "INSERT INTO custody.attempts (request_id, operation_id, attempt, kind, digest)"
                " VALUES (gen_random_uuid(), %s, 1, 'submit', 'x')",
                (oid,),
            )
            conn.execute(
                "INSERT INTO custody.start_tombstones (tenant, start_request_id, actor, reason)"
                " VALUES (%s, gen_random_uuid(), 'oncall', 'cancelled before start')",
                (tenant,),
            )
            conn.execute(
                "INSERT INTO custody.quarantine (source, reason, detail, tenant, body, worker)"
                " VALUES ('custody.receipts', 'wrong_tenant', 'x', %s, '', 'receipts')",
                (tenant,),
            )
            conn.execute(
                "INSERT INTO custody.audit (actor, action, tenant, target, reason, outcome)"
                " VALUES ('oncall', 'cancel', %s, 'x', 'customer asked', 'done')",
                (tenant,),
            )
        conn.execute(
            "INSERT INTO custody.audit (actor, action, tenant, target, reason, outcome)"
            " VALUES ('oncall', 'pause', NULL, '*', 'maintenance window', 'done')"
        )
        conn.execute(
            "INSERT INTO custody.quarantine (source, reason, detail, body, worker)"
            " VALUES ('custody.receipts', 'undecodable_properties', 'x', '', 'receipts')"
        )
    return ids


@pytest.fixture
def seeded(env: Env) -> dict[str, str]:
    return _seed(env)


@pytest.fixture(scope="module")
def refusing(templates: tuple[str, str], broker_users: None) -> Iterator[Env]:
    """One seeded world for every refused edit: a refused edit changes nothing (each case
    asserts it), so the cases can share it, and a wrongly accepted one still fails its
    own case."""
    for shared in world(templates):
        _seed(shared)
        yield shared


def _snapshot(env: Env) -> list[tuple[object, ...]]:
    with psycopg.connect(env.settings.database_url) as conn:
        return conn.execute(
            "SELECT (SELECT count(*) FROM custody.audit), (SELECT count(*) FROM custody.history),"
            " (SELECT count(*) FROM custody.outbox), (SELECT count(*) FROM custody.quarantine),"
            " (SELECT string_agg(status::text, ',' ORDER BY id) FROM custody.operations),"
            " (SELECT dispatch_paused FROM custody.control),"
            " (SELECT string_agg(name || array_to_string(tenants, '/'), ',' ORDER BY name)"
            "    FROM custody.operators)"
        ).fetchall()


@pytest.mark.parametrize("login", OPERATORS)
@pytest.mark.parametrize("statement", DIRECT_EDITS)
def test_an_operator_login_cannot_edit_a_runtime_row_directly(
    refusing: Env, login: str, statement: str
) -> None:
    """The seed: "Operators use controlled recovery commands rather than editing runtime
    rows directly." Whatever an operator's own login tries besides those commands (an
    UPDATE, DELETE, INSERT, TRUNCATE, an internal function, another role) the database
    refuses, and nothing changes."""
    before = _snapshot(refusing)
    with _as(refusing, login) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute(statement)  # type: ignore[arg-type]
    assert _snapshot(refusing) == before


@pytest.mark.parametrize("login", OPERATORS)
def test_an_operator_cannot_become_another_operator(env: Env, login: str) -> None:
    """No operator can take another's identity: not by SET ROLE, not by SET SESSION
    AUTHORIZATION (the actor the commands record is session_user)."""
    for other in (o for o in OPERATORS if o != login):
        with _as(env, login) as conn:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(f'SET ROLE "{other}"')  # type: ignore[arg-type]
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(f'SET SESSION AUTHORIZATION "{other}"')  # type: ignore[arg-type]
            assert conn.execute("SELECT session_user::text").fetchone() == (login,)


async def test_the_actor_of_a_command_is_the_login_and_cannot_be_typed(
    env: Env, seeded: dict[str, str]
) -> None:
    """The seed: "Authorization and audit apply to every transition." An operator scoped
    to acme cannot act as oncall: the CLI has no way to say so (--as and
    CUSTODY_OPERATOR are refused), and the database records the login as the actor of
    the refused command."""
    globex = seeded["globex"]
    typed = await custody(
        env, "reconcile", globex, "--reason", "support ticket 123", "--as", "oncall",
        actor="acme-support",
    )  # fmt: skip
    assert typed.returncode == 2 and "--as and CUSTODY_OPERATOR are gone" in typed.stderr
    refused = await custody(
        env, "reconcile", globex, "--reason", "support ticket 123", actor="acme-support"
    )
    assert refused.returncode == 3 and "tenant 'globex'" in refused.stderr
    done = await custody(
        env, "reconcile", seeded["acme"], "--reason", "support ticket 123", actor="acme-support"
    )
    assert done.returncode == 0, done.stderr
    with psycopg.connect(env.settings.database_url) as conn:
        audit = conn.execute(
            "SELECT actor, tenant, outcome FROM custody.audit WHERE action = 'reconcile'"
            " ORDER BY id"
        ).fetchall()
        history = conn.execute(
            "SELECT actor FROM custody.history WHERE event = 'operation.reconcile_pending'"
        ).fetchall()
        statuses = dict(
            conn.execute("SELECT tenant, status::text FROM custody.operations").fetchall()
        )
    assert audit == [("acme-support", "globex", "refused"), ("acme-support", "acme", "done")]
    assert history == [("acme-support",)]
    assert statuses == {"acme": "reconcile_pending", "globex": "outcome_unknown"}


async def test_custody_operator_cannot_name_the_actor_either(
    env: Env, seeded: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The environment variable of earlier releases is refused like --as: nothing
    typed names the actor."""
    monkeypatch.setenv("CUSTODY_OPERATOR", "oncall")
    typed = await custody(
        env, "cancel", seeded["globex-instance"], "--reason", "support ticket 123",
        actor="acme-support",
    )  # fmt: skip
    assert typed.returncode == 2 and "--as and CUSTODY_OPERATOR are gone" in typed.stderr
    with psycopg.connect(env.settings.database_url) as conn:
        [(asked,)] = conn.execute(
            "SELECT count(*) FROM custody.audit WHERE target = %s", (seeded["globex-instance"],)
        ).fetchall()
        [(status,)] = conn.execute(
            "SELECT status::text FROM custody.instances WHERE id = %s", (seeded["globex-instance"],)
        ).fetchall()
    assert (asked, status) == (0, "suspended"), "refused before asking the database"


def test_an_operator_cannot_act_outside_its_tenants_with_a_right_it_has(
    env: Env, seeded: dict[str, str]
) -> None:
    """acme-support may cancel and reconcile, for acme only: the database function
    refuses globex's instance and operation (audited under the login), and the same
    command on acme's goes through."""
    with _as(env, "acme-support") as conn:
        refused = [
            conn.execute(q, (ident, "support ticket 123")).fetchall()[0][0]
            for q, ident in (
                ("SELECT custody.cancel(%s, %s)", seeded["globex-instance"]),
                ("SELECT custody.reconcile(%s, %s)", seeded["globex"]),
            )
        ]
        [(done,)] = conn.execute(
            "SELECT custody.cancel(%s, 'support ticket 123')", (seeded["acme-instance"],)
        ).fetchall()
    for outcome in refused:
        assert outcome["result"] == "refused" and "tenant 'globex'" in outcome["message"]
    assert done["result"] == "done", done
    with psycopg.connect(env.settings.database_url) as conn:
        statuses = conn.execute(
            "SELECT i.tenant, i.status::text, o.status::text FROM custody.instances i"
            " JOIN custody.operations o ON o.instance_id = i.id ORDER BY 1"
        ).fetchall()
        audit = conn.execute(
            "SELECT actor, action, tenant, outcome FROM custody.audit"
            " WHERE actor = 'acme-support' ORDER BY id"
        ).fetchall()
    assert statuses == [
        ("acme", "cancelling", "cancelling"),
        ("globex", "suspended", "outcome_unknown"),
    ]
    assert audit == [
        ("acme-support", "cancel", "globex", "refused"),
        ("acme-support", "reconcile", "globex", "refused"),
        ("acme-support", "cancel", "acme", "done"),
    ]


def test_a_login_that_is_no_operator_is_refused_and_audited(
    env: Env, seeded: dict[str, str]
) -> None:
    """Anyone who can log in may ask; only a registered operator is answered. The
    refusal is audited under the login's own name."""
    with _as(env, "mallory") as conn:
        [(outcome,)] = conn.execute(
            "SELECT custody.cancel(%s, 'I would like to cancel')", (seeded["acme-instance"],)
        ).fetchall()
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT count(*) FROM custody.operations")
    assert outcome["result"] == "refused" and "'mallory' is not an operator" in outcome["message"]
    with psycopg.connect(env.settings.database_url) as conn:
        rows = conn.execute(
            "SELECT actor, outcome FROM custody.audit WHERE action = 'cancel' AND target = %s",
            (seeded["acme-instance"],),
        ).fetchall()
        assert rows == [("mallory", "refused")]
        [(status,)] = conn.execute(
            "SELECT status::text FROM custody.instances WHERE id = %s", (seeded["acme-instance"],)
        ).fetchall()
        assert status == "suspended"


TENANT_TABLES = [
    "instances",
    "operations",
    "node_states",
    "history",
    "attempts",
    "start_tombstones",
    "quarantine",
    "audit",
]


@pytest.mark.parametrize("table", TENANT_TABLES)
def test_an_operator_scoped_to_a_tenant_reads_only_that_tenants_rows(
    env: Env, seeded: dict[str, str], table: str
) -> None:
    """Tenant isolation for operators, enforced in the database (row-level security):
    acme-support reads acme's instances, operations, history, quarantine and audit rows
    and none of globex's, nor the rows of no tenant (a global pause, an undecodable
    message); an operator of every tenant reads them all."""
    with psycopg.connect(env.settings.database_url) as conn:
        [(everything,)] = conn.execute(f"SELECT count(*) FROM custody.{table}").fetchall()  # type: ignore[arg-type]
    tenant_of = {
        "node_states": "(SELECT tenant FROM custody.instances i WHERE i.id = instance_id)",
        "history": "(SELECT tenant FROM custody.instances i WHERE i.id = instance_id)",
        "attempts": "(SELECT tenant FROM custody.operations o WHERE o.id = operation_id)",
    }.get(table, "tenant")
    with _as(env, "acme-support") as conn:
        seen = conn.execute(
            f"SELECT DISTINCT coalesce({tenant_of}, '(none)') FROM custody.{table}"  # type: ignore[arg-type]
        ).fetchall()
    assert seen == [("acme",)]
    for wide in ("oncall", "auditor"):
        with _as(env, wide) as conn:
            [(count,)] = conn.execute(f"SELECT count(*) FROM custody.{table}").fetchall()  # type: ignore[arg-type]
        assert count == everything


TENANT_FREE = {
    "control",
    "schema_migrations",
    "leases",
    "operators",
    "operation_events",
    "operation_transitions",
    "instance_transitions",
}


def test_every_relation_an_operator_reads_is_tenant_free_or_under_row_level_security(
    env: Env,
) -> None:
    """A new table or view cannot slip past tenant isolation: what an operator login may
    SELECT in schema custody (or custody_archive) is a table under row-level security, a
    view that runs with the reader's rights (so under the tables' policies), or a table of
    no tenant. A view that runs with its owner's would show acme-support every tenant's
    rows."""
    with _as(env, "acme-support") as conn:
        rows = conn.execute(
            "SELECT c.relname::text, c.relkind IN ('r', 'p') AND c.relrowsecurity,"
            " c.relkind = 'v' AND coalesce(c.reloptions::text ~* 'security_invoker=(true|on)',"
            " false) FROM pg_class c"
            " WHERE c.relnamespace IN ('custody'::regnamespace, 'custody_archive'::regnamespace)"
            " AND c.relkind IN ('r', 'p', 'v', 'm', 'f') AND has_table_privilege(c.oid, 'SELECT')"
        ).fetchall()
    readable = {name for name, _, _ in rows}
    assert set(TENANT_TABLES) <= readable
    exposed = {name for name, rls, invoker in rows if not (rls or invoker)} - TENANT_FREE
    assert exposed == set()


async def test_the_cli_lists_only_the_operators_tenants(env: Env, seeded: dict[str, str]) -> None:
    """What the CLI shows an operator is what the database lets its login read."""
    listed = await custody(env, "operations", "list", "--json", actor="acme-support")
    assert listed.returncode == 0, listed.stderr
    assert seeded["acme"] in listed.stdout and seeded["globex"] not in listed.stdout
    shown = await custody(env, "operations", "show", seeded["globex"], actor="acme-support")
    assert shown.returncode == 4
    everything = await custody(env, "operations", "list", "--json", actor="oncall")
    assert seeded["acme"] in everything.stdout and seeded["globex"] in everything.stdout


async def test_a_broker_cancel_request_is_authorized_as_its_broker_user_in_the_database(
    env: Env, seeded: dict[str, str]
) -> None:
    """The committer cancels for the delivery's broker-validated user through the same
    database function (t_cancel_start), which authorizes that user from the operators
    table: a user that is no operator is refused and audited, and nothing changes."""
    committer = db.with_user(env.settings.database_url, "custody_committer")
    start = str(uuid.uuid4())
    with psycopg.connect(committer, autocommit=True) as conn:
        [(refused,)] = conn.execute(
            "SELECT custody.t_cancel_start('custody-inventory', 'acme', %s, 'cancel please')",
            (start,),
        ).fetchall()
        [(done,)] = conn.execute(
            "SELECT custody.t_cancel_start('custody-frontend', 'acme', %s, 'customer cancelled')",
            (start,),
        ).fetchall()
    assert refused["result"] == "refused" and "is not an operator" in refused["message"]
    assert done["result"] == "done" and done["data"]["tombstoned"] is True
    with psycopg.connect(env.settings.database_url) as conn:
        rows = conn.execute(
            "SELECT actor, outcome FROM custody.audit WHERE action = 'cancel-start' ORDER BY id"
        ).fetchall()
    assert rows == [("custody-inventory", "refused"), ("custody-frontend", "done")]
