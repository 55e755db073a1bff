"""``reconcile``, ``retry-safe``, ``cancel``, ``cancel-start``, ``dispatch``, ``restore``:
the controlled operator commands, run in the database as the operator's own login."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from workers import provision
from workers.cli import bulk
from workers.cli.common import (
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_USAGE,
    Subparsers,
    audited_args,
    emit,
)
from workers.core import process
from workers.io import db
from workers.settings import Settings

if TYPE_CHECKING:
    from workers.engine import transitions


async def _operator_command(settings: Settings, args: argparse.Namespace, call: Any) -> int:
    """Run a controlled command as the login of ``CUSTODY_DATABASE_URL``: the database
    takes the actor from that authenticated role (``session_user``), never from input."""
    from workers.engine import transitions

    if getattr(args, "actor", None) or os.environ.get("CUSTODY_OPERATOR"):
        print(
            "custody: --as and CUSTODY_OPERATOR are gone: you act as the Postgres login "
            "of CUSTODY_DATABASE_URL (your own operator role), and only as that",
            file=sys.stderr,
        )
        return EXIT_USAGE
    async with db.connected(settings.database_url, schema="custody") as database:
        outcome = await call(transitions.Operator(database))
    codes = {
        transitions.Result.DONE: EXIT_OK,
        transitions.Result.REFUSED: EXIT_REFUSED,
        transitions.Result.NOT_FOUND: EXIT_NOT_FOUND,
    }
    if args.json:
        emit({"result": outcome.result.value, "message": outcome.message, **outcome.data}, True)
    else:
        stream = sys.stdout if outcome.result is transitions.Result.DONE else sys.stderr
        print(f"{outcome.result.value}: {outcome.message}", file=stream)
    return codes[outcome.result]


async def _one_or_batch(
    settings: Settings,
    args: argparse.Namespace,
    *,
    kind: str,
    action: str,
    target: str | None,
    command: Callable[[transitions.Operator, str | None], Awaitable[transitions.Outcome]],
    batch_without_target: bool = True,
) -> int:
    """The command on one target, or (with a filter, or without a target where the
    command has no meaning without one) on every target the filter matches."""
    if bulk.is_batch(args, kind) or (batch_without_target and target is None):
        return await bulk.run(
            settings, args, kind=kind, action=action, command=command, single=target
        )
    return await _operator_command(settings, args, lambda op: command(op, target))


async def cmd_reconcile(settings: Settings, args: argparse.Namespace) -> int:
    return await _one_or_batch(
        settings,
        args,
        kind=bulk.OPERATIONS,
        action="reconcile",
        target=args.operation_id,
        command=lambda op, target: op.reconcile(None, _given(target), args.reason),
    )


async def cmd_retry_safe(settings: Settings, args: argparse.Namespace) -> int:
    return await _one_or_batch(
        settings,
        args,
        kind=bulk.OPERATIONS,
        action="retry-safe",
        target=args.operation_id,
        command=lambda op, target: op.retry_safe(None, _given(target), args.reason),
    )


async def cmd_cancel(settings: Settings, args: argparse.Namespace) -> int:
    return await _one_or_batch(
        settings,
        args,
        kind=bulk.INSTANCES,
        action="cancel",
        target=args.instance_id,
        command=lambda op, target: op.cancel_instance(None, _given(target), args.reason),
    )


async def cmd_cancel_start(settings: Settings, args: argparse.Namespace) -> int:
    return await _operator_command(
        settings,
        args,
        lambda op: op.cancel_start(None, args.tenant, args.start_request_id, args.reason),
    )


async def cmd_dispatch(settings: Settings, args: argparse.Namespace) -> int:
    """``dispatch pause|resume``: globally without a target, for one ``--instance``, or
    for every instance a filter matches."""
    paused = args.dispatch_command == "pause"
    return await _one_or_batch(
        settings,
        args,
        kind=bulk.INSTANCES,
        action=args.dispatch_command,
        target=args.instance,
        command=lambda op, target: op.set_paused(None, paused, args.reason, target),
        batch_without_target=False,
    )


def _given(target: str | None) -> str:
    assert target is not None  # a batch passes each target it selected
    return target


async def cmd_restore(settings: Settings, args: argparse.Namespace) -> int:
    from workers.engine import restore

    step = args.restore_command
    if step == "report":
        engine_db = db.Database(settings.database_url, schema="custody", name="cli", max_size=1)
        table, _ = process.load_config(settings)
        journals = {
            owner: db.Database(
                settings.participant_database_url,
                schema=provision.participant_schema(owner),
                name="cli",
                max_size=1,
            )
            for owner in sorted({r.owner for r in table.by_name.values()})
        }
        for d in (engine_db, *journals.values()):
            await d.open()
        try:
            result = await restore.report(engine_db, journals)
        finally:
            for d in (engine_db, *journals.values()):
                await d.close()
        emit(result, True)
        return EXIT_OK

    async def call(op: transitions.Operator) -> transitions.Outcome:
        runbook = restore.Restore(op)
        if step == "mark-restored":
            return await runbook.mark_restored(None, args.reason)
        if step == "reconcile":
            return await runbook.reconcile(None, args.reason)
        return await runbook.resume(None, args.reason, args.force)

    return await _operator_command(settings, args, call)


def _operator_args(p: argparse.ArgumentParser) -> None:
    audited_args(p)
    # gone: the actor is the database login; kept only to say so
    p.add_argument("--as", dest="actor", help=argparse.SUPPRESS)


def register(sub: Subparsers) -> None:
    rc = sub.add_parser(
        "reconcile",
        help="query the pinned executor of an outcome_unknown "
        "operation (ReconcilePending), or of every operation a filter matches; "
        "exit 0 done, 3 refused, 4 not found",
    )
    rc.add_argument("operation_id", nargs="?")
    _operator_args(rc)
    bulk.add_filters(rc, bulk.OPERATIONS)
    rc.set_defaults(fn=cmd_reconcile)

    rs = sub.add_parser(
        "retry-safe",
        help="a new attempt, only from retry_waiting with "
        "effect none (one operation, or every one a filter matches); exit 0 done, "
        "3 refused, 4 not found",
    )
    rs.add_argument("operation_id", nargs="?")
    _operator_args(rs)
    bulk.add_filters(rs, bulk.OPERATIONS)
    rs.set_defaults(fn=cmd_retry_safe)

    cn = sub.add_parser(
        "cancel",
        help="cancel an instance: its unresolved operations stay "
        "cancelling until their executors answer; exit 0 done, 3 refused, "
        "4 not found; or every instance a filter matches",
    )
    cn.add_argument("instance_id", nargs="?")
    _operator_args(cn)
    bulk.add_filters(cn, bulk.INSTANCES)
    cn.set_defaults(fn=cmd_cancel)

    cs = sub.add_parser(
        "cancel-start",
        help="cancel a start request: its instance if it "
        "exists, otherwise a durable tombstone so a late start creates nothing",
    )
    cs.add_argument("start_request_id")
    cs.add_argument("--tenant", required=True)
    _operator_args(cs)
    cs.set_defaults(fn=cmd_cancel_start)

    dp = sub.add_parser("dispatch", help="pause or resume effect dispatch").add_subparsers(
        dest="dispatch_command", required=True
    )
    for verb in ("pause", "resume"):
        v = dp.add_parser(
            verb,
            help=f"{verb} submits globally, for one --instance, or for every instance a "
            "filter matches (queries and cancels still flow)",
        )
        v.add_argument("--instance")
        _operator_args(v)
        bulk.add_filters(v, bulk.INSTANCES)
        v.set_defaults(fn=cmd_dispatch)

    rp = sub.add_parser("restore", help="the restore runbook (README: Restore)").add_subparsers(
        dest="restore_command", required=True
    )
    for step, text in (
        ("mark-restored", "after restoring the database: hold dispatch, bump the generation"),
        ("reconcile", "query the pinned executor of every unsettled operation"),
        ("resume", "resume effect dispatch (refused while queries are unanswered)"),
    ):
        st = rp.add_parser(step, help=text)
        _operator_args(st)
        if step == "resume":
            st.add_argument(
                "--force", action="store_true", help="resume although queries are unanswered"
            )
        st.set_defaults(fn=cmd_restore)
    rp.add_parser("report", help="participant journals against engine rows (JSON)").set_defaults(
        fn=cmd_restore
    )
