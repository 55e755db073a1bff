"""Provisioning: the engine and participant schemas, the broker topology, the broker
users of development, the operators' grants. Used by the CLI, the demo, the tests and the
bench alike (each a thin caller)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from workers.core import authz, process
from workers.io import broker, db, migrations
from workers.settings import ROOT, Settings

# beside queries.sql in the SQL directory (CUSTODY_SQL_DIR): versioned migrations, applied
# once each, and the repeatable definitions (functions, views, grants) applied every time
MIGRATIONS_DIR = "migrations"
REPEATABLE = ("commands.sql", "transitions.sql")


async def db_status(settings: Settings) -> list[migrations.MigrationState]:
    """Each engine migration, applied or pending (``custody db status``)."""
    return await migrations.status(settings.database_url, db.SQL_DIR / MIGRATIONS_DIR)


async def migrate(settings: Settings, *, participants: bool) -> list[str]:
    """Apply the pending engine migrations and the repeatable definitions, then the
    operators file (and each participant's schema, with ``participants``). Returns the
    engine migrations this call applied (none: another migrator had, or nothing new)."""
    await db.ensure_database(settings.database_url)
    applied, adopted = await migrations.migrate(
        settings.database_url,
        db.SQL_DIR / MIGRATIONS_DIR,
        [db.SQL_DIR / script for script in REPEATABLE],
    )
    for name in adopted:
        print(f"migration {name} adopted (its schema was already there)")
    for name in applied:
        print(f"migration {name} applied")
    print(f"engine schema up to date; {', '.join(REPEATABLE)} re-applied")
    if await asyncio.to_thread(Path(settings.operators_file).exists):
        await sync_operators(settings, settings.operators_file, create_logins=False)
    if participants:
        await db.ensure_database(settings.participant_database_url)
        table, _ = process.load_config(settings)
        for owner in sorted({r.owner for r in table.by_name.values()}):
            await migrate_participant(settings, owner)
            print(f"participant schema participant_{owner} applied")
    return applied


async def migrate_participant(settings: Settings, owner: str) -> None:
    schema = participant_schema(owner)
    await db.apply_script(
        settings.participant_database_url, db.SQL_DIR / "participant_schema.sql", schema=schema
    )
    await db.apply_script(
        settings.participant_database_url, ROOT / "participants" / "samples.sql", schema=schema
    )
    await db.grant_schema(settings.participant_database_url, schema, participant_role(owner))


def participant_role(owner: str) -> str:
    """The participant's own Postgres role: its schema, and nothing else."""
    return f"custody_participant_{owner}"


def participant_schema(owner: str) -> str:
    return f"participant_{owner}"


async def apply_topology(settings: Settings) -> None:
    """Exchanges, quorum queues, bindings and the dead-letter policy, idempotently."""
    table, _ = process.load_config(settings)
    amqp = broker.Broker(settings.amqp_url, "topology", broker.tls(settings))
    await amqp.connect()
    try:
        plan = await broker.apply_topology(
            amqp, table.bindings(), settings.delivery_limit, settings.amqp_management_url
        )
    finally:
        await amqp.close()
    print(
        f"declared {len(plan['exchanges'])} exchanges, {len(plan['queues'])} quorum queues, "
        f"{len(plan['bindings'])} bindings; policy {broker.POLICY_NAME} "
        f"(dead-letter-exchange {broker.EXCHANGE_DEAD}, delivery-limit {settings.delivery_limit})"
    )


async def sync_operators(settings: Settings, path: str, *, create_logins: bool) -> None:
    """deploy/operators.toml into the engine database (who may do what, per tenant)."""
    roles = authz.load(Path(path))
    found = await db.sync_operators(
        settings.database_url,
        {name: (sorted(g.actions), sorted(g.tenants)) for name, g in roles.operators.items()},
        create_logins=create_logins,
    )
    print(
        f"operators: {len(roles.operators)} from {path}; logins in custody_operators: "
        f"{', '.join(found.members) or 'none'}"
        + (f"; created {', '.join(found.created)}" if found.created else "")
        + (
            f"; no login role (broker-only): {', '.join(found.without_login)}"
            if found.without_login
            else ""
        )
    )


async def dev_users(settings: Settings, password: str) -> None:
    """One broker user per engine worker type and per participant principal, with only
    the permissions its boundary needs (development and tests: one shared password)."""
    table, _ = process.load_config(settings)
    vhost = broker.vhost_of(settings.amqp_url)
    plan = broker.permissions({r.principal: r.binding for r in table.by_name.values()})
    await asyncio.gather(
        *(
            broker.ensure_user(
                settings.amqp_management_url,
                user,
                password,
                vhost,
                configure=configure,
                write=write,
                read=read,
            )
            for user, (configure, write, read) in plan.items()
        )
    )
    for user, (configure, write, read) in plan.items():
        print(f"broker user {user}: configure {configure} write {write} read {read}")
