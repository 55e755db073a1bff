"""``retention``, ``contracts``, ``definitions``, ``config``, ``demo``: housekeeping,
checks of the files a deployment ships, and the demo."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from contracts import codec
from workers import provision
from workers.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, Subparsers, emit
from workers.core import horizon, process, routes
from workers.engine import retention as engine_retention
from workers.io import db
from workers.participant import retention as participant_retention
from workers.settings import ROOT, Settings


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
            removed = await engine_retention.cleanup(
                database, settings.retention_s, archive_s=horizon.archive_after(settings)
            )
    emit({"horizon_s": settings.retention_s, "removed": removed}, args.json)
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
    emit(settings.redacted(), True)
    return EXIT_OK


async def cmd_demo(settings: Settings, args: argparse.Namespace) -> int:
    from workers.harness import demo

    return await demo.run(settings, instances=args.instances, replicas=args.replicas)


def register_retention(sub: Subparsers) -> None:
    """``retention`` (listed before ``audit`` in ``custody --help``: see :func:`register`)."""
    rt = (
        sub.add_parser("retention")
        .add_subparsers(dest="r", required=True)
        .add_parser(
            "cleanup",
            help="remove history older than CUSTODY_RETENTION_S and archive instances "
            "finished before CUSTODY_ARCHIVE_AFTER_S, in batches "
            "(refused if a horizon is too short)",
        )
    )
    rt.add_argument("--participant", help="a participant's history instead of the engine's")
    rt.add_argument("--json", action="store_true")
    rt.set_defaults(fn=cmd_retention)


def register(sub: Subparsers) -> None:
    """``contracts``, ``definitions``, ``config``, ``demo``."""
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
