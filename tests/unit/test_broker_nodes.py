"""Issue 12 (the chaos harness): a RabbitMQ cluster without a load balancer, and a
worker that starts before its broker or database.

``CUSTODY_AMQP_URL`` may name several nodes of one cluster,
``amqp[s]://user:password@host1[:port],host2[:port],.../vhost?options`` (one user, one
vhost, one set of options, like libpq's host lists); the single-host form is unchanged.
Everything that parses the URL handles both forms. Connection attempts follow a
full-jitter exponential backoff capped at a few seconds, so that replicas never retry
in lockstep, and each process tries the nodes in its own shuffled order.
"""

from __future__ import annotations

import asyncio
import random

import aio_pika
import aiormq
import pytest

from workers import errors
from workers.core import amqp_url, backoff
from workers.harness.env import with_vhost
from workers.io import broker, db, startup
from workers.runtime import supervisor
from workers.runtime.probes import Health
from workers.settings import Settings

SINGLE = "amqp://guest:guest@127.0.0.1:5672/%2F"
CLUSTER = "amqps://u%3Ax:p%40ss@rabbit-0:5671,rabbit-1:5672,rabbit-2/custody%2Fprod?heartbeat=10"


# -- the URL ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        SINGLE,
        "amqp://rabbit/",
        "amqps://custody:s3cret@rabbit.internal:5671/%2F?heartbeat=10&name=x",
        "amqp://u:p@[::1]:5672/v",
    ],
)
def test_a_single_host_url_is_used_exactly_as_it_was_given(url: str) -> None:
    """The single-URL form keeps working unchanged: its one node is the URL itself."""
    parsed = amqp_url.parse(url)
    assert parsed.node_urls() == [url]
    assert str(parsed) == url


def test_a_host_list_is_one_url_per_node_with_the_same_user_vhost_and_options() -> None:
    parsed = amqp_url.parse(CLUSTER)
    assert parsed.node_urls() == [
        "amqps://u%3Ax:p%40ss@rabbit-0:5671/custody%2Fprod?heartbeat=10",
        "amqps://u%3Ax:p%40ss@rabbit-1:5672/custody%2Fprod?heartbeat=10",
        "amqps://u%3Ax:p%40ss@rabbit-2/custody%2Fprod?heartbeat=10",
    ]
    assert [n.address for n in parsed.nodes] == ["rabbit-0:5671", "rabbit-1:5672", "rabbit-2:5671"]
    assert (parsed.user, parsed.password, parsed.vhost) == ("u:x", "p@ss", "custody/prod")
    assert str(parsed) == CLUSTER


def test_ipv6_nodes_keep_their_brackets() -> None:
    parsed = amqp_url.parse("amqp://u:p@[::1]:5672,[fe80::2]/%2F")
    assert parsed.node_urls() == ["amqp://u:p@[::1]:5672/%2F", "amqp://u:p@[fe80::2]/%2F"]
    assert [n.address for n in parsed.nodes] == ["[::1]:5672", "[fe80::2]:5672"]


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("amqp://u:p@h1,,h2/", "empty host"),
        ("amqp://u:p@h1:56x2,h2/", "port"),
        ("amqp://u:p@h1:99999/", "port"),
        ("amqp://u:p@h1/v,amqp://u:p@h2/v", "one URL with several hosts"),
        ("http://u:p@h1/", "amqp:// or amqps://"),
        ("rabbit:5672", "amqp:// or amqps://"),
        ("amqp://u:p@[::1/", "host"),
    ],
)
def test_a_malformed_amqp_url_is_a_config_error_that_says_why(url: str, says: str) -> None:
    """A bad URL refuses to start (exit 2), naming the setting and the mistake."""
    with pytest.raises(errors.ConfigError, match="CUSTODY_AMQP_URL") as raised:
        amqp_url.parse(url)
    assert says in str(raised.value)
    assert "p@" not in str(raised.value).replace("u:p@h", ""), "no password in the message"


def test_the_broker_helpers_handle_the_host_list() -> None:
    """vhost_of, user_of and url_with_user keep every node, the vhost and the options."""
    assert broker.vhost_of(CLUSTER) == "custody/prod"
    assert broker.user_of(CLUSTER) == "u:x"
    assert broker.url_with_user(CLUSTER, "custody-publisher", "pw/@:") == (
        "amqps://custody-publisher:pw%2F%40%3A@rabbit-0:5671,rabbit-1:5672,rabbit-2"
        "/custody%2Fprod?heartbeat=10"
    )
    assert broker.url_with_user(SINGLE, "custody-receipts", "x") == (
        "amqp://custody-receipts:x@127.0.0.1:5672/%2F"
    )
    assert broker.vhost_of(SINGLE) == "/" and broker.user_of(SINGLE) == "guest"
    assert broker.user_of("amqp://rabbit-0,rabbit-1/") == "guest"


