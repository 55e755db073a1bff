"""The acceptance tier's crew of real worker processes and its end-state oracle.

Everything here asserts on durable state (the engine's and the participants' own
databases) and waits with bounded polls; nothing sleeps a fixed time.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika

from tests.conftest import Env, wait_until
from workers.harness.fleet import ENGINE_WORKERS, PARTICIPANTS, Fleet, Proc

CRASH_ENV = "CUSTODY_CRASH_POINTS"
STOCK = 100_000_000  # sku-1 in participants/samples.sql
EFFECTS = (
    ("inventory", "reservations", "inventory.reserve"),
    ("payments", "charges", "payments.charge"),
    ("shipping", "shipments", "shipping.ship"),
)
NODES = ("reserve", "charge", "ship")


@dataclass
class Crew:
    """A :class:`workers.harness.fleet.Fleet` that knows which processes are meant to die."""

    env: Env
    fleet: Fleet
    doomed: set[str] = field(default_factory=set)
    retired: set[str] = field(default_factory=set)

    def __repr__(self) -> str:
        return f"Crew({', '.join(self.fleet.alive())})"

    def start(
        self, worker: str, *, crash: str | None = None, env: Mapping[str, str] | None = None
    ) -> Proc:
        """Start one engine worker or participant (by participant name), with ``env``
        added to its environment. Only a process started with ``crash`` carries the
        crash-point variable."""
        assert CRASH_ENV not in os.environ, f"the test process must not export {CRASH_ENV}"
        extra: dict[str, str] = dict(env or {})
        if crash:
            extra[CRASH_ENV] = crash
        if worker in PARTICIPANTS:
            extra["CUSTODY_AMQP_URL"] = self.env.participant_amqp(worker)
            proc = self.fleet.start("participant", name=worker, extra_env=extra)
        else:
            assert worker in ENGINE_WORKERS, worker
            proc = self.fleet.start(worker, extra_env=extra)
        if crash:
            self.doomed.add(proc.name)
        return proc

    def start_all(
        self, *, replicas: int = 1, skip: Iterable[str] = (), crash: Mapping[str, str] | None = None
    ) -> list[Proc]:
        skipped = set(skip)
        return [
            self.start(w, crash=(crash or {}).get(w))
            for _ in range(replicas)
            for w in (*ENGINE_WORKERS, *PARTICIPANTS)
            if w not in skipped
        ]

    def stop_all(self, grace_s: float) -> dict[str, int]:
        """SIGTERM every process still running; exit codes (SIGKILL after ``grace_s``)."""
        running = {p.name for p in self.fleet.procs if p.popen.poll() is None}
        codes = self.fleet.stop(grace_s=grace_s)
        self.retired |= set(codes)
        return {name: code for name, code in codes.items() if name in running}

    def unexpected_deaths(self) -> list[tuple[str, int]]:
        return [
            (name, code)
            for name, code in self.fleet.dead()
            if name not in self.doomed and name not in self.retired
        ]

    def check_alive(self) -> None:
        dead = self.unexpected_deaths()
        assert not dead, f"worker processes died unexpectedly (name, exit code): {dead}"

    async def wait(
        self, predicate: Callable[[], Awaitable[bool]], *, timeout: float, what: str
    ) -> None:
        """Poll ``predicate``; fail at once if a process that should live has died."""

        async def check() -> bool:
            self.check_alive()
            return await predicate()

        await wait_until(check, timeout=timeout, interval=0.1, what=what)

    async def wait_started(self, *, timeout: float = 30.0) -> None:
        """Wait until every running process logged ``worker.started``: its SIGTERM
        handler is installed just before (a process signalled earlier, still importing,
        dies of the signal instead of draining)."""

        async def started() -> bool:
            return all(
                '"event":"worker.started"' in p.log.read_text(errors="replace")
                for p in self.fleet.procs
                if p.popen.poll() is None
            )

        await self.wait(started, timeout=timeout, what="every process to install its handlers")

    async def wait_killed(self, proc: Proc, *, timeout: float = 30.0) -> None:
        """Wait for a process to die at its crash point: SIGKILL, exit -9."""

        async def gone() -> bool:
            return proc.popen.poll() is not None

        await self.wait(gone, timeout=timeout, what=f"{proc.name} to hit its crash point")
        assert proc.popen.returncode == -signal.SIGKILL, (
            f"{proc.name} exited {proc.popen.returncode}, not by SIGKILL at its crash point"
        )

    def report(self, codes: Mapping[str, int] | None = None, lines: int = 25) -> str:
        out = []
        for p in self.fleet.procs:
            code = (codes or {}).get(p.name, p.popen.returncode)
            try:
                tail = p.log.read_text(errors="replace").splitlines()[-lines:]
            except OSError as exc:
                tail = [f"<no log: {exc}>"]
            out.append(f"----- {p.name} (exit {code}) {p.log}")
            out.extend(tail)
        return "\n".join(out)


def environ_of(proc: Proc) -> dict[str, str]:
    """The environment a running worker process actually has (Linux /proc)."""
    raw = Path(f"/proc/{proc.popen.pid}/environ").read_bytes()
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def assert_clean(proc: Proc) -> None:
    """A restarted process must not carry the crash point that killed its predecessor."""
    assert CRASH_ENV not in environ_of(proc), f"{proc.name} was started with {CRASH_ENV}"


# -- database probes -------------------------------------------------------------


async def count(env: Env, query: str, params: Any = None, *, participant: bool = False) -> int:
    return int(await env.scalar(query, params, participant=participant))


async def finished(env: Env) -> int:
    return await count(
        env,
        "SELECT count(*) FROM custody.instances"
        " WHERE status IN ('completed', 'failed', 'cancelled')",
    )


def all_finished(env: Env, n: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await finished(env) >= n

    return check


def settled(env: Env, n: int) -> Callable[[], Awaitable[bool]]:
    """n instances finished and nothing left to send: no pending row in the engine's
    outbox or any participant's, no pending successor intent."""

    async def check() -> bool:
        if await finished(env) < n:
            return False
        if await count(env, "SELECT count(*) FROM custody.outbox WHERE status = 'pending'"):
            return False
        if await count(
            env, "SELECT count(*) FROM custody.successor_intents WHERE status = 'pending'"
        ):
            return False
        for owner in PARTICIPANTS:
            if await count(
                env,
                f"SELECT count(*) FROM participant_{owner}.outbox WHERE status = 'pending'",
                participant=True,
            ):
                return False
        return True

    return check


