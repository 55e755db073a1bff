"""Operator commands by filter: ``reconcile``, ``retry-safe``, ``cancel`` and ``dispatch
pause|resume`` given a filter instead of one id (``workers.engine.batch``).

``--dry-run`` prints how many the filter matches and a sample, and changes nothing;
``--yes`` runs the command for each (progress on stderr, the counts at the end);
without either a batch is refused. Exit 0 if every command was done, 3 if any was
refused (or its target had gone), 2 for a usage error."""

from __future__ import annotations

import re
import sys
from typing import Final

import click

from workers.cli.common import EXIT_OK, EXIT_REFUSED, NAME, Args, Decorator, emit
from workers.core import lifecycle
from workers.engine import batch, transitions
from workers.io import db
from workers.settings import Settings

OPERATIONS: Final = batch.OPERATIONS
INSTANCES: Final = batch.INSTANCES
SAMPLE: Final = 5
_SINCE: Final = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# the filters of each kind of target
OPERATION_FILTERS: Final = ("status", "route", "tenant", "since")
INSTANCE_FILTERS: Final = ("status", "tenant", "process", "since")


UsageError = click.UsageError


def filters(kind: str) -> list[Decorator]:
    """The filter options (a batch: every visible target the filter matches, instead of
    an id) and --dry-run/--yes."""
    statuses = lifecycle.Status if kind == batch.OPERATIONS else lifecycle.InstanceStatus
    out = [
        click.option(
            "--status",
            type=click.Choice([s.value for s in statuses]),
            help="batch filter: the status",
        ),
        click.option("--tenant", type=NAME, help="batch filter: the tenant"),
    ]
    if kind == batch.OPERATIONS:
        out += [
            click.option("--route", type=NAME, help="batch filter: the route"),
            click.option(
                "--since", help="batch filter: changed within this long: 90s, 30m, 2h, 1d"
            ),
        ]
    else:
        out += [
            click.option("--process", type=NAME, help="batch filter: the process"),
            click.option(
                "--since", help="batch filter: started within this long: 90s, 30m, 2h, 1d"
            ),
        ]
    return [
        *out,
        click.option(
            "--limit",
            type=click.IntRange(1, batch.MAX_BATCH),
            default=1000,
            show_default=True,
            help="a batch acts on at most this many",
        ),
        click.option("--dry-run", is_flag=True, help="print the batch's count and a sample"),
        click.option("--yes", is_flag=True, help="run the command for each of the batch"),
    ]


def is_batch(args: Args, kind: str) -> bool:
    names = OPERATION_FILTERS if kind == batch.OPERATIONS else INSTANCE_FILTERS
    return any(getattr(args, n, None) is not None for n in names) or bool(args.dry_run or args.yes)


def since_seconds(text: str) -> float:
    match = _SINCE.match(text.strip())
    if not match or float(match[1]) <= 0:
        raise UsageError(f"--since {text!r}: give a duration such as 90s, 30m, 2h or 1d")
    return float(match[1]) * _UNIT_S[match[2]]


def filter_of(args: Args, kind: str) -> batch.Filter:
    statuses = lifecycle.Status if kind == batch.OPERATIONS else lifecycle.InstanceStatus
    names = OPERATION_FILTERS if kind == batch.OPERATIONS else INSTANCE_FILTERS
    if all(getattr(args, n, None) is None for n in names):
        raise UsageError(f"a batch needs a filter: at least one of --{', --'.join(names)}")
    if args.status is not None and args.status not in {s.value for s in statuses}:
        raise UsageError(f"--status {args.status!r}: one of {', '.join(s.value for s in statuses)}")
    if not 1 <= args.limit <= batch.MAX_BATCH:
        raise UsageError(f"--limit {args.limit}: between 1 and {batch.MAX_BATCH}")
    if args.dry_run and args.yes:
        raise UsageError("--dry-run or --yes, not both")
    return batch.Filter(
        query=kind,
        status=args.status,
        route=getattr(args, "route", None),
        tenant=args.tenant,
        process=getattr(args, "process", None),
        since_s=None if args.since is None else since_seconds(args.since),
        since=args.since,
        limit=args.limit,
    )


async def run(
    settings: Settings,
    args: Args,
    *,
    kind: str,
    action: str,
    command: batch.Command,
    single: str | None,
) -> int:
    """A batch: the filter (as the login), then --dry-run's report or --yes's commands."""
    if single is not None:
        raise UsageError("give an id or a filter, not both")
    flt = filter_of(args, kind)
    if not (args.dry_run or args.yes):
        raise UsageError(f"a batch {action} needs --dry-run (count and sample) or --yes (run it)")
    async with db.connected(settings.database_url, schema="custody") as database:
        chosen = await batch.select(database, flt)
        what = "operation(s)" if kind == batch.OPERATIONS else "instance(s)"
        if args.dry_run:
            report = {
                "action": action,
                "filter": flt.describe(),
                "matched": chosen.matched,
                "would_act_on": len(chosen.rows),
                "sample": chosen.rows[:SAMPLE],
            }
            if args.json:
                emit(report, args.output)
            else:
                print(
                    f"dry run: {action} would act on {len(chosen.rows)} of {chosen.matched} "
                    f"{what} matching {_describe(flt)}; nothing changed"
                )
                emit(chosen.rows[:SAMPLE], "text")
            return EXIT_OK

        def progress(i: int, n: int, target: str, outcome: transitions.Outcome) -> None:
            print(f"[{i}/{n}] {outcome.result.value}: {outcome.message}", file=sys.stderr)

        targets = [str(r["id"]) for r in chosen.rows]
        summary = await batch.run(database, action, flt, targets, args.reason, command, progress)
    counts = {r.value: summary.counts.get(r.value, 0) for r in transitions.Result}
    if args.json:
        emit(
            {"action": action, "filter": flt.describe(), "selected": len(targets)} | counts,
            args.output,
        )
    else:
        print(
            f"batch {action}: {len(targets)} selected, {counts['done']} done, "
            f"{counts['refused']} refused, {counts['not_found']} not found "
            f"(audited: one row per {what[:-3]} and one for the batch)"
        )
    return EXIT_REFUSED if summary.refused else EXIT_OK


def _describe(flt: batch.Filter) -> str:
    return " ".join(f"{k}={v}" for k, v in flt.describe().items() if k != "limit")
