"""psycopg's placeholders turned into libpq's (workers/io/flights.py ``compile_query``):
every statement a unit sends goes through it, so a placeholder read otherwise than
psycopg reads it would send a parameter to the wrong place."""

from __future__ import annotations

import psycopg
import pytest
from psycopg.adapt import PyFormat

from workers.io.flights import compile_query


def test_positional_placeholders_are_numbered_in_order() -> None:
    q = compile_query("SELECT %s, %b FROM t WHERE a = %t")
    assert q.text == b"SELECT $1, $2 FROM t WHERE a = $3"
    assert q.names is None
    assert q.formats == (PyFormat.AUTO, PyFormat.BINARY, PyFormat.TEXT)
    assert q.values((1, 2, 3)) == (1, 2, 3)


def test_a_repeated_name_is_one_parameter() -> None:
    q = compile_query("SELECT %(a)s, %(b)s, %(a)s")
    assert q.text == b"SELECT $1, $2, $1"
    assert q.names == ("a", "b")
    assert list(q.values({"b": 2, "a": 1, "unused": 3})) == [1, 2]


def test_a_doubled_percent_is_one_percent_and_no_parameter() -> None:
    q = compile_query("SELECT 'x' LIKE '10%%' AND %s")
    assert q.text == b"SELECT 'x' LIKE '10%' AND $1"
    assert len(q.formats) == 1


def test_what_psycopg_refuses_is_refused() -> None:
    with pytest.raises(psycopg.ProgrammingError, match="placeholders"):
        compile_query("SELECT %d")
    with pytest.raises(psycopg.ProgrammingError, match="mixed"):
        compile_query("SELECT %s, %(a)s")
    with pytest.raises(psycopg.ProgrammingError, match="missing"):
        compile_query("SELECT %(a)s").values({"b": 1})
    with pytest.raises(psycopg.ProgrammingError, match="positional"):
        compile_query("SELECT %s, %s").values((1,))
    with pytest.raises(psycopg.ProgrammingError, match="mapping"):
        compile_query("SELECT %(a)s").values((1,))


def test_a_statement_without_placeholders_takes_no_parameters() -> None:
    q = compile_query("COMMIT")
    assert q.text == b"COMMIT" and q.formats == () and q.values(None) == ()
