"""The durable happy path, end to end, across all five commit boundaries: a real worker
process is SIGKILLed at an exact crash point (``CUSTODY_CRASH_POINTS``, FAULTS.md rows
1-5, 7 and 9), a clean one takes over, and every instance still completes with every
effect exactly once, counted in the participants' own tables.

The boundaries (seed, "Commit boundaries"):

| Boundary | Durable fact |
|---|---|
| Workflow transition | Node state, history, operation/attempt and dispatch intent commit together |
| Broker confirmation | The configured broker accepted the publication under its transport policy |
| Participant acceptance | The executor retained a recoverable operation and its identity |
| Participant completion | The business effect and terminal receipt are authoritative |
| Workflow receipt application | A validated result and successor intent commit once |
"""

from __future__ import annotations

import pytest

from tests.acceptance.support import (
    STOCK,
    Crew,
    assert_clean,
    assert_durable_happy_end,
    count,
    queue_state,
    settled,
    state,
)
from tests.conftest import Env
from tests.harness import order, publish_starts
from workers.io import broker

pytestmark = pytest.mark.acceptance

N = 30
SETTLE_S = 60.0


async def _start(env: Env, n: int = N) -> None:
    await publish_starts(env.settings, [order(i) for i in range(n)])


async def _settle(env: Env, crew: Crew, n: int = N) -> None:
    try:
        await crew.wait(settled(env, n), timeout=SETTLE_S, what=f"{n} instances settled")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; state: {await state(env)}") from None


@pytest.mark.timeout(90)
async def test_workflow_transition_killed_before_commit_commits_nothing(
    env: Env, crew: Crew
) -> None:
    """Workflow transition: "Node state, history, operation/attempt and dispatch intent
    commit together". A committer SIGKILLed after writing a batch of starts but before
    COMMIT leaves none of those rows; the start requests it held go back to the queue,
    and a clean committer commits them, once (FAULTS 1)."""
    doomed = crew.start("committer", crash="before_commit")
    await _start(env)
    await crew.wait_killed(doomed)

    for table in (
        "instances",
        "node_states",
        "operations",
        "attempts",
        "outbox",
        "history",
        "successor_intents",
        "quarantine",
    ):
        assert await count(env, f"SELECT count(*) FROM custody.{table}") == 0, (
            f"custody.{table} has rows from a transaction that never committed"
        )

    for proc in crew.start_all():
        assert_clean(proc)
    await _settle(env, crew)
    await assert_durable_happy_end(env, N)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "point",
    ["after_commit_before_send", "after_publish_before_confirm", "after_confirm_before_mark"],
)
async def test_broker_confirmation_sender_killed_before_mark_republishes_same_message(
    env: Env, crew: Crew, point: str
) -> None:
    """Broker confirmation: "The configured broker accepted the publication under its
    transport policy" — and only the outbox mark, committed after that confirm, ends the
    sender's custody of a row. The committer publishes the submits it commits (each
    queued claimed by its own sender); a committer SIGKILLed after its commit but before
    the send, after publishing but before the confirm (FAULTS 2), or after the confirm
    but before the mark (FAULTS 3), leaves its claimed rows pending; after the claim
    expires the publisher worker claims them and sends them again under the same
    message id (the row id is the request id), and the participant's inbox
    deduplicates: every effect once, one inbox row per request id, no conflict. A row
    whose operation settled meanwhile (the first send did arrive) is retired. The
    publisher's own claims take the same path from the publish on
    (``OutboxPublisher.run_once``; its claim: test_claim_and_send.py)."""
    crew.start_all(skip=["committer"])

    async def inventory_consumes() -> bool:
        return (await queue_state(env, broker.command_queue("inventory.v1")))[1] == 1

    # the first copies are answered as they arrive, long before the claim expires and
    # the copies are sent again (a participant still starting could take both copies
    # in one batch, answered by the one receipt it was committing)
    await crew.wait(inventory_consumes, timeout=30, what="the inventory participant consuming")
    doomed = crew.start("committer", crash=point)
    await _start(env)
    await crew.wait_killed(doomed)

    # the rows the killed committer's sender held (its claim names its process); the
    # receipt consumer meanwhile activates and sends the successors of what did arrive
    mine = f"%-{doomed.popen.pid}-%"
    held = await env.sql(
        "SELECT id, status, publish_attempts FROM custody.outbox WHERE claimed_by LIKE %s",
        (mine,),
    )
    assert held, "the killed committer held no claimed outbox row"
    assert {(s, a) for _, s, a in held} == {("pending", 1)}, held[:5]
    starts = await env.sql(
        "SELECT b.status FROM custody.outbox b JOIN custody.operations o"
        " ON o.id = b.operation_id WHERE o.node = 'reserve'"
    )
    assert {s for (s,) in starts} == {"pending"}, "a reserve left without a committer"
    held_ids = [r[0] for r in held]

    assert_clean(crew.start("committer"))
    await _settle(env, crew)

    # sent again under the same id, unless the first send had already reached the owner
    # and its operation settled: then the row is retired, never sent a second time
    again = await env.sql(
        "SELECT b.id, b.status, b.publish_attempts, o.status::text FROM custody.outbox b"
        " JOIN custody.operations o ON o.id = b.operation_id WHERE b.id = ANY(%s)",
        (held_ids,),
    )
    assert len(again) == len(held_ids)
    not_resent = [
        r
        for r in again
        if not (r[1] == "published" and r[2] >= 2)
        and not (r[1] == "retired" and r[3] in ("succeeded", "failed"))
    ]
    assert not not_resent, f"rows the killed committer held were not sent again: {not_resent[:5]}"
    await assert_durable_happy_end(env, N)


