"""``custody workers list`` (the fleet from its leases, with each holder's last
heartbeat) and ``custody quarantine stats --by …`` (issue 13), against a running
in-process fleet."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime

import psycopg
import pytest

from tests.conftest import Env, wait_until
from tests.harness import ENGINE, InProcessFleet, client, order, publish_starts
from tests.integration.test_recovery import custody
from workers.io import broker, db
from workers.settings import ROOT


async def test_workers_list_shows_every_lease_holder_with_its_last_heartbeat(
    env: Env, fleet: InProcessFleet
) -> None:
    fleet.start_all(participants=())

    async def renewed() -> bool:
        return await env.scalar(
            "SELECT count(*) FROM custody.leases WHERE renewed_at IS NOT NULL"
        ) == len(ENGINE)

    await wait_until(renewed, timeout=30, what="every engine worker's lease renewed")
    result = await custody(env, "workers", "list", "--json", actor="auditor")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert sorted(r["worker"] for r in rows) == sorted(ENGINE)
    for r in rows:
        assert r["live"] is True and r["epoch"] >= 1 and r["holder"]
        acquired, beat, expires = (
            datetime.fromisoformat(r[k]) for k in ("acquired_at", "last_heartbeat", "expires_at")
        )
        assert acquired < beat < expires  # a renewal after the acquisition
    text = await custody(env, "workers", "list", actor="auditor")
    assert text.returncode == 0, text.stderr
    header, *lines = text.stdout.splitlines()  # a table for people: a header, a row each
    live = header.split().index("live")
    assert sum(line.split()[live] == "True" for line in lines) == len(ENGINE)


async def test_the_renewed_at_column_is_added_to_an_existing_leases_table(env: Env) -> None:
    """A database of an earlier release gets the heartbeat column from the migration."""
    await env.sql("ALTER TABLE custody.leases DROP COLUMN renewed_at")
    await db.apply_script(env.settings.database_url, ROOT / "migrations" / "0001_baseline.sql")
    assert (
        await env.scalar(
            "SELECT count(*) FROM information_schema.columns"
            " WHERE table_schema = 'custody' AND table_name = 'leases'"
            " AND column_name = 'renewed_at'"
        )
        == 1
    )


def _quarantine(env: Env, rows: Sequence[tuple[str, str | None]]) -> None:
    with psycopg.connect(env.settings.database_url, autocommit=True) as conn:
        for reason, tenant in rows:
            conn.execute(
                "INSERT INTO custody.quarantine (source, reason, detail, tenant, body, worker)"
                " VALUES ('custody.receipts', %s, 'x', %s, '', 'receipts')",
                (reason, tenant),
            )


async def test_quarantine_stats_counts_by_the_chosen_columns_within_the_operators_tenants(
    env: Env, fleet: InProcessFleet
) -> None:
    fleet.start_all(participants=())
    await publish_starts(env.settings, [order(1)])
    async with client(env.settings) as amqp:  # a start request that is not JSON
        assert await broker.publish_raw(
            amqp, broker.EXCHANGE_REQUESTS, broker.START_KEY, b"{not json", message_id="bad-1"
        )

    async def quarantined() -> bool:
        return await env.scalar("SELECT count(*) FROM custody.quarantine") == 1

    await wait_until(quarantined, timeout=30, what="the bad start request quarantined")
    [real] = await env.sql("SELECT reason FROM custody.quarantine")
    _quarantine(env, [("wrong_tenant", "acme")] * 3 + [("wrong_tenant", "globex")] * 2)
    _quarantine(env, [("bad_digest", "acme")])

    result = await custody(env, "quarantine", "stats", "--by", "reason,tenant", "--json")
    assert result.returncode == 0, result.stderr
    counts = {(r["reason"], r["tenant"]): r["n"] for r in json.loads(result.stdout)}
    assert counts == {
        ("wrong_tenant", "acme"): 3,
        ("wrong_tenant", "globex"): 2,
        ("bad_digest", "acme"): 1,
        (real[0], None): 1,
    }
    by_reason = await custody(env, "quarantine", "stats", "--by", "reason", "--json")
    assert {r["reason"]: r["n"] for r in json.loads(by_reason.stdout)}["wrong_tenant"] == 5
    scoped = await custody(
        env, "quarantine", "stats", "--by", "tenant", "--json", actor="acme-support"
    )
    assert scoped.returncode == 0, scoped.stderr
    assert [(r["tenant"], r["n"]) for r in json.loads(scoped.stdout)] == [("acme", 4)]
    participant = await custody(
        env, "quarantine", "stats", "--participant", "inventory", "--by", "reason", "--json"
    )
    assert participant.returncode == 0 and json.loads(participant.stdout) == []


@pytest.mark.parametrize(
    "args",
    [
        ["--by", "reason,colour"],
        ["--by", ""],
        ["--participant", "nosuch"],
        ["--participant", "inventory", "--by", "tenant"],
    ],
    ids=["unknown-column", "empty", "unknown-participant", "participant-tenant"],
)
async def test_quarantine_stats_refuses_bad_input_in_one_line(env: Env, args: list[str]) -> None:
    result = await custody(env, "quarantine", "stats", *args)
    assert result.returncode == 2, result
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
