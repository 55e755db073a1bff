"""``run`` (one worker, or one sample participant, until SIGTERM) and ``start`` (publish
start requests)."""

from __future__ import annotations

import argparse
import sys

import orjson

from workers import errors, provision
from workers.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, Subparsers, emit
from workers.core import horizon, names, process
from workers.io import broker
from workers.runtime import faults, logs, metrics, supervisor
from workers.settings import Settings


async def cmd_run(settings: Settings, args: argparse.Namespace) -> int:
    logs.setup_logging(settings.log_format, logs.level_of(settings.log_level))
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
    )


async def run_participant(settings: Settings, name: str | None) -> int:
    from participants import samples
    from workers.participant import service

    if not name or name not in samples.HANDLERS:
        print(f"--name must be one of {sorted(samples.HANDLERS)}", file=sys.stderr)
        return EXIT_USAGE
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
    )


async def cmd_start(settings: Settings, args: argparse.Namespace) -> int:
    try:
        data = orjson.loads(args.input)
    except orjson.JSONDecodeError as exc:
        print(f"--input is not JSON: {exc}", file=sys.stderr)
        return EXIT_USAGE
    amqp = broker.Broker(settings.amqp_url, "cli", broker.tls(settings))
    await amqp.connect()
    try:
        pub = await amqp.publisher(window=64, timeout_s=10, user_id=None)
        ids = []
        items = []
        for _ in range(args.count):
            item = broker.start_request(
                tenant=args.tenant, process=args.process, input=data, requested_by=args.actor
            )
            ids.append(item.message_id)
            items.append(item)
        outcomes = await pub.publish_many(items)
    finally:
        await amqp.close()
    failed = [o for o in outcomes if not o.ok]
    emit(
        {
            "published": len(outcomes) - len(failed),
            "failed": len(failed),
            "start_request_ids": ids[:10],
        },
        args.json,
    )
    return EXIT_OK if not failed else EXIT_FAILED


def register(sub: Subparsers) -> None:
    r = sub.add_parser("run", help="run one worker until SIGTERM")
    r.add_argument("worker", choices=[*names.ENGINE_WORKERS, names.PARTICIPANT])
    r.add_argument("--name", help="participant name (inventory, payments, shipping)")
    r.set_defaults(fn=cmd_run)

    s = sub.add_parser("start", help="publish start requests")
    s.add_argument("--tenant", required=True)
    s.add_argument("--process", required=True)
    s.add_argument("--input", required=True, help="the instance input, a JSON object")
    s.add_argument("--count", type=int, default=1)
    s.add_argument("--actor", default="cli")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_start)