async def state(env: Env) -> dict[str, Any]:
    """A one-line picture of progress, for assertion messages."""
    inst = dict(
        await env.sql("SELECT status::text, count(*) FROM custody.instances GROUP BY 1 ORDER BY 1")
    )
    ops = dict(
        await env.sql("SELECT status::text, count(*) FROM custody.operations GROUP BY 1 ORDER BY 1")
    )
    outbox = dict(await env.sql("SELECT status, count(*) FROM custody.outbox GROUP BY 1"))
    quarantine = dict(await env.sql("SELECT reason, count(*) FROM custody.quarantine GROUP BY 1"))
    return {"instances": inst, "operations": ops, "outbox": outbox, "quarantine": quarantine}


async def assert_effects_once(env: Env, n: int) -> None:
    """Every effect exactly once: per effect table, rows == distinct operation ids == n,
    and they are exactly the engine's succeeded operations of that kind."""
    for owner, table, operation in EFFECTS:
        rows = await env.sql(
            f"SELECT count(*), count(DISTINCT operation_id) FROM participant_{owner}.{table}",
            participant=True,
        )
        assert rows[0] == (n, n), (
            f"participant_{owner}.{table}: (rows, distinct operation ids) = {rows[0]}, "
            f"expected ({n}, {n})"
        )
        effect_ops = {
            str(r[0])
            for r in await env.sql(
                f"SELECT operation_id FROM participant_{owner}.{table}", participant=True
            )
        }
        engine_ops = {
            str(r[0])
            for r in await env.sql(
                "SELECT id FROM custody.operations WHERE operation = %s AND status = 'succeeded'",
                (operation,),
            )
        }
        assert effect_ops == engine_ops, f"{owner}.{table} effects are not the engine's operations"
    released = await count(
        env, "SELECT count(*) FROM participant_inventory.releases", participant=True
    )
    assert released == 0, "nothing was declined, yet a reservation was released"
    available = await count(
        env,
        "SELECT available FROM participant_inventory.stock WHERE sku = 'sku-1'",
        participant=True,
    )
    assert available == STOCK - n, f"sku-1 stock {available}, expected {STOCK - n}"


async def assert_participants_deduplicated(env: Env, n: int) -> None:
    """Each participant retained each command identity once, with the engine's request
    ids, executed it once (one terminal receipt, revision 2 succeeded, after revision 1
    accepted when the executor ran it; an inline handler's command says no accepted
    receipt), and saw no conflicting digest and refused nothing."""
    for owner, _table, operation in EFFECTS:
        schema = f"participant_{owner}"
        inbox = await env.sql(f"SELECT request_id, status FROM {schema}.inbox", participant=True)
        assert len(inbox) == n, f"{schema}.inbox has {len(inbox)} rows, expected {n}"
        assert {s for _, s in inbox} == {"succeeded"}, f"{schema}.inbox statuses {inbox[:5]}"
        issued = {
            str(r[0])
            for r in await env.sql(
                "SELECT a.request_id FROM custody.attempts a JOIN custody.operations o"
                " ON o.id = a.operation_id WHERE o.operation = %s AND a.kind = 'submit'",
                (operation,),
            )
        }
        assert {str(r) for r, _ in inbox} == issued, (
            f"{schema}.inbox request ids are not the engine's issued request ids"
        )
        revisions = await env.sql(
            f"SELECT request_id, array_agg(owner_revision ORDER BY owner_revision)"
            f" FROM {schema}.receipts GROUP BY 1",
            participant=True,
        )
        odd = [(str(r), revs) for r, revs in revisions if revs not in ([1, 2], [2])]
        assert len(revisions) == n, f"{schema}.receipts covers {len(revisions)} commands"
        assert not odd, (
            f"{schema}.receipts: each command must have revisions [1, 2] or [2]; odd: {odd[:5]}"
        )
        conflicts = await count(env, f"SELECT count(*) FROM {schema}.conflicts", participant=True)
        assert conflicts == 0, f"{schema}.conflicts has {conflicts} rows"
        refused = await env.sql(
            f"SELECT reason, detail FROM {schema}.refused LIMIT 5", participant=True
        )
        assert not refused, f"{schema}.refused: {refused}"


