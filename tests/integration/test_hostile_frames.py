"""Frame-level hostility: messages whose AMQP properties pamqp cannot decode (invalid
UTF-8 in short strings and header names, timestamps out of range, ...), and consumer
connections killed under load. No message may stop a consumer or cost a legitimate
message its delivery budget; an undecodable message is isolated with its raw body and
the reason ``undecodable_properties``; only a message that fails on its own is
dead-lettered."""

from __future__ import annotations

import asyncio
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from prometheus_client import REGISTRY

from tests.acceptance.support import assert_effects_once
from tests.amqp_raw import F as Field
from tests.amqp_raw import Hostile, RawPublisher, properties, table
from tests.conftest import Env, wait_until
from tests.harness import InProcessFleet, drain, order, publish_starts
from workers import errors
from workers.io import broker
from workers.runtime import faults

UNDECODABLE = broker.UNDECODABLE


def _q(value: str) -> str:
    return urllib.parse.quote(value, safe="")


def _metric(name: str, **labels: str) -> float:
    return sum(
        s.value
        for m in REGISTRY.collect()
        for s in m.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def _custody_connections(env: Env) -> dict[str, str]:
    """The fleet's live connections in this test's vhost: broker-side name → client
    name (a reconnect is a new broker-side name)."""
    rows = await broker.management(
        env.settings.amqp_management_url,
        "GET",
        f"/api/vhosts/{_q(env.vhost)}/connections?columns=name,client_properties",
    )
    out = {}
    for r in rows or []:
        client = str((r.get("client_properties") or {}).get("connection_name", ""))
        if client.startswith("custody-") and client not in ("custody-test-client", "custody-drain"):
            out[r["name"]] = client
    return out


async def _consumers(env: Env) -> dict[str, int]:
    rows = await broker.management(
        env.settings.amqp_management_url,
        "GET",
        f"/api/queues/{_q(env.vhost)}?columns=name,consumers",
    )
    return {r["name"]: int(r.get("consumers") or 0) for r in rows or []}


def _start_body() -> bytes:
    return broker.start_request(
        tenant="acme", process="order-fulfilment", input=order(999), requested_by="hostile"
    ).body


def _five_hostile() -> list[Hostile]:
    """The issue's five: a valid start request whose message_id is not UTF-8 (so it
    must not start anything), receipts with a bad correlation_id and a bad header name,
    commands with a bad type and a bad message_id."""
    bad = b"\xff\xfe\xc3("
    return [
        Hostile(
            broker.EXCHANGE_REQUESTS,
            broker.START_KEY.encode(),
            _start_body(),
            *properties(
                message_id=bad + uuid.uuid4().hex.encode(), content_type=b"application/json"
            ),
            kind="requests:message_id",
        ),
        Hostile(
            broker.EXCHANGE_RECEIPTS,
            broker.RECEIPTS_KEY.encode(),
            b'{"type": "custody.receipt"}',
            *properties(correlation_id=bad, message_id=uuid.uuid4().hex.encode()),
            kind="receipts:correlation_id",
        ),
        Hostile(
            broker.EXCHANGE_COMMANDS,
            b"inventory.v1",
            b'{"type": "custody.submit"}',
            *properties(message_type=bad, message_id=uuid.uuid4().hex.encode()),
            kind="commands:type",
        ),
        Hostile(
            broker.EXCHANGE_RECEIPTS,
            broker.RECEIPTS_KEY.encode(),
            b"raw \x00 bytes \xff kept",
            *properties(
                headers=table([(b"ok", Field.longstr(b"v")), (bad + b"-name", Field.i32(1))]),
                message_id=uuid.uuid4().hex.encode(),
            ),
            kind="receipts:header_name",
        ),
        Hostile(
            broker.EXCHANGE_COMMANDS,
            b"payments.v1",
            b"{}",
            *properties(message_id=bad),
            kind="commands:message_id",
        ),
    ]


@pytest.fixture
async def fleet(env: Env) -> AsyncIterator[InProcessFleet]:
    f = InProcessFleet(env)
    f.start_all()
    yield f
    await f.stop_all()


async def _state(env: Env, n: int) -> dict[str, Any]:
    depths = await broker.queue_depths(env.settings.amqp_management_url, env.vhost)
    return {
        "completed": await env.scalar(
            "SELECT count(*) FROM custody.instances WHERE status = 'completed'"
        ),
        "instances": await env.scalar("SELECT count(*) FROM custody.instances"),
        "expected": n,
        "dead_letters": depths.get(broker.QUEUE_DEAD, 0),
        "quarantined": dict(
            await env.sql("SELECT reason, count(*) FROM custody.quarantine GROUP BY 1")
        ),
    }


async def test_undecodable_properties_are_quarantined_while_every_consumer_stays_connected(
    env: Env, fleet: InProcessFleet
) -> None:
    """The issue's run: five hostile messages interleaved with 48 real start requests.
    Before the fix each one closed its consumer's connection (InvalidFrameError), the
    prefetched deliveries were requeued, and legitimate ones were dead-lettered by the
    delivery limit while the hostile ones were never quarantined."""
    undecodable_before = _metric("custody_undecodable_deliveries_total")
    await publish_starts(env.settings, [order(i) for i in range(2)])
    await wait_until(
        lambda: _all_completed(env, 2), timeout=60, what="the fleet to be up and working"
    )

    async def all_connected() -> bool:
        c = await _consumers(env)
        return all(
            c.get(q, 0) >= 1
            for q in (broker.QUEUE_RECEIPTS, broker.QUEUE_REQUESTS, "custody.commands.inventory.v1")
        )

    await wait_until(all_connected, timeout=30, what="every consumer listed")

    async def all_listed() -> bool:
        # the management API lists a connection once its first statistics arrive, which
        # can trail its consumers' (CI saw an empty list right after them)
        return len(set((await _custody_connections(env)).values())) >= 7

    await wait_until(all_listed, timeout=30, what="every worker's connection listed")
    connections_before = await _custody_connections(env)
    # 4 engine workers, 3 participants
    assert len(set(connections_before.values())) >= 7, connections_before
    hostile = _five_hostile()
    n = 48
    async with RawPublisher(env.settings.amqp_url) as raw:
        for i, h in enumerate(hostile):
            await publish_starts(env.settings, [order(100 + 10 * i + k) for k in range(8)])
            assert await raw.publish([h], window=1) == ["ack"], h.meta
        await publish_starts(env.settings, [order(200 + k) for k in range(8)])
    total = n + 2

    async def settled() -> bool:
        s = await _state(env, total)
        return s["completed"] >= total and s["quarantined"].get(UNDECODABLE, 0) >= 3

    try:
        await wait_until(settled, timeout=60, what="real work done, the hostile quarantined")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {await _state(env, total)}") from None
    fleet.check_alive()

    # the consumers never lost their connections
    assert await _custody_connections(env) == connections_before
    state = await _state(env, total)
    assert state["dead_letters"] == 0, state
    assert state["instances"] == total, "the start with an undecodable message_id started nothing"

    rows = await env.sql(
        "SELECT source, message_id, body, detail FROM custody.quarantine WHERE reason = %s"
        " ORDER BY id",
        (UNDECODABLE,),
    )
    by_body = {bytes(r[2]): r for r in rows}
    engine = [h for h in hostile if not h.kind.startswith("commands")]
    assert len(rows) == len(engine)
    for h in engine:
        source, _, _, detail = by_body[h.body]  # raw body kept, byte for byte
        assert source == (
            broker.QUEUE_REQUESTS if h.kind.startswith("requests") else broker.QUEUE_RECEIPTS
        )
        field = h.kind.split(":")[1].replace("type", "message_type").replace("header_name", "key")
        assert field in detail and "not UTF-8" in detail, detail
    assert by_body[hostile[0].body][1].startswith("\\xff\\xfe"), "message_id kept, escaped"

    for h, owner in ((hostile[2], "inventory"), (hostile[4], "payments")):
        refused = await env.sql(
            f"SELECT reason, body FROM participant_{owner}.refused", participant=True
        )
        assert [(r[0], bytes(r[1])) for r in refused] == [(UNDECODABLE, h.body)]
    assert _metric("custody_undecodable_deliveries_total") - undecodable_before == len(hostile)
    await assert_effects_once(env, total)


async def _all_completed(env: Env, n: int) -> bool:
    done = await env.scalar("SELECT count(*) FROM custody.instances WHERE status = 'completed'")
    return bool(done >= n)


@pytest.fixture
def slow_units() -> Iterator[None]:
    """Units of work that take longer than the broker takes to list a new connection
    (its statistics interval, 5 s): every kill then finds the same deliveries
    prefetched and unacked, as under real load, and each kill counts against them."""

    async def slow() -> None:
        await asyncio.sleep(SLOW_UNIT_S)

    for point in ("starts_locked", "receipts_locked"):
        faults.set_hook(point, slow)
    yield
    for point in ("starts_locked", "receipts_locked"):
        faults.set_hook(point, None)


SLOW_UNIT_S = 6.0


@pytest.mark.timeout(300)
async def test_consumer_connections_killed_repeatedly_under_load_dead_letter_nothing(
    env: Env, fleet: InProcessFleet, slow_units: None
) -> None:
    """Every custody connection is closed by the broker (management API) again and
    again while real work runs, more times than the old delivery limit (5): each close
    requeues every prefetched delivery and RabbitMQ 3.10 counts it. Nothing legitimate
    may reach the dead-letter queue; every instance completes; effects happen once."""
    n = 300
    await publish_starts(env.settings, [order(i) for i in range(n)])
    kills, rounds = 0, 9
    started = time.monotonic()
    for _ in range(rounds):
        # wait for the fleet to be back (a robust connection reconnects), then kill it
        async def back() -> bool:
            return len(set((await _custody_connections(env)).values())) >= 7

        await wait_until(back, timeout=30, interval=0.05, what="the fleet reconnected")
        for name in await _custody_connections(env):
            try:
                await broker.management(
                    env.settings.amqp_management_url, "DELETE", f"/api/connections/{_q(name)}"
                )
                kills += 1
            except errors.BrokerError:
                pass  # already gone
    faults.set_hook("starts_locked", None)
    faults.set_hook("receipts_locked", None)
    try:
        await wait_until(
            lambda: _all_completed(env, n), timeout=120, what="every instance completed"
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {await _state(env, n)}") from None
    assert kills >= rounds * 7, kills
    redelivered = _metric("custody_redeliveries_total")
    assert redelivered > 0
    fleet.check_alive()
    state = await _state(env, n)
    assert state["dead_letters"] == 0, state
    assert state["instances"] == n
    assert state["quarantined"] == {}, state
    await assert_effects_once(env, n)
    assert time.monotonic() - started < 200


PARTICIPANT_NAMES = ("inventory", "payments", "shipping")


async def test_broker_permissions_are_what_each_worker_does(env: Env) -> None:
    """Every user's configure/write/read in the vhost is exactly broker.permissions;
    a participant cannot publish to custody.dead, nor read another's queue, yet
    publishes receipts."""
    principals = {f"custody-{p}": f"{p}.v1" for p in PARTICIPANT_NAMES}
    expected = broker.permissions(principals)
    rows = await broker.management(
        env.settings.amqp_management_url, "GET", f"/api/vhosts/{_q(env.vhost)}/permissions"
    )
    actual = {
        r["user"]: (r["configure"], r["write"], r["read"])
        for r in rows
        if r["user"].startswith("custody-") and r["user"] in expected
    }
    assert actual == {u: p for u, p in expected.items() if u in actual}
    # every worker's user is there (none was left out of the comparison)
    assert {f"custody-{w}" for w in broker.ENGINE_USERS} | set(principals) <= set(actual)
    for user, (configure, write, _) in expected.items():
        assert configure == "^$", user
        if user in principals:
            assert "dead" not in write, user

    url = env.participant_amqp("inventory")
    message = Hostile(broker.EXCHANGE_DEAD, b"poison.inventory", b"{}", *properties())
    receipt = Hostile(broker.EXCHANGE_RECEIPTS, b"receipts", b"{}", *properties())
    async with RawPublisher(url) as raw:
        assert await raw.publish([message], window=1) == ["refused"]
        assert "ACCESS_REFUSED" in message.meta["refusal"]
    async with RawPublisher(url) as raw:
        # user_id absent: the receipt is the engine's to quarantine; the write is allowed
        assert await raw.publish([receipt], window=1) == ["ack"]
    amqp = broker.Broker(url, "perm-check")
    await amqp.connect()
    try:
        with pytest.raises(errors.BrokerError, match=r"ACCESS_REFUSED|access"):
            async with amqp.consume(["custody.commands.payments.v1"], 1):
                pass
    finally:
        await amqp.close()


async def test_a_participants_poison_command_is_dead_lettered_by_the_queue_policy(
    env: Env, fleet: InProcessFleet, poison_marker: str
) -> None:
    """Without write access to custody.dead, a participant rejects the command that
    fails on its own; the queue's DLX dead-letters it (x-death reason rejected), the
    participant goes on, and the rest of the work completes."""
    await publish_starts(env.settings, [order(i) for i in range(3)])
    await wait_until(lambda: _all_completed(env, 3), timeout=60, what="the fleet up")
    body = b'{"marker": "' + poison_marker.encode() + b'"}'
    async with RawPublisher(env.settings.amqp_url) as raw:
        poison = Hostile(broker.EXCHANGE_COMMANDS, b"inventory.v1", body, *properties())
        assert await raw.publish([poison], window=1) == ["ack"]
    await publish_starts(env.settings, [order(10 + i) for i in range(5)])
    await wait_until(lambda: _all_completed(env, 8), timeout=60, what="the rest completed")

    async def dead_lettered() -> bool:
        depths = await broker.queue_depths(env.settings.amqp_management_url, env.vhost)
        return depths.get(broker.QUEUE_DEAD, 0) >= 1

    await wait_until(dead_lettered, timeout=30, what="the poison command dead-lettered")
    [dead] = await drain(env.settings, broker.QUEUE_DEAD, timeout=1.0)
    assert dead.body == body
    death = dead.headers["x-death"][0]
    assert death["reason"] == "rejected" and death["queue"] == "custody.commands.inventory.v1"
    fleet.check_alive()


# The corpus: frame-level hostility into every queue custody consumes ------------------

_SHORT_PROPS = (
    "content_type",
    "content_encoding",
    "correlation_id",
    "reply_to",
    "message_id",
    "message_type",
    "app_id",
    "cluster_id",  # deprecated, yet a short string the broker passes through
)
_BAD_UTF8 = (b"\xff", b"\xc3(", b"\xe2\x82", b"\xf0\x28\x8c\xbc", b"\xed\xa0\x80", b"\x80abc")
_GARBAGE = (b"", b"{", b"\x1f\x8b\x08\x00garbage", b"\xff\xfe", b"null", b'{"type": 1}')


def _every_field_type() -> bytes:
    return table(
        [
            (b"S", Field.longstr(b"\xff binary long string")),
            (b"t", Field.boolean(True)),
            (b"b", Field.i8(-128)),
            (b"B", Field.u8(255)),
            (b"s", Field.i16(-32768)),
            (b"u", Field.u16(65535)),
            (b"I", Field.i32(-(2**31))),
            (b"i", Field.u32(2**32 - 1)),
            (b"l", Field.i64(2**63 - 1)),
            (b"f", Field.f32(3.5)),
            (b"d", Field.f64(-1e308)),
            (b"D", Field.dec(255, 2**31 - 1)),
            (b"T", Field.timestamp(0)),
            (b"x", Field.binary(b"\x00" * 64)),
            (b"V", Field.void()),
            (b"F", Field.table([(b"a", Field.array([Field.void(), Field.boolean(False)]))])),
            (b"A", Field.array([Field.table([]), Field.array([])])),
        ]
    )


def _hostile_kind(i: int, rnd: Any) -> tuple[str, int, bytes, bool]:
    """(kind, flags, property bytes, undecodable?) for the i-th corpus message."""
    bad = _BAD_UTF8[i % len(_BAD_UTF8)] + str(i).encode()
    k = i % 10
    if k <= 2:  # invalid UTF-8 in one short-string property
        name = _SHORT_PROPS[(i // 10) % len(_SHORT_PROPS)]
        return f"utf8:{name}", *properties(**{name: bad}), True
    if k == 3:  # invalid UTF-8 in a header key, among valid ones
        entries = [(b"traceparent", Field.longstr(b"00-x")), (bad, Field.u8(1))]
        return "utf8:header_key", *properties(headers=table(entries)), True
    if k == 4:  # absurd timestamps: the property, or a header value
        if i % 20 == 4:
            return "timestamp:property", *properties(timestamp=2**64 - 1 - i), True
        entries = [(b"when", Field.timestamp(2**63 + i))]
        return "timestamp:header", *properties(headers=table(entries)), True
    if k == 5:  # every field type a header may have (decodable: the body is the problem)
        return "fields:all", *properties(headers=_every_field_type()), False
    if k == 6:  # gzip claimed, garbage sent
        return (
            "gzip",
            *properties(content_encoding=b"gzip", content_type=b"application/json"),
            False,
        )
    if k == 7:  # an oversized header table (a fifth of it with an invalid key)
        n = 2000 + rnd.randrange(2000)
        entries = [(b"h%05d" % j, Field.void()) for j in range(n)]
        undecodable = i % 5 == 0
        if undecodable:
            entries.append((bad, Field.void()))
        return "headers:oversized", *properties(headers=table(entries)), undecodable
    if k == 8:  # nested deeper than the decoder goes
        value = Field.u8(1)
        for _ in range(40 + i % 20):
            value = Field.array([value])
        return "headers:deep", *properties(headers=table([(b"deep", value)])), True
    # several bad short strings at once, plus a bad header key
    return (
        "utf8:many",
        *properties(
            message_id=bad,
            correlation_id=bad,
            message_type=bad,
            headers=table([(bad, Field.void())]),
        ),
        True,
    )


# what RabbitMQ 3.10 itself refuses: a channel error, or (an unknown field type, a NaN)
# a crash of the channel process that closes the connection
_REFUSED = (
    properties(delivery_mode=3),
    properties(expiration=b"soon"),
    properties(user_id=b"someone-else"),
    properties(delivery_mode=0xFF, headers=table([(b"k", Field.u8(1))])),
)
_CRASHING = (
    properties(headers=table([(b"k", b"Zjunk")])),
    properties(headers=table([(b"k", Field.f64(float("nan")))])),
)

CORPUS = 10_000
QUEUES = {
    broker.QUEUE_REQUESTS: (broker.EXCHANGE_REQUESTS, broker.START_KEY.encode()),
    broker.QUEUE_RECEIPTS: (broker.EXCHANGE_RECEIPTS, broker.RECEIPTS_KEY.encode()),
    **{
        broker.command_queue(f"{p}.v1"): (broker.EXCHANGE_COMMANDS, f"{p}.v1".encode())
        for p in PARTICIPANT_NAMES
    },
}


def _corpus(seed: int) -> list[Hostile]:
    import random

    rnd = random.Random(seed)
    out = []
    queues = list(QUEUES)
    for i in range(CORPUS):
        queue = queues[i % len(queues)]
        exchange, key = QUEUES[queue]
        kind, flags, props, undecodable = _hostile_kind(i, rnd)
        if undecodable and queue == broker.QUEUE_REQUESTS and i % 3 == 0:
            body = _start_body()  # a valid start: it must not start anything
        else:
            body = _GARBAGE[i % len(_GARBAGE)] + rnd.randbytes(i % 64)
        if i % 97 == 0 and undecodable:  # routed by CC, with a routing key that is not UTF-8
            cc = table([(b"CC", Field.array([Field.longstr(key)]))])
            flags, props = properties(headers=cc, message_id=b"cc\xff")
            key = b"\xff\xfe" + str(i).encode()
            kind = "utf8:routing_key"
        out.append(
            Hostile(exchange, key, body, flags, props, kind, {"queue": queue, "bad": undecodable})
        )
    return out


@pytest.mark.timeout(240)
async def test_ten_thousand_hostile_frames_into_every_queue_while_real_work_completes(
    env: Env, fleet: InProcessFleet
) -> None:
    """Accounting: hostile sent = quarantined + dead-lettered with a reason + refused
    (by a participant, or by the broker at publish); every legitimate instance
    completes with each effect once and nothing dead-lettered; every worker alive."""
    undecodable_before = _metric("custody_undecodable_deliveries_total")
    await publish_starts(env.settings, [order(i) for i in range(2)])
    await wait_until(lambda: _all_completed(env, 2), timeout=60, what="the fleet up")

    async def listed() -> bool:  # 4 engine workers, 3 participants
        return len(set((await _custody_connections(env)).values())) >= 7

    await wait_until(listed, timeout=30, what="every worker's connection listed")
    connections_before = await _custody_connections(env)
    corpus = _corpus(seed=16)
    refused_kinds = [
        Hostile(*QUEUES[q], b"{}", *_REFUSED[j % len(_REFUSED)], "broker-refused", {"queue": q})
        for j, q in enumerate(list(QUEUES) * 2)
    ] + [
        Hostile(*QUEUES[broker.QUEUE_RECEIPTS], b"{}", *p, "broker-crashed", {"queue": "-"})
        for p in _CRASHING
    ]
    n = 122  # 2 above, 120 while the corpus arrives
    started = time.monotonic()

    async def real_work() -> None:
        for k in range(0, n - 2, 20):
            await publish_starts(env.settings, [order(500 + k + j) for j in range(20)])
            await asyncio.sleep(0.5)

    async def hostile() -> list[str]:
        async with RawPublisher(env.settings.amqp_url) as raw:
            outcomes = await raw.publish(corpus, window=200)
            # a channel the broker crashed on is closed only after 30 s: no confirm
            # within 3 s is a refusal (were it enqueued after all, the accounting below
            # would count it twice and fail)
            outcomes += await raw.publish(refused_kinds, window=1, refusal_timeout=3.0)
            assert raw.returns == 0
        return outcomes

    _, outcomes = await asyncio.gather(real_work(), hostile())
    sent = corpus + refused_kinds
    assert len(outcomes) == len(sent) >= 10_000
    by_outcome = {o: outcomes.count(o) for o in set(outcomes)}
    broker_refused = by_outcome.get("refused", 0)
    assert broker_refused == len(refused_kinds), by_outcome  # and nothing else refused
    accepted: dict[str, int] = {}
    for h, o in zip(sent, outcomes, strict=True):
        if o == "ack":
            accepted[h.meta["queue"]] = accepted.get(h.meta["queue"], 0) + 1
    engine_expected = accepted[broker.QUEUE_REQUESTS] + accepted[broker.QUEUE_RECEIPTS]

    async def participants_refused() -> dict[str, int]:
        return {
            p: await env.scalar(f"SELECT count(*) FROM participant_{p}.refused", participant=True)
            for p in PARTICIPANT_NAMES
        }

    async def settled() -> bool:
        quarantined = await env.scalar("SELECT count(*) FROM custody.quarantine")
        refused = await participants_refused()
        done = await _all_completed(env, n)
        return (
            done
            and quarantined >= engine_expected
            and all(refused[p] >= accepted[broker.command_queue(f"{p}.v1")] for p in refused)
        )

    try:
        await wait_until(settled, timeout=150, interval=0.5, what="corpus isolated, work done")
    except AssertionError as exc:
        state = await _state(env, n)
        raise AssertionError(f"{exc}: {state} {await participants_refused()}") from None
    fleet.check_alive()
    # no worker lost a connection to the corpus (a reconnect is a new broker-side name)
    assert connections_before.items() <= (await _custody_connections(env)).items()

    by_source = dict(await env.sql("SELECT source, count(*) FROM custody.quarantine GROUP BY 1"))
    assert by_source == {
        broker.QUEUE_REQUESTS: accepted[broker.QUEUE_REQUESTS],
        broker.QUEUE_RECEIPTS: accepted[broker.QUEUE_RECEIPTS],
    }
    refused = await participants_refused()
    for p in PARTICIPANT_NAMES:
        assert refused[p] == accepted[broker.command_queue(f"{p}.v1")], (p, refused)
    dead = await drain(env.settings, broker.QUEUE_DEAD, timeout=0.5)
    assert [d for d in dead if "x-custody-reason" not in d.headers] == []
    # hostile sent = quarantined + dead-lettered with a reason + refused
    assert len(sent) == sum(by_source.values()) + len(dead) + sum(refused.values()) + (
        broker_refused
    )
    assert dead == [], "nothing here fails on its own: nothing is dead-lettered"

    undecodable = sum(
        1 for h, o in zip(sent, outcomes, strict=True) if o == "ack" and h.meta["bad"]
    )
    engine_undecodable = await env.scalar(
        "SELECT count(*) FROM custody.quarantine WHERE reason = %s", (UNDECODABLE,)
    )
    participant_undecodable = 0
    for p in PARTICIPANT_NAMES:
        participant_undecodable += await env.scalar(
            f"SELECT count(*) FROM participant_{p}.refused WHERE reason = %s",
            (UNDECODABLE,),
            participant=True,
        )
    assert engine_undecodable + participant_undecodable == undecodable
    assert _metric("custody_undecodable_deliveries_total") - undecodable_before == undecodable

    # legitimate work: every instance, each effect once, nothing started by the corpus
    assert await env.scalar("SELECT count(*) FROM custody.instances") == n
    await assert_effects_once(env, n)
    assert time.monotonic() - started < 180
