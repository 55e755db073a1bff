"""``db migrate``, ``topology apply``, ``broker dev-users``, ``operators apply``: thin
callers of :mod:`workers.provision`."""

from __future__ import annotations

import argparse

from workers import provision
from workers.cli.common import EXIT_FAILED, EXIT_OK, Subparsers, emit
from workers.settings import Settings


async def cmd_migrate(settings: Settings, args: argparse.Namespace) -> int:
    await provision.migrate(settings, participants=args.participants)
    return EXIT_OK


async def cmd_status(settings: Settings, args: argparse.Namespace) -> int:
    found = await provision.db_status(settings)
    emit([m.as_dict() for m in found], args.json)
    return EXIT_FAILED if any(m.state != "applied" for m in found) else EXIT_OK


async def cmd_topology(settings: Settings, args: argparse.Namespace) -> int:
    await provision.apply_topology(settings)
    return EXIT_OK


async def cmd_operators_apply(settings: Settings, args: argparse.Namespace) -> int:
    await provision.sync_operators(
        settings, args.file or settings.operators_file, create_logins=args.create_logins
    )
    return EXIT_OK


async def cmd_dev_users(settings: Settings, args: argparse.Namespace) -> int:
    await provision.dev_users(settings, args.password)
    return EXIT_OK


def register(sub: Subparsers) -> None:
    dbp = sub.add_parser("db", help="database schema").add_subparsers(
        dest="db_command", required=True
    )
    m = dbp.add_parser(
        "migrate",
        help="apply the pending migrations and re-apply commands.sql, transitions.sql "
        "(CUSTODY_DATABASE_URL, CUSTODY_SQL_DIR), under an advisory lock",
    )
    m.add_argument(
        "--participants",
        action="store_true",
        help="also the sample participants' schemas (CUSTODY_PARTICIPANT_DATABASE_URL)",
    )
    m.set_defaults(fn=cmd_migrate)
    st = dbp.add_parser(
        "status",
        help="each migration: applied or pending (CUSTODY_DATABASE_URL); exit 1 if any "
        "is pending or was changed after it was applied",
    )
    st.add_argument("--json", action="store_true")
    st.set_defaults(fn=cmd_status)

    top = sub.add_parser("topology", help="RabbitMQ topology").add_subparsers(
        dest="t", required=True
    )
    top.add_parser(
        "apply",
        help="declare exchanges, quorum queues, bindings and the policy "
        "(CUSTODY_AMQP_URL, CUSTODY_AMQP_MANAGEMENT_URL, CUSTODY_DELIVERY_LIMIT)",
    ).set_defaults(fn=cmd_topology)

    br = sub.add_parser("broker", help="broker users").add_subparsers(dest="b", required=True)
    du = br.add_parser("dev-users", help="one user per participant principal (dev and tests)")
    du.add_argument("--password", default="custody-dev")
    du.set_defaults(fn=cmd_dev_users)

    ops = sub.add_parser("operators", help="operator logins and grants").add_subparsers(
        dest="o", required=True
    )
    oa = ops.add_parser(
        "apply",
        help="make the database's operator grants say what the operators file says, and "
        "each operator's own login role a member of custody_operators (as the migrator)",
    )
    oa.add_argument("--file", help="default: CUSTODY_OPERATORS_FILE")
    oa.add_argument(
        "--create-logins",
        action="store_true",
        help="create a missing login role per operator (development and tests only)",
    )
    oa.set_defaults(fn=cmd_operators_apply)
