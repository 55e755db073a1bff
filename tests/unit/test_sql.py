"""Named queries (workers/io/sql.py): loaded once, lazily, from the SQL directory.

Engine queries live in queries.sql and participant queries (p_*) in
participant_queries.sql; a name is defined once across both, and importing the module
reads neither a file nor the environment.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.errors import ConfigError, CustodyError
from workers.io import db, sql
from workers.settings import ROOT

NAME = re.compile(r"^--\s*name:\s*([a-z_0-9]+)\s*$", re.M)


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    sql.configure(None)
    yield
    sql.configure(None)


def _names(filename: str) -> list[str]:
    return NAME.findall((ROOT / filename).read_text())


def test_importing_reads_no_sql_file_and_no_custody_variable() -> None:
    """The import itself reads nothing: a broken CUSTODY_SQL_DIR or crash point is
    refused on first use, not while importing."""
    probe = (
        "import os, pathlib\n"
        "reads, keys = [], []\n"
        "real = pathlib.Path.read_text\n"
        "pathlib.Path.read_text = lambda self, *a, **k: reads.append(str(self)) or real(self)\n"
        "Env = type(os.environ)\n"
        "get, has = Env.__getitem__, Env.__contains__\n"
        "Env.__getitem__ = lambda self, key: keys.append(key) or get(self, key)\n"
        "Env.__contains__ = lambda self, key: keys.append(key) or has(self, key)\n"
        "import workers.io.db, workers.runtime.faults\n"
        "assert not [r for r in reads if r.endswith('.sql')], reads\n"
        "assert not [k for k in keys if k.startswith('CUSTODY_')], keys\n"
        "from workers.io import sql\n"
        "try:\n"
        "    sql.queries()\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    env = {"CUSTODY_SQL_DIR": "/nonexistent", "CUSTODY_CRASH_POINTS": "no_such_point"}
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ConfigError"), done.stdout
    assert "/nonexistent/queries.sql" in done.stdout


def test_every_query_of_both_files_is_loaded_once_and_on_first_use(tmp_path: Path) -> None:
    (tmp_path / "queries.sql").write_text("-- name: a\nSELECT 1;\n")
    (tmp_path / "participant_queries.sql").write_text("-- name: p_b\nSELECT 2;\n")
    sql.configure(tmp_path)
    assert dict(sql.queries()) == {"a": "SELECT 1", "p_b": "SELECT 2"}
    (tmp_path / "queries.sql").write_text("-- name: a\nSELECT 3;\n")
    assert sql.query("a") == "SELECT 1"  # loaded once
    assert db.QUERIES is sql.queries()
    assert tmp_path == db.SQL_DIR


def test_the_directory_is_the_sql_dir_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUSTODY_SQL_DIR", raising=False)
    assert sql.directory() == ROOT
    sql.configure(None)
    monkeypatch.setenv("CUSTODY_SQL_DIR", "/app")
    assert sql.directory() == Path("/app")
    assert sql.path("schema.sql") == Path("/app/schema.sql")


def test_a_missing_sql_file_says_which_and_where(tmp_path: Path) -> None:
    (tmp_path / "queries.sql").write_text("-- name: a\nSELECT 1;\n")
    sql.configure(tmp_path)
    with pytest.raises(ConfigError, match=r"participant_queries\.sql"):
        sql.queries()


def test_a_name_defined_twice_is_refused(tmp_path: Path) -> None:
    (tmp_path / "queries.sql").write_text("-- name: a\nSELECT 1;\n")
    (tmp_path / "participant_queries.sql").write_text("-- name: a\nSELECT 2;\n")
    sql.configure(tmp_path)
    with pytest.raises(ConfigError, match="more than one file"):
        sql.queries()
    with pytest.raises(ConfigError, match="defined twice"):
        sql.parse("-- name: a\nSELECT 1;\n-- name: a\nSELECT 2;\n")


def test_an_unknown_name_is_a_custody_error() -> None:
    with pytest.raises(CustodyError, match="no query named 'nope'"):
        sql.query("nope")


def test_a_group_heading_is_not_part_of_the_statement_before_it() -> None:
    text = (
        "-- name: a\n-- what a does\nSELECT 1\n  FROM t;\n\n"
        "-- Next group: one line --------\n\n-- name: b\nSELECT 2;\n"
    )
    assert sql.parse(text) == {"a": "-- what a does\nSELECT 1\n  FROM t", "b": "SELECT 2"}


def test_participant_queries_have_their_own_file() -> None:
    engine, participant = _names("queries.sql"), _names("participant_queries.sql")
    assert engine and participant
    assert all(n.startswith("p_") for n in participant), participant
    assert not [n for n in engine if n.startswith("p_")]
    assert set(sql.queries()) == set(engine) | set(participant)


def test_no_two_queries_are_the_same_statement() -> None:
    def flat(text: str) -> str:
        lines = [ln for ln in text.splitlines() if not ln.strip().startswith("--")]
        return " ".join(" ".join(lines).split())

    seen: dict[str, str] = {}
    for name, text in sql.queries().items():
        assert flat(text) not in seen, f"{name} repeats {seen[flat(text)]}"
        seen[flat(text)] = name


@pytest.mark.parametrize("filename", ["queries.sql", "participant_queries.sql"])
def test_every_query_is_in_a_described_group(filename: str) -> None:
    """Each group (a commit boundary) opens with a one-line heading comment."""
    text = (ROOT / filename).read_text()
    first = text.index("-- name:")
    heading = re.compile(r"^-- \S.* -{3,}$")
    assert heading.match(text[:first].rstrip().splitlines()[-1])
    for block in re.split(r"\n(?=-- \S.* -{3,}\n)", text[first:]):
        assert NAME.search(block), block[:80]


@pytest.mark.parametrize(
    ("statement", "nothing"),
    [
        ("INSERT INTO shipments (operation_id) VALUES (%s)", True),
        ("  update stock SET available = available + %s WHERE sku = %s", True),
        ("\nDELETE FROM holds WHERE id = %s", True),
        ("UPDATE stock SET available = available - %s WHERE sku = %s RETURNING available", False),
        ("INSERT INTO t (a) VALUES (%s)\n  returning id", False),
        ("SELECT available FROM stock WHERE sku = %s FOR UPDATE", False),
        ("WITH s AS (SELECT 1) INSERT INTO t SELECT * FROM s", False),
        ("-- a comment first\nINSERT INTO t (a) VALUES (%s)", False),
        ("INSERT INTO t (note) VALUES ('returning soon')", False),
        ("INSERTED", False),
    ],
)
def test_only_a_plain_write_that_returns_no_rows_is_sent_without_waiting(
    statement: str, nothing: bool
) -> None:
    """A participant's handler statement is sent without waiting for its answer only
    when nothing can be lost by it: a plain INSERT, UPDATE or DELETE that says
    RETURNING nowhere. Anything else (a read, a CTE, a leading comment, the word in a
    literal) is waited for, as every statement was."""
    assert db.returns_nothing(statement) is nothing
