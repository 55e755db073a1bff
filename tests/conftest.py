"""Real-service fixtures: a template database cloned per test, a vhost per test.

When Postgres or RabbitMQ is missing the suite fails loudly and says how to start
them (``bash scripts/ensure-services.sh``); it never skips.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from typing import Any

import hypothesis
import psycopg
import pytest
from psycopg import sql

from workers import provision
from workers.harness import fleet
from workers.harness.env import with_vhost
from workers.io import broker
from workers.runtime import metrics
from workers.settings import ROOT, Settings

# CI runs the property tests derandomized: the same examples every run, so a red CI is
# a reproducible failure (locally they keep exploring new examples).
hypothesis.settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    hypothesis.settings.load_profile("ci")

PG_ADMIN = os.environ.get("CUSTODY_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
AMQP = os.environ.get("CUSTODY_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672/%2F")
MGMT = os.environ.get("CUSTODY_TEST_MGMT", "http://guest:guest@127.0.0.1:15672")
DEV_PASSWORD = fleet.DEV_PASSWORD
RUN = uuid.uuid4().hex[:8]
HOW = "start them with: bash scripts/ensure-services.sh"


def database_url(name: str) -> str:
    return psycopg.conninfo.make_conninfo(PG_ADMIN, dbname=name)


def admin_execute(statement: sql.Composable) -> None:
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(statement)


@contextlib.contextmanager
def clone_database(template: str, prefix: str) -> Iterator[str]:
    """A database of its own, cloned from ``template`` (no broker), dropped after use:
    its url."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin_execute(
        sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
            sql.Identifier(name), sql.Identifier(template)
        )
    )
    try:
        yield database_url(name)
    finally:
        admin_execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@pytest.fixture(scope="session", autouse=True)
def every_metric_family() -> None:
    """Workers run in the test process (the in-process fleets, a unit called directly)
    record every family; a worker process exports only its own (``custody run``)."""
    metrics.register_all()


@pytest.fixture(scope="session")
def services() -> None:
    try:
        psycopg.connect(PG_ADMIN, connect_timeout=3).close()
    except psycopg.OperationalError as exc:
        pytest.fail(f"PostgreSQL is not reachable ({exc}); {HOW}", pytrace=False)
    try:
        asyncio.run(broker.management(MGMT, "GET", "/api/overview"))
    except Exception as exc:
        pytest.fail(f"RabbitMQ (with management) is not reachable ({exc}); {HOW}", pytrace=False)


@pytest.fixture(scope="session")
def templates(services: None) -> Iterator[tuple[str, str]]:
    """Template databases with schema.sql and the participants' schemas applied once."""
    engine_tpl, part_tpl = f"custody_tpl_{RUN}", f"custody_ptpl_{RUN}"
    for name in (engine_tpl, part_tpl):
        admin_execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    settings = replace(
        Settings(),
        database_url=database_url(engine_tpl),
        participant_database_url=database_url(part_tpl),
    )
    # roles are the cluster's, not a database's: the test processes (pytest-xdist) create
    # them one at a time, or two "IF NOT EXISTS" checks race to the same CREATE ROLE
    with psycopg.connect(PG_ADMIN, autocommit=True) as lock:
        lock.execute("SELECT pg_advisory_lock(hashtext('custody tests: roles'))")
        asyncio.run(provision.migrate(settings, participants=True))
        # each operator its own login role; "mallory" can log in and is no operator
        asyncio.run(provision.sync_operators(settings, settings.operators_file, create_logins=True))
        admin_execute(
            sql.SQL(
                "DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'mallory') "
                "THEN CREATE ROLE mallory LOGIN; END IF; END $$"
            )
        )
    yield engine_tpl, part_tpl
    for name in (engine_tpl, part_tpl):
        admin_execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@pytest.fixture(scope="session")
def broker_users(services: None) -> None:
    """One broker user per participant principal (permissions are set per vhost)."""
    for name in ("inventory", "payments", "shipping", *broker.ENGINE_USERS):
        asyncio.run(
            broker.management(
                MGMT, "PUT", f"/api/users/custody-{name}", {"password": DEV_PASSWORD, "tags": ""}
            )
        )


