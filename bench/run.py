"""``make bench``: custody's end-to-end throughput as a ratio against a naive baseline.

In one invocation, on the same Postgres and RabbitMQ:

1. the baseline (``bench/baseline.py``): a hand-rolled outbox pipeline doing one
   message at a time, on its own database and vhost;
2. the custody fleet, started like ``custody demo`` (real processes, its own
   databases and vhost), once per ``--replicas`` setting, with K order-fulfilment
   instances; exactly-once effects are checked, and a wrong answer fails the run;
3. a report: operations/s, the ratio against the baseline, latency percentiles, the
   CPU seconds each process spent in the measured window, the machine, versions and
   the command; printed, and written to ``bench/results/latest.md``.

See ``bench/README.md`` for how to read it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import io
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, LiteralString

import psycopg

from bench import baseline
from workers import provision
from workers.harness import demo, env, fleet
from workers.io import broker
from workers.io import db as workers_db
from workers.settings import ROOT, Settings

ENGINE_DB = "custody_bench"
PARTICIPANT_DB = "custody_bench_participants"
VHOST = "custody-bench"
BASELINE_DB = "custody_bench_baseline"
BASELINE_VHOST = "custody-bench-baseline"
RESULTS = ROOT / "bench" / "results" / "latest.md"
CLK_TCK = os.sysconf("SC_CLK_TCK")
FINISHED = ("completed", "failed", "cancelled")


class BenchFailure(Exception):
    """The run cannot produce a trustworthy figure (wrong effects, a dead worker, a
    timeout): fail loudly, never report it."""


# CPU accounting -------------------------------------------------------------------


def _proc_cpu_s(pid: int) -> float | None:
    """utime + stime of one process, in seconds (None once it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class MachineCpu:
    """CPU seconds of the whole machine (all cores), from /proc/stat."""

    busy: float  # user + nice + system + irq + softirq
    irq: float  # irq + softirq: not always charged to a process
    steal: float  # taken by the hypervisor for someone else
    total: float

    @classmethod
    def now(cls) -> MachineCpu:
        v = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
        v += [0] * (8 - len(v))
        user, nice, system, _idle, _iowait, irq, softirq, steal = v
        return cls(
            busy=(user + nice + system + irq + softirq) / CLK_TCK,
            irq=(irq + softirq) / CLK_TCK,
            steal=steal / CLK_TCK,
            total=sum(v) / CLK_TCK,
        )

    def __sub__(self, other: MachineCpu) -> MachineCpu:
        return MachineCpu(
            self.busy - other.busy,
            self.irq - other.irq,
            self.steal - other.steal,
            self.total - other.total,
        )


@dataclass
class Snapshot:
    wall: float
    cpu: dict[int, tuple[str, float]]  # pid -> (label, CPU seconds so far)
    machine: MachineCpu


@dataclass
class CpuRow:
    label: str
    group: str
    seconds: float


@dataclass
class CpuWindow:
    seconds: float  # wall-clock length of the window
    rows: list[CpuRow]
    machine: MachineCpu
    activity: PgActivity | None = None

    @property
    def accounted(self) -> float:
        return sum(r.seconds for r in self.rows)

    @property
    def own(self) -> float:
        """CPU of this run's processes, the broker and the database (not "other")."""
        return sum(r.seconds for r in self.rows if r.group != "other")


class Probe:
    """Samples the CPU time of every process on the machine: the ones this run started
    (labelled), the broker (beam.smp), the Postgres processes (labelled with the
    ``application_name`` of the client they serve, when it is one of this run's
    databases), and everything else by its command name, so that another workload on
    the machine shows up instead of hiding in the figures."""

    def __init__(
        self,
        admin_url: str,
        own: Mapping[str, int],
        groups: Mapping[str, str],
        databases: Sequence[str],
    ) -> None:
        self.admin_url = admin_url
        self.own = dict(own)
        self.groups = dict(groups)
        self.databases = set(databases)
        self._conn: psycopg.AsyncConnection[tuple[Any, ...]] | None = None

    async def __aenter__(self) -> Probe:
        self._conn = await psycopg.AsyncConnection.connect(
            self.admin_url, autocommit=True, application_name="bench-probe"
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._conn is not None:
            await self._conn.close()

    async def snapshot(self) -> Snapshot:
        assert self._conn is not None
        rows = await (
            await self._conn.execute(
                "SELECT pid, coalesce(nullif(application_name, ''), backend_type), datname"
                " FROM pg_stat_activity"
            )
        ).fetchall()
        names = {}
        for pid, name, datname in rows:
            if datname is None or datname in self.databases or str(name).startswith("bench-"):
                names[int(pid)] = f"postgres ← {name}"
            else:
                names[int(pid)] = f"other: postgres ← {name} (database {datname})"
        return _snapshot(self.own, names)

    def window(self, start: Snapshot, end: Snapshot) -> CpuWindow:
        out: dict[str, CpuRow] = {}
        for pid, (label, value) in end.cpu.items():
            used = value - start.cpu.get(pid, ("", 0.0))[1]
            row = out.setdefault(label, CpuRow(label, self._group(label), 0.0))
            row.seconds += max(0.0, used)
        return CpuWindow(
            seconds=end.wall - start.wall,
            rows=sorted(out.values(), key=lambda r: -r.seconds),
            machine=end.machine - start.machine,
        )

    def _group(self, label: str) -> str:
        if label in self.groups:
            return self.groups[label]
        for prefix in ("postgres", "rabbitmq", "other"):
            if label.startswith(prefix):
                return prefix
        return "bench"


def _snapshot(own: Mapping[str, int], pg_names: Mapping[int, str]) -> Snapshot:
    """Synchronous /proc reads (one sample takes a few milliseconds)."""
    wall = time.monotonic()
    label_of = {pid: label for label, pid in own.items()}
    cpu: dict[int, tuple[str, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        used = _proc_cpu_s(pid)
        if not used:
            continue
        comm = _comm(pid)
        if pid in label_of:
            label = label_of[pid]
        elif comm == "beam.smp":
            label = "rabbitmq (beam.smp)"
        elif comm == "postgres":
            label = pg_names.get(pid, "postgres: postmaster and others")
        else:
            label = "other: " + ("kworker" if comm.startswith("kworker") else comm)
        cpu[pid] = (label, used)
    return Snapshot(wall, cpu, MachineCpu.now())


# What Postgres is doing ------------------------------------------------------------


def _normalise(text: str) -> str:
    """A statement without comments, placeholders or repeated whitespace."""
    lines = [ln for ln in text.splitlines() if not ln.strip().startswith("--")]
    flat = " ".join(" ".join(lines).split())
    return re.sub(r"%\(\w+\)s|%s|\$\d+", "", flat.replace("%%", "%"))


def _statement_names() -> list[tuple[str, str]]:
    """(normalised text, name) of every named query in queries.sql."""
    return [(_normalise(text)[:200], name) for name, text in workers_db.QUERIES.items()]


def statement_name(query: str, names: Sequence[tuple[str, str]]) -> str:
    """The queries.sql name of a statement, or its first words."""
    flat = _normalise(query)
    for text, name in names:
        n = min(len(text), len(flat))
        if n >= 20 and flat[:n] == text[:n]:
            return name
    return " ".join(query.split())[:60] or "?"


@dataclass
class PgActivity:
    """Samples of pg_stat_activity: which client's backend ran what, or waited on what."""

    ticks: int = 0
    counts: dict[tuple[str, str, str], int] = field(default_factory=dict)

    @property
    def samples(self) -> int:
        return sum(self.counts.values())


class ActivitySampler:
    """Every ``interval_s``, the non-idle backends of this run's databases."""

    def __init__(self, admin_url: str, databases: Sequence[str], interval_s: float = 0.05) -> None:
        self.admin_url = admin_url
        self.databases = list(databases)
        self.interval_s = interval_s
        self.result = PgActivity()
        self._names = _statement_names()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> ActivitySampler:
        conn = await psycopg.AsyncConnection.connect(
            self.admin_url, autocommit=True, application_name="bench-activity"
        )
        self._task = asyncio.ensure_future(self._run(conn))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self, conn: psycopg.AsyncConnection[tuple[Any, ...]]) -> None:
        try:
            while True:
                rows = await (
                    await conn.execute(
                        "SELECT coalesce(nullif(application_name, ''), backend_type), state,"
                        " wait_event_type, wait_event, query FROM pg_stat_activity"
                        " WHERE datname = ANY(%s) AND pid <> pg_backend_pid()"
                        " AND state IS NOT NULL AND state <> 'idle'",
                        (self.databases,),
                    )
                ).fetchall()
                self.result.ticks += 1
                for client, state, wait_type, wait_event, query in rows:
                    if state == "active":
                        what = statement_name(str(query or ""), self._names)
                        wait = f"{wait_type}:{wait_event}" if wait_type else "CPU"
                    else:
                        what, wait = f"({state})", "client"
                    key = (str(client), what, wait)
                    self.result.counts[key] = self.result.counts.get(key, 0) + 1
                await asyncio.sleep(self.interval_s)
        finally:
            await conn.close()


# Processes --------------------------------------------------------------------------


def _spawn(
    args: Sequence[str], log: Path, *, stdin: int | None = None, stdout: int | None = None
) -> subprocess.Popen[bytes]:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        return subprocess.Popen(
            list(args),
            cwd=ROOT,
            stdin=stdin,
            stdout=stdout if stdout is not None else out,
            stderr=out,
        )


def _stop_all(procs: Sequence[subprocess.Popen[bytes]], grace_s: float = 15.0) -> list[int]:
    """SIGTERM, wait up to the grace period, SIGKILL what is left; exit codes."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    return codes


# Databases and vhosts -------------------------------------------------------------


async def _drop_database(url: str) -> None:
    admin = psycopg.conninfo.make_conninfo(url, dbname="postgres")
    name = str(psycopg.conninfo.conninfo_to_dict(url)["dbname"])
    async with await psycopg.AsyncConnection.connect(admin, autocommit=True) as conn:
        await conn.execute(
            psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                psycopg.sql.Identifier(name)
            )
        )


async def _fresh_vhost(settings: Settings, vhost: str) -> None:
    await broker.delete_vhost(settings.amqp_management_url, vhost)
    await broker.ensure_vhost(
        settings.amqp_management_url, vhost, [broker.user_of(settings.amqp_url)]
    )


async def _query(url: str, statement: LiteralString, params: Sequence[Any] = ()) -> list[Any]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        return list(await (await conn.execute(statement, params)).fetchall())


# The baseline -------------------------------------------------------------------------


@dataclass
class BaselineResult:
    ops: int
    warmup: int
    seconds: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    cpu: CpuWindow

    @property
    def ops_per_s(self) -> float:
        return self.ops / self.seconds


async def run_baseline(settings: Settings, *, ops: int, warmup: int, logs: Path) -> BaselineResult:
    db_url = env.with_db(settings.database_url, BASELINE_DB)
    amqp_url = env.with_vhost(settings.amqp_url, BASELINE_VHOST)
    admin_url = env.with_db(settings.database_url, "postgres")
    print(f"baseline: {ops} operations (+{warmup} warm-up), one message at a time", flush=True)
    await env.reset_database(db_url)
    await _fresh_vhost(settings, BASELINE_VHOST)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        await baseline.setup(amqp_url, db_url)
        common = ["--amqp-url", amqp_url, "--db-url", db_url]
        base = [sys.executable, "-m", "bench.baseline"]
        labels: dict[str, int] = {}
        for role in ("worker", "replier"):
            proc = _spawn([*base, role, *common], logs / f"baseline-{role}.log")
            procs.append(proc)
            labels[f"baseline {role}"] = proc.pid
        producer = _spawn(
            [*base, "producer", *common, "--warmup", str(warmup), "--ops", str(ops)],
            logs / "baseline-producer.log",
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        procs.append(producer)
        labels["baseline producer"] = producer.pid
        assert producer.stdout is not None and producer.stdin is not None
        line = await asyncio.wait_for(asyncio.to_thread(producer.stdout.readline), 120)
        if line.strip() != b"ready":
            raise BenchFailure(f"baseline producer did not get ready ({line!r}); see {logs}")
        await _wait_replies(db_url, "warmup", warmup, procs, timeout_s=60)
        labels["bench (this process)"] = os.getpid()
        groups = dict.fromkeys(labels, "baseline")
        groups["bench (this process)"] = "bench"
        async with (
            Probe(admin_url, labels, groups, [BASELINE_DB]) as probe,
            ActivitySampler(admin_url, [BASELINE_DB]) as sampler,
        ):
            start = await probe.snapshot()
            _send_go(producer.stdin)  # the measured operations
            await _wait_replies(db_url, "measure", ops, procs, timeout_s=30 + ops * 0.05)
            end = await probe.snapshot()
        cpu = probe.window(start, end)
        cpu.activity = sampler.result
        line = await asyncio.wait_for(asyncio.to_thread(producer.stdout.readline), 30)
        if line.strip() != b"done":
            raise BenchFailure(f"baseline producer did not finish ({line!r}); see {logs}")
        _send_go(producer.stdin)  # the producer may exit now
        [row] = await _query(
            db_url,
            "SELECT count(*),"
            " extract(epoch FROM max(r.applied_at) - min(o.created_at)),"
            " percentile_cont(0.5) WITHIN GROUP"
            "   (ORDER BY extract(epoch FROM r.applied_at - o.created_at)),"
            " percentile_cont(0.99) WITHIN GROUP"
            "   (ORDER BY extract(epoch FROM r.applied_at - o.created_at)),"
            " extract(epoch FROM max(r.applied_at - o.created_at))"
            " FROM outbox o JOIN replies r USING (id) WHERE o.phase = 'measure'",
        )
        [counts] = await _query(
            db_url,
            "SELECT (SELECT count(*) FROM outbox WHERE status = 'published'),"
            " (SELECT count(*) FROM inbox), (SELECT count(*) FROM replies)",
        )
        if list(counts) != [ops + warmup] * 3 or row[0] != ops:
            raise BenchFailure(
                f"baseline lost or doubled messages: published/inbox/replies {list(counts)},"
                f" expected {ops + warmup} each"
            )
        return BaselineResult(
            ops=ops,
            warmup=warmup,
            seconds=float(row[1]),
            p50_ms=float(row[2]) * 1000,
            p99_ms=float(row[3]) * 1000,
            max_ms=float(row[4]) * 1000,
            cpu=cpu,
        )
    finally:
        _stop_all(procs)
        await _drop_database(db_url)
        await broker.delete_vhost(settings.amqp_management_url, BASELINE_VHOST)


def _send_go(stdin: IO[bytes]) -> None:
    stdin.write(b"go\n")
    stdin.flush()


async def _wait_replies(
    db_url: str,
    phase: str,
    n: int,
    procs: Sequence[subprocess.Popen[bytes]],
    *,
    timeout_s: float,
) -> None:
    deadline = time.monotonic() + timeout_s
    async with await psycopg.AsyncConnection.connect(
        db_url, autocommit=True, application_name="bench-poll"
    ) as conn:
        while True:
            row = await (
                await conn.execute(
                    "SELECT count(*) FROM replies r JOIN outbox o USING (id) WHERE o.phase = %s",
                    (phase,),
                )
            ).fetchone()
            done = int(row[0]) if row else 0
            if done >= n:
                return
            dead = [p.args for p in procs if p.poll() not in (None, 0)]
            if dead:
                raise BenchFailure(f"a baseline process died: {dead}")
            if time.monotonic() > deadline:
                raise BenchFailure(f"baseline {phase}: {done}/{n} replies after {timeout_s:.0f}s")
            await asyncio.sleep(0.1)


# The custody fleet ----------------------------------------------------------------


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
    effects: dict[str, tuple[int, int]]  # table -> (rows, expected)
    duplicates: int
    quarantined: int
    shutdown_codes: list[int]
    cpu: CpuWindow

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
    prefix: str,
    n: int,
    crew: fleet.Fleet,
    *,
    timeout_s: float,
    progress: bool,
) -> None:
    deadline = time.monotonic() + timeout_s
    started = time.monotonic()
    last = 0.0
    while True:
        row = await (
            await conn.execute(
                "SELECT count(*) FILTER (WHERE status::text = ANY(%s)), count(*)"
                " FROM custody.instances WHERE input->>'order_id' LIKE %s",
                (list(FINISHED), prefix + "%"),
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
        if progress and time.monotonic() - last >= 5:
            print(
                f"    {time.monotonic() - started:5.1f}s: {done}/{n} instances finished,"
                f" {created} created",
                flush=True,
            )
            last = time.monotonic()
        await asyncio.sleep(0.1)


async def run_custody(
    settings: Settings, *, replicas: int, instances: int, warmup: int, logs: Path
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
        f"custody: {instances} order-fulfilment instances (+{warmup} warm-up),"
        f" {replicas} replica(s) per worker",
        flush=True,
    )
    await env.reset_database(engine_url)
    await env.reset_database(part_url)
    await _fresh_vhost(settings, VHOST)
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
        amqp = broker.Broker(amqp_url, "bench-client")
        await amqp.connect()
        try:
            pub = await amqp.publisher(window=64, timeout_s=10, user_id=None)
            async with await psycopg.AsyncConnection.connect(
                engine_url, autocommit=True, application_name="bench-poll"
            ) as conn:
                # warm-up: a trickle, so its latency is the unloaded one
                await _publish_starts(pub, warm, pace_s=0.05)
                await _wait_finished(conn, "warm-", warmup, crew, timeout_s=60, progress=False)
                labels = {p.name: p.popen.pid for p in crew.procs}
                groups = dict.fromkeys(labels, "custody workers")
                labels["bench (this process)"] = os.getpid()
                databases = [ENGINE_DB, PARTICIPANT_DB]
                async with (
                    Probe(admin_url, labels, groups, databases) as probe,
                    ActivitySampler(admin_url, databases) as sampler,
                ):
                    start = await probe.snapshot()
                    t0_row = await (await conn.execute("SELECT clock_timestamp()")).fetchone()
                    assert t0_row is not None
                    await _publish_starts(pub, measured)
                    await _wait_finished(
                        conn,
                        "order-",
                        instances,
                        crew,
                        timeout_s=30 + instances * 0.05,
                        progress=True,
                    )
                    end = await probe.snapshot()
                cpu = probe.window(start, end)
                cpu.activity = sampler.result
                figures = await _custody_figures(conn, t0_row[0])
                await _wait_outbox_drained(conn)
        finally:
            await amqp.close()
        counts = await env.counts(engine_url, part_url)
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
            **figures,
        )
        _verify(result, counts)
        return result
    finally:
        if crew is not None:
            crew.stop(grace_s=20)
        await _drop_database(engine_url)
        await _drop_database(part_url)
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
    }


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


def _verify(result: CustodyResult, counts: Mapping[str, Any]) -> None:
    problems = []
    total = result.instances + result.warm_instances
    inst = counts["instances"]
    done = sum(int(inst.get(s, 0)) for s in FINISHED)
    if done != total:
        problems.append(f"{done}/{total} instances finished ({inst})")
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


# The report -------------------------------------------------------------------------


@dataclass
class Machine:
    nproc: int
    cpu_model: str
    kernel: str
    python: str
    rabbitmq: str
    erlang: str
    postgres: str
    libraries: str
    load_before: str
    revision: str


def _read(path: str) -> str:
    return Path(path).read_text()


async def machine_facts(settings: Settings) -> Machine:
    model = "unknown"
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    overview = await broker.management(settings.amqp_management_url, "GET", "/api/overview")
    [[pg_version]] = await _query(
        env.with_db(settings.database_url, "postgres"), "SHOW server_version"
    )
    libs = ", ".join(
        f"{name} {importlib.metadata.version(name)}"
        for name in ("aio-pika", "aiormq", "psycopg", "pydantic", "orjson")
    )
    return Machine(
        nproc=os.cpu_count() or 0,
        cpu_model=model,
        kernel=platform.release(),
        python=platform.python_version(),
        rabbitmq=str(overview.get("rabbitmq_version", "?")),
        erlang=str(overview.get("erlang_version", "?")),
        postgres=str(pg_version),
        libraries=libs,
        load_before=" ".join(_read("/proc/loadavg").split()[:3]),
        revision=await asyncio.to_thread(_revision),
    )


CODE_PATHS = (
    "workers",
    "contracts",
    "participants",
    "bench",
    ":(exclude)bench/results",
    "schema.sql",
    "commands.sql",
    "transitions.sql",
    "participant_schema.sql",
    "queries.sql",
    "deploy",
)


def _revision() -> str:
    """The commit measured, and whether the code differed from it (read-only git)."""
    worker_env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            env=worker_env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", *CODE_PATHS],
            cwd=ROOT,
            env=worker_env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    changed = sorted({line[3:].split("/")[0] for line in dirty if line.strip()})
    if not changed:
        return f"commit {head}, clean"
    return f"commit {head} with uncommitted changes in {', '.join(changed)}"


def _command() -> str:
    exe = Path(sys.executable)
    with contextlib.suppress(ValueError):
        exe = exe.relative_to(Path.cwd())
    return shlex.join([str(exe), "-m", "bench.run", *sys.argv[1:]])


def _ms(value: float) -> str:
    return f"{value:,.0f} ms"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def _cpu_table(window: CpuWindow, ops: int, nproc: int) -> list[str]:
    """Every process of this run, the broker and the database; other processes only
    when they used a noticeable share (the rest folded into one row)."""

    def row(label: str, group: str, seconds: float) -> list[str]:
        return [
            label,
            group,
            f"{seconds:.2f}",
            f"{100 * seconds / window.seconds:.0f} %",
            f"{1000 * seconds / ops:.2f}",
        ]

    rows = []
    folded = 0.0
    for r in window.rows:
        if r.group == "other" and r.seconds < 0.05:
            folded += r.seconds
        elif r.seconds >= 0.005:
            rows.append(row(r.label, r.group, r.seconds))
    rows.append(row("other: smaller processes", "other", folded))
    m = window.machine
    unattributed = max(0.0, m.busy - window.accounted)
    rows.append(
        row(
            "not charged to a live process (interrupts, processes that exited)",
            "other",
            unattributed,
        )
    )
    by_group: dict[str, float] = {"other": unattributed}
    for r in window.rows:
        by_group[r.group] = by_group.get(r.group, 0.0) + r.seconds
    capacity = nproc * window.seconds
    lines = _table(["process", "group", "CPU s", "% of one core", "CPU ms / operation"], rows)
    lines.append("")
    lines.append(
        f"Window {window.seconds:.1f} s; machine busy {m.busy:.1f} of {capacity:.1f}"
        f" CPU-seconds ({100 * m.busy / capacity:.0f} % of {nproc} cores; of which"
        f" interrupts {m.irq:.1f} s), hypervisor steal {m.steal:.1f} s. By group: "
        + ", ".join(f"{g} {s:.1f} s" for g, s in sorted(by_group.items(), key=lambda x: -x[1]))
        + "."
    )
    foreign = sum(r.seconds for r in window.rows if r.group == "other")
    if foreign + unattributed > 0.1 * m.busy:
        lines += [
            "",
            f"**Another workload shared the machine**: {foreign + unattributed:.1f} CPU-s"
            " (other processes and unattributed time) in this window; this run's figures"
            " are pessimistic. Re-run on a quiet machine to compare.",
        ]
    return lines


def _activity_table(activity: PgActivity | None, top: int = 12) -> list[str]:
    if activity is None or not activity.ticks:
        return []
    total = activity.samples
    rows = [
        [client, f"`{what}`", wait, f"{n}", f"{n / activity.ticks:.2f}", f"{100 * n / total:.0f} %"]
        for (client, what, wait), n in sorted(activity.counts.items(), key=lambda x: -x[1])[:top]
    ]
    lines = [
        "",
        f"Postgres sessions of this run, sampled {activity.ticks} times (every 50 ms):"
        f" on average {total / activity.ticks:.2f} backends were not idle.",
        "",
    ]
    lines += _table(
        [
            "client",
            "statement (queries.sql name)",
            "running or waiting on",
            "samples",
            "avg backends",
            "share",
        ],
        rows,
    )
    return lines


def _reading(window: CpuWindow, nproc: int) -> str:
    """Where the time went, in one sentence: saturation, the busiest processes, and
    what Postgres was doing most."""
    capacity = nproc * window.seconds
    busy = 100 * window.machine.busy / capacity
    own = [r for r in window.rows if r.group != "other"]
    workers = [r for r in own if r.group in ("custody workers", "baseline")]
    by_group: dict[str, float] = {}
    for r in own:
        by_group[r.group] = by_group.get(r.group, 0.0) + r.seconds
    parts = [
        f"machine {busy:.0f} % busy"
        + (" (CPU-bound as a whole)" if busy >= 90 else " (not CPU-bound: waiting somewhere)"),
        "CPU by group "
        + ", ".join(
            f"{g} {100 * v / max(window.own, 1e-9):.0f} %"
            for g, v in sorted(by_group.items(), key=lambda x: -x[1])
        ),
    ]
    if workers:
        top = workers[0]
        parts.append(
            f"busiest worker {top.label} ({100 * top.seconds / window.seconds:.0f} % of a core)"
        )
    activity = window.activity
    if activity is not None and activity.ticks:
        running = [
            (k, n)
            for k, n in activity.counts.items()
            if not k[1].startswith("(") and not k[0].startswith("bench")
        ]
        if running:
            (client, what, wait), n = max(running, key=lambda x: x[1])
            parts.append(
                f"Postgres busiest statement `{what}` from {client} ({wait},"
                f" {n / activity.ticks:.2f} backends on average)"
            )
    return "; ".join(parts) + "."


@dataclass
class Report:
    started: datetime
    command: str
    machine: Machine
    settings: Settings
    baseline: BaselineResult
    custody: list[CustodyResult] = field(default_factory=list)
    total_s: float = 0.0

    def markdown(self) -> str:
        m, b = self.machine, self.baseline
        s = self.settings
        lines = [
            f"# custody benchmark, {self.started.strftime('%Y-%m-%d %H:%M UTC')}",
            "",
            f"Command: `{self.command}` (`make bench` runs it without arguments);"
            f" the whole run took {self.total_s:.0f} s.",
            "",
            f"- Machine: {m.nproc} x {m.cpu_model}, Linux {m.kernel};"
            f" load average before the run {m.load_before}",
            f"- Python {m.python}; RabbitMQ {m.rabbitmq} (Erlang {m.erlang});"
            f" PostgreSQL {m.postgres}",
            f"- Code: {m.revision}",
            f"- Libraries: {m.libraries}",
            f"- Fleet settings: batch_size {s.batch_size}, prefetch {s.prefetch},"
            f" confirm_window {s.confirm_window}, linger_ms {s.linger_ms},"
            f" poll_interval_s {os.environ.get('CUSTODY_POLL_INTERVAL_S', '0.5')}",
            "- Broker, database, every worker and the bench share the same cores.",
            "",
            "## Throughput (operations fully round-tripped, end to end)",
            "",
        ]
        rows = [
            [
                "baseline: naive hand-rolled outbox, one message at a time (3 processes)",
                f"{b.ops:,}",
                f"{b.seconds:.1f}",
                f"**{b.ops_per_s:,.0f}**",
                "1.00",
                f"{1000 * b.cpu.own / b.ops:.1f}",
            ]
        ]
        for c in self.custody:
            rows.append(
                [
                    f"custody, {c.replicas} replica(s) per worker ({c.processes} processes),"
                    f" {c.instances:,} instances",
                    f"{c.ops:,}",
                    f"{c.seconds:.1f}",
                    f"**{c.ops_per_s:,.0f}**",
                    f"**{c.ops_per_s / b.ops_per_s:.2f}**",
                    f"{1000 * c.cpu.own / c.ops:.1f}",
                ]
            )
        lines += _table(
            [
                "run",
                "operations",
                "seconds",
                "operations/s",
                "x baseline",
                "CPU ms / operation",
            ],
            rows,
        )
        lines += [
            "",
            "An operation is one call to a participant: for the baseline a command and its"
            " reply; for custody a submit command, an `accepted` and a terminal receipt,"
            " each through an outbox, applied with validation and history. Baseline"
            f" window: first outbox insert to last reply applied ({b.warmup} warm-up"
            " operations before it). Custody window: the first start request published"
            " to the last instance finished (database clock). CPU ms / operation: the CPU"
            " time of this run's processes, the broker and the database in the window, per"
            " operation (other workloads on the machine excluded); on a saturated machine,"
            " operations/s is about cores x 1000 / this.",
            "",
        ]
        for c in self.custody:
            lines.append(f"- custody r{c.replicas}: {_reading(c.cpu, m.nproc)}")
        lines += [
            "",
            "## Latency",
            "",
        ]
        lat = [
            [
                "baseline, one operation (outbox insert → reply applied)",
                _ms(b.p50_ms),
                _ms(b.p99_ms),
                _ms(b.max_ms),
            ]
        ]
        for c in self.custody:
            lat += [
                [
                    f"custody r{c.replicas}, one instance of 3 sequential operations"
                    f" (created → finished), burst of {c.instances:,}",
                    _ms(c.inst_p50_ms),
                    _ms(c.inst_p99_ms),
                    _ms(c.inst_max_ms),
                ],
                [
                    f"custody r{c.replicas}, one operation (created → terminal),"
                    f" burst of {c.instances:,}",
                    _ms(c.op_p50_ms),
                    _ms(c.op_p99_ms),
                    "",
                ],
                [
                    f"custody r{c.replicas}, one instance, unloaded"
                    f" (warm-up trickle of {c.warm_instances}, 20/s)",
                    _ms(c.warm_p50_ms),
                    "",
                    _ms(c.warm_max_ms),
                ],
            ]
        lines += _table(["what", "p50", "p99", "max"], lat)
        lines += [
            "",
            "Under a burst every instance waits behind the others: the burst latencies"
            " measure queueing at saturation, not the cost of one instance.",
            "",
            "## Correctness (checked; a mismatch fails the run)",
            "",
        ]
        for c in self.custody:
            effects = ", ".join(f"{k} {v[0]} (expected {v[1]})" for k, v in c.effects.items())
            lines.append(
                f"- custody r{c.replicas}: {c.instances + c.warm_instances:,} instances finished"
                f" (measured: completed {c.completed}, failed and compensated {c.failed});"
                f" effects {effects}; duplicates {c.duplicates}; quarantined"
                f" {c.quarantined}; shutdown exit codes {sorted(set(c.shutdown_codes))}"
            )
        lines.append(
            f"- baseline: {b.ops + b.warmup:,} commands published, received and replied,"
            " each exactly once"
        )
        lines += ["", "## Where the CPU goes (utime + stime in the measured window)", ""]
        lines += [f"### baseline ({b.ops:,} operations)", ""]
        lines += _cpu_table(b.cpu, b.ops, m.nproc)
        lines += _activity_table(b.cpu.activity)
        for c in self.custody:
            lines += ["", f"### custody, {c.replicas} replica(s) ({c.ops:,} operations)", ""]
            lines += _cpu_table(c.cpu, c.ops, m.nproc)
            lines += _activity_table(c.cpu.activity)
        lines += [
            "",
            "`postgres ← X` is the backend serving the client whose application_name is X"
            " (`custody-<worker>` for a worker's pool; LISTEN connections have no name and"
            " show as `client backend`).",
            "",
        ]
        return "\n".join(lines)


# Main -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    instances: int
    baseline_ops: int
    baseline_warmup: int
    warmup: int
    replicas: tuple[int, ...]
    output: Path


def parse(argv: Sequence[str] | None = None) -> Options:
    p = argparse.ArgumentParser(
        prog="python -m bench.run",
        description="custody's end-to-end throughput against a naive baseline (bench/README.md)",
    )
    p.add_argument(
        "--instances",
        type=int,
        help="order-fulfilment instances per custody run (default 2500, --quick 150)",
    )
    p.add_argument(
        "--baseline-ops", type=int, help="measured baseline operations (default 3000, --quick 300)"
    )
    p.add_argument(
        "--replicas",
        default=None,
        help="comma-separated replicas per worker, one custody run each (default 1,2; --quick 1)",
    )
    p.add_argument("--warmup", type=int, help="custody warm-up instances (default 20)")
    p.add_argument("--quick", action="store_true", help="a small run for smoke-testing")
    p.add_argument(
        "--output",
        type=Path,
        default=RESULTS,
        help=f"markdown report (default {RESULTS.relative_to(ROOT)})",
    )
    a = p.parse_args(argv)
    replicas_text = a.replicas or ("1" if a.quick else "1,2")
    try:
        replicas = tuple(int(x) for x in replicas_text.split(",") if x.strip())
    except ValueError:
        p.error(f"--replicas {replicas_text!r}: expected e.g. 1,2")
    if not replicas or min(replicas) < 1:
        p.error("--replicas: at least one setting, each at least 1")
    opts = Options(
        instances=a.instances or (150 if a.quick else 2500),
        baseline_ops=a.baseline_ops or (300 if a.quick else 3000),
        baseline_warmup=50 if a.quick else 200,
        warmup=a.warmup if a.warmup is not None else (10 if a.quick else 20),
        replicas=replicas,
        output=a.output,
    )
    if opts.instances < 1 or opts.baseline_ops < 1 or opts.warmup < 0:
        p.error("sizes must be positive")
    return opts


@contextlib.contextmanager
def _log_dir() -> Iterator[Path]:
    """Worker logs: removed after a good run, kept (and named) after a failed one."""
    path = Path(tempfile.mkdtemp(prefix="custody-bench-"))
    try:
        yield path
    except BaseException:
        print(f"worker logs kept in {path}", file=sys.stderr)
        raise
    shutil.rmtree(path, ignore_errors=True)


async def main_async(opts: Options) -> int:
    started = time.monotonic()
    settings = Settings.from_env()
    machine = await machine_facts(settings)
    report_time = datetime.now(UTC)
    with _log_dir() as logs:
        b = await run_baseline(
            settings, ops=opts.baseline_ops, warmup=opts.baseline_warmup, logs=logs
        )
        print(f"  baseline: {b.ops_per_s:,.0f} operations/s", flush=True)
        report = Report(report_time, _command(), machine, settings, b)
        for replicas in opts.replicas:
            c = await run_custody(
                settings,
                replicas=replicas,
                instances=opts.instances,
                warmup=opts.warmup,
                logs=logs,
            )
            print(
                f"  custody r{replicas}: {c.ops_per_s:,.0f} operations/s"
                f" ({c.ops_per_s / b.ops_per_s:.2f} x baseline)",
                flush=True,
            )
            report.custody.append(c)
    report.total_s = time.monotonic() - started
    text = report.markdown()
    print()
    print(text)
    opts.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = opts.output.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(opts.output)
    print(f"written to {opts.output}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse(argv)
    loop = asyncio.new_event_loop()
    task = loop.create_task(main_async(opts))
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        return loop.run_until_complete(task)
    except BenchFailure as exc:
        print(f"BENCH FAILED: {exc}", file=sys.stderr)
        return 1
    except (asyncio.CancelledError, KeyboardInterrupt):
        print("bench interrupted; everything it started was stopped", file=sys.stderr)
        return 130
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


if __name__ == "__main__":
    sys.exit(main())
