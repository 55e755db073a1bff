"""``quarantine``, ``instances list|show|history``, ``operations list|show``, ``audit``:
read-only views through the named queries."""

from __future__ import annotations

import sys
from typing import Any

import click

from workers import provision
from workers.cli.common import (
    EXIT_NOT_FOUND,
    EXIT_OK,
    LIMIT,
    NAME,
    UUID,
    Args,
    command,
    emit,
    group,
    known_participant,
)
from workers.core import lifecycle
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


async def cmd_quarantine(settings: Settings, args: Args) -> int:
    params = {"reason": args.reason, "limit": args.limit}
    if args.participant:
        known_participant(settings, args.participant)
        rows = await _participant_query(settings, args.participant, "p_refused_list", params)
    else:
        rows = await _query(settings, "quarantine_list", params)
    emit(rows, args.output)
    return EXIT_OK


STATS_BY = ("reason", "tenant", "source", "worker")  # a participant's: reason only


async def cmd_quarantine_stats(settings: Settings, args: Args) -> int:
    """Counts by the chosen columns, of the engine's quarantine (row-level security: an
    operator counts only its tenants') or of a participant's refused commands."""
    by = [c.strip() for c in args.by.split(",") if c.strip()]
    allowed = ("reason",) if args.participant else STATS_BY
    bad = [c for c in by if c not in allowed]
    if not by or bad:
        where = f"participant {args.participant}'s refused commands" if args.participant else ""
        raise click.UsageError(
            f"--by {args.by!r}: a comma-separated list of {', '.join(allowed)}"
            + (f" (for {where})" if where else "")
        )
    if args.participant:
        known_participant(settings, args.participant)
        rows = await _participant_query(settings, args.participant, "p_refused_stats", {"by": by})
    else:
        rows = await _query(settings, "quarantine_stats", {"by": by})
    emit([{c: r.get(c) for c in (*by, "n", "last_at")} for r in rows], args.output)
    return EXIT_OK


async def cmd_instances(settings: Settings, args: Args) -> int:
    rows = await _query(
        settings,
        "instance_list",
        {"status": args.status, "tenant": args.tenant, "limit": args.limit},
    )
    emit(rows, args.output)
    return EXIT_OK


async def cmd_operations(settings: Settings, args: Args) -> int:
    rows = await _query(
        settings,
        "operation_list",
        {"status": args.status, "tenant": args.tenant, "route": args.route, "limit": args.limit},
    )
    emit(rows, args.output)
    return EXIT_OK


async def cmd_history(settings: Settings, args: Args) -> int:
    rows = await _query(settings, "instance_history", {"id": args.instance_id})
    if not rows:
        print(f"custody: no instance {args.instance_id}", file=sys.stderr)
        return EXIT_NOT_FOUND
    emit(rows, args.output)
    return EXIT_OK


async def cmd_audit(settings: Settings, args: Args) -> int:
    emit(await _query(settings, "audit_list", {"limit": args.limit}), args.output)
    return EXIT_OK


async def _show(
    settings: Settings, args: Args, noun: str, query: str, parts: dict[str, str]
) -> int:
    """One row in full, with its related rows (exit 4 if there is none)."""
    async with (
        db.connected(settings.database_url, schema="custody") as database,
        database.transaction() as tx,
    ):
        row = await tx.one(query, {"id": args.id})
        if row is None:
            print(f"custody: no {noun} {args.id}", file=sys.stderr)
            return EXIT_NOT_FOUND
        for key, name in parts.items():
            row[key] = await tx.rows(name, {"id": args.id})
    emit(row, args.output)
    return EXIT_OK


async def cmd_instance_show(settings: Settings, args: Args) -> int:
    return await _show(
        settings,
        args,
        "instance",
        "instance_get",
        {"operations": "instance_operations", "history": "instance_history"},
    )


async def cmd_operation_show(settings: Settings, args: Args) -> int:
    return await _show(
        settings,
        args,
        "operation",
        "operation_get",
        {"attempts": "operation_attempts", "receipts": "operation_receipts"},
    )


def register(root: click.Group) -> None:
    q = group(root, "quarantine")
    participant = click.option(
        "--participant",
        help="a participant's refused commands instead of the engine's (a route owner)",
    )
    command(
        q,
        "list",
        cmd_quarantine,
        help="newest first, with their reasons",
        params=[click.option("--reason"), participant, _limit(50)],
    )
    command(
        q,
        "stats",
        cmd_quarantine_stats,
        help="counts grouped by --by (reason,tenant,source,worker)",
        params=[
            click.option(
                "--by",
                default="reason",
                show_default=True,
                help="comma-separated: reason, tenant, source, worker (a participant's: reason)",
            ),
            participant,
        ],
    )

    for noun, fn, show, statuses in (
        ("instances", cmd_instances, cmd_instance_show, lifecycle.InstanceStatus),
        ("operations", cmd_operations, cmd_operation_show, lifecycle.Status),
    ):
        nouns = group(root, noun)
        command(
            nouns,
            "show",
            show,
            help=f"one of the {noun}, in full (default --output json); exit 4 if there is none",
            default_output="json",
            params=[click.argument("id", type=UUID)],
        )
        filters = [
            click.option("--status", type=click.Choice([s.value for s in statuses])),
            click.option("--tenant", type=NAME),
        ]
        if noun == "operations":
            filters.append(click.option("--route", type=NAME))
        command(nouns, "list", fn, help=f"the {noun}, newest first", params=[*filters, _limit(50)])
    command(
        group(root, "instances"),
        "history",
        cmd_history,
        help="an instance's history, in order; exit 4 if there is none",
        params=[click.argument("instance_id", type=UUID)],
    )
    command(
        group(root, "audit"),
        "list",
        cmd_audit,
        help="operator commands and refusals, newest first",
        params=[_limit(50)],
    )


def _limit(default: int) -> Any:
    return click.option(
        "--limit", type=LIMIT, default=default, show_default=True, help="at most this many rows"
    )