async def assert_engine_applied_once(env: Env, n: int) -> None:
    """The engine side of exactly-once: every instance completed through reserve, charge
    and ship; each operation applied each owner revision once; one succeeded event per
    operation; nothing quarantined."""
    picture = await state(env)
    assert picture["instances"] == {"completed": n}, picture
    assert picture["operations"] == {"succeeded": 3 * n}, picture
    assert picture["quarantine"] == {}, picture
    nodes = await env.sql(
        "SELECT node, count(*), count(DISTINCT instance_id)"
        " FROM custody.node_states GROUP BY 1 ORDER BY 1"
    )
    assert sorted(nodes) == sorted((node, n, n) for node in NODES), nodes
    twice = await env.sql(
        "SELECT operation_id, owner_revision, count(*) FROM custody.receipt_inbox"
        " WHERE decision = 'apply' GROUP BY 1, 2 HAVING count(*) > 1 LIMIT 5"
    )
    assert not twice, f"an owner revision was applied twice: {twice}"
    applied_events = await env.sql(
        "SELECT operation_id, detail->>'owner_revision', count(*) FROM custody.history"
        # (not the node.activated and instance events of the successors it activates)
        " WHERE actor = 'receipts' AND event LIKE 'operation.%%'"
        " GROUP BY 1, 2 HAVING count(*) > 1 LIMIT 5"
    )
    assert not applied_events, f"a receipt changed an operation twice: {applied_events}"
    succeeded = await env.sql(
        "SELECT o.id, count(h.id) FROM custody.operations o LEFT JOIN custody.history h"
        " ON h.operation_id = o.id AND h.event = 'operation.succeeded'"
        " GROUP BY o.id HAVING count(h.id) <> 1 LIMIT 5"
    )
    assert not succeeded, f"operations without exactly one operation.succeeded: {succeeded}"
    ends = await env.sql(
        "SELECT event, count(*), count(DISTINCT instance_id) FROM custody.history"
        " WHERE event IN ('instance.started', 'instance.completed') GROUP BY 1 ORDER BY 1"
    )
    assert ends == [("instance.completed", n, n), ("instance.started", n, n)], ends
    # every command was sent, or retired because its operation had settled before it was
    # (re)sent (a receipt overtook a publisher that died before its confirm mark)
    outbox = await env.sql(
        "SELECT count(*), count(*) FILTER (WHERE b.status = 'published'"
        " OR (b.status = 'retired' AND o.status IN ('succeeded', 'failed')))"
        " FROM custody.outbox b JOIN custody.operations o ON o.id = b.operation_id"
    )
    assert outbox[0] == (3 * n, 3 * n), f"engine outbox (rows, sent or retired) = {outbox[0]}"


async def assert_durable_happy_end(env: Env, n: int) -> None:
    """All n instances completed, every effect exactly once, on both sides."""
    await assert_engine_applied_once(env, n)
    await assert_participants_deduplicated(env, n)
    await assert_effects_once(env, n)


def process_state(pid: int) -> str:
    """The kernel's one-letter state of a process (``T``: stopped, at its stop point)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


async def freeze_past_lease(env: Env, proc: Proc, what: str) -> str:
    """Wait until ``proc`` stopped itself at its stop point (state T), then until its
    lease row has expired; returns the LIKE pattern of its lease holder."""

    async def frozen() -> bool:
        return process_state(proc.popen.pid) == "T"

    await wait_until(frozen, timeout=30, what=f"the {what} to freeze inside its transaction")
    holder = f"%-{proc.popen.pid}-%"

    async def expired() -> bool:
        return (
            await env.scalar(
                "SELECT bool_and(expires_at < now()) FROM custody.leases WHERE holder LIKE %s",
                (holder,),
            )
            is True
        )

    await wait_until(expired, timeout=30, what=f"the frozen {what}'s lease to expire")
    return holder


async def queue_state(env: Env, name: str) -> tuple[int, int]:
    """(ready messages, consumers) of a queue, as the broker says right now (a passive
    declare: no management-statistics delay). Unacked deliveries are not ready."""
    connection = await aio_pika.connect(env.settings.amqp_url)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(name, passive=True)
        ok = queue.declaration_result
        return int(ok.message_count or 0), int(ok.consumer_count or 0)
