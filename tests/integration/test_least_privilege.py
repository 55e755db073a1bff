"""Least privilege: one Postgres role per worker type (schema.sql grants) and one
RabbitMQ user per worker type and participant. The whole suite runs the fleet under
them; here each is shown refused outside its boundary."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from contracts import codec
from tests.conftest import Env, world
from tests.harness import publish_raw
from tests.integration.test_participant import submit
from workers.harness import fleet
from workers.io import broker, db

REFUSED = [
    ("custody_publisher", "INSERT INTO custody.operations (id) VALUES (gen_random_uuid())"),
    ("custody_publisher", "UPDATE custody.receipt_inbox SET decision = 'x'"),
    # the receipt consumer activates successors, never starts an instance, and marks
    # the outbox rows it sends without reading a command's body
    ("custody_receipts", "INSERT INTO custody.instances (id) VALUES (gen_random_uuid())"),
    # it inserts a new activation's rows only (restrictive policies, migration 0003)
    (
        "custody_receipts",
        "INSERT INTO custody.outbox (id, kind, exchange, routing_key, body)"
        " VALUES (gen_random_uuid(), 'query', 'custody.commands', 'inventory.v1', '')",
    ),
    (
        "custody_receipts",
        "INSERT INTO custody.outbox (id, kind, exchange, routing_key, body)"
        " VALUES (gen_random_uuid(), 'submit', 'custody.receipts', 'x', '')",
    ),
    (
        "custody_receipts",
        "INSERT INTO custody.operations (id, status) VALUES (gen_random_uuid(), 'succeeded')",
    ),
    (
        "custody_receipts",
        "INSERT INTO custody.attempts (request_id, kind) VALUES (gen_random_uuid(), 'query')",
    ),
    ("custody_receipts", "SELECT body FROM custody.outbox"),
    ("custody_receipts", "UPDATE custody.outbox SET routing_key = 'x'"),
    ("custody_receipts", "UPDATE custody.control SET dispatch_paused = false"),
    ("custody_committer", "UPDATE custody.receipt_inbox SET decision = 'x'"),
    ("custody_committer", "DELETE FROM custody.outbox"),
    ("custody_reconciler", "INSERT INTO custody.instances (id) VALUES (gen_random_uuid())"),
    ("custody_reconciler", "UPDATE custody.control SET dispatch_paused = false"),
    ("oncall", "DELETE FROM custody.history"),
    # column-level: each role writes only the columns its commit boundary owns
    ("custody_publisher", "UPDATE custody.operations SET result = '{}'"),
    ("custody_publisher", "UPDATE custody.operations SET owner = 'payments'"),
    ("custody_publisher", "UPDATE custody.outbox SET body = ''"),
    ("custody_receipts", "UPDATE custody.operations SET binding = 'payments.v1'"),
    ("custody_receipts", "UPDATE custody.instances SET routes = '{}'"),
    ("custody_committer", "UPDATE custody.operations SET result = '{}'"),
    ("custody_committer", "UPDATE custody.outbox SET body = ''"),
    # its sender marks what it sent; it reads no command's body, moves no row of the
    # outbox elsewhere, and retires nothing (the publisher's sample does)
    ("custody_committer", "SELECT body FROM custody.outbox"),
    ("custody_committer", "UPDATE custody.outbox SET routing_key = 'payments.v1'"),
    ("custody_committer", "SELECT custody.t_retire_submits('committer')"),
    # the reconciler moves statuses only (deadlines, query timeouts, suspending an
    # instance): it cannot forge an outcome's evidence nor re-point an operation
    ("custody_reconciler", "UPDATE custody.operations SET result = '{}'"),
    ("custody_reconciler", "UPDATE custody.operations SET effect = 'applied'"),
    ("custody_reconciler", "UPDATE custody.operations SET binding = 'payments.v1'"),
    ("custody_reconciler", "UPDATE custody.operations SET digest = 'x'"),
    ("custody_reconciler", "UPDATE custody.instances SET routes = '{}'"),
    ("custody_reconciler", "UPDATE custody.node_states SET status = 'active'"),
    ("custody_participant_inventory", "SELECT count(*) FROM custody.operations"),
    # archival: the reconciler only calls the archiver's function, which moves finished
    # instances; it deletes no hot row and writes no archived one itself
    ("custody_reconciler", "DELETE FROM custody.instances"),
    ("custody_reconciler", "DELETE FROM custody.operations"),
    ("custody_reconciler", "DELETE FROM custody.history"),
    ("custody_reconciler", "DELETE FROM custody.attempts"),
    ("custody_reconciler", "SELECT count(*) FROM custody_archive.operations"),
    ("custody_reconciler", "INSERT INTO custody_archive.history SELECT * FROM custody.history"),
    ("custody_reconciler", "DELETE FROM custody_archive.instances"),
    ("custody_committer", "SELECT custody_archive.move_finished(0, 1000)"),
    ("custody_publisher", "SELECT custody_archive.move_finished(0, 1000)"),
    ("custody_receipts", "SELECT custody_archive.move_finished(0, 1000)"),
    ("custody_participant_inventory", "SELECT custody_archive.move_finished(0, 1000)"),
]
AUDIT_WRITERS = [
    "custody_committer",
    "custody_publisher",
    "custody_receipts",
    "custody_reconciler",
    "oncall",
]


@pytest.fixture(scope="module")
def shared(templates: tuple[str, str], broker_users: None) -> Iterator[Env]:
    """One world for the refusals: a refused statement changes nothing, so the cases can
    share it (each checks its own rows)."""
    yield from world(templates)


@pytest.mark.parametrize(
    ("role", "statement"), REFUSED, ids=[f"{r}:{s.split()[0]}" for r, s in REFUSED]
)
def test_each_engine_role_is_refused_outside_its_commit_boundary(
    shared: Env, role: str, statement: str
) -> None:
    with (
        psycopg.connect(db.with_user(shared.settings.database_url, role)) as conn,
        pytest.raises(psycopg.errors.InsufficientPrivilege),
    ):
        conn.execute(statement)


@pytest.mark.parametrize("role", AUDIT_WRITERS)
@pytest.mark.parametrize(
    "statement", ["UPDATE custody.audit SET outcome = 'x'", "DELETE FROM custody.audit"]
)
def test_runtime_roles_cannot_update_or_delete_audit_rows(
    shared: Env, role: str, statement: str
) -> None:
    """INV-10: runtime roles cannot update or delete audit rows."""
    with (
        psycopg.connect(db.with_user(shared.settings.database_url, role)) as conn,
        pytest.raises(psycopg.errors.InsufficientPrivilege),
    ):
        conn.execute(statement)


def test_a_participant_role_sees_only_its_own_schema(env: Env) -> None:
    url = db.with_user(env.settings.participant_database_url, "custody_participant_inventory")
    with psycopg.connect(url) as conn:
        conn.execute("SELECT count(*) FROM participant_inventory.inbox")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT count(*) FROM participant_payments.charges")


async def test_a_participant_cannot_publish_a_command_into_a_route(env: Env) -> None:
    """A participant's broker user may publish receipts, never commands: it cannot
    inject work into another route."""
    forged = submit()
    with pytest.raises(AssertionError, match="channel"):
        await publish_raw(
            env.participant_settings("inventory"),
            broker.EXCHANGE_COMMANDS,
            "payments.v1",
            [codec.encode(forged)],
            user_id="custody-inventory",
        )


async def test_a_participant_cannot_publish_a_receipt_as_another_participant(env: Env) -> None:
    """RabbitMQ validates user_id: the payments user cannot send as custody-inventory."""
    with pytest.raises(AssertionError):
        await publish_raw(
            env.participant_settings("payments"),
            broker.EXCHANGE_RECEIPTS,
            broker.RECEIPTS_KEY,
            [b"{}"],
            user_id="custody-inventory",
        )


@pytest.mark.parametrize(
    ("user", "exchange"),
    [
        ("custody-receipts", broker.EXCHANGE_RECEIPTS),
        ("custody-receipts", broker.EXCHANGE_REQUESTS),
        ("custody-committer", broker.EXCHANGE_RECEIPTS),
        ("custody-publisher", broker.EXCHANGE_RECEIPTS),
    ],
)
async def test_engine_broker_users_write_only_where_their_boundary_does(
    env: Env, user: str, exchange: str
) -> None:
    settings = dataclasses.replace(
        env.settings, amqp_url=broker.url_with_user(env.settings.amqp_url, user, fleet.DEV_PASSWORD)
    )
    with pytest.raises(AssertionError, match="channel"):
        await publish_raw(settings, exchange, "x", [b"{}"])


ENGINE_ROLES = [
    "custody_committer",
    "custody_publisher",
    "custody_receipts",
    "custody_reconciler",
    "oncall",
    "postgres",
]
ILLEGAL = [
    ("operations", "failed", "succeeded"),
    ("operations", "cancelled", "succeeded"),
    ("operations", "outcome_unknown", "pending"),
    ("instances", "completed", "running"),
    ("instances", "cancelled", "running"),
]


def _row(env: Env, table: str, status: str) -> str:
    """One instance (and, for operations, one operation of it) in ``status``."""
    iid, oid = str(uuid.uuid4()), str(uuid.uuid4())
    with psycopg.connect(env.settings.database_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO custody.instances (id, tenant, start_request_id, process,"
            " process_version, input, status, requested_by, routes)"
            " VALUES (%s, 'acme', gen_random_uuid(), 'order-fulfilment', 1, '{}', %s,"
            " 'test', '{}')",
            (iid, status if table == "instances" else "running"),
        )
        if table == "operations":
            conn.execute(
                "INSERT INTO custody.operations (id, tenant, instance_id, node, activation,"
                " operation, route, owner, principal, binding, input, lineage, attempt,"
                " digest, status, deadline_seconds) VALUES (%s, 'acme', %s, 'reserve', 1,"
                " 'inventory.reserve', 'inventory', 'inventory', 'custody-inventory',"
                " 'inventory.v1', '{}', '{}', 1, 'x', %s, 60)",
                (oid, iid, status),
            )
    return oid if table == "operations" else iid


@pytest.mark.parametrize("role", ENGINE_ROLES)
@pytest.mark.parametrize(
    ("table", "before", "after"), ILLEGAL, ids=[f"{t}:{b}->{a}" for t, b, a in ILLEGAL]
)
def test_a_status_change_the_lifecycle_forbids_is_refused_by_the_database(
    shared: Env, role: str, table: str, before: str, after: str
) -> None:
    """The seed: "Unknown effects cannot become success through an operator assertion
    or blind replay" and "Operators use controlled recovery commands rather than
    editing runtime rows directly." Whoever attempts it — a worker role, the operator
    role, the owner — a status change the lifecycle table does not allow is refused by
    the database itself: by a missing privilege, or by the transition guard."""
    ident = _row(shared, table, before)
    url = (
        shared.settings.database_url
        if role == "postgres"
        else db.with_user(shared.settings.database_url, role)
    )
    with psycopg.connect(url) as conn:
        with pytest.raises(psycopg.Error) as refused:
            conn.execute(
                f"UPDATE custody.{table} SET status = %s WHERE id = %s",  # type: ignore[arg-type]
                (after, ident),
            )
        assert isinstance(refused.value, psycopg.errors.InsufficientPrivilege) or (
            refused.value.sqlstate == "CU002"
        ), refused.value
    with psycopg.connect(shared.settings.database_url) as conn:
        row = conn.execute(f"SELECT status::text FROM custody.{table} WHERE id = %s", (ident,))  # type: ignore[arg-type]
        assert row.fetchone() == (before,)


@pytest.mark.parametrize("table", ["operations", "instances"])
def test_every_status_change_outside_the_lifecycle_table_is_refused_even_to_the_owner(
    shared: Env, table: str
) -> None:
    """Not a sample: every (from, to) pair of the status type that the lifecycle table
    lacks is refused by the guard (CU002) to the table's owner, who has every
    privilege; the worker and operator roles are refused a subset of what it may do."""
    kind = table.rstrip("s")
    with psycopg.connect(shared.settings.database_url) as conn:
        statuses = [
            r[0]
            for r in conn.execute(
                f"SELECT unnest(enum_range(NULL::custody.{kind}_status))::text"  # type: ignore[arg-type]
            ).fetchall()
        ]
        allowed = set(
            conn.execute(
                f"SELECT from_status::text, to_status::text FROM custody.{kind}_transitions"  # type: ignore[arg-type]
            ).fetchall()
        )
    illegal = [(a, b) for a in statuses for b in statuses if a != b and (a, b) not in allowed]
    assert len(illegal) > len(ILLEGAL)
    with psycopg.connect(shared.settings.database_url) as conn:
        for before, after in illegal:
            ident = _row(shared, table, before)
            with pytest.raises(psycopg.Error) as refused, conn.transaction():
                conn.execute(
                    f"UPDATE custody.{table} SET status = %s WHERE id = %s",  # type: ignore[arg-type]
                    (after, ident),
                )
            assert refused.value.sqlstate == "CU002", (before, after, refused.value)


@pytest.mark.parametrize("role", ["custody_publisher", "custody_committer"])
def test_a_status_change_the_lifecycle_allows_still_goes_through(env: Env, role: str) -> None:
    """The guard refuses only what the lifecycle forbids: the confirm mark (pending ->
    dispatched) is a legal change under the publisher's role and under the committer's,
    whose sender marks the submits it sends."""
    oid = _row(env, "operations", "pending")
    with psycopg.connect(db.with_user(env.settings.database_url, role)) as conn:
        conn.execute("UPDATE custody.operations SET status = 'dispatched' WHERE id = %s", (oid,))
        conn.commit()
    with psycopg.connect(env.settings.database_url) as conn:
        row = conn.execute("SELECT status::text FROM custody.operations WHERE id = %s", (oid,))
        assert row.fetchone() == ("dispatched",)


NOT_A_DISPATCH = [
    ("pending", "cancelling"),
    ("retry_waiting", "cancelled"),
    ("outcome_unknown", "reconcile_pending"),
    ("dispatched", "outcome_unknown"),
]


@pytest.mark.parametrize(
    ("before", "after"), NOT_A_DISPATCH, ids=[f"{b}->{a}" for b, a in NOT_A_DISPATCH]
)
def test_the_committer_moves_an_operation_only_to_dispatched(
    shared: Env, before: str, after: str
) -> None:
    """Broker confirmation is the only operation status the committer's role writes
    (its sender's confirm mark): a change the lifecycle allows but another boundary
    owns (a cancel, a deadline, a restore) is refused to it by the guard (CU003)."""
    oid = _row(shared, "operations", before)
    with (
        psycopg.connect(db.with_user(shared.settings.database_url, "custody_committer")) as conn,
        pytest.raises(psycopg.Error) as refused,
    ):
        conn.execute("UPDATE custody.operations SET status = %s WHERE id = %s", (after, oid))
    assert refused.value.sqlstate == "CU003", refused.value


ASSERTED = [
    ("outcome_unknown", "succeeded"),
    ("reconcile_pending", "succeeded"),
    ("accepted", "failed"),
    ("dispatched", "retry_waiting"),
]


@pytest.mark.parametrize(
    "role", ["custody_committer", "custody_publisher", "custody_reconciler", "oncall"]
)
@pytest.mark.parametrize(("before", "after"), ASSERTED, ids=[f"{b}->{a}" for b, a in ASSERTED])
def test_an_outcome_is_never_asserted_by_a_role_that_validates_no_receipt(
    shared: Env, role: str, before: str, after: str
) -> None:
    """The seed: "Unknown effects cannot become success through an operator assertion
    or blind replay." An outcome comes only from a validated receipt: even a change
    the lifecycle allows (outcome_unknown -> succeeded) is refused by the database
    unless the receipt consumer's role writes it."""
    oid = _row(shared, "operations", before)
    with psycopg.connect(db.with_user(shared.settings.database_url, role)) as conn:
        with pytest.raises(psycopg.Error) as refused:
            conn.execute("UPDATE custody.operations SET status = %s WHERE id = %s", (after, oid))
        assert isinstance(refused.value, psycopg.errors.InsufficientPrivilege) or (
            refused.value.sqlstate == "CU003"
        ), refused.value
    with psycopg.connect(shared.settings.database_url) as conn:
        row = conn.execute("SELECT status::text FROM custody.operations WHERE id = %s", (oid,))
        assert row.fetchone() == (before,)


def test_the_receipt_consumers_role_writes_an_outcome(env: Env) -> None:
    oid = _row(env, "operations", "accepted")
    with psycopg.connect(db.with_user(env.settings.database_url, "custody_receipts")) as conn:
        conn.execute("UPDATE custody.operations SET status = 'succeeded' WHERE id = %s", (oid,))
        conn.commit()
