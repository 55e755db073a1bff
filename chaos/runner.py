"""One chaos run: private services, the fleet through fault proxies, the workload,
the seeded schedule, the settle phase (the harness plays the operator), the checker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import shutil
import signal
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from chaos import checker, schedule, workload
from chaos.faults import World, user_url
from chaos.proxy import FaultProxy
from chaos.services import Services, run
from workers.core import amqp_url
from workers.harness.fleet import DEV_PASSWORD, Fleet
from workers.settings import ROOT

PROCESSES = ROOT / "chaos" / "processes"
# more outcome_unknown operations due than this: one batch reconcile, not one per operation
BULK_FROM = 8
BUSY = ("pending", "dispatched", "accepted", "reconcile_pending", "cancelling", "retry_waiting")


@dataclass
class Config:
    seed: int
    instances: int = 1000
    duration_s: float = 90.0
    settle_s: float = 240.0
    base_port: int = 21000
    workdir: Path = ROOT / ".chaos"
    kinds: Sequence[str] = schedule.KINDS
    scale: float = 1.0
    nodes: int = 1
    lease_ttl_s: float = 6.0
    deadline_s: float = 12.0  # chaos/processes/*.toml
    label: str = "chaos"
    extra_env: Mapping[str, str] = field(default_factory=dict)  # every worker (broken builds)
    keep: bool = False


def _say(line: str) -> None:
    print(line, flush=True)


async def _snapshot(engine_dsn: str, part_dsn: str) -> dict[str, Any]:
    async with await psycopg.AsyncConnection.connect(engine_dsn, autocommit=True) as c:
        inst: dict[str, int] = dict(
            await (
                await c.execute("SELECT status::text, count(*) FROM custody.instances GROUP BY 1")
            ).fetchall()
        )
        ops: dict[str, int] = dict(
            await (
                await c.execute("SELECT status::text, count(*) FROM custody.operations GROUP BY 1")
            ).fetchall()
        )
        pending = (
            await (
                await c.execute(
                    "SELECT (SELECT count(*) FROM custody.outbox WHERE status = 'pending')"
                    " + (SELECT count(*) FROM custody.successor_intents WHERE status = 'pending')"
                )
            ).fetchone()
            or (0,)
        )[0]
        unknown = [
            r[0]
            for r in await (
                await c.execute(
                    "SELECT id::text FROM custody.operations WHERE status = 'outcome_unknown'"
                )
            ).fetchall()
        ]
    async with await psycopg.AsyncConnection.connect(part_dsn, autocommit=True) as c:
        ppending = 0
        for p in checker.PARTICIPANTS:
            row = await (
                await c.execute(
                    f"SELECT (SELECT count(*) FROM participant_{p}.outbox WHERE status = 'pending')"
                    f" + (SELECT count(*) FROM participant_{p}.inbox WHERE status = 'accepted')"
                )
            ).fetchone()
            ppending += int(row[0]) if row else 0
    return {
        "instances": inst,
        "operations": ops,
        "engine_pending": int(pending),
        "participant_pending": ppending,
        "unknown": unknown,
    }


def _progress(t: float, snap: Mapping[str, Any], world: World | None, total: int) -> str:
    if not snap:
        return f"  t+{t:5.0f}s (databases not reachable right now)"
    inst = snap["instances"]
    done = sum(inst.get(s, 0) for s in ("completed", "failed", "cancelled"))
    ops = snap["operations"]
    faults = sum(world.injected.values()) if world else 0
    return (
        f"  t+{t:5.0f}s faults {faults} | instances {done}/{total} finished"
        f" ({', '.join(f'{k} {v}' for k, v in sorted(inst.items()))})"
        f" | operations {sum(ops.values())}"
        f" (unknown {ops.get('outcome_unknown', 0)}, busy {sum(ops.get(s, 0) for s in BUSY)})"
        f" | pending {snap['engine_pending']}+{snap['participant_pending']}"
    )


async def run_chaos(cfg: Config) -> int:
    main = asyncio.current_task()
    if main is not None:  # SIGTERM (a CI timeout, kill): clean up as for Ctrl-C
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main.cancel)
    for noisy in ("aio_pika", "aiormq"):  # the harness's own reconnect chatter
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    started = time.monotonic()
    work = cfg.workdir / f"{cfg.label}-{cfg.seed}"
    plan = schedule.build(
        cfg.seed, cfg.duration_s, kinds=cfg.kinds, lease_ttl_s=cfg.lease_ttl_s, scale=cfg.scale
    )
    reproduce = (
        f"python -m chaos {cfg.label} --seed {cfg.seed}"
        f" --instances {cfg.instances} --duration {cfg.duration_s:g}"
        + ("" if tuple(cfg.kinds) == schedule.KINDS else f" --kinds {','.join(cfg.kinds)}")
        + ("" if cfg.scale == 1.0 else f" --scale {cfg.scale:g}")
    )
    _say(
        f"chaos: seed {cfg.seed}, {cfg.instances} instances, {cfg.duration_s:g}s of faults,"
        f" {len(plan)} scheduled"
        f" ({', '.join(f'{k} {v}' for k, v in schedule.counts(plan).items())})"
    )
    _say(f"  reproduce: {reproduce}")
    _say(f"  work dir: {work}")
    services = Services(work / "svc", base_port=cfg.base_port, nodes=cfg.nodes)
    proxies: dict[str, FaultProxy] = {}
    world: World | None = None
    stop_supervisor = asyncio.Event()
    supervisor: asyncio.Task[None] | None = None
    fleet: Fleet | None = None
    code = 1
    report: dict[str, Any] = {"seed": cfg.seed, "reproduce": reproduce}
    try:
        t = time.monotonic()
        await services.start()
        p = cfg.base_port
        # the workers reach each RabbitMQ node through a fault proxy of its own, and are
        # given every node's address (CUSTODY_AMQP_URL's host list): no load balancer
        # between them and the cluster, they move to another node when theirs goes away
        node_proxies = amqp_proxies(services, p)
        proxies = {
            **node_proxies,
            "pg-engine": FaultProxy("pg-engine", p + 52, [("127.0.0.1", services.engine_pg.port)]),
            "pg-participants": FaultProxy(
                "pg-participants", p + 53, [("127.0.0.1", services.part_pg.port)]
            ),
        }
        if cfg.nodes > 1:  # the harness's own way in: any live node, never a fault
            proxies["harness-amqp"] = FaultProxy(
                "harness-amqp", p + 54, [("127.0.0.1", n.amqp_port) for n in services.rabbits]
            )
        fleet_amqp = str(
            amqp_url.parse("amqp://guest:guest@127.0.0.1/%2F").with_addresses(
                [f"127.0.0.1:{x.listen_port}" for x in node_proxies.values()]
            )
        )
        for proxy in proxies.values():
            await proxy.start()
        engine_dsn = services.engine_pg.dsn("custody")
        part_dsn = services.part_pg.dsn("custody_participants")
        rabbit = services.rabbit
        direct_amqp = rabbit.amqp_url("/", port=p + 54 if cfg.nodes > 1 else None)
        common = {
            "CUSTODY_PROCESSES_DIR": str(PROCESSES),
            "CUSTODY_AMQP_MANAGEMENT_URL": rabbit.mgmt_url,
            "CUSTODY_LOG_FORMAT": "json",
        }
        setup_env = {
            **os.environ,
            **common,
            "CUSTODY_DATABASE_URL": engine_dsn,
            "CUSTODY_PARTICIPANT_DATABASE_URL": part_dsn,
            "CUSTODY_AMQP_URL": direct_amqp,
        }
        for args in (
            ["db", "migrate", "--participants"],
            ["topology", "apply"],
            ["broker", "dev-users", "--password", DEV_PASSWORD],
        ):
            await run(sys.executable, "-m", "workers.cli", *args, env=setup_env)
        if cfg.nodes > 1:
            members = await rabbit.ctl(
                "list_queues", "name", "type", "members", "--quiet", check=False
            )
            _say("  quorum queues (name, type, members):")
            for row in members.strip().splitlines():
                _say(f"    {row}")
        _say(
            f"  services: Postgres :{services.engine_pg.port} (engine),"
            f" :{services.part_pg.port} (participants), RabbitMQ"
            f" {', '.join(f'{n.node} :{n.amqp_port}' for n in services.rabbits)};"
            f" fault proxies {', '.join(f'{n} :{x.listen_port}' for n, x in proxies.items())};"
            f" ready in {time.monotonic() - t:.0f}s"
        )
        fleet_env = {
            **common,
            "CUSTODY_DATABASE_URL": f"postgresql://postgres@127.0.0.1:{p + 52}/custody",
            "CUSTODY_PARTICIPANT_DATABASE_URL": (
                f"postgresql://postgres@127.0.0.1:{p + 53}/custody_participants"
            ),
            "CUSTODY_AMQP_URL": fleet_amqp,
            "CUSTODY_POLL_INTERVAL_S": "0.5",
            "CUSTODY_LEASE_TTL_S": str(cfg.lease_ttl_s),
            "CUSTODY_CONFIRM_TIMEOUT_S": "5",
            "CUSTODY_BATCH_SIZE": "50",
            "CUSTODY_PREFETCH": "100",
            **cfg.extra_env,
        }
        for leak in ("CUSTODY_CRASH_POINTS", "CUSTODY_STOP_POINTS"):
            os.environ.pop(leak, None)
        fleet = Fleet(env=fleet_env, log_dir=work / "logs")
        rng = random.Random(cfg.seed)
        starts = workload.Starts(direct_amqp)
        operator = workload.Operator(engine_dsn, {**common, "CUSTODY_AMQP_URL": direct_amqp})
        world = World(
            fleet=fleet,
            services=services,
            proxies=proxies,
            operator=operator,
            engine_dsn=engine_dsn,
            amqp_admin_url=direct_amqp,
            amqp_user_url=user_url(direct_amqp),
            starts=starts,
            deadline_s=cfg.deadline_s,
            rng=rng,
            log=_say,
        )
        mode = await operator.prepare()
        _say(f"  operator: the custody CLI as {workload.OPERATOR} ({mode})")
        replicated = rng.choice(schedule.PARTICIPANTS)
        world.start_fleet(replicated)
        await world.setup_taps()
        supervisor = asyncio.create_task(world.supervise(stop_supervisor))
        _say(
            f"  fleet: {len(world.slots)} processes (2 of each engine worker, 2 of"
            f" {replicated}); logs in {work / 'logs'}"
        )

        # -- the fault phase: workload in waves, faults on schedule ---------------
        orders = workload.orders(cfg.instances, cfg.seed)
        t0 = time.monotonic()
        publish_span = max(1.0, cfg.duration_s * 0.8)
        queue = list(plan)
        sent = 0
        last_progress = 0.0
        while True:
            now = time.monotonic() - t0
            while queue and queue[0].at_s <= now:
                world.inject(queue.pop(0))
            want = min(len(orders), int(len(orders) * min(1.0, (now + 1) / publish_span)))
            if want > sent:
                await starts.publish(workload.start_items(orders[sent:want]))
                sent = want
            elif starts.unconfirmed:
                await starts.flush()
            if now - last_progress >= 5:
                last_progress = now
                _say(
                    _progress(
                        now,
                        await _safe_snapshot(engine_dsn, part_dsn),
                        world,
                        len(starts.confirmed),
                    )
                )
            if now >= cfg.duration_s and not queue:
                break
            await asyncio.sleep(0.5)
        _say(f"  faults stopped after {time.monotonic() - t0:.0f}s: {dict(world.injected)}")
        if world.tasks:
            await asyncio.wait(list(world.tasks), timeout=cfg.deadline_s + 40)
        await world.heal()
        while starts.unconfirmed:
            await starts.flush()
            await asyncio.sleep(0.5)

        # -- settle: the harness plays the operator -------------------------------------
        t_settle = time.monotonic()
        reconciled: dict[str, tuple[int, float]] = {}
        first_seen: dict[str, float] = {}
        stable_since: float | None = None
        snap: dict[str, Any] = {}
        last_progress = 0.0
        while time.monotonic() - t_settle < cfg.settle_s:
            now = time.monotonic()
            snap = await _safe_snapshot(engine_dsn, part_dsn)
            if not snap:
                await asyncio.sleep(1)
                continue
            # as the runbook says: an operation that stays outcome_unknown (no late
            # receipt settled it within a few seconds) is reconciled, again if the answer
            # was "no receipt", at most 6 times
            for op in snap["unknown"]:
                first_seen.setdefault(op, now)
            due = [
                op
                for op in snap["unknown"]
                if now - first_seen[op] >= 6
                and reconciled.get(op, (0, 0.0))[0] < 6
                and now - reconciled.get(op, (0, 0.0))[1] >= 10
            ]
            if len(due) > BULK_FROM:
                # many at once (after a long partition): the runbook's batch form, one
                # CLI process for all of them instead of one per operation (each costs
                # about 0.7 s of CPU to start); it reconciles every outcome_unknown
                # operation, the few not yet due included
                acted = list(snap["unknown"])
                await operator.reconcile_unknown()
            else:
                acted = due
                for i in range(0, len(due), 4):
                    await asyncio.gather(*(operator.reconcile(op) for op in due[i : i + 4]))
            for op in acted:
                n, _ = reconciled.get(op, (0, 0.0))
                reconciled[op] = (n + 1, time.monotonic())
            ops = snap["operations"]
            busy = (
                sum(ops.get(s, 0) for s in BUSY)
                + snap["engine_pending"]
                + snap["participant_pending"]
            )
            exhausted = all(
                reconciled.get(op, (0, 0.0))[0] >= 3 and now - reconciled[op][1] > 10
                for op in snap["unknown"]
            )
            if busy == 0 and (not snap["unknown"] or exhausted):
                stable_since = stable_since or now
                if now - stable_since >= 4:
                    break
            else:
                stable_since = None
            if now - last_progress >= 5:
                last_progress = now
                _say(
                    _progress(now - t0, snap, world, len(starts.confirmed))
                    + f" | settling, reconciled {sum(n for n, _ in reconciled.values())}"
                )
            await asyncio.sleep(1)
        settle_time = time.monotonic() - t_settle
        final = _progress(time.monotonic() - t0, snap, world, len(starts.confirmed)).strip()
        _say(f"  settled in {settle_time:.0f}s: {final}")

        # -- check -------------------------------------------------------------------
        stop_supervisor.set()
        await supervisor
        supervisor = None
        codes = await asyncio.to_thread(fleet.stop, 20.0)
        findings = await asyncio.to_thread(
            checker.check,
            engine_dsn,
            part_dsn,
            management_url=rabbit.mgmt_url,
            vhost="/",
            starts=starts.confirmed,
        )
        ops_total = int(findings.stats.get("operations_total", 0))
        elapsed = time.monotonic() - started
        result = "OK" if findings.ok else "FAILED"
        line = (
            f"chaos seed={cfg.seed} instances={cfg.instances} operations={ops_total}"
            f" faults={sum(world.injected.values())} kinds={len(world.injected)}"
            f" {findings.line()} result={result} ({elapsed:.0f}s)"
        )
        report.update(
            {
                "summary": line,
                "config": {
                    k: (str(v) if isinstance(v, Path) else v)
                    for k, v in asdict(cfg).items()
                    if k != "extra_env"
                }
                | {"extra_env": dict(cfg.extra_env)},
                "broken_build": os.environ.get("CUSTODY_BROKEN", ""),
                "schedule": [f.describe() for f in plan],
                "injected": dict(world.injected),
                "failed_injections": world.failed_injections,
                "armed_points_hit": dict(world.armed_deaths),
                "republished": world.republished,
                "replies_dropped": world.dropped,
                "replies_delayed": world.delayed,
                "hostile_sent": world.hostile_sent,
                "self_exits": world.self_exits,
                "operator_commands": operator.done,
                "operator_failures": operator.failures,
                "start_publish_failures": starts.failures,
                "settle_s": round(settle_time, 1),
                "shutdown_exit_codes": dict(Counter(codes.values())),
                "proxies": {n: {"connections": x.accepted} for n, x in proxies.items()},
                "checker": findings.report(),
            }
        )
        (work / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
        _say(f"  report: {work / 'report.json'}")
        if not findings.ok:
            for cat in ("lost", "duplicated", "unexpected"):
                for kind, items in getattr(findings, cat).items():
                    example = json.dumps(items[0], default=str)[:400]
                    _say(f"  {cat}: {kind}: {len(items)}, e.g. {example}")
        if operator.failures:
            _say(f"  ! operator commands failed: {operator.failures[0]}")
        _say(line)
        misused = any(k.endswith(":2") for k in operator.done)  # the harness's bug
        code = 0 if findings.ok and not misused else 1
    finally:
        stop_supervisor.set()
        if world is not None:
            await world.starts.close()
        if supervisor is not None:
            supervisor.cancel()
        if world is not None:
            for task in list(world.tasks):
                task.cancel()
        if fleet is not None:
            for proc in fleet.procs:
                with contextlib.suppress(Exception):
                    fleet.signal(proc, signal.SIGCONT)
            await asyncio.to_thread(fleet.stop, 10.0)
        for proxy in proxies.values():
            await proxy.close()
        if not cfg.keep:
            await services.stop()
            if code == 0:  # the evidence is the report and the logs; data only if it failed
                await asyncio.to_thread(shutil.rmtree, work / "svc", True)
    return code


def amqp_proxies(services: Services, base_port: int) -> dict[str, FaultProxy]:
    """One fault proxy per RabbitMQ node: ``amqp`` (port base + 51) for a single node;
    ``amqp-1``, ``amqp-2``, ... for a cluster (base + 51, then base + 55 onwards). A
    fault the schedule aims at ``amqp`` hits one node's proxy (``World.proxy``)."""
    nodes = services.rabbits
    if len(nodes) == 1:
        return {"amqp": FaultProxy("amqp", base_port + 51, [("127.0.0.1", nodes[0].amqp_port)])}
    out = {}
    for i, node in enumerate(nodes):
        name = f"amqp-{i + 1}"
        port = base_port + (51 if i == 0 else 54 + i)
        out[name] = FaultProxy(name, port, [("127.0.0.1", node.amqp_port)])
    return out


async def _safe_snapshot(engine_dsn: str, part_dsn: str) -> dict[str, Any]:
    try:
        return await asyncio.wait_for(_snapshot(engine_dsn, part_dsn), 10)
    except (psycopg.Error, OSError, TimeoutError):
        return {}
