"""``workers run`` (one worker, or one sample participant, until SIGTERM) and
``instances start`` (publish start requests)."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import click
import pydantic

from contracts import identity
from workers import errors, provision
from workers.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    JSON_OBJECT,
    NAME,
    UUID,
    Args,
    command,
    emit,
    group,
)
from workers.core import horizon, names, process
from workers.io import broker
from workers.runtime import faults, logs, metrics, supervisor
from workers.settings import Settings


async def cmd_run(settings: Settings, args: Args) -> int:
    logs.setup_logging(settings.log_format, logs.level_of(settings.log_level))
    for warning in Settings.unknown_variables():
        logs.event("config.unknown_variable", logging.WARNING, warning=warning)
    faults.arm()  # an unknown fault name stops the worker before it takes work
    if args.worker == "participant":
        return await run_participant(settings, args.name)
    from workers.engine import committer, publisher, receipts, reconciler

    mains = {
        "committer": committer.main,
        "publisher": publisher.main,
        "receipts": receipts.main,
        "reconciler": reconciler.main,
    }
    metrics.register(
        args.worker, dispatch_paused=settings.dispatch_paused, revision=settings.git_revision
    )
    return await supervisor.run(
        args.worker,
        lambda stop, health: mains[args.worker](settings, stop, health),
        metrics_port=settings.metrics_port,
        grace_s=settings.drain_grace_s,
        gc_threshold=settings.gc_threshold,
    )


async def run_participant(settings: Settings, name: str | None) -> int:
    from participants import samples
    from workers.participant import service

    if not name or name not in samples.HANDLERS:
        raise click.UsageError(
            f"--name {name!r}: a participant worker needs one of "
            + ", ".join(sorted(samples.HANDLERS))
        )
    table, catalog = process.load_config(settings)
    horizon.check(settings, catalog)
    owned = table.owned_by(name)
    principals = {r.principal for r in owned}
    if len(principals) != 1:
        raise errors.ConfigError(f"participant {name} needs exactly one principal in routes")
    principal = principals.pop()
    if broker.user_of(settings.amqp_url) != principal:
        raise errors.ConfigError(
            f"participant {name} must connect as its principal {principal!r}, "
            f"not {broker.user_of(settings.amqp_url)!r} (RabbitMQ validates user_id)"
        )
    me = service.Identity(
        owner=name, principal=principal, bindings=frozenset(r.binding for r in owned)
    )
    worker = names.participant_worker(name)
    metrics.register(worker, revision=settings.git_revision)
    return await supervisor.run(
        worker,
        lambda stop, health: service.serve(
            me,
            samples.HANDLERS[name],
            settings,
            stop,
            health,
            schema=provision.participant_schema(name),
            inline=samples.INLINE[name] if settings.participant_inline else (),
        ),
        metrics_port=settings.metrics_port,
        grace_s=settings.drain_grace_s,
        gc_threshold=settings.gc_threshold,
    )


MAX_COUNT = 100_000  # one command's starts (each is held in memory until confirmed)


async def cmd_start(settings: Settings, args: Args) -> int:
    """Publish ``--count`` start requests and print every one (start request id, the
    instance id it creates, whether the broker confirmed it)."""
    _, catalog = process.load_config(settings)
    known = sorted({n for n, _ in catalog.definitions})
    if args.process not in known:
        raise click.UsageError(
            f"--process {args.process!r}: no such process definition; one of {', '.join(known)}"
        )
    first = args.start_request_id or str(uuid.uuid4())
    ids = (
        identity.start_request_ids(first, args.count)
        if args.start_request_id
        else [first, *(str(uuid.uuid4()) for _ in range(args.count - 1))]
    )
    try:
        items = [
            broker.start_request(
                tenant=args.tenant,
                process=args.process,
                input=args.input,
                requested_by=args.actor,
                start_request_id=sid,
            )
            for sid in ids
        ]
    except pydantic.ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"])
        raise click.UsageError(f"--input: {where}: {error['msg']}") from None
    amqp = broker.Broker(settings.amqp_url, "cli", broker.tls(settings))
    await amqp.connect()
    try:
        pub = await amqp.publisher(
            window=64,
            timeout_s=settings.confirm_timeout_s,
            user_id=None,
            envelope_max=settings.envelope_max,
        )
        outcomes = await pub.publish_many(items)
    finally:
        await amqp.close()
    rows: list[dict[str, Any]] = [
        {
            "start_request_id": o.message_id,
            "instance_id": identity.instance_id(args.tenant, o.message_id),
            "published": o.ok,
            **({"error": o.error} if o.error else {}),
        }
        for o in outcomes
    ]
    failed = sum(not o.ok for o in outcomes)
    if args.output == "json":
        emit(
            {
                "published": len(outcomes) - failed,
                "failed": failed,
                "start_request_ids": [r["start_request_id"] for r in rows],
                "instance_ids": [r["instance_id"] for r in rows],
                "starts": rows,
            },
            "json",
        )
    else:
        emit(rows, args.output)
    if failed:
        click.echo(
            f"custody: {failed} of {len(rows)} start requests not confirmed; run the same "
            "command again (with --start-request-id, it creates nothing twice)",
            err=True,
        )
    return EXIT_OK if not failed else EXIT_FAILED


def register(root: click.Group) -> None:
    run_params = [
        click.argument("worker", type=click.Choice([*names.ENGINE_WORKERS, names.PARTICIPANT])),
        click.option("--name", help="participant name (inventory, payments, shipping)"),
    ]
    run_help = (
        "run one worker until SIGTERM (CUSTODY_METRICS_PORT, CUSTODY_DRAIN_GRACE_S, "
        "CUSTODY_LOG_FORMAT)"
    )
    command(group(root, "workers"), "run", cmd_run, help=run_help, emits=False, params=run_params)
    # the old spelling: every deployment manifest and the harnesses run ``custody run``
    command(root, "run", cmd_run, help=run_help, emits=False, hidden=True, params=run_params)

    start_params = [
        click.option("--tenant", required=True, type=NAME, help="the tenant (a contract name)"),
        click.option("--process", required=True, type=NAME, help="a process definition's name"),
        click.option(
            "--input", required=True, type=JSON_OBJECT, help="the instance input, a JSON object"
        ),
        click.option(
            "--count",
            type=click.IntRange(1, MAX_COUNT),
            default=1,
            show_default=True,
            help="how many instances",
        ),
        click.option(
            "--start-request-id",
            type=UUID,
            help="the (first) start request's id, so a retry after a confirm timeout "
            "creates nothing new; with --count N the others are derived from it",
        ),
        click.option("--actor", type=NAME, default="cli", show_default=True, help="requested_by"),
    ]
    start_help = (
        "publish start requests and print each one's id and its instance's "
        "(CUSTODY_AMQP_URL, CUSTODY_CONFIRM_TIMEOUT_S)"
    )
    command(group(root, "instances"), "start", cmd_start, help=start_help, params=start_params)
    command(root, "start", cmd_start, help=start_help, hidden=True, params=start_params)
