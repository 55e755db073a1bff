"""A JSON value reads back from Postgres as it was written (workers/io/db.py: orjson both
ways, the standard library where orjson would read a number otherwise).

The seed: "A participant persists the semantic command digest so repeated delivery cannot
silently change the requested work." A successor's input is rendered from the results
stored in ``operations.result`` (jsonb); an integer beyond 64 bits that came back as a
float would change that input and its digest.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.conftest import database_url
from workers.io import db

VALUES: list[Any] = [
    {"n": 2**64, "m": -(2**64) - 1, "big": 10**30, "small": 2**63 - 1},
    {"digits in a string": "0000000000000000000000", "n": 1},
    {"f": 0.1, "e": 2.5e-7, "neg": -2.5, "i": 0, "t": True, "none": None},
    {"text": "é ☃ \U0001f600", "nested": [[[{"a": [1, 2, {"b": "c"}]}]]]},
    [1, "two", 3.0, {"four": 4}],
    "a string",
    12345678901234567890123,
]


@pytest.fixture
async def database(services: None) -> AsyncIterator[db.Database]:
    d = db.Database(database_url("postgres"), schema="public", name="json-test", max_size=1)
    await d.open()
    try:
        yield d
    finally:
        await d.close()


@pytest.mark.parametrize("value", VALUES, ids=range(len(VALUES)))
async def test_a_jsonb_value_reads_back_as_it_was_written(
    database: db.Database, value: Any
) -> None:
    """Successful application records the result as the participant sent it: through a
    worker's pool a jsonb value reads back equal, every integer still an integer."""
    async with database.transaction() as tx:
        [row] = await tx.business("SELECT %s::jsonb AS v", (db.jsonb(value),))
    assert typed(row["v"]) == typed(value)  # 10**30 is an int, not 1e+30


def typed(value: Any) -> Any:
    """A JSON value with the type of every scalar beside it (jsonb keeps no key order)."""
    if isinstance(value, dict):
        return {k: typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [typed(v) for v in value]
    return (type(value).__name__, value)
