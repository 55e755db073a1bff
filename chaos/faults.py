"""Injectors: each fault kind of :mod:`chaos.schedule` done to real processes, the
private services, the fault proxies and the broker's queues.

The fleet is supervised: a process the harness killed (or armed to die at a crash
point) is restarted clean after its down time; a process that exits by itself is
recorded (with the tail of its log) and restarted, as an orchestrator would.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import psycopg
from aio_pika.abc import AbstractIncomingMessage

from chaos import workload
from chaos.proxy import FaultProxy
from chaos.schedule import PARTICIPANTS, Fault
from chaos.services import Services
from workers.harness.fleet import DEV_PASSWORD, Fleet, Proc
from workers.io import amqp_frames, broker

TAP_COMMANDS = "chaos.tap.commands"
TAP_RECEIPTS = "chaos.tap.receipts"
BINDINGS = ("inventory.v1", "payments.v1", "shipping.v1")


async def connect(url: str, wait_s: float = 45.0) -> aio_pika.abc.AbstractConnection:
    """A plain connection, waiting for a broker that is restarting (a fault injected
    while another fault has the broker down still happens, a little later)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return await aio_pika.connect(url, timeout=5)
        except (OSError, aio_pika.exceptions.AMQPConnectionError, TimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(1)


def proc_state(proc: Proc) -> str:
    """'R', 'S', 'T' (stopped), … from /proc; '' if gone."""
    try:
        stat = Path(f"/proc/{proc.popen.pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[0]


# Participants run their handlers inline (in the acceptance transaction), but for these,
# which run them in the executor after acceptance: both paths are under the faults.
EXECUTOR_MODE = frozenset({"shipping"})


@dataclass
class Slot:
    worker: str  # committer, …, or a participant name
    proc: Proc
    doomed_until: float | None = None  # we killed it: restart after this moment
    stopped: bool = False  # we SIGSTOPped it


@dataclass
class Extra:
    """An additional armed replica (crash point or stop point), retired by the harness."""

    worker: str
    proc: Proc
    kind: str
    point: str
    started: float
    stopped_s: float = 0.0
    frozen_at: float | None = None
    resumed: bool = False
    retired: bool = False


@dataclass
class World:
    fleet: Fleet
    services: Services
    proxies: Mapping[str, FaultProxy]
    operator: workload.Operator
    engine_dsn: str
    amqp_admin_url: str  # direct, as guest (administrator of the private node)
    amqp_user_url: Callable[[str], str]  # the same, as another broker user
    starts: workload.Starts
    deadline_s: float
    rng: random.Random
    log: Callable[[str], None]
    slots: list[Slot] = field(default_factory=list)
    extras: list[Extra] = field(default_factory=list)
    injected: Counter[str] = field(default_factory=Counter)
    failed_injections: list[str] = field(default_factory=list)
    self_exits: list[dict[str, Any]] = field(default_factory=list)
    armed_deaths: Counter[str] = field(default_factory=Counter)
    republished: int = 0
    dropped: int = 0
    delayed: int = 0
    hostile_sent: int = 0
    service_busy: asyncio.Lock = field(default_factory=asyncio.Lock)
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    # -- the fleet ---------------------------------------------------------------------

    def spawn(self, worker: str, extra_env: Mapping[str, str] | None = None) -> Proc:
        if worker in PARTICIPANTS:
            mode = {"CUSTODY_PARTICIPANT_INLINE": "false"} if worker in EXECUTOR_MODE else {}
            return self.fleet.start(
                "participant", name=worker, extra_env={**mode, **(extra_env or {})}
            )
        return self.fleet.start(worker, extra_env=extra_env)

    def start_fleet(self, replicated_participant: str) -> None:
        for w in ("committer", "publisher", "receipts", "reconciler"):
            for _ in range(2):
                self.slots.append(Slot(w, self.spawn(w)))
        for p in PARTICIPANTS:
            for _ in range(2 if p == replicated_participant else 1):
                self.slots.append(Slot(p, self.spawn(p)))

    def _slot(self, worker: str) -> Slot | None:
        live = [
            s
            for s in self.slots
            if s.worker == worker
            and s.doomed_until is None
            and not s.stopped
            and s.proc.popen.poll() is None
        ]
        return self.rng.choice(live) if live else None

    async def supervise(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.supervise_once()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.3)

    def supervise_once(self, *, now_all: bool = False) -> None:
        now = time.monotonic()
        for s in self.slots:
            if s.proc.popen.poll() is None:
                continue
            if s.doomed_until is not None:
                if now >= s.doomed_until or now_all:
                    s.proc = self.spawn(s.worker)
                    s.doomed_until = None
                continue
            self.self_exits.append(
                {"process": s.proc.name, "exit": s.proc.popen.returncode, "log": _tail(s.proc)}
            )
            self.log(f"  ! {s.proc.name} exited by itself ({s.proc.popen.returncode}); restarted")
            s.proc = self.spawn(s.worker)
        for e in list(self.extras):
            code = e.proc.popen.poll()
            if code is not None:
                if code == -signal.SIGKILL:
                    self.armed_deaths[e.point] += 1
                elif e.kind == "crash_point" and not e.retired:
                    self.self_exits.append(
                        {"process": e.proc.name, "exit": code, "log": _tail(e.proc)}
                    )
                self.extras.remove(e)
                continue
            if e.kind == "stop_point" and e.frozen_at is None and proc_state(e.proc) == "T":
                e.frozen_at = now
            if (
                e.frozen_at is not None
                and not e.resumed
                and (now - e.frozen_at >= e.stopped_s or now_all)
            ):
                self.fleet.signal(e.proc, signal.SIGCONT)
                e.resumed = True
                self.armed_deaths[f"{e.point}:zombie_resumed"] += 1
            # an armed replica that never reached its point (or a resumed zombie) is retired
            limit = 40.0 if e.kind == "crash_point" else 60.0
            if now_all or now - e.started > limit or (e.resumed and now - (e.frozen_at or 0) > 15):
                if proc_state(e.proc) == "T":
                    self.fleet.signal(e.proc, signal.SIGCONT)
                self.fleet.signal(e.proc, signal.SIGTERM)
                e.retired = True

    async def heal(self) -> None:
        """After the schedule: every service up, every proxy clean, every slot running."""
        for p in self.proxies.values():
            p.heal()
        async with self.service_busy:
            for node in self.services.rabbits:
                if node.beam_pid() is None:
                    await node.start()
            for pg in (self.services.engine_pg, self.services.part_pg):
                if not (pg.data / "postmaster.pid").exists():
                    await pg.start()
        for s in self.slots:
            if s.stopped:
                self.fleet.signal(s.proc, signal.SIGCONT)
                s.stopped = False
        self.supervise_once(now_all=True)

    # -- injection ---------------------------------------------------------------------

    def inject(self, fault: Fault) -> None:
        task = asyncio.create_task(self._inject(fault))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _inject(self, fault: Fault) -> None:
        handler: Callable[[Fault], Awaitable[None]] = getattr(self, f"do_{fault.kind}")
        try:
            await handler(fault)
            self.injected[fault.kind] += 1
        except Exception as exc:
            self.failed_injections.append(f"{fault.describe()}: {type(exc).__name__}: {exc}")
            self.log(f"  ! injection failed: {fault.describe()}: {exc!r}"[:300])

    async def do_kill(self, f: Fault) -> None:
        s = self._slot(f.target)
        if s is None:
            raise RuntimeError(f"no live {f.target}")
        s.doomed_until = time.monotonic() + float(f.params["down_s"])
        self.fleet.signal(s.proc, signal.SIGKILL)

    async def do_crash_point(self, f: Fault) -> None:
        point = str(f.params["point"])
        proc = self.spawn(f.target, {"CUSTODY_CRASH_POINTS": point})
        self.extras.append(Extra(f.target, proc, "crash_point", point, time.monotonic()))

    async def do_stop_point(self, f: Fault) -> None:
        point = str(f.params["point"])
        proc = self.spawn(f.target, {"CUSTODY_STOP_POINTS": point})
        self.extras.append(
            Extra(
                f.target,
                proc,
                "stop_point",
                point,
                time.monotonic(),
                stopped_s=float(f.params["stopped_s"]),
            )
        )

    async def do_pause(self, f: Fault) -> None:
        s = self._slot(f.target)
        if s is None:
            raise RuntimeError(f"no live {f.target}")
        s.stopped = True
        self.fleet.signal(s.proc, signal.SIGSTOP)
        try:
            await asyncio.sleep(float(f.params["stopped_s"]))
        finally:
            self.fleet.signal(s.proc, signal.SIGCONT)
            s.stopped = False

    async def do_rabbit_app_restart(self, f: Fault) -> None:
        async with self.service_busy:
            node = self.rng.choice(self.services.rabbits)
            await node.app_restart(float(f.params["down_s"]))

    async def do_rabbit_kill(self, f: Fault) -> None:
        async with self.service_busy:
            node = self.rng.choice(self.services.rabbits)
            await node.kill_restart(float(f.params["down_s"]))

    async def do_pg_restart(self, f: Fault) -> None:
        async with self.service_busy:
            pg = self.services.engine_pg if f.target == "engine" else self.services.part_pg
            await pg.crash_restart(float(f.params["down_s"]))

    def proxy(self, target: str) -> FaultProxy:
        """The proxy a fault aims at: ``amqp`` is one node's proxy in a cluster (``amqp-1``,
        ``amqp-2``, ...; drawn from the run's rng), so the workers on that node move to
        another one; the harness's own way in is never a target."""
        if target in self.proxies:
            return self.proxies[target]
        nodes = sorted(n for n in self.proxies if n.startswith(f"{target}-"))
        if not nodes:
            raise RuntimeError(f"no proxy {target!r}")
        return self.proxies[self.rng.choice(nodes)]

    async def do_proxy_cut(self, f: Fault) -> None:
        self.proxy(f.target).cut(float(f.params["refuse_s"]))

    async def do_proxy_stall(self, f: Fault) -> None:
        await self.proxy(f.target).stall(float(f.params["stall_s"]))

    async def do_proxy_slow(self, f: Fault) -> None:
        self.proxy(f.target).slow(float(f.params["for_s"]), float(f.params["delay_s"]))

    # -- the broker's queues: duplicates, reordering, dropped and late replies --------

    async def setup_taps(self) -> None:
        """Copies of every command and receipt (classic queues, bounded), to republish."""
        conn = await connect(self.amqp_admin_url)
        async with conn:
            ch = await conn.channel()
            args: dict[str, Any] = {"x-max-length": 2000, "x-overflow": "drop-head"}
            q = await ch.declare_queue(TAP_COMMANDS, durable=True, arguments=args)
            for b in BINDINGS:
                await q.bind(broker.EXCHANGE_COMMANDS, b)
            q = await ch.declare_queue(TAP_RECEIPTS, durable=True, arguments=args)
            await q.bind(broker.EXCHANGE_RECEIPTS, broker.RECEIPTS_KEY)

    async def _republish(
        self, messages: list[AbstractIncomingMessage], exchange: str, *, as_sender: bool
    ) -> int:
        """Publish copies (same body, message_id, headers) as their original sender."""
        by_user: dict[str | None, list[AbstractIncomingMessage]] = {}
        for m in messages:
            by_user.setdefault(m.user_id if as_sender else None, []).append(m)
        sent = 0
        for user, group in by_user.items():
            url = self.amqp_user_url(user) if user else self.amqp_admin_url
            conn = await connect(url)
            async with conn:
                ch = await conn.channel(publisher_confirms=True)
                ex = await ch.get_exchange(exchange, ensure=False)
                for m in group:
                    await ex.publish(
                        aio_pika.Message(
                            m.body,
                            message_id=m.message_id,
                            headers=dict(m.headers or {}),
                            content_type=m.content_type,
                            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                            user_id=user,
                        ),
                        m.routing_key or "",
                        mandatory=False,
                    )
                    sent += 1
        return sent

    async def do_republish(self, f: Fault) -> None:
        """Duplicates, late and out of order: captured copies sent again after a delay."""
        tap = TAP_COMMANDS if f.target == "commands" else TAP_RECEIPTS
        exchange = broker.EXCHANGE_COMMANDS if f.target == "commands" else broker.EXCHANGE_RECEIPTS
        conn = await connect(self.amqp_admin_url)
        got: list[AbstractIncomingMessage] = []
        async with conn:
            ch = await conn.channel()
            q = await ch.get_queue(tap, ensure=False)
            for _ in range(int(f.params["count"])):
                m = await q.get(no_ack=True, fail=False)
                if m is None:
                    break
                got.append(m)
        got = [m for m in got if amqp_frames.MARK not in (m.headers or {})]
        self.rng.shuffle(got)
        await asyncio.sleep(float(f.params["delay_s"]))
        self.republished += await self._republish(got, exchange, as_sender=f.target == "receipts")

    async def _intercept_receipts(self, f: Fault, late: bool) -> None:
        """A competing consumer on the receipts queue for a while: a fraction of what it
        takes is dropped (a lost reply) or held past the deadline (a late answer); the
        rest is passed on at once (reordered)."""
        held: list[AbstractIncomingMessage] = []
        passed: list[AbstractIncomingMessage] = []
        conn = await connect(self.amqp_admin_url)
        fraction = float(f.params["fraction"])
        async with conn:
            ch = await conn.channel()
            await ch.set_qos(prefetch_count=50)
            q = await ch.get_queue(broker.QUEUE_RECEIPTS, ensure=False)
            until = time.monotonic() + float(f.params["for_s"])
            async with q.iterator() as it:
                while time.monotonic() < until:
                    try:
                        m = await asyncio.wait_for(
                            it.__anext__(), max(0.05, until - time.monotonic())
                        )
                    except (TimeoutError, StopAsyncIteration):
                        break
                    if amqp_frames.MARK in (m.headers or {}):
                        # a hostile frame (properties the client cannot decode, or
                        # re-encode): left for the receipt consumer to quarantine
                        await m.nack(requeue=True)
                        continue
                    (held if self.rng.random() < fraction else passed).append(m)
            # pass on first, then settle: what is acked is already published again
            await self._republish(passed, broker.EXCHANGE_RECEIPTS, as_sender=True)
            for m in passed + held:
                await m.ack()
        if late:
            self.delayed += len(held)
            await asyncio.sleep(self.deadline_s + 3)
            await self._republish(held, broker.EXCHANGE_RECEIPTS, as_sender=True)
        else:
            self.dropped += len(held)

    async def do_drop_replies(self, f: Fault) -> None:
        await self._intercept_receipts(f, late=False)

    async def do_late_replies(self, f: Fault) -> None:
        await self._intercept_receipts(f, late=True)

    # -- cancellations ---------------------------------------------------------------

    async def do_cancel(self, f: Fault) -> None:
        async with await psycopg.AsyncConnection.connect(self.engine_dsn, autocommit=True) as c:
            cur = await c.execute(
                "SELECT id::text FROM custody.instances WHERE status IN ('running', 'suspended')"
                " ORDER BY random() LIMIT %s",
                (int(f.params["count"]),),
            )
            ids = [r[0] for r in await cur.fetchall()]
        await asyncio.gather(*(self.operator.cancel(i) for i in ids))

    async def do_cancel_start(self, f: Fault) -> None:
        """New start requests, each racing its own cancel-start (some cancels first)."""
        orders = workload.orders(int(f.params["count"]), self.rng.randrange(1 << 30))
        for o in orders:
            o["order_id"] = "cs-" + uuid.uuid4().hex[:12]
        items = workload.start_items(orders)
        first = [i for i in items if self.rng.random() < 0.3]
        for i in first:
            await self.operator.cancel_start(i.message_id)
        await asyncio.gather(
            self.starts.publish(items),
            *(self.operator.cancel_start(i.message_id) for i in items if i not in first),
        )

    # -- hostile messages ----------------------------------------------------------------

    async def do_hostile(self, f: Fault) -> None:
        from chaos import hostile

        self.hostile_sent += await hostile.send(
            f.target,
            int(f.params["seed"]),
            self.engine_dsn,
            self.amqp_admin_url,
            lambda user: self.amqp_user_url(user),
        )


def _tail(proc: Proc, lines: int = 15) -> list[str]:
    try:
        return proc.log.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def user_url(amqp_url: str) -> Callable[[str], str]:
    def make(user: str) -> str:
        return broker.url_with_user(amqp_url, user, DEV_PASSWORD)

    return make
