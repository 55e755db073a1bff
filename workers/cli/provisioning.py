"""``db migrate``, ``topology apply``, ``broker dev-users``, ``operators apply``: thin
callers of :mod:`workers.provision`."""

from __future__ import annotations

import click

from workers import provision
from workers.cli.common import EXIT_OK, Args, command, group
from workers.settings import Settings


async def cmd_migrate(settings: Settings, args: Args) -> int:
    await provision.migrate(settings, participants=args.participants)
    return EXIT_OK


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
    # one verb a line: ``db status`` (the migrations' state) is one more command() here
    command(
        db,
        "migrate",
        cmd_migrate,
        help="apply schema.sql (CUSTODY_DATABASE_URL), idempotently",
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
