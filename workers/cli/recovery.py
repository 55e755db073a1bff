"""``operations reconcile|retry-safe``, ``instances cancel``, ``start-requests cancel``,
``dispatch``, ``restore``: the controlled operator commands, run in the database as the
operator's own login. The old spellings (``custody reconcile``, ``retry-safe``,
``cancel``, ``cancel-start``) stay as hidden aliases: the tests and runbooks use them."""

from __future__ import annotations

import os
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import click

from workers import provision
from workers.cli import bulk
from workers.cli.common import (
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_USAGE,
    NAME,
    UUID,
    Args,
    Body,
    Decorator,
    audited_options,
    command,
    emit,
    group,
    with_options,
)
from workers.core import process
from workers.io import db
from workers.settings import Settings

if TYPE_CHECKING:
    from workers.engine import transitions


async def _operator_command(settings: Settings, args: Args, call: Any) -> int:
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
        emit(
            {"result": outcome.result.value, "message": outcome.message, **outcome.data},
            args.output,
        )
    else:
        stream = sys.stdout if outcome.result is transitions.Result.DONE else sys.stderr
        print(f"{outcome.result.value}: {outcome.message}", file=stream)
    return codes[outcome.result]


async def _one_or_batch(
    settings: Settings,
    args: Args,
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


async def cmd_reconcile(settings: Settings, args: Args) -> int:
    return await _one_or_batch(
        settings,
        args,
        kind=bulk.OPERATIONS,
        action="reconcile",
        target=args.operation_id,
        command=lambda op, target: op.reconcile(None, _given(target), args.reason),
    )


async def cmd_retry_safe(settings: Settings, args: Args) -> int:
    return await _one_or_batch(
        settings,
        args,
        kind=bulk.OPERATIONS,
        action="retry-safe",
        target=args.operation_id,
        command=lambda op, target: op.retry_safe(None, _given(target), args.reason),
    )


async def cmd_cancel(settings: Settings, args: Args) -> int:
    return await _one_or_batch(
        settings,
        args,
        kind=bulk.INSTANCES,
        action="cancel",
        target=args.instance_id,
        command=lambda op, target: op.cancel_instance(None, _given(target), args.reason),
    )


async def cmd_cancel_start(settings: Settings, args: Args) -> int:
    return await _operator_command(
        settings,
        args,
        lambda op: op.cancel_start(None, args.tenant, args.start_request_id, args.reason),
    )


async def cmd_dispatch(settings: Settings, args: Args) -> int:
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


async def cmd_restore(settings: Settings, args: Args) -> int:
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
        emit(result, args.output)
        return EXIT_OK

    async def call(op: transitions.Operator) -> transitions.Outcome:
        runbook = restore.Restore(op)
        if step == "mark-restored":
            return await runbook.mark_restored(None, args.reason)
        if step == "reconcile":
            return await runbook.reconcile(None, args.reason)
        return await runbook.resume(None, args.reason, bool(args.force))

    return await _operator_command(settings, args, call)


def _operator_options(f: Any) -> Any:
    f = audited_options(f)
    # gone: the actor is the database login; kept only to say so
    return click.option("--as", "actor", hidden=True)(f)


def _controlled(
    root: click.Group,
    parent: click.Group,
    name: str,
    body: Body,
    help: str,
    params: list[Decorator],
    *,
    alias: str | None = None,
) -> None:
    """A controlled command under its noun, and (if the repo still uses it) under its
    old top-level spelling, hidden."""
    params = [*params, _operator_options]
    command(parent, name, body, help=help, params=params)
    if alias is not None:
        command(root, alias, body, help=help, params=params, hidden=True)


def register(root: click.Group) -> None:
    operations = group(root, "operations")
    instances = group(root, "instances")
    _controlled(
        root,
        operations,
        "reconcile",
        cmd_reconcile,
        "query the pinned executor of an outcome_unknown operation (ReconcilePending), "
        "or of every operation a filter matches; exit 0 done, 3 refused, 4 not found",
        [click.argument("operation_id", required=False, type=UUID), *bulk.filters(bulk.OPERATIONS)],
        alias="reconcile",
    )
    _controlled(
        root,
        operations,
        "retry-safe",
        cmd_retry_safe,
        "a new attempt, only from retry_waiting with effect none (one operation, or every "
        "one a filter matches); exit 0 done, 3 refused, 4 not found",
        [click.argument("operation_id", required=False, type=UUID), *bulk.filters(bulk.OPERATIONS)],
        alias="retry-safe",
    )
    _controlled(
        root,
        instances,
        "cancel",
        cmd_cancel,
        "cancel an instance: its unresolved operations stay cancelling until their "
        "executors answer; or every instance a filter matches; exit 0 done, 3 refused, "
        "4 not found",
        [click.argument("instance_id", required=False, type=UUID), *bulk.filters(bulk.INSTANCES)],
        alias="cancel",
    )
    _controlled(
        root,
        group(root, "start-requests"),
        "cancel",
        cmd_cancel_start,
        "cancel a start request: its instance if it exists, otherwise a durable tombstone "
        "so a late start creates nothing; exit 0 done, 3 refused",
        [
            click.argument("start_request_id", type=UUID),
            click.option("--tenant", required=True, type=NAME),
        ],
        alias="cancel-start",
    )

    dispatch = group(root, "dispatch")
    for verb in ("pause", "resume"):
        _controlled(
            root,
            dispatch,
            verb,
            with_options(cmd_dispatch, dispatch_command=verb),
            f"{verb} submits globally, for one --instance, or for every instance a filter "
            "matches (queries and cancels still flow)",
            [
                click.option("--instance", type=UUID, help="one instance only"),
                *bulk.filters(bulk.INSTANCES),
            ],
        )

    restore = group(root, "restore")
    for step, text in (
        ("mark-restored", "after restoring the database: hold dispatch, bump the generation"),
        ("reconcile", "query the pinned executor of every unsettled operation"),
        ("resume", "resume effect dispatch (refused while queries are unanswered)"),
    ):
        force = click.option("--force", is_flag=True, help="resume although queries are unanswered")
        _controlled(
            root,
            restore,
            step,
            with_options(cmd_restore, restore_command=step),
            text,
            [force] if step == "resume" else [],
        )
    command(
        restore,
        "report",
        with_options(cmd_restore, restore_command="report"),
        help="participant journals against engine rows (default --output json)",
        default_output="json",
    )