@pytest.mark.timeout(90)
async def test_a_command_confirmed_twice_is_answered_with_its_stored_receipt(
    env: Env, crew: Crew
) -> None:
    """Idempotency and identity: "The same command identity with the same semantic input
    returns the existing receipt." A committer SIGKILLed after the broker confirmed a
    batch but before the mark (FAULTS 3) leaves its rows pending; the publisher sends
    them again, so the inventory participant receives each command of that batch twice.
    The second copy is answered with the receipt the first one stored (that receipt's
    outbox row sent a second time), and reserves nothing. The order is forced: the
    engine's receipt consumer is held back until then, so no operation settles and no
    row is retired instead of sent again, and the publisher starts only once the first
    copies' receipts were sent, so no second copy finds its answer still waiting (it is
    then answered by that one send: right, but not what this test shows)."""
    crew.start_all(skip=["committer", "publisher", "receipts"])

    async def inventory_consumes() -> bool:
        return (await queue_state(env, broker.command_queue("inventory.v1")))[1] == 1

    await crew.wait(inventory_consumes, timeout=30, what="the inventory participant consuming")
    doomed = crew.start("committer", crash="after_confirm_before_mark")
    await _start(env)
    await crew.wait_killed(doomed)

    held = [
        i
        for (i,) in await env.sql(
            "SELECT id::text FROM custody.outbox WHERE claimed_by LIKE %s AND status = 'pending'",
            (f"%-{doomed.popen.pid}-%",),
        )
    ]
    assert held, "the killed committer held no claimed outbox row"
    # the rows of the batch it published reach the participant; rows it held but had not
    # sent yet (committed by a later transaction) do not, and are sent a first time later
    arrived: dict[str, int] = {}  # command → the sends of its latest receipt, answered

    # each command's latest receipt (its terminal one), sent: how many times its row was
    latest_sends = (
        "SELECT r.request_id::text, o.publish_attempts FROM participant_inventory.outbox o"
        " JOIN (SELECT DISTINCT ON (request_id) request_id, receipt_id"
        "         FROM participant_inventory.receipts WHERE request_id = ANY(%s)"
        "        ORDER BY request_id, owner_revision DESC) r"
        "   ON r.receipt_id = o.id"
        " WHERE o.status = 'published'"
    )

    async def inbox() -> dict[str, str]:
        """The status of each held command the participant retained."""
        rows = await env.sql(
            "SELECT request_id::text, status FROM participant_inventory.inbox"
            " WHERE request_id = ANY(%s)",
            (held,),
            participant=True,
        )
        return dict(rows)

    async def first_copies_answered() -> bool:
        nonlocal arrived
        if (await queue_state(env, broker.command_queue("inventory.v1")))[0]:
            return False
        retained = await inbox()
        unsent = await count(
            env,
            "SELECT count(*) FROM participant_inventory.outbox WHERE status = 'pending'",
            participant=True,
        )
        if not retained or "accepted" in retained.values() or unsent:
            return False
        arrived = dict(await env.sql(latest_sends, (list(retained),), participant=True))
        return len(arrived) == len(retained)

    await crew.wait(first_copies_answered, timeout=30, what="the first copies answered")

    crew.start("publisher")

    async def resent() -> bool:
        return len(held) == await count(
            env,
            "SELECT count(*) FROM custody.outbox WHERE id = ANY(%s)"
            " AND status = 'published' AND publish_attempts >= 2",
            (held,),
        )

    await crew.wait(resent, timeout=30, what="the held rows sent again by the publisher")

    async def reemitted() -> bool:
        now = dict(await env.sql(latest_sends, (list(arrived),), participant=True))
        return all(now.get(r, 0) > n for r, n in arrived.items())

    await crew.wait(reemitted, timeout=30, what="every second copy answered by its stored receipt")

    async def all_answered() -> bool:
        retained = await inbox()
        return len(retained) == len(held) and "accepted" not in retained.values()

    await crew.wait(all_answered, timeout=30, what="every held command answered")
    reservations = await count(
        env,
        "SELECT count(*) FROM participant_inventory.reservations r"
        " JOIN participant_inventory.inbox i"
        " ON i.operation_id = r.operation_id WHERE i.request_id = ANY(%s)",
        (held,),
        participant=True,
    )
    assert reservations == len(held), "a command's copies reserved the stock other than once"

    crew.start("receipts")
    crew.start("committer")
    await _settle(env, crew)
    await assert_durable_happy_end(env, N)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("inline", [True, False], ids=["inline", "executor"])
