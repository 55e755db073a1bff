"""Observability of real worker processes: secrets.

No secret reaches a log line, and ``custody config show`` redacts them.

The shared broker and database are never stopped: a dependency is made unreachable for
one worker only, through the TCP proxy in ``tests/proxy.py``. Every wait is a bounded
poll; nothing sleeps a fixed time. The helpers live in ``tests/acceptance/observability.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import psycopg
import pytest

from tests.acceptance.observability import (
    GRACE_S,
    poll,
    start,
    wait_ready,
)
from tests.acceptance.support import Crew, all_finished, environ_of
from tests.conftest import DEV_PASSWORD, MGMT, Env
from tests.harness import order, publish_starts
from tests.proxy import Proxy, amqp_port
from workers.harness.fleet import ENGINE_WORKERS, PARTICIPANTS, Fleet
from workers.io import broker
from workers.settings import ROOT

pytestmark = pytest.mark.acceptance


@pytest.mark.timeout(90)
async def test_no_secret_reaches_a_log_line_and_config_show_redacts_them(
    env: Env, crew: Crew, tmp_path: Path
) -> None:
    """Engine workers get a database URL with a password in CUSTODY_DATABASE_URL and
    their AMQP URL (a dedicated broker user with a recognisable password) only from the
    file named by CUSTODY_AMQP_URL_FILE, through a proxy that is cut once so the
    connection code logs its failures; participants get a key=value conninfo with a
    password. After a workload and a SIGTERM, no secret appears anywhere in any worker's
    log, and ``custody config show`` redacts every one of them."""
    tag = uuid.uuid4().hex[:8]
    pg_secret, pgkv_secret, amqp_secret = (
        f"pg-s3cr3t-{tag}",
        f"pgkv-s3cr3t-{tag}",
        f"amqp-s3cr3t-{tag}",
    )
    secrets = (pg_secret, pgkv_secret, amqp_secret, DEV_PASSWORD)
    user = f"custody-obs-{tag}"
    engine_db = psycopg.conninfo.conninfo_to_dict(env.settings.database_url)
    part_db = psycopg.conninfo.conninfo_to_dict(env.settings.participant_database_url)
    db_url = (
        f"postgresql://{engine_db.get('user', 'postgres')}:{pg_secret}"
        f"@127.0.0.1:{engine_db.get('port', 5432)}/{engine_db['dbname']}"
    )
    part_url = psycopg.conninfo.make_conninfo("", **{**part_db, "password": pgkv_secret})
    # No CUSTODY_AMQP_URL at all: it and CUSTODY_AMQP_URL_FILE are exclusive.
    base = {k: v for k, v in env.fleet_env().items() if k != "CUSTODY_AMQP_URL"}
    base["CUSTODY_PARTICIPANT_DATABASE_URL"] = part_url
    # Without the fleet's per-worker roles (workers.harness.fleet.role_env), which would set
    # CUSTODY_AMQP_URL for every worker and so exclude CUSTODY_AMQP_URL_FILE.
    secret_crew = Crew(
        env, Fleet(env=base, log_dir=tmp_path / "secret-logs", least_privilege=False)
    )
    await broker.ensure_user(
        MGMT, user, amqp_secret, env.vhost, configure=".*", write=".*", read=".*"
    )
    try:
        async with Proxy(amqp_port(env.settings.amqp_url)) as proxy:
            amqp_url = (
                urllib.parse.urlsplit(env.settings.amqp_url)
                ._replace(netloc=f"{user}:{amqp_secret}@127.0.0.1:{proxy.port}")
                .geturl()
            )
            url_file = tmp_path / "amqp_url"
            url_file.write_text(amqp_url + "\n")
            engine_env = {"CUSTODY_DATABASE_URL": db_url, "CUSTODY_AMQP_URL_FILE": str(url_file)}
            engine = [start(secret_crew, w, port=None, **engine_env) for w in ENGINE_WORKERS]
            parts = [start(secret_crew, p) for p in PARTICIPANTS]
            for s in engine:
                assert "CUSTODY_AMQP_URL" not in environ_of(s.proc), s.proc.name
            await wait_ready(secret_crew, [*engine, *parts])
            assert proxy.accepted >= len(engine), "the engine workers did not use the file's URL"

            proxy.cut()

            async def refused() -> bool:
                return proxy.refused > 0

            await poll(
                refused, timeout=30, what="a refused reconnect", alive=[s.proc for s in engine]
            )
            proxy.heal()
            await wait_ready(secret_crew, engine)
            n = 3
            await publish_starts(env.settings, [order(i) for i in range(n)])
            await secret_crew.wait(all_finished(env, n), timeout=40, what=f"{n} instances finished")
            codes = await asyncio.to_thread(secret_crew.stop_all, GRACE_S)
        assert set(codes.values()) == {0}, codes
        logged = [p for p in secret_crew.fleet.procs if p.name.startswith(ENGINE_WORKERS)]
        # custody's own event for every failed attempt (aio-pika's repeat of it is muted)
        reconnects = sum("broker.connect_retry" in p.log.read_text() for p in logged)
        assert reconnects, "the outage left no connection failure in any log: nothing was tested"
        for proc in secret_crew.fleet.procs:
            text = proc.log.read_text(errors="replace")
            assert "worker.stopped" in text, f"{proc.name} log is incomplete:\n{text[-2000:]}"
            leaked = [s for s in secrets if s in text]
            assert not leaked, f"{proc.name} logged secrets {leaked}"

        shown = subprocess.run(
            [sys.executable, "-m", "workers.cli", "config", "show"],
            cwd=ROOT,
            env={**os.environ, **base, **engine_env},
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert shown.returncode == 0, shown.stderr
        output = shown.stdout + shown.stderr
        leaked = [s for s in secrets if s in output]
        assert not leaked, f"config show printed secrets {leaked}:\n{output}"
        config = json.loads(shown.stdout)
        assert config["amqp_url"].startswith(f"amqp://{user}:***@127.0.0.1:"), config["amqp_url"]
        assert config["database_url"].startswith("postgresql://postgres:***@"), config
        assert "password=***" in config["participant_database_url"], config
        assert "guest:***@" in config["amqp_management_url"], config
    finally:
        secret_crew.fleet.stop(grace_s=GRACE_S)
        with contextlib.suppress(Exception):
            await broker.management(MGMT, "DELETE", f"/api/users/{urllib.parse.quote(user)}")
