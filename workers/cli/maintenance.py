"""``retention``, ``contracts``, ``definitions``, ``config``, ``demo``: housekeeping,
checks of the files a deployment ships, and the demo."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import click

from contracts import codec
from workers import provision
from workers.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    Args,
    command,
    emit,
    group,
    known_participant,
)
from workers.core import horizon, process, routes
from workers.engine import retention as engine_retention
from workers.io import db
from workers.participant import retention as participant_retention
from workers.settings import ROOT, Settings


async def cmd_retention(settings: Settings, args: Args) -> int:
    _, catalog = process.load_config(settings)
    horizon.check(settings, catalog)
    if args.participant:
        known_participant(settings, args.participant)
        async with db.connected(
            settings.participant_database_url, schema=provision.participant_schema(args.participant)
        ) as database:
            removed = await participant_retention.cleanup(database, settings.retention_s)
    else:
        async with db.connected(settings.database_url, schema="custody") as database:
            removed = await engine_retention.cleanup(
                database, settings.retention_s, archive_s=horizon.archive_after(settings)
            )
    emit({"horizon_s": settings.retention_s, "removed": removed}, args.output)
    return EXIT_OK


async def cmd_schemas(settings: Settings, args: Args) -> int:
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


async def cmd_definitions_check(settings: Settings, args: Args) -> int:
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


async def cmd_config(settings: Settings, args: Args) -> int:
    emit(settings.redacted(), args.output)
    return EXIT_OK


async def cmd_demo(settings: Settings, args: Args) -> int:
    from workers.harness import demo

    return await demo.run(
        settings, instances=args.instances, replicas=args.replicas, keep=args.keep
    )


def register(root: click.Group) -> None:
    command(
        group(root, "retention"),
        "cleanup",
        cmd_retention,
        help="remove history older than CUSTODY_RETENTION_S and archive instances "
        "finished before CUSTODY_ARCHIVE_AFTER_S, in batches (refused if a horizon is "
        "too short)",
        params=[
            click.option("--participant", help="a participant's history instead of the engine's")
        ],
    )
    command(
        group(root, "contracts"),
        "schemas",
        cmd_schemas,
        help="write (or --check) contracts/schemas/*.json",
        emits=False,
        params=[click.option("--check", is_flag=True, help="exit 1 if a schema drifted")],
    )
    command(
        group(root, "definitions"),
        "check",
        cmd_definitions_check,
        help="load the routes file and the process definitions as a worker would "
        "(CUSTODY_ROUTES_FILE, CUSTODY_PROCESSES_DIR); exit 0 ok, 2 refused",
        emits=False,
        params=[
            click.option("--dir", help="a processes directory instead of CUSTODY_PROCESSES_DIR"),
            click.option("--routes", help="a routes file instead of CUSTODY_ROUTES_FILE"),
        ],
    )
    command(
        group(root, "config"),
        "show",
        cmd_config,
        help="the effective settings, every password masked (default --output json)",
        default_output="json",
    )
    command(
        group(root, "demo"),
        "run",
        cmd_demo,
        help="the whole fleet and the sample participants doing real work, in their own "
        "databases and vhost",
        emits=False,
        params=[
            click.option("--instances", type=click.IntRange(1), default=300, show_default=True),
            click.option("--replicas", type=click.IntRange(1, 16), default=1, show_default=True),
            click.option(
                "--keep",
                is_flag=True,
                help="leave the fleet running (metrics ports and the management UI "
                "printed) until Ctrl-C, then drain it",
            ),
        ],
    )
