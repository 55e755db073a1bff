"""Operator commands by filter (issue 13): ``reconcile``, ``retry-safe``, ``cancel`` and
``dispatch pause`` over every operation or instance a filter matches, as Temporal's
batch operations do: ``--dry-run`` counts and samples and changes nothing, ``--yes``
acts on exactly the filtered set through the per-operation commands (their
authorization, lifecycle checks and audit rows), one audit row for the batch, and
the filter runs as the operator's login, so a tenant-scoped operator's batch never
includes another tenant's rows."""

from __future__ import annotations

import uuid

import psycopg
import pytest

from tests.conftest import Env
from tests.harness import seed_unknown_operation
from tests.integration.test_recovery import custody


def _seed(
    env: Env, tenant: str, n: int, *, route: str = "inventory", age_h: float = 0
) -> list[str]:
    """``n`` suspended instances of ``tenant``, each with one outcome_unknown operation on
    ``route`` last changed ``age_h`` hours ago; their operation ids."""
    with psycopg.connect(env.settings.database_url, autocommit=True) as conn:
        return [seed_unknown_operation(conn, tenant, route=route, age_h=age_h)[1] for _ in range(n)]


async def _statuses(env: Env) -> dict[str, str]:
    rows = await env.sql("SELECT id::text, status::text FROM custody.operations")
    return {str(i): str(s) for i, s in rows}


FILTER = ["--status", "outcome_unknown", "--route", "inventory", "--since", "2h"]


async def test_a_dry_run_counts_and_samples_and_changes_nothing(env: Env) -> None:
    wanted = _seed(env, "acme", 7)
    _seed(env, "acme", 2, route="payments")  # another route
    _seed(env, "acme", 2, age_h=3)  # older than --since
    before = await _statuses(env)
    result = await custody(env, "reconcile", *FILTER, "--reason", "inventory outage", "--dry-run")
    assert result.returncode == 0, result.stderr
    first, header, *sample = result.stdout.splitlines()  # the sample: a table
    assert "would act on 7 of 7 operation(s)" in first
    assert "status=outcome_unknown route=inventory since=2h" in first
    assert header.split()[0] == "id"
    assert len(sample) == 5 and all(line.split()[0] in wanted for line in sample)
    assert await _statuses(env) == before
    assert await env.scalar("SELECT count(*) FROM custody.audit") == 0
    assert await env.scalar("SELECT count(*) FROM custody.outbox") == 0


async def test_yes_acts_on_exactly_the_filtered_set_with_an_audit_row_each_and_one_for_the_batch(
    env: Env,
) -> None:
    wanted = _seed(env, "acme", 4) + _seed(env, "globex", 3)
    others = _seed(env, "acme", 2, route="payments") + _seed(env, "acme", 2, age_h=3)
    result = await custody(env, "reconcile", *FILTER, "--reason", "inventory outage", "--yes")
    assert result.returncode == 0, result.stderr
    assert "batch reconcile: 7 selected, 7 done, 0 refused, 0 not found" in result.stdout
    assert result.stderr.count("[") == 7 and "[7/7] done" in result.stderr  # progress
    after = await _statuses(env)
    assert {o for o, s in after.items() if s == "reconcile_pending"} == set(wanted)
    assert {after[o] for o in others} == {"outcome_unknown"}
    rows = await env.sql(
        "SELECT actor, action, target, outcome, inputs FROM custody.audit ORDER BY id"
    )
    assert sorted(str(r[2]) for r in rows[:-1]) == sorted(wanted)
    assert {(r[0], r[1], r[3]) for r in rows[:-1]} == {("oncall", "reconcile", "done")}
    actor, action, target, outcome, inputs = rows[-1]
    assert (actor, action, target, outcome) == ("oncall", "reconcile", "batch", "done")
    assert inputs["filter"] == {
        "status": "outcome_unknown",
        "route": "inventory",
        "since": "2h",
        "limit": 1000,
    }
    assert (inputs["selected"], inputs["done"], inputs["refused"]) == (7, 7, 0)


