"""Least privilege: one Postgres role per worker type (schema.sql grants) and one
RabbitMQ user per worker type and participant. The whole suite runs the fleet under
them; here each is shown refused outside its boundary."""

from __future__ import annotations

import dataclasses

import psycopg
import pytest

from contracts import codec
from tests.conftest import Env
from tests.harness import publish_raw
from tests.integration.test_participant import submit
from workers import broker, db, fleet

REFUSED = [
    ("custody_publisher", "INSERT INTO custody.operations (id) VALUES (gen_random_uuid())"),
    ("custody_publisher", "UPDATE custody.receipt_inbox SET decision = 'x'"),
    (
        "custody_receipts",
        "INSERT INTO custody.outbox (id, kind, exchange, routing_key, body)"
        " VALUES (gen_random_uuid(), 'submit', 'x', 'y', '')",
    ),
    ("custody_receipts", "UPDATE custody.control SET dispatch_paused = false"),
    ("custody_committer", "UPDATE custody.receipt_inbox SET decision = 'x'"),
    ("custody_committer", "DELETE FROM custody.outbox"),
    ("custody_reconciler", "INSERT INTO custody.instances (id) VALUES (gen_random_uuid())"),
    ("custody_reconciler", "UPDATE custody.control SET dispatch_paused = false"),
    ("custody_operator", "DELETE FROM custody.history"),
    ("custody_participant_inventory", "SELECT count(*) FROM custody.operations"),
]
AUDIT_WRITERS = [
    "custody_committer",
    "custody_publisher",
    "custody_receipts",
    "custody_reconciler",
    "custody_operator",
]


@pytest.mark.parametrize(
    ("role", "statement"), REFUSED, ids=[f"{r}:{s.split()[0]}" for r, s in REFUSED]
)
def test_each_engine_role_is_refused_outside_its_commit_boundary(
    env: Env, role: str, statement: str
) -> None:
    with (
        psycopg.connect(db.with_user(env.settings.database_url, role)) as conn,
        pytest.raises(psycopg.errors.InsufficientPrivilege),
    ):
        conn.execute(statement)


@pytest.mark.parametrize("role", AUDIT_WRITERS)
@pytest.mark.parametrize(
    "statement", ["UPDATE custody.audit SET outcome = 'x'", "DELETE FROM custody.audit"]
)
def test_runtime_roles_cannot_update_or_delete_audit_rows(
    env: Env, role: str, statement: str
) -> None:
    """INV-10: runtime roles cannot update or delete audit rows."""
    with (
        psycopg.connect(db.with_user(env.settings.database_url, role)) as conn,
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
        ("custody-receipts", broker.EXCHANGE_COMMANDS),
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
