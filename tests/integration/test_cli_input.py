"""The CLI's edge: every bad input is one ``custody: ...`` line on stderr and exit 2,
never a traceback or a raw SQL error, and it changes nothing (no row written, no
message published); a start retried with its start request id creates nothing new.

The commands run in this process (``workers.cli.main``, as the ``custody`` script
does) against the test's real databases and vhost; one case per mistake seen in the
wild (issue 13) and the others of the same kinds."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from typing import Any

import pytest

from contracts import identity
from tests.conftest import Env, wait_until
from tests.harness import InProcessFleet, drain, order
from tests.integration.test_recovery import custody, env_vars
from workers import cli
from workers.io import broker
from workers.settings import ROOT

SOME_ID = "00000000-0000-4000-8000-000000000000"
START = ["instances", "start", "--tenant", "acme", "--process", "order-fulfilment"]
INPUT = ["--input", json.dumps(order(1))]
REASON = ["--reason", "checking the edge"]

# (argv, a word the one line must contain)
BAD_INPUT: dict[str, tuple[list[str], str]] = {
    "history-not-a-uuid": (["instances", "history", "not-a-uuid"], "not a UUID"),
    "instance-show-not-a-uuid": (["instances", "show", "xyz"], "not a UUID"),
    "operation-show-not-a-uuid": (["operations", "show", "12"], "not a UUID"),
    "start-input-array": ([*START, "--input", "[1,2]"], "a JSON object"),
    "start-input-not-json": ([*START, "--input", "{oops"], "not JSON"),
    "start-input-float": ([*START, "--input", '{"amount": 1.5}'], "floats"),
    "start-tenant-upper-case": (
        ["instances", "start", "--tenant", "ACME", "--process", "order-fulfilment", *INPUT],
        "--tenant",
    ),
    "start-unknown-process": (
        ["instances", "start", "--tenant", "acme", "--process", "nosuch", *INPUT],
        "no such process definition",
    ),
    "start-count-negative": ([*START, *INPUT, "--count", "-1"], "--count"),
    "start-count-zero": ([*START, *INPUT, "--count", "0"], "--count"),
    "start-request-id-not-a-uuid": ([*START, *INPUT, "--start-request-id", "abc"], "not a UUID"),
    "start-actor-with-a-space": ([*START, *INPUT, "--actor", "Bob Smith"], "--actor"),
    "start-missing-tenant": (
        ["instances", "start", "--process", "order-fulfilment", *INPUT],
        "--tenant",
    ),
    "old-start-spelling-count-negative": (
        ["start", *START[2:], *INPUT, "--count", "-1"],
        "--count",
    ),
    "instances-limit-negative": (["instances", "list", "--limit", "-5"], "--limit"),
    "instances-unknown-status": (["instances", "list", "--status", "nosuch"], "--status"),
    "instances-tenant-upper-case": (["instances", "list", "--tenant", "ACME"], "--tenant"),
    "operations-limit-zero": (["operations", "list", "--limit", "0"], "--limit"),
    "audit-limit-zero": (["audit", "list", "--limit", "0"], "--limit"),
    "quarantine-unknown-participant": (
        ["quarantine", "list", "--participant", "nosuch"],
        "no such participant",
    ),
    "quarantine-limit-negative": (["quarantine", "list", "--limit", "-1"], "--limit"),
    "retention-unknown-participant": (
        ["retention", "cleanup", "--participant", "nosuch"],
        "no such participant",
    ),
    "dead-letters-limit-zero": (["dead-letters", "list", "--limit", "0"], "--limit"),
    "reconcile-not-a-uuid": (["operations", "reconcile", "nope", *REASON], "not a UUID"),
    "old-reconcile-not-a-uuid": (["reconcile", "nope", *REASON], "not a UUID"),
    "cancel-not-a-uuid": (["instances", "cancel", "nope", *REASON], "not a UUID"),
    "cancel-start-not-a-uuid": (
        ["start-requests", "cancel", "abc", "--tenant", "acme", *REASON],
        "not a UUID",
    ),
    "cancel-start-tenant-upper-case": (
        ["cancel-start", SOME_ID, "--tenant", "ACME", *REASON],
        "--tenant",
    ),
    "dispatch-instance-not-a-uuid": (
        ["dispatch", "pause", "--instance", "bad", *REASON],
        "not a UUID",
    ),
    "batch-dry-run-and-yes": (
        ["operations", "reconcile", "--tenant", "acme", "--dry-run", "--yes", *REASON],
        "not both",
    ),
    "controlled-without-reason": (["operations", "retry-safe", SOME_ID], "--reason"),
    "unknown-output": (["config", "show", "--output", "yaml"], "--output"),
    "unknown-global-output": (["--output", "yaml", "config", "show"], "--output"),
    "unknown-verb": (["instances", "nosuch"], "nosuch"),
    "unknown-noun": (["nosuch"], "nosuch"),
}


def _state(env: Env) -> dict[str, Any]:
    """Every runtime table's row count, the control row, and the start requests queue."""

    async def read() -> dict[str, Any]:
        tables = [
            "instances",
            "operations",
            "outbox",
            "history",
            "audit",
            "start_tombstones",
            "quarantine",
        ]
        counts = {t: await env.scalar(f"SELECT count(*) FROM custody.{t}") for t in tables}
        counts["control"] = await env.sql("SELECT * FROM custody.control")
        counts["requests"] = len(await drain(env.settings, broker.QUEUE_REQUESTS, timeout=0.1))
        return counts

    return asyncio.run(read())


