"""Versioned migrations against the real Postgres: concurrent migrators serialise on the
advisory lock, a database made before versioned migrations is adopted, a failed
migration leaves nothing behind, and ``custody db status`` gates a deploy.

Only Postgres is needed; each test makes and drops its own database.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from tests.conftest import RUN, admin_execute, database_url
from workers import provision
from workers.io import db, migrations
from workers.settings import ROOT, Settings

BASELINE = ROOT / "migrations" / "0001_baseline.sql"
# every shipped migration, in order (the baseline first)
SHIPPED = [m.id for m in migrations.discover(ROOT / "migrations")]


@pytest.fixture
def fresh(services: None) -> Iterator[str]:
    """An empty database, dropped afterwards."""
    name = f"custody_mig_{RUN}_{uuid.uuid4().hex[:6]}"
    admin_execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield database_url(name)
    finally:
        admin_execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


def _rows(url: str, query: str) -> list[tuple[object, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute(query).fetchall()  # type: ignore[arg-type]


def _cli(url: str, *args: str, sql_dir: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CUSTODY_DATABASE_URL": url, "CUSTODY_SQL_DIR": str(sql_dir)}
    return subprocess.run(
        [sys.executable, "-m", "workers.cli", "db", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_two_migrators_at_once_one_applies_the_other_waits_and_finds_nothing(
    fresh: str,
) -> None:
    settings = replace(Settings(), database_url=fresh)
    # hold the lock, so that both migrators are provably waiting on it at the same time
    async with await psycopg.AsyncConnection.connect(fresh, autocommit=True) as holder:
        await holder.execute(migrations.LOCK)
        both = asyncio.gather(
            provision.migrate(settings, participants=False),
            provision.migrate(settings, participants=False),
        )
        deadline = asyncio.get_running_loop().time() + 20
        while True:
            cur = await holder.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            )
            row = await cur.fetchone()
            if row is not None and row[0] == 2:
                break
            assert asyncio.get_running_loop().time() < deadline, "the migrators never waited"
            await asyncio.sleep(0.05)
        await holder.execute(migrations.UNLOCK)
        results = await both
    assert sorted(results) == [[], SHIPPED]
    assert _rows(fresh, "SELECT id, adopted FROM custody.schema_migrations ORDER BY id") == [
        (m, False) for m in SHIPPED
    ]
    assert [s.state for s in await provision.db_status(settings)] == ["applied"] * len(SHIPPED)


async def test_a_database_made_before_versioned_migrations_is_adopted_not_rerun(
    fresh: str,
) -> None:
    # what `custody db migrate` did before: the three idempotent scripts
    for path in (BASELINE, ROOT / "commands.sql", ROOT / "transitions.sql"):
        await db.apply_script(fresh, path)
    # a mark the baseline would undo if it ran again (it recreates the index)
    with psycopg.connect(fresh, autocommit=True) as conn:
        conn.execute("DROP INDEX custody.quarantine_received")
    settings = replace(Settings(), database_url=fresh)
    assert [s.state for s in await provision.db_status(settings)] == ["pending"] * len(SHIPPED)

    # the baseline adopted, not rerun; the migrations after it applied
    assert await provision.migrate(settings, participants=False) == SHIPPED[1:]

    assert _rows(fresh, "SELECT id, adopted FROM custody.schema_migrations ORDER BY id") == [
        ("0001_baseline", True),
        *((m, False) for m in SHIPPED[1:]),
    ]
    assert _rows(fresh, "SELECT to_regclass('custody.quarantine_received')") == [(None,)]
    assert [s.state for s in await provision.db_status(settings)] == ["applied"] * len(SHIPPED)
    assert await provision.migrate(settings, participants=False) == []


def _sql_dir(tmp_path: Path, *extra: tuple[str, str]) -> Path:
    """A copy of the SQL directory, with ``extra`` (name, text) migrations added."""
    for name in ("commands.sql", "transitions.sql", "queries.sql", "participant_queries.sql"):
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / "migrations").mkdir()
    shutil.copy(BASELINE, tmp_path / "migrations" / BASELINE.name)
    for name, text in extra:
        (tmp_path / "migrations" / name).write_text(text)
    return tmp_path


def test_a_failed_migration_rolls_back_completely_is_not_recorded_and_says_so(
    fresh: str, tmp_path: Path
) -> None:
    broken = (
        "CREATE TABLE custody.half_done (id int);\n"
        "ALTER TABLE custody.leases ADD COLUMN note text;\n"
        "SELECT * FROM custody.no_such_table;\n"
    )
    where = _sql_dir(tmp_path, ("0002_broken.sql", broken))

    failed = _cli(fresh, "migrate", sql_dir=where)

    assert failed.returncode == 2, failed
    lines = failed.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "custody: migration 0002_broken failed and was rolled back (nothing recorded): "
    ), failed.stderr
    assert "no_such_table" in lines[0] and "42P01" in lines[0]
    assert _rows(fresh, "SELECT id FROM custody.schema_migrations") == [("0001_baseline",)]
    assert _rows(fresh, "SELECT to_regclass('custody.half_done')") == [(None,)]
    assert _rows(
        fresh,
        "SELECT count(*) FROM information_schema.columns WHERE table_schema = 'custody'"
        " AND table_name = 'leases' AND column_name = 'note'",
    ) == [(0,)]

    status = _cli(fresh, "status", "--json", sql_dir=where)
    assert status.returncode == 1, status
    listed = json.loads(status.stdout)
    assert [(m["id"], m["state"]) for m in listed] == [
        ("0001_baseline", "applied"),
        ("0002_broken", "pending"),
    ]
    assert listed[0]["applied_at"] and listed[1]["applied_at"] is None

    # fixed, it applies; the status gate opens
    (where / "migrations" / "0002_broken.sql").write_text(
        "ALTER TABLE custody.leases ADD COLUMN note text;\n"
    )
    assert _cli(fresh, "migrate", sql_dir=where).returncode == 0
    status = _cli(fresh, "status", sql_dir=where)
    assert status.returncode == 0, status
    assert _table_row(status.stdout, "0002_broken")[:2] == ["0002_broken", "applied"]


def _table_row(text: str, first: str) -> list[str]:
    """The cells of the text table's row that starts with ``first`` (a header line, then
    one aligned line a migration)."""
    header, *rows = text.splitlines()
    assert header.split()[:2] == ["id", "state"], text
    return next(r.split() for r in rows if r.split()[0] == first)


def test_an_applied_migration_that_was_edited_is_refused(fresh: str, tmp_path: Path) -> None:
    where = _sql_dir(tmp_path, ("0002_note.sql", "ALTER TABLE custody.leases ADD note text;\n"))
    assert _cli(fresh, "migrate", sql_dir=where).returncode == 0
    (where / "migrations" / "0002_note.sql").write_text("-- edited\n")
    (where / "migrations" / "0003_later.sql").write_text("CREATE TABLE custody.later (id int);\n")

    status = _cli(fresh, "status", sql_dir=where)
    assert status.returncode == 1, status
    assert _table_row(status.stdout, "0002_note")[:2] == ["0002_note", "modified"]
    again = _cli(fresh, "migrate", sql_dir=where)
    assert again.returncode == 2
    assert again.stderr.startswith("custody: configuration error: migration 0002_note was changed")
    # refused before anything ran: the pending 0003 was not applied
    assert _rows(fresh, "SELECT to_regclass('custody.later')") == [(None,)]


def test_the_status_of_an_empty_database_lists_every_migration_pending(fresh: str) -> None:
    status = _cli(fresh, "status", "--json")
    assert status.returncode == 1, status
    assert json.loads(status.stdout) == [
        {"id": m, "state": "pending", "applied_at": None} for m in SHIPPED
    ]
