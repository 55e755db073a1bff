"""The reconciler's deadline sweep (``operations_overdue``) as the rows see it: up to a
batch of each in-flight status at a time, the oldest deadlines first, every overdue
operation taken once, nothing else taken, no row locked that the sweep does not move,
and two sweeps never taking the same operation.

Seed: "A timeout can produce OutcomeUnknown." The sweep reads one status at a time, each
in deadline order and stopped at the batch, and merges them (queries.sql); these tests
hold what it takes, the plans are held in
test_query_plans.py::test_the_deadline_sweep_reads_only_the_operations_it_takes_….
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from tests.conftest import clone_database
from workers.io import sql

BATCH = 50
# (status, how many, deadline offset from now in seconds for row g: overdue when < 0)
ROWS: list[tuple[str, int, str]] = [
    ("pending", 40, "-(g * 3 + 0)"),
    ("dispatched", 70, "-(g * 3 + 1)"),
    ("accepted", 60, "-(g * 3 + 2)"),
    ("accepted", 20, "g * 60"),  # in flight, not due yet
    ("retry_waiting", 10, "-g"),  # past its deadline, but not in flight
    ("succeeded", 10, "-g"),
]
OVERDUE = 40 + 70 + 60


@pytest.fixture
def engine(templates: tuple[str, str]) -> Iterator[str]:
    """An engine database of its own, with operations in every case above."""
    with clone_database(templates[0], "custody_sweep") as url:
        with psycopg.connect(url, autocommit=True) as conn:
            for n, (status, count, offset) in enumerate(ROWS):
                conn.execute(
                    "INSERT INTO custody.instances (id, tenant, start_request_id, process,"
                    " process_version, input, status, requested_by, routes)"
                    " SELECT md5(%(n)s || '/' || g)::uuid, 'acme', gen_random_uuid(),"
                    " 'order-fulfilment', 1, '{}', 'running', 'test', '{}'"
                    " FROM generate_series(1, %(count)s) g",
                    {"n": n, "count": count},
                )
                conn.execute(
                    "INSERT INTO custody.operations (id, tenant, instance_id, node, activation,"
                    " operation, route, owner, principal, binding, input, lineage, attempt,"
                    " digest, status, deadline_seconds, deadline_at)"
                    " SELECT md5('op' || %(n)s || '/' || g)::uuid, 'acme',"
                    " md5(%(n)s || '/' || g)::uuid, 'reserve', 1, 'inventory.reserve',"
                    " 'inventory', 'inventory', 'custody-inventory', 'inventory.v1', '{}',"
                    " '{}', 1, 'x', %(status)s, 60,"
                    f" now() + make_interval(secs => {offset})"
                    " FROM generate_series(1, %(count)s) g",
                    {"n": n, "count": count, "status": status},
                )
        yield url


def _overdue(conn: psycopg.Connection[Any]) -> list[tuple[str, str]]:
    """What the sweep should take next: the oldest ``BATCH`` overdue operations of each
    in-flight status, oldest deadline first."""
    return [
        (str(i), s)
        for i, s in conn.execute(
            "SELECT id, status FROM (SELECT id, status::text, deadline_at, row_number()"
            "   OVER (PARTITION BY status ORDER BY deadline_at) AS n FROM custody.operations"
            "  WHERE status IN ('pending', 'dispatched', 'accepted') AND deadline_at < now()) o"
            " WHERE n <= %s ORDER BY deadline_at",
            [BATCH],
        ).fetchall()
    ]


def _sweep(conn: psycopg.Connection[Any]) -> list[tuple[str, str]]:
    rows = conn.execute(sql.query("operations_overdue"), {"limit": BATCH}).fetchall()
    return [(str(i), str(s)) for i, _, s in rows]


def _locked_by_another(conn: psycopg.Connection[Any]) -> set[str]:
    """The overdue in-flight operations another transaction holds locked."""
    return {
        str(i)
        for (i,) in conn.execute(
            "SELECT id FROM custody.operations o WHERE status IN"
            " ('pending', 'dispatched', 'accepted') AND deadline_at < now()"
            " AND NOT EXISTS (SELECT 1 FROM custody.operations x WHERE x.id = o.id"
            " FOR UPDATE SKIP LOCKED)"
        ).fetchall()
    }


def test_each_sweep_takes_the_oldest_of_each_status_and_every_overdue_one_once(
    engine: str,
) -> None:
    """Sweeps in a row, each moving what it took to outcome_unknown as the reconciler
    does: each takes the oldest overdue operations, up to a batch of each status,
    oldest deadline first, and together they take every overdue in-flight operation
    exactly once, and nothing else (not the one not due yet, not one not in flight)."""
    taken: list[str] = []
    with psycopg.connect(engine) as conn:
        conn.execute("SET search_path = custody")
        sweeps = 0
        while batch := _sweep(conn):
            expected = _overdue(conn)
            assert batch == expected, "the oldest of each status, oldest first"
            for op, status in batch:
                changed = conn.execute(
                    sql.query("operation_set_status"),
                    {"id": op, "status": "outcome_unknown", "expected": status},
                ).rowcount
                assert changed == 1
            conn.commit()
            taken += [i for i, _ in batch]
            sweeps += 1
        conn.commit()
        assert sweeps == 2  # 40 + 50 + 50, then the 20 dispatched and 10 accepted left
        assert len(taken) == len(set(taken)) == OVERDUE
        left = conn.execute(
            "SELECT status::text, count(*) FROM custody.operations GROUP BY 1 ORDER BY 1"
        ).fetchall()
    assert left == [
        ("accepted", 20),
        ("outcome_unknown", OVERDUE),
        ("retry_waiting", 10),
        ("succeeded", 10),
    ]


def test_a_sweep_locks_only_what_it_takes_and_a_second_one_takes_the_rest(
    engine: str,
) -> None:
    """Every row a sweep locks is one it returns (it moves them all: none stays locked
    for nothing). While one sweep's transaction is open, a second one (a reconciler that
    took the lease over from a stalled one) skips the rows the first holds and takes the
    others; together they take every overdue operation, none twice."""
    with psycopg.connect(engine) as first, psycopg.connect(engine) as second:
        for conn in (first, second):
            conn.execute("SET search_path = custody")
        one = {i for i, _ in _sweep(first)}
        assert _locked_by_another(second) == one
        two = {i for i, _ in _sweep(second)}
        assert one and two and not one & two
        assert len(one) + len(two) == OVERDUE
        first.rollback()
        second.rollback()
