"""The custody run: the fleet started the way ``custody demo`` starts it, a warm-up
trickle, instances one at a time (the light-load latency), optionally a backlog seeded
into the tables (``bench/backlog.py``), then a burst of order-fulfilment instances; the
figures, and the checks that fail the run on a wrong answer."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg

from bench.backlog import Backlog, Seeded, seed
from bench.common import BenchFailure
from bench.cpu import CpuWindow, Probe
from bench.pg_activity import ActivitySampler
from bench.profile import ProcessProfile, Sampler
from bench.resources import drop_database, fresh_vhost
from workers import provision
from workers.harness import demo, env, fleet
from workers.io import broker
from workers.settings import Settings

ENGINE_DB = "custody_bench"
PARTICIPANT_DB = "custody_bench_participants"
VHOST = "custody-bench"
FINISHED = ("completed", "failed", "cancelled")


@dataclass(frozen=True)
class Hop:
    """One leg of a light-load operation's path, timed from the rows' own timestamps."""

    what: str
    p50_ms: float
    p90_ms: float
    count: int


@dataclass
class CustodyResult:
    replicas: int
    instances: int
    processes: int
    ops: int
    seconds: float
    completed: int
    failed: int
    inst_p50_ms: float
    inst_p99_ms: float
    inst_max_ms: float
    op_p50_ms: float
    op_p99_ms: float
    warm_instances: int
    warm_p50_ms: float
    warm_max_ms: float
    light_instances: int
    light_inst_p50_ms: float
    light_inst_p99_ms: float
    light_ops: int
    light_op_p50_ms: float
    light_op_p99_ms: float
    effects: dict[str, tuple[int, int]]  # table -> (rows, expected)
    duplicates: int
    quarantined: int
    shutdown_codes: list[int]
    cpu: CpuWindow
    backlog: Seeded | None = None
    # where a light-load operation's time goes: (hop, p50 ms, p90 ms), in path order
    light_hops: list[Hop] = field(default_factory=list)
    # the processes' CPU while the light-load instances ran, one at a time
    light_cpu: CpuWindow | None = None
    # py-spy's samples of each worker process during the burst (--profile)
    profile: list[ProcessProfile] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"custody r{self.replicas}" + (", backlog" if self.backlog else "")

    @property
    def workflows_per_s(self) -> float:
        return self.instances / self.seconds

    @property
    def ops_per_s(self) -> float:
        return self.ops / self.seconds


def _start_items(orders: Sequence[dict[str, Any]]) -> list[broker.Outgoing]:
    return [
        broker.start_request(
            tenant="acme", process="order-fulfilment", input=order, requested_by="bench"
        )
        for order in orders
    ]


async def _publish_starts(
    publisher: broker.Publisher, items: Sequence[broker.Outgoing], *, pace_s: float = 0.0
) -> None:
    if pace_s:
        for item in items:
            outcomes = await publisher.publish_many([item])
            if not outcomes[0].ok:
                raise BenchFailure(f"start request not confirmed: {outcomes[0].error}")
            await asyncio.sleep(pace_s)
        return
    bad = [o for o in await publisher.publish_many(items) if not o.ok]
    if bad:
        raise BenchFailure(f"{len(bad)} start requests not confirmed: {bad[0].error}")


async def _wait_consumers(settings: Settings, replicas: int, crew: fleet.Fleet) -> None:
    """Until every queue the fleet consumes has its consumers (the workers are up)."""
    deadline = time.monotonic() + 60
    while True:
        rows = await broker.management(
            settings.amqp_management_url,
            "GET",
            f"/api/queues/{VHOST}?columns=name,consumers",
        )
        wanted = [
            r
            for r in rows or []
            if r["name"] in (broker.QUEUE_REQUESTS, broker.QUEUE_RECEIPTS)
            or str(r["name"]).startswith("custody.commands.")
        ]
        if wanted and all(int(r.get("consumers") or 0) >= replicas for r in wanted):
            return
        if crew.dead():
            raise BenchFailure(f"a worker died while starting: {crew.dead()}")
        if time.monotonic() > deadline:
            raise BenchFailure(f"the fleet's consumers did not come up: {rows}")
        await asyncio.sleep(0.2)


async def _wait_finished(
    conn: psycopg.AsyncConnection[tuple[Any, ...]],
    items: Sequence[broker.Outgoing],
    crew: fleet.Fleet,
    *,
    timeout_s: float,
    progress: bool,
    interval_s: float = 0.1,
    others_open: int = 0,
) -> None:
    """Until the instances of these start requests have finished.

    Cheap on a table full of other instances (the backlog): each poll counts the
    instances not finished through the partial index ``instances_status``; only once
    that is down to ``others_open`` (the open instances that are not this wait's) or
    to print progress are these instances looked up by their start request ids (the
    unique index), to tell "all finished" from "not all created yet"."""
    n = len(items)
    ids = [item.message_id for item in items]
    deadline = time.monotonic() + timeout_s
    started = time.monotonic()
    last = 0.0
    done = created = 0
    while True:
        due = progress and time.monotonic() - last >= 5
        if n > 50 and not due:
            row = await (
                await conn.execute(
                    "SELECT count(*) FROM custody.instances"
                    " WHERE status NOT IN ('completed', 'failed', 'cancelled')"
                )
            ).fetchone()
            exact = row is None or int(row[0]) <= others_open
        else:
            exact = True
        if exact:
            row = await (
                await conn.execute(
                    "SELECT count(*) FILTER (WHERE status::text = ANY(%s)), count(*)"
                    " FROM custody.instances WHERE tenant = 'acme'"
                    " AND start_request_id = ANY(%s::uuid[])",
                    (list(FINISHED), ids),
                )
            ).fetchone()
            done, created = (int(row[0]), int(row[1])) if row else (0, 0)
            if done >= n:
                return
        if crew.dead():
            raise BenchFailure(f"a worker died: {crew.dead()}")
        if time.monotonic() > deadline:
            raise BenchFailure(
                f"only {done}/{n} instances finished ({created} created) after {timeout_s:.0f}s"
            )
        if due:
            print(
                f"    {time.monotonic() - started:5.1f}s: {done}/{n} instances finished,"
                f" {created} created",
                flush=True,
            )
            last = time.monotonic()
        await asyncio.sleep(interval_s)


async def run_custody(
    settings: Settings,
    *,
    replicas: int,
    instances: int,
    warmup: int,
    light: int,
    logs: Path,
    backlog: Backlog | None = None,
    profile: bool = False,
) -> CustodyResult:
    engine_url = env.with_db(settings.database_url, ENGINE_DB)
    part_url = env.with_db(settings.participant_database_url, PARTICIPANT_DB)
    admin_url = env.with_db(settings.database_url, "postgres")
    amqp_url = env.with_vhost(settings.amqp_url, VHOST)
    bench = replace(
        settings,
        database_url=engine_url,
        participant_database_url=part_url,
        amqp_url=amqp_url,
        log_format="json",
    )
    print(
        f"custody: {instances} order-fulfilment instances (+{warmup} warm-up, {light} one"
        f" at a time), {replicas} replica(s) per worker"
        + (
            f", on a backlog of {backlog.finished:,} finished and {backlog.pending:,}"
            " pending operations"
            if backlog
            else ""
        ),
        flush=True,
    )
    await env.reset_database(engine_url)
    await env.reset_database(part_url)
    await fresh_vhost(settings, VHOST)
    crew: fleet.Fleet | None = None
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            await provision.migrate(bench, participants=True)
            await provision.apply_topology(bench)
            await provision.dev_users(bench, demo.DEV_PASSWORD)
        worker_env = {
            "CUSTODY_DATABASE_URL": engine_url,
            "CUSTODY_PARTICIPANT_DATABASE_URL": part_url,
            "CUSTODY_AMQP_URL": amqp_url,
            "CUSTODY_LOG_FORMAT": "json",
            "CUSTODY_POLL_INTERVAL_S": os.environ.get("CUSTODY_POLL_INTERVAL_S", "0.5"),
        }
        participant_env = {
            name: {
                "CUSTODY_AMQP_URL": env.with_vhost(
                    settings.amqp_url, VHOST, f"custody-{name}", demo.DEV_PASSWORD
                )
            }
            for name in fleet.PARTICIPANTS
        }
        crew = fleet.Fleet(env=worker_env, log_dir=logs / f"custody-r{replicas}")
        crew.start_all(replicas=replicas, participant_env=participant_env)
        await _wait_consumers(settings, replicas, crew)
        measured = _start_items(demo.orders(instances))
        warm_orders = [
            {**o, "order_id": f"warm-{i:05d}"} for i, o in enumerate(demo.orders(warmup, seed=11))
        ]
        warm = _start_items(warm_orders)
        light_orders = [
            {**o, "order_id": f"light-{i:05d}"} for i, o in enumerate(demo.orders(light, seed=13))
        ]
        lights = _start_items(light_orders)
        amqp = broker.Broker(amqp_url, "bench-client")
        await amqp.connect()
        try:
            pub = await amqp.publisher(
                window=64, timeout_s=10, user_id=None, envelope_max=Settings.read("envelope_max")
            )
            async with await psycopg.AsyncConnection.connect(
                engine_url, autocommit=True, application_name="bench-poll"
            ) as conn:
                # warm-up: a trickle, so its latency is the unloaded one
                await _publish_starts(pub, warm, pace_s=0.05)
                await _wait_finished(conn, warm, crew, timeout_s=60, progress=False)
                labels = {p.name: p.popen.pid for p in crew.procs}
                groups = dict.fromkeys(labels, "custody workers")
                labels["bench (this process)"] = os.getpid()
                databases = [ENGINE_DB, PARTICIPANT_DB]
                # light load: one instance at a time, the next once the last finished;
                # its CPU too, for what a unit of one item costs each process
                async with Probe(admin_url, labels, groups, databases) as light_probe:
                    before = await light_probe.snapshot()
                    for item in lights:
                        await _publish_starts(pub, [item])
                        await _wait_finished(
                            conn, [item], crew, timeout_s=30, progress=False, interval_s=0.01
                        )
                    light_cpu = light_probe.window(before, await light_probe.snapshot())
                seeded = None
                if backlog is not None:
                    seeded = await seed(engine_url, backlog)
                    print(
                        f"    backlog: {seeded.rows:,} rows ({seeded.finished_ops:,} finished"
                        f" and {seeded.pending_ops:,} pending operations) seeded in"
                        f" {seeded.seconds:.0f}s; database {seeded.database_mb:,.0f} MB",
                        flush=True,
                    )
                workers = {p.name: p.popen.pid for p in crew.procs}
                profiler = Sampler(workers) if profile else contextlib.nullcontext()
                async with (
                    profiler,
                    Probe(admin_url, labels, groups, databases) as probe,
                    ActivitySampler(admin_url, databases) as sampler,
                ):
                    start = await probe.snapshot()
                    t0_row = await (await conn.execute("SELECT clock_timestamp()")).fetchone()
                    assert t0_row is not None
                    await _publish_starts(pub, measured)
                    await _wait_finished(
                        conn,
                        measured,
                        crew,
                        timeout_s=30 + instances * 0.05,
                        progress=True,
                        others_open=seeded.instances.get("running", 0) if seeded else 0,
                    )
                    end = await probe.snapshot()
                cpu = probe.window(start, end)
                cpu.activity = sampler.result
                figures = await _custody_figures(conn, t0_row[0])
                hops = await _light_hops(conn, part_url)
                await _wait_outbox_drained(conn)
        finally:
            await amqp.close()
        counts = await env.counts(engine_url, part_url)
        if seeded is not None:  # the seeded rows are nobody's effects
            counts = _without_seeded(counts, seeded)
        succeeded = counts["succeeded_by_operation"]
        expected = {
            "inventory.reservations": succeeded.get("inventory.reserve", 0),
            "inventory.releases": succeeded.get("inventory.release", 0),
            "payments.charges": succeeded.get("payments.charge", 0),
            "shipping.shipments": succeeded.get("shipping.ship", 0),
        }
        effects = {k: (int(counts["effects"][k]), v) for k, v in expected.items()}
        processes = len(crew.procs)
        codes = crew.stop(grace_s=20)
        crew = None
        result = CustodyResult(
            replicas=replicas,
            instances=instances,
            processes=processes,
            effects=effects,
            duplicates=int(counts["duplicates"]),
            quarantined=int(counts["quarantined"]),
            shutdown_codes=sorted(codes.values()),
            cpu=cpu,
            backlog=seeded,
            light_hops=hops,
            light_cpu=light_cpu if lights else None,
            profile=profiler.profiles if isinstance(profiler, Sampler) else [],
            **figures,
        )
        _verify(result, counts)
        return result
    finally:
        if crew is not None:
            crew.stop(grace_s=20)
        await drop_database(engine_url)
        await drop_database(part_url)
        await broker.delete_vhost(settings.amqp_management_url, VHOST)


async def _custody_figures(
    conn: psycopg.AsyncConnection[tuple[Any, ...]], t0: datetime
) -> dict[str, Any]:
    [inst] = await (
        await conn.execute(
            "SELECT extract(epoch FROM max(finished_at) - %s),"
            " count(*) FILTER (WHERE status = 'completed'),"
            " count(*) FILTER (WHERE status = 'failed'),"
            " percentile_cont(0.5) WITHIN GROUP"
            "   (ORDER BY extract(epoch FROM finished_at - created_at)),"
            " percentile_cont(0.99) WITHIN GROUP"
            "   (ORDER BY extract(epoch FROM finished_at - created_at)),"
            " extract(epoch FROM max(finished_at - created_at))"
            " FROM custody.instances WHERE input->>'order_id' LIKE 'order-%%'",
            (t0,),
        )
    ).fetchall()
    [ops] = await (
        await conn.execute(
            "SELECT count(*),"
            " percentile_cont(0.5) WITHIN GROUP"
            "   (ORDER BY extract(epoch FROM o.finished_at - o.created_at)),"
            " percentile_cont(0.99) WITHIN GROUP"
            "   (ORDER BY extract(epoch FROM o.finished_at - o.created_at))"
            " FROM custody.operations o JOIN custody.instances i ON i.id = o.instance_id"
            " WHERE i.input->>'order_id' LIKE 'order-%'"
        )
    ).fetchall()
    [warm] = await (
        await conn.execute(
            "SELECT count(*),"
            " percentile_cont(0.5) WITHIN GROUP"
            "   (ORDER BY extract(epoch FROM finished_at - created_at)),"
            " extract(epoch FROM max(finished_at - created_at))"
            " FROM custody.instances WHERE input->>'order_id' LIKE 'warm-%'"
        )
    ).fetchall()
    [light_inst] = await (
        await conn.execute(
            "SELECT count(*),"
            " percentile_cont(0.5) WITHIN GROUP"
            "   (ORDER BY extract(epoch FROM finished_at - created_at)),"
            " percentile_cont(0.99) WITHIN GROUP"
            "   (ORDER BY extract(epoch FROM finished_at - created_at))"
            " FROM custody.instances WHERE input->>'order_id' LIKE 'light-%'"
        )
    ).fetchall()
    [light_ops] = await (
        await conn.execute(
            "SELECT count(*),"
            " percentile_cont(0.5) WITHIN GROUP"
            "   (ORDER BY extract(epoch FROM o.finished_at - o.created_at)),"
            " percentile_cont(0.99) WITHIN GROUP"
            "   (ORDER BY extract(epoch FROM o.finished_at - o.created_at))"
            " FROM custody.operations o JOIN custody.instances i ON i.id = o.instance_id"
            " WHERE i.input->>'order_id' LIKE 'light-%'"
        )
    ).fetchall()
    return {
        "seconds": float(inst[0]),
        "completed": int(inst[1]),
        "failed": int(inst[2]),
        "inst_p50_ms": float(inst[3]) * 1000,
        "inst_p99_ms": float(inst[4]) * 1000,
        "inst_max_ms": float(inst[5]) * 1000,
        "ops": int(ops[0]),
        "op_p50_ms": float(ops[1]) * 1000,
        "op_p99_ms": float(ops[2]) * 1000,
        "warm_instances": int(warm[0]),
        "warm_p50_ms": float(warm[1] or 0) * 1000,
        "warm_max_ms": float(warm[2] or 0) * 1000,
        "light_instances": int(light_inst[0]),
        "light_inst_p50_ms": float(light_inst[1] or 0) * 1000,
        "light_inst_p99_ms": float(light_inst[2] or 0) * 1000,
        "light_ops": int(light_ops[0]),
        "light_op_p50_ms": float(light_ops[1] or 0) * 1000,
        "light_op_p99_ms": float(light_ops[2] or 0) * 1000,
    }


# The light-load instances' operations, each with the engine's timestamps of its path:
# created (the committer's transaction began), its submit confirmed (the publisher's mark
# began), finished (the receipt consumer's transaction began), and the next operation's
# creation in its instance. The participant's own timestamps come from its database.
_LIGHT_PATH = """
SELECT o.id::text, o.created_at, o.finished_at,
       lead(o.created_at) OVER (PARTITION BY o.instance_id ORDER BY o.created_at),
       CASE WHEN row_number() OVER (PARTITION BY o.instance_id ORDER BY o.created_at DESC) = 1
            THEN i.finished_at END
  FROM custody.operations o JOIN custody.instances i ON i.id = o.instance_id
 WHERE i.input->>'order_id' LIKE 'light-%' AND o.finished_at IS NOT NULL
"""
# per participant schema: when its acceptance of the command began, and when its
# terminal receipt's confirm was marked (the mark began right after the broker's confirm)
_PARTICIPANT_PATH = """
SELECT i.operation_id::text, min(i.accepted_at), max(o.published_at)
  FROM {schema}.inbox i JOIN {schema}.outbox o ON o.operation_id = i.operation_id
 GROUP BY i.operation_id
"""
HOPS = (
    "created → the participant begins accepting it (the rest of the transaction that"
    " created it, the receipt consumer's or the committer's, and its commit, that worker's"
    " publish of the submit, the delivery)",
    "the participant: acceptance begins → its receipt confirmed by the broker (inbox,"
    " handler, effect and receipt in one commit; the receipt's publish and confirm)",
    "receipt confirmed → the receipt consumer begins applying it (the delivery)",
    "receipt applied → the next operation created (0 when the receipt consumer activated"
    " it in the receipt's own transaction; else its commit, the committer's wake-up and"
    " claim)",
    "last receipt applied → the instance finished (as above, ending the instance)",
)


async def _light_hops(conn: psycopg.AsyncConnection[tuple[Any, ...]], part_url: str) -> list[Hop]:
    """Where a light-load operation's time goes, leg by leg (p50, p90). The legs overlap
    nothing and leave out only the receipt consumer's own transaction, so they add up to
    about an operation's created → terminal time plus the hop to the next one."""
    rows = await (await conn.execute(_LIGHT_PATH)).fetchall()
    if not rows:
        return []
    participant: dict[str, tuple[datetime, datetime]] = {}
    async with await psycopg.AsyncConnection.connect(part_url, autocommit=True) as pconn:
        for name in fleet.PARTICIPANTS:
            query = _PARTICIPANT_PATH.format(schema=f"participant_{name}")
            for op, accepted, confirmed in await (await pconn.execute(query)).fetchall():
                if accepted is not None and confirmed is not None:
                    participant[op] = (accepted, confirmed)
    legs: list[list[float]] = [[] for _ in HOPS]

    def add(leg: int, start: datetime | None, end: datetime | None) -> None:
        if start is not None and end is not None:
            legs[leg].append((end - start).total_seconds() * 1000)

    for op, created, finished, next_created, instance_finished in rows:
        if op in participant:
            accepted, confirmed = participant[op]
            add(0, created, accepted)
            add(1, accepted, confirmed)
            add(2, confirmed, finished)
        add(3, finished, next_created)
        add(4, finished, instance_finished)
    return [
        Hop(what, statistics.median(values), _quantile(values, 0.9), len(values))
        for what, values in zip(HOPS, legs, strict=True)
        if values
    ]


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _wait_outbox_drained(conn: psycopg.AsyncConnection[tuple[Any, ...]]) -> None:
    """A receipt may overtake the publisher's mark: give the last marks a moment."""
    deadline = time.monotonic() + 15
    while True:
        row = await (
            await conn.execute("SELECT count(*) FROM custody.outbox WHERE status = 'pending'")
        ).fetchone()
        if row is None or int(row[0]) == 0:
            return
        if time.monotonic() > deadline:
            raise BenchFailure(f"{row[0]} outbox rows still pending after every instance finished")
        await asyncio.sleep(0.1)


def _without_seeded(counts: dict[str, Any], seeded: Seeded) -> dict[str, Any]:
    """The counts of the instances the run started: the seeded ones subtracted (and the
    pending ones checked to be still as seeded, untouched)."""
    out = dict(counts)
    inst = {k: int(v) - seeded.instances.get(k, 0) for k, v in counts["instances"].items()}
    out["instances"] = {k: v for k, v in inst.items() if v}
    out["seeded_running"] = int(counts["instances"].get("running", 0))
    out["seeded_accepted"] = int(counts["operations"].get("accepted", 0))
    out["succeeded_by_operation"] = {
        k: int(v) - seeded.succeeded.get(k, 0) for k, v in counts["succeeded_by_operation"].items()
    }
    return out


def _verify(result: CustodyResult, counts: Mapping[str, Any]) -> None:
    problems = []
    total = result.instances + result.warm_instances + result.light_instances
    inst = counts["instances"]
    done = sum(int(inst.get(s, 0)) for s in FINISHED)
    if done != total or any(int(v) for k, v in inst.items() if k not in FINISHED):
        problems.append(f"{done}/{total} instances finished ({inst})")
    if result.backlog is not None:
        seeded_running = result.backlog.instances.get("running", 0)
        if (counts["seeded_running"], counts["seeded_accepted"]) != (
            seeded_running,
            result.backlog.pending_ops,
        ):
            problems.append(
                f"{counts['seeded_running']} instances running and"
                f" {counts['seeded_accepted']} operations accepted after the run,"
                f" {seeded_running} and {result.backlog.pending_ops} were seeded"
                " (a seeded row was touched)"
            )
    mismatched = {k: v for k, v in result.effects.items() if v[0] != v[1]}
    if mismatched:
        problems.append(f"effects (rows, expected = operations succeeded): {mismatched}")
    if result.duplicates:
        problems.append(f"{result.duplicates} duplicate effects")
    if result.quarantined:
        problems.append(f"{result.quarantined} messages quarantined")
    if any(result.shutdown_codes):
        problems.append(f"shutdown not clean: exit codes {result.shutdown_codes}")
    if result.ops < result.instances:
        problems.append(f"only {result.ops} operations for {result.instances} instances")
    if problems:
        raise BenchFailure(
            f"custody with {result.replicas} replica(s) gave a WRONG answer: " + "; ".join(problems)
        )
