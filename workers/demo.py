"""``custody demo``: the whole fleet and the sample participants doing real work.

It uses its own databases (``custody_demo``, ``custody_demo_participants``) and its
own RabbitMQ vhost (``custody-demo``), resets them, starts every worker type and the
three participants as real processes, starts a few hundred order-fulfilment
instances (some declined, some out of stock, to show both branches), shows
progress, checks every effect against the participants' own tables, and shuts the
fleet down with SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
import urllib.parse
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg

from participants import samples
from workers import broker, cli, fleet
from workers.config import ROOT, Settings

DEMO_VHOST = "custody-demo"
DEV_PASSWORD = fleet.DEV_PASSWORD


def _with_db(url: str, name: str) -> str:
    return psycopg.conninfo.make_conninfo(url, dbname=name)


def _with_vhost(url: str, vhost: str, user: str | None = None, password: str | None = None) -> str:
    parsed = urllib.parse.urlparse(url)
    netloc = parsed.hostname or "127.0.0.1"
    if parsed.port:
        netloc += f":{parsed.port}"
    user = user or urllib.parse.unquote(parsed.username or "guest")
    password = password or urllib.parse.unquote(parsed.password or "guest")
    creds = f"{urllib.parse.quote(user)}:{urllib.parse.quote(password)}@"
    return parsed._replace(
        netloc=creds + netloc, path="/" + urllib.parse.quote(vhost, safe="")
    ).geturl()


async def _reset_database(url: str) -> None:
    admin = psycopg.conninfo.make_conninfo(url, dbname="postgres")
    name = psycopg.conninfo.conninfo_to_dict(url)["dbname"]
    async with await psycopg.AsyncConnection.connect(admin, autocommit=True) as conn:
        await conn.execute(
            psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                psycopg.sql.Identifier(str(name))
            )
        )
        await conn.execute(
            psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(str(name)))
        )


def orders(n: int, seed: int = 7) -> list[dict[str, Any]]:
    """A deterministic mix: most orders succeed, some are declined, some run out of stock."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        roll = rng.random()
        sku, qty, amount = "sku-1", rng.randint(1, 3), rng.randint(500, 50_000)
        if roll < 0.05:
            amount = samples.CHARGE_LIMIT_CENTS + 1  # declined: the reservation is released
        elif roll < 0.10:
            sku, qty = "sku-rare", 1  # only 3 in stock: the rest fail at reserve
        out.append(
            {
                "order_id": f"order-{i:05d}",
                "sku": sku,
                "quantity": qty,
                "amount_cents": amount,
                "address": f"{i} Demo Street",
            }
        )
    return out


async def _counts(engine_url: str, part_url: str) -> dict[str, Any]:
    async with await psycopg.AsyncConnection.connect(engine_url) as conn:
        inst: dict[str, int] = dict(
            await (
                await conn.execute(
                    "SELECT status::text, count(*) FROM custody.instances GROUP BY 1"
                )
            ).fetchall()
        )
        ops: dict[str, int] = dict(
            await (
                await conn.execute(
                    "SELECT status::text, count(*) FROM custody.operations GROUP BY 1"
                )
            ).fetchall()
        )
        pending = (
            await (
                await conn.execute("SELECT count(*) FROM custody.outbox WHERE status = 'pending'")
            ).fetchone()
            or [0]
        )[0]
        quarantined = (
            await (await conn.execute("SELECT count(*) FROM custody.quarantine")).fetchone() or [0]
        )[0]
        succeeded: dict[str, int] = dict(
            await (
                await conn.execute(
                    "SELECT operation, count(*) FROM custody.operations WHERE status = 'succeeded'"
                    " GROUP BY 1"
                )
            ).fetchall()
        )
    effects: dict[str, int] = {}
    duplicates = 0
    async with await psycopg.AsyncConnection.connect(part_url) as conn:
        for owner, tables in samples.EFFECT_TABLES.items():
            for table in tables:
                ident = psycopg.sql.Identifier(f"participant_{owner}", table)
                row = await (
                    await conn.execute(
                        psycopg.sql.SQL(
                            "SELECT count(*), count(*) - count(DISTINCT operation_id) FROM {}"
                        ).format(ident)
                    )
                ).fetchone()
                assert row is not None
                effects[f"{owner}.{table}"] = row[0]
                duplicates += row[1]
    return {
        "instances": inst,
        "operations": ops,
        "outbox_pending": pending,
        "quarantined": quarantined,
        "effects": effects,
        "duplicates": duplicates,
        "succeeded_by_operation": succeeded,
    }


