"""``custody``: the operator and deployment command line.

Every command goes through the same code paths as the workers (named queries, the
codec, the topology plan); none edits runtime rows by hand. Settings come from the
environment (``CUSTODY_*``, see ``custody config show``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import uuid
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import orjson

from contracts import codec
from workers import errors, provision
from workers.core import horizon, process, routes
from workers.engine import retention as engine_retention
from workers.io import broker, db
from workers.participant import retention as participant_retention
from workers.runtime import logs, supervisor
from workers.settings import ROOT, Settings

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_REFUSED, EXIT_NOT_FOUND = 0, 1, 2, 3, 4


def _print(data: Any, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(
            orjson.dumps(data, default=str, option=orjson.OPT_INDENT_2).decode() + "\n"
        )
        return
    if isinstance(data, list):
        for row in data:
            sys.stdout.write("  ".join(f"{k}={v}" for k, v in row.items()) + "\n")
    else:
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


async def cmd_migrate(settings: Settings, args: argparse.Namespace) -> int:
    await provision.migrate(settings, participants=args.participants)
    return EXIT_OK


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


async def cmd_run(settings: Settings, args: argparse.Namespace) -> int:
    logs.setup_logging(settings.log_format)
    if args.worker == "participant":
        return await run_participant(settings, args.name)
    from workers.engine import committer, publisher, receipts, reconciler

    mains = {
        "committer": committer.main,
        "publisher": publisher.main,
        "receipts": receipts.main,
        "reconciler": reconciler.main,
    }
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
    return await supervisor.run(
        f"participant-{name}",
        lambda stop, health: service.serve(
            me,
            samples.HANDLERS[name],
            settings,
            stop,
            health,
            schema=provision.participant_schema(name),
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
    _print(
        {
            "published": len(outcomes) - len(failed),
            "failed": len(failed),
            "start_request_ids": ids[:10],
        },
        args.json,
    )
    return EXIT_OK if not failed else EXIT_FAILED


async def _query(settings: Settings, name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    async with (
        db.connected(settings.database_url, schema="custody") as database,
        database.transaction() as tx,
    ):
        return await tx.rows(name, params)


async def cmd_quarantine(settings: Settings, args: argparse.Namespace) -> int:
    params = {"reason": args.reason, "limit": args.limit}
    if args.participant:
        async with (
            db.connected(
                settings.participant_database_url,
                schema=provision.participant_schema(args.participant),
            ) as database,
            database.transaction() as tx,
        ):
            rows = await tx.rows("p_refused_list", params)
    else:
        rows = await _query(settings, "quarantine_list", params)
    _print(rows, args.json)
    return EXIT_OK


async def cmd_instances(settings: Settings, args: argparse.Namespace) -> int:
    rows = await _query(
        settings,
        "instance_list",
        {"status": args.status, "tenant": args.tenant, "limit": args.limit},
    )
    _print(rows, args.json)
    return EXIT_OK


async def cmd_operations(settings: Settings, args: argparse.Namespace) -> int:
    rows = await _query(
        settings,
        "operation_list",
        {"status": args.status, "tenant": args.tenant, "route": args.route, "limit": args.limit},
    )
    _print(rows, args.json)
    return EXIT_OK


async def cmd_history(settings: Settings, args: argparse.Namespace) -> int:
    rows = await _query(settings, "instance_history", {"id": args.instance_id})
    if not rows:
        print(f"no instance {args.instance_id}", file=sys.stderr)
        return EXIT_NOT_FOUND
    _print(rows, args.json)
    return EXIT_OK


async def cmd_schemas(settings: Settings, args: argparse.Namespace) -> int:
    out = ROOT / "contracts" / "schemas"
    drift = []
    for name, schema in codec.json_schemas().items():
        path = out / f"{name}.json"
        text = json.dumps(schema, indent=2, sort_keys=True) + "\n"
        if args.check:
            if not path.exists() or path.read_text() != text:
                drift.append(path.name)
        else:
            path.write_text(text)
    if drift:
        print(
            f"JSON Schemas drifted from the models: {drift}; run `custody contracts schemas`",
            file=sys.stderr,
        )
        return EXIT_FAILED
    print("schemas up to date" if args.check else f"wrote {out}")
    return EXIT_OK


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
        _print({"result": outcome.result.value, "message": outcome.message, **outcome.data}, True)
    else:
        stream = sys.stdout if outcome.result is transitions.Result.DONE else sys.stderr
        print(f"{outcome.result.value}: {outcome.message}", file=stream)
    return codes[outcome.result]


async def cmd_reconcile(settings: Settings, args: argparse.Namespace) -> int:
    return await _operator_command(
        settings, args, lambda op: op.reconcile(None, args.operation_id, args.reason)
    )


async def cmd_retry_safe(settings: Settings, args: argparse.Namespace) -> int:
    return await _operator_command(
        settings, args, lambda op: op.retry_safe(None, args.operation_id, args.reason)
    )


async def cmd_cancel(settings: Settings, args: argparse.Namespace) -> int:
    return await _operator_command(
        settings, args, lambda op: op.cancel_instance(None, args.instance_id, args.reason)
    )


async def cmd_cancel_start(settings: Settings, args: argparse.Namespace) -> int:
    return await _operator_command(
        settings,
        args,
        lambda op: op.cancel_start(None, args.tenant, args.start_request_id, args.reason),
    )


async def cmd_dispatch(settings: Settings, args: argparse.Namespace) -> int:
    paused = args.dispatch_command == "pause"
    return await _operator_command(
        settings, args, lambda op: op.set_paused(None, paused, args.reason, args.instance)
    )


async def cmd_audit(settings: Settings, args: argparse.Namespace) -> int:
    _print(await _query(settings, "audit_list", {"limit": args.limit}), args.json)
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
    _print(row, True)
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


async def cmd_restore(settings: Settings, args: argparse.Namespace) -> int:
    from workers.engine import restore, transitions

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
        _print(result, True)
        return EXIT_OK

    async def call(op: transitions.Operator) -> transitions.Outcome:
        runbook = restore.Restore(op)
        if step == "mark-restored":
            return await runbook.mark_restored(None, args.reason)
        if step == "reconcile":
            return await runbook.reconcile(None, args.reason)
        return await runbook.resume(None, args.reason, args.force)

    return await _operator_command(settings, args, call)


async def cmd_retention(settings: Settings, args: argparse.Namespace) -> int:
    _, catalog = process.load_config(settings)
    horizon.check(settings, catalog)
    if args.participant:
        async with db.connected(
            settings.participant_database_url, schema=provision.participant_schema(args.participant)
        ) as database:
            removed = await participant_retention.cleanup(database, settings.retention_s)
    else:
        async with db.connected(settings.database_url, schema="custody") as database:
            removed = await engine_retention.cleanup(database, settings.retention_s)
    _print({"horizon_s": settings.retention_s, "removed": removed}, args.json)
    return EXIT_OK


async def cmd_definitions_check(settings: Settings, args: argparse.Namespace) -> int:
    """Load the routes file and every process definition as a worker's start-up does
    (contract names, the digest's domain, the routes, the retention horizon)."""
    checked = replace(
        settings,
        routes_file=args.routes or settings.routes_file,
        processes_dir=args.dir or settings.processes_dir,
    )
    try:
        table, catalog = process.load_config(checked)
    except (routes.RouteConfigError, process.DefinitionError) as exc:
        print(f"custody: definitions refused: {exc}", file=sys.stderr)
        return EXIT_USAGE
    horizon.check(checked, catalog)
    versions = ", ".join(f"{n} v{v}" for n, v in sorted(catalog.definitions))
    print(
        f"definitions ok: {len(catalog.definitions)} in {checked.processes_dir} ({versions}) "
        f"fit {len(table.by_name)} routes in {checked.routes_file}"
    )
    return EXIT_OK


async def cmd_config(settings: Settings, args: argparse.Namespace) -> int:
    _print(settings.redacted(), True)
    return EXIT_OK


async def cmd_demo(settings: Settings, args: argparse.Namespace) -> int:
    from workers.harness import demo

    return await demo.run(settings, instances=args.instances, replicas=args.replicas)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="custody", description=__doc__.split("\n")[0] if __doc__ else ""
    )
    sub = p.add_subparsers(dest="command", required=True)

    dbp = sub.add_parser("db", help="database schema").add_subparsers(
        dest="db_command", required=True
    )
    m = dbp.add_parser("migrate", help="apply schema.sql (CUSTODY_DATABASE_URL), idempotently")
    m.add_argument(
        "--participants",
        action="store_true",
        help="also the sample participants' schemas (CUSTODY_PARTICIPANT_DATABASE_URL)",
    )
    m.set_defaults(fn=cmd_migrate)

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

    r = sub.add_parser("run", help="run one worker until SIGTERM")
    r.add_argument(
        "worker", choices=["committer", "publisher", "receipts", "reconciler", "participant"]
    )
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

    def operator_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--reason", required=True, help="why (audited)")
        # gone: the actor is the database login; kept only to say so
        p.add_argument("--as", dest="actor", help=argparse.SUPPRESS)
        p.add_argument("--json", action="store_true")

    rc = sub.add_parser(
        "reconcile",
        help="query the pinned executor of an outcome_unknown "
        "operation (ReconcilePending); exit 0 done, 3 refused, 4 not found",
    )
    rc.add_argument("operation_id")
    operator_args(rc)
    rc.set_defaults(fn=cmd_reconcile)

    rs = sub.add_parser(
        "retry-safe",
        help="a new attempt, only from retry_waiting with "
        "effect none; exit 0 done, 3 refused, 4 not found",
    )
    rs.add_argument("operation_id")
    operator_args(rs)
    rs.set_defaults(fn=cmd_retry_safe)

    cn = sub.add_parser(
        "cancel",
        help="cancel an instance: its unresolved operations stay "
        "cancelling until their executors answer; exit 0 done, 3 refused, "
        "4 not found",
    )
    cn.add_argument("instance_id")
    operator_args(cn)
    cn.set_defaults(fn=cmd_cancel)

    cs = sub.add_parser(
        "cancel-start",
        help="cancel a start request: its instance if it "
        "exists, otherwise a durable tombstone so a late start creates nothing",
    )
    cs.add_argument("start_request_id")
    cs.add_argument("--tenant", required=True)
    operator_args(cs)
    cs.set_defaults(fn=cmd_cancel_start)

    dp = sub.add_parser("dispatch", help="pause or resume effect dispatch").add_subparsers(
        dest="dispatch_command", required=True
    )
    for verb in ("pause", "resume"):
        v = dp.add_parser(
            verb,
            help=f"{verb} submits globally, or for one --instance (queries and cancels still flow)",
        )
        v.add_argument("--instance")
        operator_args(v)
        v.set_defaults(fn=cmd_dispatch)

    rp = sub.add_parser("restore", help="the restore runbook (README: Restore)").add_subparsers(
        dest="restore_command", required=True
    )
    for step, text in (
        ("mark-restored", "after restoring the database: hold dispatch, bump the generation"),
        ("reconcile", "query the pinned executor of every unsettled operation"),
        ("resume", "resume effect dispatch (refused while queries are unanswered)"),
    ):
        rs_ = rp.add_parser(step, help=text)
        operator_args(rs_)
        if step == "resume":
            rs_.add_argument(
                "--force", action="store_true", help="resume although queries are unanswered"
            )
        rs_.set_defaults(fn=cmd_restore)
    rp.add_parser("report", help="participant journals against engine rows (JSON)").set_defaults(
        fn=cmd_restore
    )

    rt = (
        sub.add_parser("retention")
        .add_subparsers(dest="r", required=True)
        .add_parser(
            "cleanup",
            help="remove history older than CUSTODY_RETENTION_S, in batches "
            "(refused if the horizon is too short)",
        )
    )
    rt.add_argument("--participant", help="a participant's history instead of the engine's")
    rt.add_argument("--json", action="store_true")
    rt.set_defaults(fn=cmd_retention)

    au = (
        sub.add_parser("audit")
        .add_subparsers(dest="a", required=True)
        .add_parser("list", help="operator commands and refusals, newest first")
    )
    au.add_argument("--limit", type=int, default=50)
    au.add_argument("--json", action="store_true")
    au.set_defaults(fn=cmd_audit)

    c = sub.add_parser("contracts").add_subparsers(dest="c", required=True)
    cs = c.add_parser("schemas", help="write (or --check) contracts/schemas/*.json")
    cs.add_argument("--check", action="store_true")
    cs.set_defaults(fn=cmd_schemas)

    dc = (
        sub.add_parser("definitions", help="process definitions")
        .add_subparsers(dest="df", required=True)
        .add_parser(
            "check",
            help="load the routes file and the process definitions as a worker would "
            "(CUSTODY_ROUTES_FILE, CUSTODY_PROCESSES_DIR); exit 0 ok, 2 refused",
        )
    )
    dc.add_argument("--dir", help="a processes directory instead of CUSTODY_PROCESSES_DIR")
    dc.add_argument("--routes", help="a routes file instead of CUSTODY_ROUTES_FILE")
    dc.set_defaults(fn=cmd_definitions_check)

    sub.add_parser("config").add_subparsers(dest="cf", required=True).add_parser(
        "show", help="effective settings, secrets redacted"
    ).set_defaults(fn=cmd_config)

    d = sub.add_parser("demo", help="the whole fleet and sample participants doing real work")
    d.add_argument("--instances", type=int, default=300)
    d.add_argument("--replicas", type=int, default=1)
    d.set_defaults(fn=cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        settings = Settings.from_env()
        return int(asyncio.run(args.fn(settings, args)))
    except errors.ConfigError as exc:
        print(f"custody: configuration error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except errors.CustodyError as exc:
        print(f"custody: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
