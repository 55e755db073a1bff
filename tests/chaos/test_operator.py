"""The harness's operator tells its own misuse from a database that is restarting.

A chaos run fails when the harness misused the CLI (exit 2: a usage error). The CLI
also exits 2 for a refused connection, as documented ("a refused connection … exit 2,
nothing read or written"), and a cancel-start racing a ``pg_restart`` fault meets one:
seed 208 was failed by the harness itself on it, with the checker at 0/0/0.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from chaos.workload import Operator


@pytest.mark.chaos
@pytest.mark.timeout(60)
def test_a_command_that_meets_a_restarting_postgres_is_unreachable_not_a_misuse() -> None:
    # nothing listens on port 1: the refusal a Postgres restart gives
    operator = Operator("postgresql://postgres@127.0.0.1:1/custody", {})
    code, out = asyncio.run(operator.cancel_start(str(uuid.uuid4())))
    assert code == 2 and "cannot connect to" in out
    assert operator.done == {"cancel-start:unreachable": 1}
    assert operator.failures == []


@pytest.mark.chaos
@pytest.mark.timeout(60)
def test_a_command_the_harness_misspelt_is_still_its_misuse() -> None:
    operator = Operator("postgresql://postgres@127.0.0.1:1/custody", {})
    code, _ = asyncio.run(operator.reconcile("not-a-uuid"))
    assert code == 2
    assert operator.done == {"reconcile:2": 1}
    assert len(operator.failures) == 1
