"""``db migrate``, ``topology apply``, ``broker dev-users``, ``operators apply``: thin
callers of :mod:`workers.provision`."""

from __future__ import annotations

import click

from workers import provision
from workers.cli.common import EXIT_FAILED, EXIT_OK, Args, command, emit, group
from workers.settings import Settings


async def cmd_migrate(settings: Settings, args: Args) -> int:
    await provision.migrate(settings, participants=args.participants)
    return EXIT_OK


async def cmd_status(settings: Settings, args: Args) -> int:
    found = await provision.db_status(settings)
    emit([m.as_dict() for m in found], args.output)
    return EXIT_FAILED if any(m.state != "applied" for m in found) else EXIT_OK


async def cmd_topology(settings: Settings, args: Args) -> int:
    await provision.apply_topology(settings)
    return EXIT_OK


async def cmd_operators_apply(settings: Settings, args: Args) -> int:
    await provision.sync_operators(
        settings, args.file or settings.operators_file, create_logins=args.create_logins
    )
    return EXIT_OK


async def cmd_dev_users(settings: Settings, args: Args) -> int:
    await provision.dev_users(settings, args.password)
    return EXIT_OK


def register(root: click.Group) -> None:
    db = group(root, "db")
    command(
        db,
        "migrate",
        cmd_migrate,
        help="apply the pending migrations and re-apply commands.sql, transitions.sql "
        "(CUSTODY_DATABASE_URL, CUSTODY_SQL_DIR), under an advisory lock",
        emits=False,
        params=[
            click.option(
                "--participants",
                is_flag=True,
                help="also the sample participants' schemas (CUSTODY_PARTICIPANT_DATABASE_URL)",
            )
        ],
    )
    command(
        db,
        "status",
        cmd_status,
        help="each migration: applied or pending (CUSTODY_DATABASE_URL); exit 1 if any "
        "is pending or was changed after it was applied",
    )

    command(
        group(root, "topology"),
        "apply",
        cmd_topology,
        help="declare exchanges, quorum queues, bindings and the policy "
        "(CUSTODY_AMQP_URL, CUSTODY_AMQP_MANAGEMENT_URL, CUSTODY_DELIVERY_LIMIT)",
        emits=False,
    )

    command(
        group(root, "broker"),
        "dev-users",
        cmd_dev_users,
        help="one user per participant principal (dev and tests; CUSTODY_AMQP_MANAGEMENT_URL)",
        emits=False,
        params=[click.option("--password", default="custody-dev", show_default=True)],
    )

    command(
        group(root, "operators"),
        "apply",
        cmd_operators_apply,
        help="make the database's operator grants say what the operators file says, and "
        "each operator's own login role a member of custody_operators (as the migrator)",
        emits=False,
        params=[
            click.option("--file", help="the operators file (default: CUSTODY_OPERATORS_FILE)"),
            click.option(
                "--create-logins",
                is_flag=True,
                help="create a missing login role per operator (development and tests only)",
            ),
        ],
    )