def test_the_harness_vhost_helper_handles_the_host_list() -> None:
    assert with_vhost("amqp://guest:guest@h1:5672,h2:5673/%2F", "custody-test-1", "u", "p") == (
        "amqp://u:p@h1:5672,h2:5673/custody-test-1"
    )


def test_the_management_api_url_may_name_several_nodes() -> None:
    """The management helpers try each node of a host list (any node answers for the
    cluster), with the URL's one user."""
    bases = amqp_url.management_bases("https://admin:s%3Acret@rabbit-0:15671,rabbit-1")
    assert bases == [
        ("https://rabbit-0:15671", "admin", "s:cret"),
        ("https://rabbit-1", "admin", "s:cret"),
    ]
    assert amqp_url.management_bases("http://127.0.0.1:15672") == [
        ("http://127.0.0.1:15672", "guest", "guest")
    ]


def test_config_show_masks_the_password_of_a_host_list() -> None:
    shown = Settings.from_env(
        {
            "CUSTODY_AMQP_URL": "amqp://custody:mq-s3cret@h1:5672,h2:5672,h3:5672/%2F",
            "CUSTODY_AMQP_MANAGEMENT_URL": "http://admin:mgmt-s3cret@h1:15672,h2:15672",
        }
    ).redacted()
    assert shown["amqp_url"] == "amqp://custody:***@h1:5672,h2:5672,h3:5672/%2F"
    assert shown["amqp_management_url"] == "http://admin:***@h1:15672,h2:15672"


def test_each_process_tries_the_nodes_in_its_own_order() -> None:
    """Shuffled per process so that replicas spread over the nodes."""
    parsed = amqp_url.parse("amqp://h1,h2,h3,h4,h5/")
    orders = {tuple(parsed.shuffled(random.Random(seed))) for seed in range(40)}
    assert len(orders) > 10
    assert all(sorted(o) == sorted(parsed.node_urls()) for o in orders)


# -- the backoff -------------------------------------------------------------------------


def test_the_backoff_is_exponential_with_full_jitter_and_capped() -> None:
    """Full jitter: uniform in [0, min(cap, base * 2**attempt)], so replicas that failed
    together do not come back together."""
    top = [backoff.full_jitter(a, rand=lambda: 1.0) for a in range(12)]
    assert top[:5] == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert max(top) == backoff.CAP_S and 10.0 <= backoff.CAP_S <= 15.0
    assert backoff.full_jitter(10_000, rand=lambda: 1.0) == backoff.CAP_S
    assert backoff.full_jitter(3, rand=lambda: 0.0) == 0.0
    replicas = [random.Random(seed) for seed in range(20)]
    delays = {round(backoff.full_jitter(6, rand=r.random), 6) for r in replicas}
    assert len(delays) == 20, "replicas must not retry in lockstep"


def test_the_next_node_is_tried_at_once_and_a_failed_round_backs_off() -> None:
    """After a failure the next node is tried at once; once every node of the list has
    failed in a row, the next round waits a backoff that grows round after round."""
    one = [backoff.before_attempt(f, nodes=3, rand=lambda: 1.0) for f in range(10)]
    assert one == [0.0, 0.0, 0.0, 0.5, 0.0, 0.0, 1.0, 0.0, 0.0, 2.0]
    single = [backoff.before_attempt(f, nodes=1, rand=lambda: 1.0) for f in range(4)]
    assert single == [0.0, 0.5, 1.0, 2.0]


# -- what is transient, what is a configuration error ----------------------------------------


@pytest.mark.parametrize(
    ("exc", "refused"),
    [
        (aiormq.exceptions.ProbableAuthenticationError("ACCESS_REFUSED - Login was refused"), True),
        (aiormq.exceptions.AuthenticationError("AMQPLAIN", ["PLAIN"]), True),
        (aiormq.exceptions.AMQPConnectionError(111, "Connect call failed"), False),
        (ConnectionResetError(104, "reset"), False),
        (TimeoutError(), False),
        (aiormq.exceptions.ConnectionNotAllowed(530, "vhost / is down"), False),
    ],
)
def test_only_a_refused_login_is_not_retried_at_start(exc: BaseException, refused: bool) -> None:
    """A wrong user or password (ACCESS_REFUSED) exits 2 at start with a clear message: it
    is configuration, and no retry fixes it. A refused vhost (530) is retried, because
    RabbitMQ also says 530 while a vhost recovers on a restarting node."""
    assert (broker.refusal(exc) is not None) is refused


def test_a_certificate_the_client_does_not_trust_is_not_retried_at_start() -> None:
    import ssl

    cause = ssl.SSLCertVerificationError(1, "certificate verify failed")
    wrapped = aiormq.exceptions.AMQPConnectionError(1, "certificate verify failed")
    wrapped.__cause__ = cause
    message = broker.refusal(wrapped)
    assert message is not None and "CUSTODY_AMQP_TLS_CA_FILE" in message