async def test_participant_acceptance_killed_before_ack_returns_stored_receipt(
    env: Env, crew: Crew, inline: bool
) -> None:
    """Participant acceptance: "The executor retained a recoverable operation and its
    identity". The inventory participant SIGKILLed after its acceptance COMMIT but before
    the basic.ack: the broker redelivers the commands, the inbox recognises each identity
    and digest and returns the stored receipt, and nothing executes twice (FAULTS 4).
    Its handlers run by the executor, each retained command was journaled ``accepted``
    (revision 1) with its inbox row; run inline, with its terminal receipt (revision 2),
    effect and inbox row in that same commit, and no ``accepted`` receipt at all."""
    mode = {"CUSTODY_PARTICIPANT_INLINE": "true" if inline else "false"}
    doomed = crew.start("inventory", crash="after_commit_before_ack", env=mode)
    crew.start_all(skip=["inventory"])
    await _start(env)
    await crew.wait_killed(doomed)

    retained = await env.sql(
        "SELECT request_id, status FROM participant_inventory.inbox", participant=True
    )
    assert retained, "the acceptance of the killed participant did not commit"
    ids = [[r for r, _ in retained]]
    # the journal holds, for each retained command, the receipt its inbox row stands at
    agreeing = await count(
        env,
        "SELECT count(*) FROM participant_inventory.inbox i JOIN participant_inventory.receipts"
        " r ON r.request_id = i.request_id AND r.owner_revision = i.owner_revision"
        " WHERE i.request_id = ANY(%s)",
        ids,
        participant=True,
    )
    assert agreeing == len(retained), "each retained command has its receipt, as its inbox says"
    accepted = await count(
        env,
        "SELECT count(*) FROM participant_inventory.receipts"
        " WHERE owner_revision = 1 AND request_id = ANY(%s)",
        ids,
        participant=True,
    )
    assert accepted == (0 if inline else len(retained)), (
        "inline: no accepted receipt" if inline else "each retained command was said accepted"
    )

    assert_clean(crew.start("inventory", env=mode))
    await _settle(env, crew)
    await assert_durable_happy_end(env, N)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("inline", [True, False], ids=["inline", "executor"])
async def test_participant_completion_killed_mid_effect_rolls_back_and_executes_once(
    env: Env, crew: Crew, inline: bool
) -> None:
    """Participant completion: "The business effect and terminal receipt are
    authoritative" — they commit together or not at all. The inventory participant
    SIGKILLed inside a handler, before COMMIT: the effect rolls back with the receipt,
    and the restarted participant executes each command once (FAULTS 5). A handler run
    by the executor dies after its command's acceptance committed (the inbox holds it,
    accepted); an inline handler dies inside the acceptance transaction, which rolls
    back whole: nothing of that batch was retained, its deliveries were never acked,
    and the broker delivers them again."""
    mode = {"CUSTODY_PARTICIPANT_INLINE": "true" if inline else "false"}
    doomed = crew.start("inventory", crash="mid_effect", env=mode)
    crew.start_all(skip=["inventory"])
    await _start(env)
    await crew.wait_killed(doomed)

    inbox = await env.sql(
        "SELECT status, count(*) FROM participant_inventory.inbox GROUP BY 1", participant=True
    )
    if inline:
        assert not inbox, f"an inline acceptance committed without its effect: {inbox}"
    else:
        assert inbox, "the acceptance of the killed participant did not commit"
        assert dict(inbox).keys() == {"accepted"}, f"inventory inbox: {inbox}"
    assert (
        await count(
            env, "SELECT count(*) FROM participant_inventory.reservations", participant=True
        )
        == 0
    ), "a reservation survived its rolled-back transaction"
    assert (
        await count(
            env,
            "SELECT available FROM participant_inventory.stock WHERE sku = 'sku-1'",
            participant=True,
        )
        == STOCK
    )
    assert (
        await count(
            env,
            "SELECT count(*) FROM participant_inventory.receipts WHERE owner_revision > 1",
            participant=True,
        )
        == 0
    )

    assert_clean(crew.start("inventory", env=mode))
    await _settle(env, crew)
    await assert_durable_happy_end(env, N)


