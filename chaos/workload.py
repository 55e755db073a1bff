"""The workload: order-fulfilment start requests published in waves while faults run,
and the operator's commands (run the way an operator runs them: the ``custody`` CLI).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg

from participants import samples
from workers import errors
from workers.io import broker
from workers.settings import ROOT, Settings

OPERATOR = "oncall"  # deploy/operators.toml: every action, every tenant


def orders(n: int, seed: int) -> list[dict[str, Any]]:
    """Most orders complete; some are declined (compensated by a release), some need a
    retry (a transient gateway failure with effect none), a few run out of stock."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        roll = rng.random()
        order: dict[str, Any] = {
            "order_id": f"chaos-{seed}-{i:06d}",
            "sku": "sku-1",
            "quantity": rng.randint(1, 3),
            "amount_cents": rng.randint(500, 50_000),
            "address": f"{i} Chaos Street",
        }
        if roll < 0.05:
            order["amount_cents"] = samples.CHARGE_LIMIT_CENTS + 1
        elif roll < 0.10:
            order["flaky"] = True
        elif roll < 0.12:
            order["sku"], order["quantity"] = "sku-rare", 1
        out.append(order)
    return out


@dataclass
class Starts:
    """Publishes start requests with broker confirms; a start whose publish was not
    confirmed is sent again under the same start request id (the committer
    deduplicates), so ``confirmed`` is exactly what a sender was told."""

    amqp_url: str
    confirmed: list[str] = field(default_factory=list)
    unconfirmed: dict[str, broker.Outgoing] = field(default_factory=dict)
    failures: int = 0
    _amqp: broker.Broker | None = None

    async def _publisher(self) -> broker.Publisher:
        if self._amqp is None or not self._amqp.connected:
            if self._amqp is not None:
                await self._close()
            amqp = broker.Broker(self.amqp_url, "chaos-starts")
            await amqp.connect()
            self._amqp = amqp
        return await self._amqp.publisher(
            window=64, timeout_s=10, user_id=None, envelope_max=Settings.read("envelope_max")
        )

    async def _close(self) -> None:
        if self._amqp is not None:
            with contextlib.suppress(Exception):  # a dead connection: nothing to close
                await asyncio.wait_for(self._amqp.close(), 5)
            self._amqp = None

    async def publish(self, items: Sequence[broker.Outgoing]) -> list[str]:
        for item in items:
            self.unconfirmed[item.message_id] = item
        return await self.flush()

    async def flush(self) -> list[str]:
        if not self.unconfirmed:
            return []
        try:
            pub = await self._publisher()
            outcomes = await pub.publish_many(list(self.unconfirmed.values()))
        except (errors.BrokerError, OSError, RuntimeError, TimeoutError):
            self.failures += 1
            await self._close()
            return []
        ok = []
        for o in outcomes:
            if o.ok:
                self.unconfirmed.pop(o.message_id, None)
                self.confirmed.append(o.message_id)
                ok.append(o.message_id)
            else:
                self.failures += 1
        if len(ok) < len(outcomes):
            await self._close()
        return ok

    async def close(self) -> None:
        await self._close()


def start_items(batch: Sequence[Mapping[str, Any]]) -> list[broker.Outgoing]:
    return [
        broker.start_request(
            tenant="acme", process="order-fulfilment", input=o, requested_by="chaos"
        )
        for o in batch
    ]


def new_start_id() -> str:
    return str(uuid.uuid4())


@dataclass
class Operator:
    """The one place operator commands are run: the ``custody`` CLI as the operator
    ``OPERATOR``, connected as that operator's own Postgres login (the database takes
    the actor from the login; there is no other way to name it). :meth:`prepare`
    creates the login and refuses to go on without it."""

    engine_dsn: str  # the superuser's
    env: Mapping[str, str]
    done: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    async def _cli(
        self, args: Sequence[str], env: Mapping[str, str], timeout: float
    ) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "workers.cli",
            *args,
            cwd=ROOT,
            env={k: v for k, v in env.items() if k != "CUSTODY_OPERATOR"},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return -1, "timeout"
        return proc.returncode or 0, out.decode(errors="replace")

    async def prepare(self) -> str:
        env = {**os.environ, **self.env, "CUSTODY_DATABASE_URL": self.engine_dsn}
        code, out = await self._cli(["operators", "apply", "--create-logins"], env, 60)
        if code != 0:
            raise RuntimeError(f"custody operators apply --create-logins: exit {code}: {out}")
        return "login role"

    async def __call__(self, *args: str, timeout: float = 60.0) -> tuple[int, str]:
        env = {
            **os.environ,
            **self.env,
            "CUSTODY_DATABASE_URL": psycopg.conninfo.make_conninfo(self.engine_dsn, user=OPERATOR),
        }
        argv = list(args)
        code, out = await self._cli(argv, env, timeout)
        # exit 2 is a usage error (the harness's bug) but also, as documented, a refused
        # connection: the operator's command ran into a Postgres restart, not a misuse
        unreachable = code == 2 and "cannot connect to" in out
        key = f"{args[0]}:{'unreachable' if unreachable else code}"
        self.done[key] = self.done.get(key, 0) + 1
        if code not in (0, 3, 4) and not unreachable and len(self.failures) < 20:
            self.failures.append(f"{' '.join(args)} -> {code}: {out.strip()[-300:]}")
        return code, out

    async def reconcile(self, operation_id: str) -> tuple[int, str]:
        return await self(
            "reconcile",
            operation_id,
            "--reason",
            "chaos settle: outcome unknown, asking the pinned executor (runbook)",
        )

    async def reconcile_unknown(self) -> tuple[int, str]:
        """The runbook's batch form: every operation still outcome_unknown, in one process
        (exit 3 when one of them was settled by a receipt in the meantime)."""
        return await self(
            "operations",
            "reconcile",
            "--status",
            "outcome_unknown",
            "--limit",
            "10000",
            "--yes",
            "--reason",
            "chaos settle: outcome unknown, asking the pinned executors (runbook, batch)",
            timeout=300.0,
        )

    async def cancel(self, instance_id: str) -> tuple[int, str]:
        return await self("cancel", instance_id, "--reason", "chaos: cancellation race")

    async def cancel_start(self, start_request_id: str) -> tuple[int, str]:
        return await self(
            "cancel-start",
            start_request_id,
            "--tenant",
            "acme",
            "--reason",
            "chaos: cancel-start race",
        )
