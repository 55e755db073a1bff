"""``quarantine``, ``instances``, ``operations``, ``history``, ``audit``: read-only views
through the named queries."""

from __future__ import annotations

import argparse
import sys
import uuid
from typing import Any

from workers import provision
from workers.cli.common import EXIT_NOT_FOUND, EXIT_OK, EXIT_USAGE, Subparsers, emit
from workers.core import process
from workers.io import db
from workers.settings import Settings


async def _query(settings: Settings, name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    async with (
        db.connected(settings.database_url, schema="custody") as database,
        database.transaction() as tx,
    ):
        return await tx.rows(name, params)


async def _participant_query(
    settings: Settings, participant: str, name: str, params: dict[str, Any]
) -> list[dict[str, Any]]:
    """A named query on a participant's journal, in one transaction."""
    async with (
        db.connected(
            settings.participant_database_url, schema=provision.participant_schema(participant)
        ) as database,
        database.transaction() as tx,
    ):
        return await tx.rows(name, params)


async def cmd_quarantine(settings: Settings, args: argparse.Namespace) -> int:
    params = {"reason": args.reason, "limit": args.limit}
    if args.participant:
        rows = await _participant_query(settings, args.participant, "p_refused_list", params)
    else:
        rows = await _query(settings, "quarantine_list", params)
    emit(rows, args.json)
    return EXIT_OK


STATS_BY = ("reason", "tenant", "source", "worker")  # a participant's: reason only


async def cmd_quarantine_stats(settings: Settings, args: argparse.Namespace) -> int:
    """Counts by the chosen columns, of the engine's quarantine (row-level security: an
    operator counts only its tenants') or of a participant's refused commands."""
    by = [c.strip() for c in args.by.split(",") if c.strip()]
    allowed = ("reason",) if args.participant else STATS_BY
    bad = [c for c in by if c not in allowed]
    if not by or bad:
        where = f"participant {args.participant}'s refused commands" if args.participant else ""
        print(
            f"custody: --by {args.by!r}: a comma-separated list of {', '.join(allowed)}"
            + (f" (for {where})" if where else ""),
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.participant:
        table, _ = process.load_config(settings)
        owners = sorted({r.owner for r in table.by_name.values()})
        if args.participant not in owners:
            print(
                f"custody: --participant {args.participant!r}: one of {', '.join(owners)}",
                file=sys.stderr,
            )
            return EXIT_USAGE
        rows = await _participant_query(settings, args.participant, "p_refused_stats", {"by": by})
    else:
        rows = await _query(settings, "quarantine_stats", {"by": by})
    emit([{c: r.get(c) for c in (*by, "n", "last_at")} for r in rows], args.json)
    return EXIT_OK


async def cmd_instances(settings: Settings, args: argparse.Namespace) -> int:
    rows = await _query(
        settings,
        "instance_list",
        {"status": args.status, "tenant": args.tenant, "limit": args.limit},
    )
    emit(rows, args.json)
    return EXIT_OK


async def cmd_operations(settings: Settings, args: argparse.Namespace) -> int:
    rows = await _query(
        settings,
        "operation_list",
        {"status": args.status, "tenant": args.tenant, "route": args.route, "limit": args.limit},
    )
    emit(rows, args.json)
    return EXIT_OK


async def cmd_history(settings: Settings, args: argparse.Namespace) -> int:
    rows = await _query(settings, "instance_history", {"id": args.instance_id})
    if not rows:
        print(f"no instance {args.instance_id}", file=sys.stderr)
        return EXIT_NOT_FOUND
    emit(rows, args.json)
    return EXIT_OK


async def cmd_audit(settings: Settings, args: argparse.Namespace) -> int:
    emit(await _query(settings, "audit_list", {"limit": args.limit}), args.json)
    return EXIT_OK


async def _show(
    settings: Settings, noun: str, ident: str, query: str, parts: dict[str, str]
) -> int:
    """One row in full, with its related rows (exit 4 if there is none)."""
    async with (
        db.connected(settings.database_url, schema="custody") as database,
        database.transaction() as tx,
    ):
        row = await tx.one(query, {"id": ident}) if _uuid(ident) else None
        if row is None:
            print(f"no {noun} {ident}", file=sys.stderr)
            return EXIT_NOT_FOUND
        for key, name in parts.items():
            row[key] = await tx.rows(name, {"id": ident})
    emit(row, True)
    return EXIT_OK


async def cmd_instance_show(settings: Settings, args: argparse.Namespace) -> int:
    return await _show(
        settings,
        "instance",
        args.id,
        "instance_get",
        {"operations": "instance_operations", "history": "instance_history"},
    )


async def cmd_operation_show(settings: Settings, args: argparse.Namespace) -> int:
    return await _show(
        settings,
        "operation",
        args.id,
        "operation_get",
        {"attempts": "operation_attempts", "receipts": "operation_receipts"},
    )


def _uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True


def register(sub: Subparsers) -> None:
    """``quarantine``, ``instances``, ``operations``, ``history`` (``audit`` is listed
    later in ``custody --help``: see :func:`register_audit`)."""
    q = sub.add_parser("quarantine", help="quarantined messages").add_subparsers(
        dest="q", required=True
    )
    ql = q.add_parser("list", help="newest first, with their reasons")
    ql.add_argument("--reason")
    ql.add_argument(
        "--participant", help="a participant's refused commands instead of the engine's"
    )
    ql.add_argument("--limit", type=int, default=50)
    ql.add_argument("--json", action="store_true")
    ql.set_defaults(fn=cmd_quarantine)
    qs = q.add_parser("stats", help="counts grouped by --by (reason,tenant,source,worker)")
    qs.add_argument(
        "--by", default="reason", help="comma-separated: reason, tenant, source, worker"
    )
    qs.add_argument("--participant", help="a participant's refused commands (--by reason)")
    qs.add_argument("--json", action="store_true")
    qs.set_defaults(fn=cmd_quarantine_stats)

    for noun, fn, show in (
        ("instances", cmd_instances, cmd_instance_show),
        ("operations", cmd_operations, cmd_operation_show),
    ):
        nouns = sub.add_parser(noun).add_subparsers(dest="x", required=True)
        sp = nouns.add_parser("show", help=f"one of the {noun}, in full (JSON)")
        sp.add_argument("id")
        sp.set_defaults(fn=show)
        lp = nouns.add_parser("list")
        lp.add_argument("--status")
        lp.add_argument("--tenant")
        if noun == "operations":
            lp.add_argument("--route")
        lp.add_argument("--limit", type=int, default=50)
        lp.add_argument("--json", action="store_true")
        lp.set_defaults(fn=fn)

    h = sub.add_parser("history", help="an instance's history, in order")
    h.add_argument("instance_id")
    h.add_argument("--json", action="store_true")
    h.set_defaults(fn=cmd_history)


def register_audit(sub: Subparsers) -> None:
    au = (
        sub.add_parser("audit")
        .add_subparsers(dest="a", required=True)
        .add_parser("list", help="operator commands and refusals, newest first")
    )
    au.add_argument("--limit", type=int, default=50)
    au.add_argument("--json", action="store_true")
    au.set_defaults(fn=cmd_audit)