async def test_a_tenant_scoped_operators_batch_never_includes_another_tenants_operations(
    env: Env,
) -> None:
    acme = _seed(env, "acme", 3)
    globex = _seed(env, "globex", 4)
    dry = await custody(
        env, "reconcile", *FILTER, "--reason", "ticket 4711", "--dry-run", actor="acme-support"
    )
    assert dry.returncode == 0, dry.stderr
    assert "would act on 3 of 3" in dry.stdout
    assert not any(g in dry.stdout for g in globex)
    done = await custody(
        env, "reconcile", *FILTER, "--reason", "ticket 4711", "--yes", actor="acme-support"
    )
    assert done.returncode == 0, done.stderr
    after = await _statuses(env)
    assert {after[o] for o in acme} == {"reconcile_pending"}
    assert {after[o] for o in globex} == {"outcome_unknown"}
    targets = await env.sql("SELECT target, tenant FROM custody.audit ORDER BY id")
    assert sorted(str(t) for t, _ in targets[:-1]) == sorted(acme)
    assert targets[-1] == ("batch", "acme")  # the batch row: visible to its tenant


async def test_refusals_do_not_stop_the_batch_and_exit_3(env: Env) -> None:
    """acme-support may reconcile but not retry-safe; an operation already reconciled
    is refused by the lifecycle; the others are done."""
    ids = _seed(env, "acme", 3)
    assert (await custody(env, "reconcile", ids[0], "--reason", "asked by hand")).returncode == 0
    result = await custody(env, "reconcile", "--tenant", "acme", "--reason", "second wave", "--yes")
    assert result.returncode == 3
    assert "3 selected, 2 done, 1 refused" in result.stdout
    [inputs] = [
        r[0] for r in await env.sql("SELECT inputs FROM custody.audit WHERE target = 'batch'")
    ]
    assert (inputs["done"], inputs["refused"]) == (2, 1)
    refused = await custody(
        env,
        "retry-safe",
        "--tenant",
        "acme",
        "--reason",
        "not allowed",
        "--yes",
        actor="acme-support",
    )
    assert refused.returncode == 3 and "may not retry-safe" in refused.stderr
    assert (
        await env.scalar(
            "SELECT outcome FROM custody.audit WHERE target = 'batch' ORDER BY id DESC LIMIT 1"
        )
        == "refused"
    )


async def test_cancel_and_dispatch_pause_by_instance_filter(env: Env) -> None:
    _seed(env, "acme", 2)
    _seed(env, "globex", 2)
    pause = await custody(
        env, "dispatch", "pause", "--tenant", "acme", "--reason", "acme incident", "--yes"
    )
    assert pause.returncode == 0, pause.stderr
    paused = await env.sql("SELECT tenant, dispatch_paused FROM custody.instances")
    assert sorted(paused) == [("acme", True), ("acme", True), ("globex", False), ("globex", False)]
    assert await env.scalar("SELECT dispatch_paused FROM custody.control") is False
    cancel = await custody(
        env,
        "cancel",
        "--status",
        "suspended",
        "--tenant",
        "globex",
        "--reason",
        "customer left",
        "--yes",
    )
    assert cancel.returncode == 0, cancel.stderr
    rows = await env.sql("SELECT tenant, status::text FROM custody.instances ORDER BY tenant")
    assert [s for t, s in rows if t == "globex"] == ["cancelling", "cancelling"]
    assert [s for t, s in rows if t == "acme"] == ["suspended", "suspended"]
    actions = await env.sql(
        "SELECT action, count(*) FROM custody.audit WHERE target = 'batch' GROUP BY 1"
    )
    assert sorted(actions) == [("cancel", 1), ("pause", 1)]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["reconcile", *FILTER, "--reason", "no confirmation"], "needs --dry-run"),
        (["reconcile", "--reason", "nothing chosen", "--yes"], "needs a filter"),
        (["reconcile", "--status", "nosuch", "--reason", "bad status", "--yes"], "--status"),
        (["reconcile", "--since", "2 weeks", "--reason", "bad since", "--yes"], "--since"),
        (
            ["cancel", "--tenant", "acme", "--limit", "0", "--reason", "bad limit", "--yes"],
            "--limit",
        ),
        (
            ["retry-safe", str(uuid.uuid4()), "--tenant", "acme", "--reason", "both", "--yes"],
            "an id or a filter",
        ),
    ],
    ids=["no-yes", "no-filter", "bad-status", "bad-since", "bad-limit", "id-and-filter"],
)
async def test_a_batch_without_yes_or_with_bad_input_is_refused_in_one_line(
    env: Env, args: list[str], says: str
) -> None:
    ids = _seed(env, "acme", 2)
    result = await custody(env, *args)
    assert result.returncode == 2, result
    assert len(result.stderr.strip().splitlines()) == 1 and says in result.stderr
    assert "Traceback" not in result.stderr
    assert set((await _statuses(env)).values()) == {"outcome_unknown"}
    assert len(ids) == 2 and await env.scalar("SELECT count(*) FROM custody.audit") == 0