@pytest.fixture
def operator_env(env: Env, monkeypatch: pytest.MonkeyPatch) -> Env:
    """This process's environment as an operator's (``oncall``) of the test's world."""
    for name in [n for n in os.environ if n.startswith("CUSTODY_")]:
        monkeypatch.delenv(name)
    for name, value in env_vars(env).items():
        monkeypatch.setenv(name, value)
    return env


def test_bad_input_is_one_line_and_exit_2_and_changes_nothing(
    operator_env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every case of BAD_INPUT, one after the other in one world (none may change it):
    exit 2, one ``custody: `` line naming the problem, no traceback or driver error,
    nothing on stdout, and the same tables, control row and start-requests queue."""
    before = _state(operator_env)
    for case, (argv, says) in BAD_INPUT.items():
        code = cli.main(argv)
        out, err = capsys.readouterr()
        assert code == 2, (case, out, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1, (case, err)
        assert lines[0].startswith("custody: ") and says in lines[0], (case, err)
        assert "Traceback" not in err and "psycopg" not in err, (case, err)
        assert "Invalid" + "Text" not in err, (case, err)
        assert out == "", (case, out)
        assert _state(operator_env) == before, case


@pytest.mark.parametrize(
    "argv",
    [["instances", "history", "not-a-uuid"], [*START, "--input", "[1,2]"]],
    ids=["history", "start-input"],
)
def test_bad_input_to_the_real_entry_point_prints_no_traceback(
    operator_env: Env, argv: list[str]
) -> None:
    """The same through ``python -m workers.cli`` (the custody script's own process)."""
    result = subprocess.run(
        [sys.executable, "-m", "workers.cli", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


async def test_a_start_retried_with_its_start_request_id_creates_nothing_new(
    env: Env, fleet: InProcessFleet
) -> None:
    """After a confirm timeout the client cannot know whether its starts arrived: it runs
    the same command again, and the engine (one instance per tenant and start request
    id) creates none twice. Every id is printed, in every output format."""
    fleet.start_all(participants=())
    first = str(uuid.uuid4())
    argv = [*START, *INPUT, "--count", "12", "--start-request-id", first]
    expected = identity.start_request_ids(first, 12)
    outputs = {}
    for output in ("json", "jsonl", "text"):
        result = await custody(env, *argv, "--output", output)
        assert result.returncode == 0, result.stderr
        outputs[output] = result.stdout
    shown = json.loads(outputs["json"])
    assert shown["published"] == 12 and shown["start_request_ids"] == expected
    assert shown["instance_ids"] == [identity.instance_id("acme", s) for s in expected]
    assert [json.loads(line)["start_request_id"] for line in outputs["jsonl"].splitlines()] == (
        expected
    )
    assert all(s in outputs["text"] for s in shown["instance_ids"])

    async def committed() -> bool:
        return await env.scalar("SELECT count(*) FROM custody.instances") >= 12

    await wait_until(committed, timeout=30, what="the twelve instances")
    rows = await env.sql("SELECT id::text, start_request_id::text FROM custody.instances")
    assert sorted(rows) == sorted(zip(shown["instance_ids"], expected, strict=True))
