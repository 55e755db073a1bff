"""``dead-letters list|show|replay`` and ``workers list``: the dead-letter queue and the
fleet's leases, for an operator."""

from __future__ import annotations

import base64
import sys
from typing import Any

import click

from workers.cli.common import (
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_REFUSED,
    LIMIT,
    Args,
    audited_options,
    command,
    emit,
    group,
    with_options,
)
from workers.core import deadletters as letters
from workers.engine import deadletters
from workers.io import broker, db
from workers.settings import Settings


async def _connected(settings: Settings) -> broker.Broker:
    amqp = broker.Broker(settings.amqp_url, "custody-cli", broker.tls(settings))
    await amqp.connect()
    return amqp


async def cmd_dead_letters(settings: Settings, args: Args) -> int:
    """Read (list, show) or replay the dead letters, as CUSTODY_AMQP_URL's broker user
    (``custody-operator``: it reads custody.dead-letters, writes only where a replay
    goes) and, for a replay, CUSTODY_DATABASE_URL's operator login (authorized and
    audited)."""
    verb = args.dl_command
    amqp = await _connected(settings)
    try:
        if verb == "replay":
            async with db.connected(settings.database_url, schema="custody") as database:
                results = await deadletters.replay(
                    amqp,
                    database,
                    args.message_id,
                    args.reason,
                    confirm_timeout_s=settings.confirm_timeout_s,
                )
            return _report(results, args.output)
        listing = await deadletters.read(amqp)
    finally:
        await amqp.close()
    if verb == "list":
        emit([d.summary() for d in listing.letters[: args.limit]], args.output)
        if listing.depth > args.limit and not args.json:
            print(f"({listing.depth} dead letters; --limit shows more)", file=sys.stderr)
        return EXIT_OK
    found = [d for d in listing.letters if d.message_id == args.message_id]
    if not found:
        print(f"custody: no dead letter with message_id {args.message_id}", file=sys.stderr)
        return EXIT_NOT_FOUND
    emit([_full(d) for d in found], args.output)
    return EXIT_OK


def _full(d: letters.DeadLetter) -> dict[str, Any]:
    try:
        body: Any = d.body.decode()
    except UnicodeDecodeError:
        body = {"base64": base64.b64encode(d.body).decode()}
    return d.summary() | {
        "replayable": d.unreplayable() is None,
        "why_not": d.unreplayable(),
        "headers": broker.safe_headers(d.headers),
        "body": body,
    }


def _report(results: list[deadletters.Replayed], output: str) -> int:
    if output != "text":
        emit([r.row() for r in results], output)
    else:
        for r in results:
            stream = sys.stdout if r.result == "done" else sys.stderr
            print(f"{r.result}: {r.message}", file=stream)
    if all(r.result == "done" for r in results):
        return EXIT_OK
    if any(r.result == "failed" for r in results):
        return 1
    if all(r.result == "not_found" for r in results):
        return EXIT_NOT_FOUND
    return EXIT_REFUSED


async def cmd_workers(settings: Settings, args: Args) -> int:
    async with (
        db.connected(settings.database_url, schema="custody") as database,
        database.transaction() as tx,
    ):
        rows = await tx.rows("workers_list")
    emit(rows, args.output)
    return EXIT_OK


def register(root: click.Group) -> None:
    # (not the word "replay" at the top level: no command replays an operation)
    dl = group(root, "dead-letters")
    for verb, help, params, default_output in (
        (
            "list",
            "oldest first: message_id, reason, origin, deliveries",
            [click.option("--limit", type=LIMIT, default=50, show_default=True)],
            "text",
        ),
        (
            "show",
            "one dead letter in full: headers, x-death, body (default --output json)",
            [click.argument("message_id")],
            "json",
        ),
        (
            "replay",
            "publish to its original exchange and routing key (same message_id, body and "
            "headers), then remove it from the queue (an item of a dead-lettered envelope "
            "leaves with its envelope, once every item of it was replayed in one call); "
            "authorized (action replay) and audited; exit 0 done, 3 refused, 4 not found, "
            "1 not confirmed",
            [click.argument("message_id", nargs=-1, required=True), audited_options],
            "text",
        ),
    ):
        body = with_options(cmd_dead_letters, dl_command=verb)
        command(dl, verb, body, help=help, params=params, default_output=default_output)

    command(
        group(root, "workers"),
        "list",
        cmd_workers,
        help="holder, worker type, epoch, acquired, last heartbeat, expires, live",
    )
