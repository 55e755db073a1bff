"""deploy/rabbitmq/definitions.json is ``custody topology apply`` as a file.

(a) It says exactly what :func:`workers.io.broker.topology` and
:func:`workers.io.broker.policy_definition` say for the routes in deploy/routes.toml
(pure comparison). (b) RabbitMQ accepts it: it is imported for real into a fresh
vhost through the management API, every queue comes out a durable quorum queue, the
work queues carry the ``custody-queues`` policy (DLX and delivery limit) and a poison
message lands in the dead-letter queue after the delivery limit.

Regenerate the file after changing routes or the topology with::

    .venv/bin/python -m tests.integration.test_definitions --write
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
import urllib.parse
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aio_pika
import pytest

from deploycheck import checks
from deploycheck.sources import Deploy
from tests.conftest import AMQP, MGMT, wait_until
from workers.core import routes
from workers.harness.env import with_vhost
from workers.io import broker
from workers.settings import ROOT, Settings

DEFINITIONS = ROOT / "deploy" / "rabbitmq" / "definitions.json"
RABBIT_CONF = ROOT / "deploy" / "rabbitmq" / "rabbitmq.conf"
DELIVERY_LIMIT = Settings().delivery_limit
RABBITMQ_SCHEMAS = "/usr/lib/rabbitmq/lib/rabbitmq_server-*/plugins/*/priv/schema/*.schema"


def _plan() -> dict[str, Any]:
    return broker.topology(routes.load(ROOT / "deploy" / "routes.toml").bindings())


def expected_definitions(vhost: str = "/") -> dict[str, Any]:
    """The definitions file for ``vhost``, built from the topology plan and the policy
    (the one builder, which ``make lint`` compares the file with: deploycheck)."""
    return checks.expected_definitions(Deploy(ROOT), vhost)


def render(definitions: dict[str, Any]) -> str:
    return json.dumps(definitions, indent=2) + "\n"


def load() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DEFINITIONS.read_text())
    return data


def without_vhost(definitions: dict[str, Any]) -> dict[str, Any]:
    """The form ``POST /api/definitions/{vhost}`` takes: no vhost names, no vhosts,
    users or permissions (those belong to the whole node)."""
    out = copy.deepcopy(definitions)
    for key in ("vhosts", "users", "permissions", "topic_permissions", "global_parameters"):
        out.pop(key, None)
    for items in out.values():
        if isinstance(items, list):
            for item in items:
                item.pop("vhost", None)
    return out


# (a) pure comparison ----------------------------------------------------------------


def test_definitions_file_is_generated_from_the_topology_plan() -> None:
    assert DEFINITIONS.read_text() == render(expected_definitions()), (
        "deploy/rabbitmq/definitions.json drifted from workers.io.broker.topology(); "
        "regenerate it: .venv/bin/python -m tests.integration.test_definitions --write"
    )


def test_definitions_declare_what_topology_apply_declares() -> None:
    defs, plan = load(), _plan()
    assert {(e["name"], e["type"]) for e in defs["exchanges"]} == {
        (e["name"], e["type"]) for e in plan["exchanges"]
    }
    assert sorted(q["name"] for q in defs["queues"]) == sorted(plan["queues"])
    assert {(b["source"], b["destination"], b["routing_key"]) for b in defs["bindings"]} == set(
        plan["bindings"]
    )
    assert all(b["destination_type"] == "queue" for b in defs["bindings"])
    for item in defs["exchanges"] + defs["queues"] + defs["bindings"] + defs["policies"]:
        assert item["vhost"] == "/", item
    for ex in defs["exchanges"]:
        assert ex["durable"], ex
        assert not ex["auto_delete"], ex
        assert not ex["internal"], ex
    for q in defs["queues"]:
        assert q["durable"], q
        assert not q["auto_delete"], q
        assert q["arguments"] == {"x-queue-type": "quorum"}, q


def test_definitions_hold_topology_only_no_users_or_permissions() -> None:
    """Importing the file never creates a user or grants anything: the broker users and
    their least-privilege permissions are created separately (docs/deploy.md)."""
    assert set(load()) == {"exchanges", "queues", "bindings", "policies"}


def test_definitions_policy_is_the_dlx_and_delivery_limit_policy() -> None:
    [policy] = load()["policies"]
    assert policy["name"] == broker.POLICY_NAME
    assert {k: v for k, v in policy.items() if k not in ("name", "vhost")} == (
        broker.policy_definition(DELIVERY_LIMIT)
    )
    definition = policy["definition"]
    # 3.10 quorum queues have no default delivery limit, and a limit without a DLX
    # silently drops the poison message: both must be there.
    assert definition["delivery-limit"] == DELIVERY_LIMIT
    assert definition["dead-letter-exchange"] == broker.EXCHANGE_DEAD
    pattern = re.compile(policy["pattern"])
    names = [q["name"] for q in load()["queues"]]
    assert [n for n in names if not pattern.match(n)] == [broker.QUEUE_DEAD]


def test_every_route_binding_has_a_command_queue_and_a_binding() -> None:
    table = routes.load(ROOT / "deploy" / "routes.toml")
    defs = load()
    queues = {q["name"] for q in defs["queues"]}
    binds = {(b["source"], b["destination"], b["routing_key"]) for b in defs["bindings"]}
    for route in table.by_name.values():
        queue = broker.command_queue(route.binding)
        assert queue in queues, route
        assert (broker.EXCHANGE_COMMANDS, queue, route.binding) in binds, route


def test_rabbitmq_conf_uses_only_keys_rabbitmq_3_10_knows() -> None:
    """rabbitmq.conf keys are checked against the cuttlefish schemas of the local
    RabbitMQ installation; an unknown key would stop the compose broker at boot."""
    schemas = sorted(Path("/").glob(RABBITMQ_SCHEMAS.lstrip("/")))
    if not schemas:
        pytest.fail(
            "no RabbitMQ cuttlefish schemas under /usr/lib/rabbitmq; install the "
            "Debian rabbitmq-server package (bash scripts/ensure-services.sh)",
            pytrace=False,
        )
    mappings = []
    for schema in schemas:
        for name in re.findall(r'\{mapping,\s*"([^"]+)"', schema.read_text(errors="replace")):
            mappings.append(
                re.compile(
                    "^"
                    + ".".join(
                        "[^.]+" if part.startswith("$") else re.escape(part)
                        for part in name.split(".")
                    )
                    + "$"
                )
            )
    keys = [
        line.split("=", 1)[0].strip()
        for line in RABBIT_CONF.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert keys
    unknown = [k for k in keys if not any(m.match(k) for m in mappings)]
    assert not unknown, f"rabbitmq.conf keys unknown to RabbitMQ 3.10: {unknown}"
    plugins = (ROOT / "deploy" / "rabbitmq" / "enabled_plugins").read_text().strip()
    assert plugins == (
        "[rabbitmq_management,rabbitmq_prometheus,rabbitmq_shovel,rabbitmq_shovel_management]."
    )
    # each is a plugin this RabbitMQ ships (the compose image is the same 3.10 series)
    shipped = {
        p.name.rsplit("-", 1)[0]
        for p in Path("/").glob("usr/lib/rabbitmq/lib/rabbitmq_server-*/plugins/*")
    }
    assert set(plugins.strip("[].").split(",")) <= shipped, shipped


# (b) a real import into a fresh vhost ------------------------------------------------


def _q(value: str) -> str:
    return urllib.parse.quote(value, safe="")


@pytest.fixture(scope="module")
async def imported(services: None) -> AsyncIterator[str]:
    """A fresh vhost with definitions.json imported through the management API (in its
    vhost-less form), once the management view shows the policy on the work queues."""
    vhost = f"custody-defs-{uuid.uuid4().hex[:10]}"
    await broker.ensure_vhost(MGMT, vhost, [broker.user_of(AMQP)])
    try:
        await broker.management(
            MGMT, "POST", f"/api/definitions/{_q(vhost)}", without_vhost(load())
        )
        names = {q["name"] for q in load()["queues"]}
        pattern = re.compile(broker.POLICY_PATTERN)

        async def policies_applied() -> bool:
            queues = await _queues(vhost)
            return set(queues) == names and all(
                queues[n].get("policy") == broker.POLICY_NAME for n in names if pattern.match(n)
            )

        await wait_until(
            policies_applied,
            timeout=30,
            interval=0.5,
            what=f"{len(names)} queues with policy {broker.POLICY_NAME} in {vhost}",
        )
        yield vhost
    finally:
        await broker.delete_vhost(MGMT, vhost)


async def _queues(vhost: str) -> dict[str, dict[str, Any]]:
    rows = await broker.management(MGMT, "GET", f"/api/queues/{_q(vhost)}")
    return {r["name"]: r for r in rows or []}


async def test_definitions_import_into_a_fresh_vhost(imported: str) -> None:
    vhost = imported
    names = {q["name"] for q in load()["queues"]}
    pattern = re.compile(broker.POLICY_PATTERN)
    queues = await _queues(vhost)
    for name in sorted(names):
        q = queues[name]
        assert q["type"] == "quorum", (name, q["type"])
        assert q["durable"], name
        effective = q.get("effective_policy_definition") or {}
        if pattern.match(name):
            assert q["policy"] == broker.POLICY_NAME, name
            assert effective.get("dead-letter-exchange") == broker.EXCHANGE_DEAD, (name, effective)
            assert effective.get("delivery-limit") == DELIVERY_LIMIT, (name, effective)
        else:
            # the dead-letter queue itself is never dead-lettered
            assert name == broker.QUEUE_DEAD, name
            assert not q.get("policy"), (name, q.get("policy"))
    binds = await broker.management(MGMT, "GET", f"/api/bindings/{_q(vhost)}")
    got = {(b["source"], b["destination"], b["routing_key"]) for b in binds if b["source"]}
    assert got == set(_plan()["bindings"])
    exchanges = await broker.management(MGMT, "GET", f"/api/exchanges/{_q(vhost)}")
    got_ex = {(e["name"], e["type"]) for e in exchanges if e["name"].startswith("custody.")}
    assert got_ex == {(e["name"], e["type"]) for e in _plan()["exchanges"]}


async def test_a_poison_message_is_dead_lettered_after_the_delivery_limit(imported: str) -> None:
    """The policy works, not only exists: a message requeued past the delivery limit
    lands in custody.dead-letters (at-least-once dead-lettering) instead of vanishing."""
    vhost = imported
    connection = await aio_pika.connect(with_vhost(AMQP, vhost))
    try:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(broker.EXCHANGE_REQUESTS, ensure=True)
        message_id = uuid.uuid4().hex
        await exchange.publish(
            aio_pika.Message(
                b'{"poison": true}',
                message_id=message_id,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            ),
            broker.START_KEY,
            mandatory=True,
        )
        requests = await channel.get_queue(broker.QUEUE_REQUESTS, ensure=True)
        deliveries = 0
        for _ in range(DELIVERY_LIMIT * 4):
            incoming = await requests.get(no_ack=False, fail=False, timeout=5)
            if incoming is None:
                break
            deliveries += 1
            await incoming.nack(requeue=True)
        assert deliveries == DELIVERY_LIMIT + 1, deliveries
        dead = await channel.get_queue(broker.QUEUE_DEAD, ensure=True)
        found: list[aio_pika.abc.AbstractIncomingMessage] = []

        async def dead_lettered() -> bool:
            incoming = await dead.get(no_ack=True, fail=False, timeout=5)
            if incoming is not None:
                found.append(incoming)
            return bool(found)

        await wait_until(dead_lettered, timeout=15, interval=0.2, what="a dead-lettered message")
        assert found[0].message_id == message_id
        deaths: Any = found[0].headers["x-death"]
        death = deaths[0]
        assert death["reason"] == "delivery_limit", death
        assert death["queue"] == broker.QUEUE_REQUESTS, death
    finally:
        await connection.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else "")
    p.add_argument("--write", action="store_true", help="rewrite definitions.json")
    args = p.parse_args(argv)
    text = render(expected_definitions())
    if args.write:
        DEFINITIONS.write_text(text)
        print(f"wrote {DEFINITIONS.relative_to(ROOT)}")
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