async def run(settings: Settings, *, instances: int, replicas: int) -> int:
    started = time.monotonic()
    engine_url = _with_db(settings.database_url, "custody_demo")
    part_url = _with_db(settings.participant_database_url, "custody_demo_participants")
    amqp_url = _with_vhost(settings.amqp_url, DEMO_VHOST)
    demo = replace(
        settings,
        database_url=engine_url,
        participant_database_url=part_url,
        amqp_url=amqp_url,
        log_format="json",
    )
    print(f"custody demo: {instances} order-fulfilment instances, {replicas} replica(s) per worker")
    print("  preparing: databases custody_demo and custody_demo_participants, vhost custody-demo")
    await _reset_database(engine_url)
    await _reset_database(part_url)
    await broker.delete_vhost(settings.amqp_management_url, DEMO_VHOST)
    await broker.ensure_vhost(
        settings.amqp_management_url, DEMO_VHOST, [broker.user_of(settings.amqp_url)]
    )
    quiet = _Quiet()
    with quiet:
        await cli.cmd_migrate(demo, argparse.Namespace(participants=True))
        await cli.cmd_topology(demo, argparse.Namespace())
        await cli.cmd_dev_users(demo, argparse.Namespace(password=DEV_PASSWORD))
        # each operator of deploy/operators.toml gets its own login (dev: trust auth)
        await cli.sync_operators(demo, demo.operators_file, create_logins=True)
    env = {
        "CUSTODY_DATABASE_URL": engine_url,
        "CUSTODY_PARTICIPANT_DATABASE_URL": part_url,
        "CUSTODY_AMQP_URL": amqp_url,
        "CUSTODY_LOG_FORMAT": "json",
        "CUSTODY_POLL_INTERVAL_S": "0.5",
    }
    table = {
        name: _with_vhost(settings.amqp_url, DEMO_VHOST, f"custody-{name}", DEV_PASSWORD)
        for name in fleet.PARTICIPANTS
    }
    logs = ROOT / ".demo" / "logs"
    for old in logs.glob("*.log") if logs.exists() else []:
        old.unlink()
    crew = fleet.Fleet(env=env, log_dir=logs)
    crew.start_all(
        replicas=replicas, participant_env={n: {"CUSTODY_AMQP_URL": u} for n, u in table.items()}
    )
    print(
        f"  fleet: {len(crew.procs)} processes "
        f"({', '.join(p.name for p in crew.procs)}); logs in {logs}"
    )
    code = 1
    try:
        amqp = broker.Broker(amqp_url, "demo-client")
        await amqp.connect()
        pub = await amqp.publisher(window=64, timeout_s=10, user_id=None)
        items = [
            broker.start_request(
                tenant="acme", process="order-fulfilment", input=order, requested_by="demo"
            )
            for order in orders(instances)
        ]
        t_publish = time.monotonic()
        outcomes = await pub.publish_many(items)
        await amqp.close()
        print(f"  published {sum(o.ok for o in outcomes)} start requests (broker-confirmed)")
        counts = await _counts(engine_url, part_url)
        deadline = time.monotonic() + 90
        last_line = 0.0
        while time.monotonic() < deadline:
            counts = await _counts(engine_url, part_url)
            inst = counts["instances"]
            done = inst.get("completed", 0) + inst.get("failed", 0)
            ops = counts["operations"]
            line = (
                f"  progress: {done}/{instances} instances finished "
                f"(completed {inst.get('completed', 0)}, failed {inst.get('failed', 0)}) | "
                f"operations {sum(ops.values())} ({_by_status(ops)}) | "
                f"outbox pending {counts['outbox_pending']}"
            )
            if sys.stdout.isatty():
                sys.stdout.write("\r" + line + "   ")
                sys.stdout.flush()
            elif time.monotonic() - last_line >= 1 or done >= instances:
                print(line, flush=True)
                last_line = time.monotonic()
            if done >= instances and counts["outbox_pending"] == 0 and not crew.dead():
                break
            if crew.dead():
                break
            await asyncio.sleep(0.5)
        elapsed = time.monotonic() - t_publish
        if sys.stdout.isatty():
            print()
        dead = crew.dead()
        if dead:
            print(f"  a worker died: {dead}; see {logs}")
        code = _summary(counts, instances, elapsed, dead)
    finally:
        codes = crew.stop(grace_s=30)
        clean = all(c == 0 for c in codes.values())
        print(
            f"  shutdown: {'clean' if clean else 'NOT clean'} (SIGTERM; exit codes "
            f"{sorted(set(codes.values()))})"
        )
        if not clean:
            code = 1
    print(f"  total time {time.monotonic() - started:.1f}s")
    return code


def _by_status(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def _summary(
    counts: dict[str, Any], instances: int, elapsed: float, dead: list[tuple[str, int]]
) -> int:
    inst = counts["instances"]
    ops = counts["operations"]
    effects = counts["effects"]
    succeeded = counts["succeeded_by_operation"]
    expected = {
        "inventory.reservations": succeeded.get("inventory.reserve", 0),
        "inventory.releases": succeeded.get("inventory.release", 0),
        "payments.charges": succeeded.get("payments.charge", 0),
        "shipping.shipments": succeeded.get("shipping.ship", 0),
    }
    mismatched = {k: (effects[k], v) for k, v in expected.items() if effects[k] != v}
    done = inst.get("completed", 0) + inst.get("failed", 0)
    total_ops = sum(ops.values())
    print("summary")
    print(
        f"  instances: {done}/{instances} finished: completed {inst.get('completed', 0)}, "
        f"failed (declined or out of stock, compensated) {inst.get('failed', 0)}"
    )
    print(f"  operations: {total_ops} ({', '.join(f'{k} {v}' for k, v in sorted(ops.items()))})")
    print("  effects per participant (rows in its own tables, expected = operations succeeded):")
    for key, value in effects.items():
        print(f"    {key:<24} {value:>6}  (expected {expected[key]})")
    print(f"  duplicates found: {counts['duplicates']}")
    print(f"  quarantined: {counts['quarantined']}")
    print(f"  throughput: {total_ops / elapsed:.0f} operations/s over {elapsed:.1f}s")
    ok = (
        done == instances
        and counts["duplicates"] == 0
        and not mismatched
        and not dead
        and counts["quarantined"] == 0
    )
    if mismatched:
        print(f"  EFFECT MISMATCH (actual, expected): {mismatched}")
    print(f"  result: {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


class _Quiet:
    """Swallow the set-up commands' chatter."""

    def __enter__(self) -> None:
        self._stdout = sys.stdout
        sys.stdout = open(Path("/dev/null"), "w")

    def __exit__(self, *exc: object) -> None:
        sys.stdout.close()
        sys.stdout = self._stdout