@pytest.mark.timeout(90)
async def test_participant_killed_after_the_effect_before_its_receipt_is_sent(
    env: Env, crew: Crew
) -> None:
    """A participant killed after the effect and its terminal receipt committed but
    before the receipt left its outbox: no response ever reached the engine. The
    restarted participant's outbox sends the stored receipt; nothing executes twice."""
    doomed = crew.start("inventory", crash="after_effect_before_receipt_sent")
    crew.start_all(skip=["inventory"])
    await _start(env)
    await crew.wait_killed(doomed)

    completed = await count(
        env,
        "SELECT count(*) FROM participant_inventory.inbox WHERE status = 'succeeded'",
        participant=True,
    )
    assert completed > 0, "the effect and its receipt committed before the kill"
    unsent = await count(
        env,
        "SELECT count(*) FROM participant_inventory.outbox WHERE status = 'pending'",
        participant=True,
    )
    assert unsent >= completed, "their terminal receipts had not been sent"
    assert (
        await count(env, "SELECT count(*) FROM custody.operations WHERE status = 'succeeded'") == 0
    ), "so the engine has no outcome for them"

    assert_clean(crew.start("inventory"))
    await _settle(env, crew)
    await assert_durable_happy_end(env, N)


@pytest.mark.timeout(90)
async def test_workflow_receipt_application_killed_before_ack_applies_once(
    env: Env, crew: Crew
) -> None:
    """Workflow receipt application: "A validated result and successor intent commit
    once". The receipt consumer SIGKILLed after committing a batch but before acking it:
    the redelivered receipts are no-ops, so every operation applied each owner revision
    once and has exactly one operation.succeeded event (FAULTS 7)."""
    doomed = crew.start("receipts", crash="receipts_after_commit_before_ack")
    crew.start_all(skip=["receipts"])
    await _start(env)
    await crew.wait_killed(doomed)

    applied = await env.sql(
        "SELECT receipt_id, operation_id, owner_revision FROM custody.receipt_inbox"
        " WHERE decision = 'apply'"
    )
    assert applied, "the killed receipt consumer committed nothing"
    events = await count(
        env,
        "SELECT count(*) FROM custody.history"
        " WHERE actor = 'receipts' AND event LIKE 'operation.%%'",
    )
    assert events == len(applied)

    assert_clean(crew.start("receipts"))
    await _settle(env, crew)
    await assert_durable_happy_end(env, N)
    still = await count(
        env,
        "SELECT count(*) FROM custody.receipt_inbox WHERE receipt_id = ANY(%s)"
        " AND decision = 'apply'",
        ([r[0] for r in applied],),
    )
    assert still == len(applied)


@pytest.mark.timeout(120)
async def test_receipt_application_killed_between_result_and_successor_commits_neither(
    env: Env, crew: Crew
) -> None:
    """The seed: "Successful application records the result and next-step intent
    atomically." The receipt consumer is SIGKILLed inside its transaction after writing
    a terminal result and before writing the successor intent it causes: neither
    exists afterwards (one transaction, rolled back whole); the redelivered receipts
    then apply both, once."""
    doomed = crew.start("receipts", crash="receipts_between_result_and_successor")
    crew.start_all(skip=["receipts"])
    await _start(env)
    await crew.wait_killed(doomed)

    assert (
        await count(env, "SELECT count(*) FROM custody.operations WHERE status = 'succeeded'") == 0
    )
    assert await count(env, "SELECT count(*) FROM custody.successor_intents") == 0
    assert (
        await count(
            env,
            "SELECT count(*) FROM custody.receipt_inbox WHERE status = 'succeeded'",
        )
        == 0
    ), "no terminal receipt recorded as applied without its successor"

    assert_clean(crew.start("receipts"))
    await _settle(env, crew)
    await assert_durable_happy_end(env, N)
    dupes = await env.sql(
        "SELECT from_operation_id FROM custody.successor_intents GROUP BY 1 HAVING count(*) > 1"
    )
    assert dupes == []