def test_an_exception_chain_that_loops_is_read_to_its_end() -> None:
    first, second = OSError("a"), OSError("b")
    first.__context__, second.__context__ = second, first
    assert broker.refusal(first) is None


@pytest.mark.parametrize(
    ("text", "refused"),
    [
        ('FATAL:  password authentication failed for user "custody_publisher"', True),
        ('FATAL:  role "custody_nobody" does not exist', True),
        ('FATAL:  database "custody" does not exist', True),
        ('FATAL:  no pg_hba.conf entry for host "10.0.0.1", user "x", database "custody"', True),
        ('FATAL:  role "x" is not permitted to log in', True),
        ("Connection refused\n\tIs the server running on that host", False),
        ("FATAL:  the database system is starting up", False),
        ("FATAL:  sorry, too many clients already", False),
        ("server closed the connection unexpectedly", False),
        ("timeout expired", False),
        ('could not translate host name "pg" to address', False),
    ],
)
def test_only_a_refused_postgres_login_is_not_retried_at_start(text: str, refused: bool) -> None:
    assert db.login_refused(f'connection to server at "127.0.0.1", port 5432 failed: {text}') is (
        refused
    )


def test_the_reconnect_hook_of_aio_pika_is_where_the_broker_expects_it() -> None:
    """The broker chooses the node of each transport attempt by overriding aio-pika's
    robust connection's (private) transport step: an aio-pika that renamed it must fail
    here, not silently stop failing over."""
    assert callable(vars(aio_pika.RobustConnection)["_RobustConnection__connect_transport"])
    assert issubclass(broker.NodesConnection, aio_pika.RobustConnection)


# -- start-up: waiting is the runtime's policy, failing fast the default ------------------------


def test_commands_fail_fast_and_only_workers_wait() -> None:
    """Outside a worker (the CLI, the harnesses) a connection fails after one pass over
    the nodes, as before; ``supervisor.run`` makes its worker wait."""
    assert startup.current().wait is False

    seen: list[startup.Patience] = []

    async def main(stop: supervisor.Stop, health: Health) -> None:
        seen.append(startup.current())

    assert asyncio.run(supervisor.run("t", main, grace_s=1)) == 1  # ended by itself
    assert seen and seen[0].wait is True
    assert startup.current().wait is False


def test_a_worker_stopped_while_it_waits_for_a_dependency_exits_0_at_once() -> None:
    """SIGTERM while start-up waits for the broker: nothing is in flight, so the worker
    does not wait out its drain grace period; it stops at once with exit 0."""
    grace_s = 30.0

    async def main(stop: supervisor.Stop, health: Health) -> None:
        patience = startup.current()
        with patience.waiting_for("broker"):
            patience.waiting["broker"] = "connection refused"
            assert health.ready() == (False, {})
            await asyncio.sleep(3600)

    async def scenario() -> tuple[int, float]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        run = asyncio.ensure_future(supervisor.run("t", main, grace_s=grace_s))
        await asyncio.sleep(0.2)
        import os
        import signal

        os.kill(os.getpid(), signal.SIGTERM)
        code = await asyncio.wait_for(run, 10)
        return code, loop.time() - started

    code, took = asyncio.run(scenario())
    assert code == 0 and took < 5


def test_readiness_is_false_and_says_what_start_up_waits_for() -> None:
    health = Health()
    health.checks["broker"] = lambda: True
    assert health.ready() == (True, {"broker": True})
    health.waiting["database"] = "connection refused"
    assert health.ready() == (False, {"broker": True})
    assert health.body()["waiting"] == {"database": "connection refused"}


# -- the chaos cluster variant -------------------------------------------------------------


def test_the_chaos_cluster_gives_each_node_a_fault_proxy_of_its_own(tmp_path) -> None:
    """The cluster variant has no load balancer in front of the workers: one fault proxy
    per node, and a fault aimed at ``amqp`` hits one node's proxy (its workers move)."""
    from types import SimpleNamespace

    from chaos.faults import World
    from chaos.runner import amqp_proxies
    from chaos.services import Services

    cluster = amqp_proxies(Services(tmp_path, base_port=21000, nodes=3), 21000)
    assert {n: (x.listen_port, x.upstreams) for n, x in cluster.items()} == {
        "amqp-1": (21051, [("127.0.0.1", 21010)]),
        "amqp-2": (21055, [("127.0.0.1", 21020)]),
        "amqp-3": (21056, [("127.0.0.1", 21030)]),
    }
    single = amqp_proxies(Services(tmp_path, base_port=21000, nodes=1), 21000)
    assert {n: x.listen_port for n, x in single.items()} == {"amqp": 21051}

    world = SimpleNamespace(proxies={**cluster, "pg-engine": object()}, rng=random.Random(3))
    hit = {World.proxy(world, "amqp").name for _ in range(30)}  # type: ignore[arg-type]
    assert hit == {"amqp-1", "amqp-2", "amqp-3"}
    assert World.proxy(world, "pg-engine") is world.proxies["pg-engine"]  # type: ignore[arg-type]