class Env:
    """One test's world: its databases, its vhost, its settings."""

    def __init__(self, settings: Settings, vhost: str, engine_db: str, part_db: str) -> None:
        self.settings = settings
        self.vhost = vhost
        self.engine_db = engine_db
        self.part_db = part_db

    def participant_amqp(self, name: str) -> str:
        return with_vhost(AMQP, self.vhost, f"custody-{name}", DEV_PASSWORD)

    def participant_settings(self, name: str) -> Settings:
        return replace(self.settings, amqp_url=self.participant_amqp(name))

    def fleet_env(self) -> dict[str, str]:
        s = self.settings
        return {
            "CUSTODY_DATABASE_URL": s.database_url,
            "CUSTODY_PARTICIPANT_DATABASE_URL": s.participant_database_url,
            "CUSTODY_AMQP_URL": s.amqp_url,
            "CUSTODY_AMQP_MANAGEMENT_URL": s.amqp_management_url,
            "CUSTODY_ROUTES_FILE": s.routes_file,
            "CUSTODY_PROCESSES_DIR": s.processes_dir,
            "CUSTODY_POLL_INTERVAL_S": str(s.poll_interval_s),
            "CUSTODY_SETTLED_SAMPLE_S": str(s.settled_sample_s),
            "CUSTODY_LEASE_TTL_S": str(s.lease_ttl_s),
            "CUSTODY_BATCH_SIZE": str(s.batch_size),
            "CUSTODY_PREFETCH": str(s.prefetch),
            "CUSTODY_LOG_FORMAT": "json",
        }

    async def sql(
        self, query: str, params: Any = None, *, participant: bool = False
    ) -> list[tuple[Any, ...]]:
        url = self.settings.participant_database_url if participant else self.settings.database_url
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            cur = await conn.execute(query, params)  # type: ignore[arg-type]
            return await cur.fetchall() if cur.description else []

    async def scalar(self, query: str, params: Any = None, *, participant: bool = False) -> Any:
        rows = await self.sql(query, params, participant=participant)
        return rows[0][0]


@pytest.fixture
def env(templates: tuple[str, str], broker_users: None) -> Iterator[Env]:
    yield from world(templates)


def world(templates: tuple[str, str]) -> Iterator[Env]:
    """A test's world (two databases cloned from the templates, a vhost with the topology
    and the broker users), for a fixture of any scope to yield from."""
    engine_tpl, part_tpl = templates
    tag = uuid.uuid4().hex[:10]
    engine_db, part_db, vhost = f"custody_t_{tag}", f"custody_p_{tag}", f"custody-test-{tag}"
    for name, template in ((engine_db, engine_tpl), (part_db, part_tpl)):
        admin_execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template)
            )
        )
    settings = Settings(
        database_url=database_url(engine_db),
        participant_database_url=database_url(part_db),
        amqp_url=with_vhost(AMQP, vhost),
        amqp_management_url=MGMT,
        routes_file=str(ROOT / "deploy" / "routes.toml"),
        processes_dir=str(ROOT / "deploy" / "processes"),
        poll_interval_s=0.2,
        settled_sample_s=0.5,
        lease_ttl_s=5.0,
        batch_size=50,
        prefetch=100,
        confirm_timeout_s=5.0,
    )
    asyncio.run(_broker_world(settings, vhost))
    yield Env(settings, vhost, engine_db, part_db)
    # the test's world is removed behind the next test's back (a vhost with quorum
    # queues takes about a second to delete); the session waits for it at the end
    _CLEANUP.append(_CLEANER.submit(_remove_world, vhost, (engine_db, part_db)))


async def _broker_world(settings: Settings, vhost: str) -> None:
    await broker.ensure_vhost(MGMT, vhost, ["guest"])
    await asyncio.gather(
        provision.apply_topology(settings), provision.dev_users(settings, DEV_PASSWORD)
    )


def _remove_world(vhost: str, databases: tuple[str, ...]) -> None:
    asyncio.run(broker.delete_vhost(MGMT, vhost))
    for name in databases:
        admin_execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


_CLEANER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="cleanup")
_CLEANUP: list[concurrent.futures.Future[None]] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for done in _CLEANUP:
        done.result()
    _CLEANER.shutdown()


async def wait_until(
    predicate: Callable[[], Awaitable[bool]],
    timeout: float = 30.0,
    interval: float = 0.1,
    what: str = "condition",
) -> None:
    """Poll ``predicate`` until true, or fail after ``timeout`` seconds (never a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while True:
        if await predicate():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)
