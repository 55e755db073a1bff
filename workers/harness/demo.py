"""``custody demo``: the whole fleet and the sample participants doing real work.

It uses its own databases (``custody_demo``, ``custody_demo_participants``) and its
own RabbitMQ vhost (``custody-demo``), resets them, starts every worker type and the
three participants as real processes, starts a few hundred order-fulfilment
instances (some declined, some out of stock, to show both branches), shows
progress, checks every effect against the participants' own tables, and shuts the
fleet down with SIGTERM. With ``keep`` (``custody demo run --keep``) the fleet stays up,
each worker's metrics port printed, until Ctrl-C (or SIGTERM), then drains the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import sys
import time
import urllib.parse
from dataclasses import replace
from pathlib import Path
from typing import Any

from participants import samples
from workers import provision
from workers.harness import env, fleet
from workers.io import broker
from workers.settings import ROOT, Settings

DEMO_VHOST = "custody-demo"
DEV_PASSWORD = fleet.DEV_PASSWORD


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


async def run(settings: Settings, *, instances: int, replicas: int, keep: bool = False) -> int:
    started = time.monotonic()
    engine_url = env.with_db(settings.database_url, "custody_demo")
    part_url = env.with_db(settings.participant_database_url, "custody_demo_participants")
    amqp_url = env.with_vhost(settings.amqp_url, DEMO_VHOST)
    demo = replace(
        settings,
        database_url=engine_url,
        participant_database_url=part_url,
        amqp_url=amqp_url,
        log_format="json",
    )
    print(f"custody demo: {instances} order-fulfilment instances, {replicas} replica(s) per worker")
    print("  preparing: databases custody_demo and custody_demo_participants, vhost custody-demo")
    await env.reset_database(engine_url)
    await env.reset_database(part_url)
    await broker.delete_vhost(settings.amqp_management_url, DEMO_VHOST)
    await broker.ensure_vhost(
        settings.amqp_management_url, DEMO_VHOST, [broker.user_of(settings.amqp_url)]
    )
    quiet = _Quiet()
    with quiet:
        await provision.migrate(demo, participants=True)
        await provision.apply_topology(demo)
        await provision.dev_users(demo, DEV_PASSWORD)
        # each operator of deploy/operators.toml gets its own login (dev: trust auth)
        await provision.sync_operators(demo, demo.operators_file, create_logins=True)
    worker_env = {
        "CUSTODY_DATABASE_URL": engine_url,
        "CUSTODY_PARTICIPANT_DATABASE_URL": part_url,
        "CUSTODY_AMQP_URL": amqp_url,
        "CUSTODY_LOG_FORMAT": "json",
        "CUSTODY_POLL_INTERVAL_S": "0.5",
    }
    table = {
        name: env.with_vhost(settings.amqp_url, DEMO_VHOST, f"custody-{name}", DEV_PASSWORD)
        for name in fleet.PARTICIPANTS
    }
    logs = ROOT / ".demo" / "logs"
    for old in logs.glob("*.log") if logs.exists() else []:
        old.unlink()
    crew = fleet.Fleet(env=worker_env, log_dir=logs, metrics=keep, own_session=keep)
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
        pub = await amqp.publisher(
            window=64, timeout_s=10, user_id=None, envelope_max=Settings.read("envelope_max")
        )
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
        counts = await env.counts(engine_url, part_url)
        deadline = time.monotonic() + 90
        last_line = 0.0
        while time.monotonic() < deadline:
            counts = await env.counts(engine_url, part_url)
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
        if keep and not dead:
            _print_endpoints(crew, settings)
            await _until_stopped(crew)
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


def _print_endpoints(crew: fleet.Fleet, settings: Settings) -> None:
    mgmt = urllib.parse.urlsplit(settings.amqp_management_url)
    ui = f"{mgmt.scheme}://{mgmt.hostname}:{mgmt.port or 15672}"
    print("the fleet keeps running; Ctrl-C drains it and exits")
    print("  metrics (curl these, or give them to Prometheus as static targets):")
    for p in crew.procs:
        print(f"    {p.name:<26} http://127.0.0.1:{p.metrics_port}/metrics")
    print(f"  RabbitMQ management UI: {ui}/#/queues (vhost {DEMO_VHOST})")
    print(
        "  dashboard: deploy/grafana/dashboards/custody.json, on a Prometheus that "
        "scrapes the targets above"
    )
    sys.stdout.flush()


async def _until_stopped(crew: fleet.Fleet) -> None:
    """Wait for Ctrl-C or SIGTERM (or a worker's death, which ends the demo too)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        while not stop.is_set() and not crew.dead():
            with contextlib.suppress(TimeoutError):  # a second passed: look at the fleet
                await asyncio.wait_for(stop.wait(), timeout=1.0)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    dead = crew.dead()
    print(f"  a worker died: {dead}" if dead else "  stopping: draining the fleet (SIGTERM)")


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
