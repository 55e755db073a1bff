"""The one module that talks to RabbitMQ (AMQP through aio-pika, policies and users
through the management HTTP API).

Publishing counts only a broker confirm: channels are opened with
``publisher_confirms=True, on_return_raises=True``, every publish is ``mandatory``
and carries ``message_id``, so an unroutable message is a failure, not a success
(aio-pika 10.2.1 on a default confirm channel returns normally on a return).

The URL may name several nodes of one cluster (``workers.core.amqp_url``): the robust
connection tries them in turn, in an order of its own process, on the first connect
and on every reconnect (:class:`NodesConnection`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import random
import re
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, cast

import aio_pika
import aiormq
import orjson
from aio_pika.abc import (
    AbstractChannel,
    AbstractRobustConnection,
    ConsumerTag,
    DeliveryMode,
)
from aiormq.abc import DeliveredMessage
from pamqp import commands as spec
from pamqp.common import Arguments
from yarl import URL

from contracts import codec
from contracts.models import StartRequest
from workers import errors
from workers.core import amqp_url, backoff, commands, deadletters, envelope
from workers.io import amqp_frames, amqp_marshal, amqp_writes, startup
from workers.settings import Settings

# pamqp decodes short strings strictly and aiormq closes the connection on any decode
# error: a publisher's invalid UTF-8 would take every consumer of a queue down
amqp_frames.install()
amqp_marshal.install()
amqp_writes.install()

# What a caller above this layer may catch as a last resort (the CLI's top level),
# without importing the client library.
DRIVER_ERRORS: Final[tuple[type[Exception], ...]] = (aiormq.exceptions.AMQPError,)
EXCHANGE_COMMANDS: Final = commands.EXCHANGE_COMMANDS
EXCHANGE_RECEIPTS: Final = "custody.receipts"
EXCHANGE_REQUESTS: Final = "custody.requests"
EXCHANGE_DEAD: Final = "custody.dead"
QUEUE_RECEIPTS: Final = "custody.receipts"
QUEUE_REQUESTS: Final = "custody.requests"
QUEUE_DEAD: Final = "custody.dead-letters"
# how long a consumer's exit may spend cancelling its consumers and closing its channel
CLEANUP_TIMEOUT_S: Final = 5.0
RECEIPTS_KEY: Final = "receipts"
START_KEY: Final = "start"
CANCEL_KEY: Final = "cancel"
UNDECODABLE: Final = "undecodable_properties"
MALFORMED_ENVELOPE: Final = "malformed_envelope"
JSON: Final = "application/json"
POLICY_NAME: Final = "custody-queues"
RECONNECT_INTERVAL_S: Final = 1.0  # the pause between two attempts, before any backoff
CONNECT_TIMEOUT_S: Final = 10.0  # one attempt (TCP, TLS, AMQP handshake) on one node
POLICY_PATTERN: Final = r"^custody\.(commands\..+|receipts|requests)$"


def command_queue(binding: str) -> str:
    return f"custody.commands.{binding}"


# the outcome's error of a message not sent because its claim got too old (its kind in
# custody_outbox_publish_failures_total)
UNSENT: Final = "unsent"


@dataclass(frozen=True)
class Outgoing:
    """One message to publish: the outbox row's id is the AMQP message_id.
    ``not_after``: a ``time.monotonic()`` moment after which it is not sent any more
    (the outbox's claim on it would be too old: see ``workers.runtime.outbox``); its
    outcome is then a failure, and nothing left."""

    message_id: str
    exchange: str
    routing_key: str
    body: bytes
    headers: Mapping[str, Any] = field(default_factory=dict)
    not_after: float | None = None


def start_request(
    *,
    tenant: str,
    process: str,
    input: Mapping[str, Any],
    requested_by: str,
    start_request_id: str | None = None,
) -> Outgoing:
    """A start request (a fresh start request id unless one is given; it is also the
    message_id), ready to publish to the requests exchange."""
    request = StartRequest(
        tenant=tenant,
        start_request_id=start_request_id or str(uuid.uuid4()),
        process=process,
        input=dict(input),
        requested_by=requested_by,
    )
    return Outgoing(request.start_request_id, EXCHANGE_REQUESTS, START_KEY, codec.encode(request))


@dataclass(frozen=True)
class Outcome:
    message_id: str
    ok: bool
    error: str = ""


@dataclass
class Delivery:
    """An incoming message with what the workers may rely on."""

    body: bytes
    message_id: str | None
    user_id: str | None
    headers: Mapping[str, Any]
    redelivered: bool
    routing_key: str
    # the frames as aiormq delivered them (their channel settles it): no aio-pika
    # IncomingMessage is built per delivery (see _LeanQueue)
    _message: DeliveredMessage
    settled: bool = False
    # why its properties could not be decoded (invalid UTF-8 in a short string or a
    # header name, a timestamp out of range, ...); such a delivery is never handled,
    # only isolated (``consumer.process`` sends it to the worker's quarantine)
    undecodable: str | None = None
    # the consumer's unsettled deliveries (None: a delivery made outside consume())
    _ledger: Ledger | None = None
    # the exchange it was published to (a dead letter names its original one)
    exchange: str = ""
    # what its handler learnt of it (operation_id, instance_id, outcome): the ids of the
    # consumer's log lines about it after the commit (unit.done, a dead-letter)
    ids: dict[str, Any] = field(default_factory=dict)
    # the reason code ``payload()`` raises with when ``undecodable`` is set
    undecodable_reason: str = UNDECODABLE
    # an item of an envelope: the envelope, settled once every item of it is
    _envelope: _Envelope | None = None

    def payload(self) -> bytes:
        """The body, for a handler's decoder: a delivery whose properties could not be
        decoded (or an envelope that could not be split) raises
        ``codec.DecodeError("undecodable_properties")`` (``"malformed_envelope"``)
        instead, so every handler isolates it on its existing path (quarantine or
        refusal, raw body and reason kept, then acked) and never acts on it."""
        if self.undecodable is not None:
            raise codec.DecodeError(self.undecodable_reason, self.undecodable)
        return self.body

    async def ack(self) -> None:
        """Ack on the channel it came from, once; a closed channel means the broker will
        redeliver it, and the consumer's idempotency handles that. An envelope's item
        is acked with the last item of it settled (:class:`_Envelope`)."""
        await self._settle(_ACK)

    async def reject(self) -> None:
        """Reject without requeue: the queue's policy dead-letters it."""
        await self._settle(_REJECT)

    async def requeue(self) -> None:
        await self._settle(_REQUEUE)

    async def _settle(self, how: int) -> None:
        if self.settled:
            return
        if self._envelope is not None:
            settled = self._envelope.settle(self, how)
            if settled is None:
                return
            how = settled
        await _settle_message(self, how)

    def _mark_settled(self) -> None:
        self.settled = True
        if self._ledger is not None:
            self._ledger.settled(self._message)


# How a delivery is settled, in the order an envelope's items outrank one another.
_ACK: Final = 0
_REJECT: Final = 1
_REQUEUE: Final = 2


class _Envelope:
    """The items of one envelope, settled as one AMQP message once each is settled.

    The message's settlement is the strongest of its items': any item requeued
    requeues it (a stopping consumer gives back what it did not handle: the items
    already committed come back too, and their inboxes absorb them), else any item
    rejected rejects it (the queue's policy dead-letters the envelope, every item in
    it: a participant's poison command, which it may not publish to the dead-letter
    exchange itself, takes its envelope's siblings with it, already applied), else it
    is acked: never before the last item's commit."""

    __slots__ = ("how", "left")

    def __init__(self, items: int) -> None:
        self.left = items
        self.how = _ACK

    def settle(self, item: Delivery, how: int) -> int | None:
        """Mark ``item`` settled; the envelope's settlement once it was the last."""
        item.settled = True
        self.left -= 1
        self.how = max(self.how, how)
        return self.how if self.left == 0 else None


class Ledger:
    """One consumer's deliveries not yet settled, by channel and delivery tag.

    An ack with ``multiple`` settles every unsettled delivery of its channel up to its
    tag, so it is used for a batch only when the batch is exactly those: never for a
    delivery that was received but is not in the batch (it would be acked before its
    commit). A channel restored after a reconnect starts its tags again; its
    deliveries are counted under the new channel object.
    """

    def __init__(self) -> None:
        self._open: dict[int, set[int]] = {}

    @staticmethod
    def _key(message: DeliveredMessage) -> tuple[int, int] | None:
        channel = message.channel
        if channel.is_closed:
            return None
        tag = message.delivery_tag
        return None if tag is None else (id(channel), tag)

    def received(self, message: DeliveredMessage) -> None:
        key = self._key(message)
        if key is not None:
            self._open.setdefault(key[0], set()).add(key[1])

    def settled(self, message: DeliveredMessage) -> None:
        key = self._key(message)
        if key is not None:
            self._open.get(key[0], set()).discard(key[1])

    def covers(self, channel: int, tags: set[int]) -> bool:
        """Whether ``tags`` are exactly the channel's unsettled deliveries up to their
        highest tag (then one multiple-ack settles just them)."""
        top = max(tags)
        return {t for t in self._open.get(channel, ()) if t <= top} == tags


async def ack_all(deliveries: Sequence[Delivery]) -> None:
    """Ack a batch after its commit: one ``multiple`` ack per channel where the batch is
    every unsettled delivery up to its highest tag (:class:`Ledger`), else one by one.
    Deliveries settled already (dead-lettered, requeued) are skipped."""
    groups: dict[int, list[tuple[int, Delivery]]] = {}
    single: list[Delivery] = []
    for d in deliveries:
        if d.settled:
            continue
        if d._envelope is not None:
            # an envelope's item: its message is settled with its last item, and an
            # envelope with an item requeued or rejected is settled that way
            how = d._envelope.settle(d, _ACK)
            if how is None:
                continue
            if how != _ACK:
                await _settle_message(d, how)
                continue
            # the last item stands for its envelope's message from here on: acked
            # below, with the others of its channel or alone
            d.settled = False
            d._envelope = None
        key = Ledger._key(d._message) if d._ledger is not None else None
        if key is None:
            single.append(d)
        else:
            groups.setdefault(key[0], []).append((key[1], d))
    for channel, tagged in groups.items():
        ledger = tagged[0][1]._ledger
        tags = {t for t, _ in tagged}
        if len(tagged) < 2 or ledger is None or not ledger.covers(channel, tags):
            single.extend(d for _, d in tagged)
            continue
        top = max(tagged, key=lambda td: td[0])[1]
        for _, d in tagged:
            d._mark_settled()
        with contextlib.suppress(*_SETTLE_ERRORS):
            await _ack(top._message, multiple=True)
    for d in single:
        await d.ack()


async def _settle_message(d: Delivery, how: int) -> None:
    """Settle the AMQP message ``d`` came in (an envelope's, once its last item is)."""
    d._mark_settled()
    with contextlib.suppress(*_SETTLE_ERRORS):
        if how == _ACK:
            await _ack(d._message)
        else:
            await _reject(d._message, requeue=how == _REQUEUE)


async def _ack(message: DeliveredMessage, *, multiple: bool = False) -> None:
    tag = message.delivery_tag
    if tag is not None:
        await message.channel.basic_ack(tag, multiple=multiple)


async def _reject(message: DeliveredMessage, *, requeue: bool) -> None:
    """A nack with requeue, or a reject without: the queue's policy dead-letters it."""
    tag = message.delivery_tag
    if tag is None:
        return
    if requeue:
        await message.channel.basic_nack(tag, requeue=True)
    else:
        await message.channel.basic_reject(tag, requeue=False)


def printable(value: str) -> str:
    """A string Postgres and JSON accept: bytes that were not UTF-8 (kept as lone
    surrogates by the frame decoder) become ``\\xNN``, U+0000 is dropped."""
    if not _SURROGATE.search(value):
        return value.replace("\x00", "")
    return (
        value.encode("utf-8", "surrogateescape")
        .decode("utf-8", "backslashreplace")
        .replace("\x00", "")
    )


_SURROGATE: Final = re.compile("[\ud800-\udfff]")


def safe_headers(headers: Mapping[str, Any]) -> dict[str, str]:
    """Headers as bounded strings without U+0000, fit for a quarantine row."""
    return {printable(str(k)[:100]): printable(str(v)[:500]) for k, v in list(headers.items())[:32]}


_TRANSPORT_ERRORS = (
    aiormq.exceptions.AMQPError,
    aio_pika.exceptions.ChannelInvalidStateError,
    OSError,
)
_CLIENT_DIRS: Final = (Path(aio_pika.__file__).parent, Path(aiormq.__file__).parent)


def is_transport_error(exc: BaseException) -> bool:
    """A lost or closing connection or channel: the client's own errors, and a bare
    ``RuntimeError`` raised inside aio-pika or aiormq, or by the transport under them
    (asyncio's "Cannot call write() after write_eof()" while a connection closes): about
    their state while a robust connection reconnects ("Connection was not opened", "...
    closed"). So is a plain ``Exception`` raised inside them: aiormq fails the futures of
    a channel that closes without a reason (a publish's confirm among them) with a bare
    ``Exception`` (``FutureStore.reject_all(None)``; a chaos run's receipt consumer
    crashed on one while RabbitMQ restarted). Either, when it never passed through the
    client, is a bug, never mistaken for a broker outage."""
    if isinstance(exc, _TRANSPORT_ERRORS):
        return True
    if not isinstance(exc, RuntimeError) and type(exc) is not Exception:
        return False
    tb = exc.__traceback__
    while tb is not None:
        where = Path(tb.tb_frame.f_code.co_filename)
        if any(where.is_relative_to(d) for d in _CLIENT_DIRS):
            return True
        tb = tb.tb_next
    return False


_SETTLE_ERRORS = (
    aiormq.exceptions.AMQPError,
    aio_pika.exceptions.ChannelInvalidStateError,
    aio_pika.exceptions.MessageProcessError,
)


def _delivery(message: DeliveredMessage) -> Delivery:
    """A delivery from aiormq's frames (what aio-pika's IncomingMessage would copy)."""
    props = message.header.properties
    headers = dict(props.headers or {})
    mark = headers.pop(amqp_frames.MARK, None)
    problems = mark.describe() if isinstance(mark, amqp_frames.Undecodable) else None
    routing_key, exchange = message.routing_key, message.exchange
    texts = {
        "message_id": props.message_id,
        "correlation_id": props.correlation_id,
        "type": props.message_type,
        "routing_key": routing_key,
        "exchange": exchange,
        "consumer_tag": message.consumer_tag,
    }
    escaped = [k for k, v in texts.items() if isinstance(v, str) and _SURROGATE.search(v)]
    if escaped and problems is None:  # a method frame decoded with surrogateescape
        problems = f"{', '.join(escaped)}: not UTF-8"
    return Delivery(
        body=message.body,
        message_id=None if props.message_id is None else printable(props.message_id),
        user_id=props.user_id,
        headers=headers,
        redelivered=bool(message.redelivered),
        routing_key=printable(routing_key or ""),
        _message=message,
        undecodable=problems,
        exchange=printable(exchange or ""),
    )


# the envelope's headers each of its items carries (the broker's, custody's dead-letter
# ones): a named few, so that a large header table is not copied once per item
_ENVELOPE_HEADERS: Final = deadletters.DEATH_HEADERS | deadletters.CUSTODY_HEADERS


def _tenant(body: bytes) -> str | None:
    """The tenant a message is about (custody's commands, receipts and start requests
    name it at their top level), or None."""
    try:
        decoded = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    tenant = decoded.get("tenant") if isinstance(decoded, dict) else None
    return tenant if isinstance(tenant, str) else None


def _deliveries(message: DeliveredMessage) -> list[Delivery]:
    """The deliveries of one AMQP message: itself, or each item of an envelope
    (``workers.core.envelope``). An envelope that cannot be split is one delivery,
    isolated whole (reason ``malformed_envelope``); so is one whose properties could
    not be decoded."""
    d = _delivery(message)
    if message.header.properties.content_type != envelope.CONTENT_TYPE or d.undecodable:
        return [d]
    try:
        items = envelope.unpack(d.body)
    except envelope.Malformed as exc:
        d.undecodable = f"envelope: {exc}"
        d.undecodable_reason = MALFORMED_ENVELOPE
        return [d]
    shared = _Envelope(len(items))
    said = {k: v for k, v in d.headers.items() if k in _ENVELOPE_HEADERS}
    return [
        Delivery(
            body=item.body,
            message_id=printable(item.message_id),
            user_id=d.user_id,
            # what the broker and custody said of the envelope (a dead letter's
            # x-death, its delivery count, its x-custody-* reason) is each item's too,
            # and only the envelope says it: an item's names never begin with x-
            headers={**item.headers, **said} if said else item.headers,
            redelivered=d.redelivered,
            routing_key=d.routing_key,
            _message=message,
            exchange=d.exchange,
            _envelope=shared,
        )
        for item in items
    ]


@dataclass(frozen=True)
class Tls:
    """TLS for the AMQP connection: verify the broker against ``ca_file``; present a
    client certificate if ``cert_file`` (and ``key_file``) are set. (Postgres TLS is
    libpq's: ``sslmode``, ``sslrootcert``, ``sslcert``, ``sslkey`` in the URL or the
    ``PGSSL*`` variables.)"""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.ca_file or self.cert_file)

    def context(self) -> ssl.SSLContext:
        try:
            context = ssl.create_default_context(cafile=self.ca_file or None)
            if self.cert_file:
                context.load_cert_chain(self.cert_file, self.key_file or None)
        except (OSError, ssl.SSLError) as exc:
            raise errors.ConfigError(f"AMQP TLS files: {exc}") from exc
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        return context


def refusal(exc: BaseException, *, user: str = "", node: str = "") -> str | None:
    """Why a connection attempt failed for good, if it did: a refused login (ACCESS_REFUSED,
    or no authentication mechanism in common) or a broker certificate the client does not
    trust. These are configuration, so start-up does not retry them; anything else
    (refused, reset or timed-out connections, a node or vhost still starting) is an
    outage, waited out."""
    at = f" at {node}" if node else ""
    if isinstance(
        exc,
        (aiormq.exceptions.ProbableAuthenticationError, aiormq.exceptions.AuthenticationError),
    ):
        return (
            f"RabbitMQ{at} refused the login of {user or 'the user'!r} ({exc}):"
            " check the user and password in CUSTODY_AMQP_URL; not retried"
        )
    seen: BaseException | None = exc
    chain: set[int] = set()
    while seen is not None and id(seen) not in chain:  # causes and contexts may loop
        chain.add(id(seen))
        if isinstance(seen, ssl.SSLCertVerificationError):
            reason = getattr(seen, "verify_message", None) or seen
            return (
                f"the TLS certificate of RabbitMQ{at} was not verified ({reason}): check"
                " CUSTODY_AMQP_TLS_CA_FILE and the host names in CUSTODY_AMQP_URL; not retried"
            )
        seen = seen.__cause__ or seen.__context__
    return None


def _why(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# aio-pika's robust connection re-opens channels, restores QoS, queues and consumers after
# every reconnect, but only to its one URL; the broker keeps all of that and chooses the
# node of each transport attempt, overriding the connection's (private) transport step.
# aio-pika is pinned (pyproject.toml); an aio-pika without the step fails here, at import.
_TRANSPORT_STEP: Final = "_RobustConnection__connect_transport"
if not callable(getattr(aio_pika.RobustConnection, _TRANSPORT_STEP, None)):
    raise ImportError(f"aio-pika {aio_pika.__version__}: RobustConnection has no {_TRANSPORT_STEP}")


class _LeanQueue(aio_pika.RobustQueue):
    """aio-pika's robust queue, whose consumer may take aiormq's delivered frames as
    they are (``raw=True``): aio-pika would wrap each delivery in an IncomingMessage
    (two dozen attribute writes through a checking ``__setattr__``) and run its callback
    in a second task, about a third of a delivery's client CPU. A raw consumer is
    recorded like any other, so the robust channel restores it after a reconnect."""

    __slots__ = ()

    async def consume(
        self,
        callback: Any,
        no_ack: bool = False,
        exclusive: bool = False,
        arguments: Arguments = None,
        consumer_tag: ConsumerTag | None = None,
        timeout: float | None = None,
        robust: bool = True,
        raw: bool = False,
    ) -> ConsumerTag:
        if not raw:
            return await super().consume(
                callback,
                no_ack=no_ack,
                exclusive=exclusive,
                arguments=arguments,
                consumer_tag=consumer_tag,
                timeout=timeout,
                robust=robust,
            )
        channel = await self.channel.get_underlay_channel()
        result = await channel.basic_consume(
            queue=self.name,
            consumer_callback=callback,
            exclusive=exclusive,
            no_ack=no_ack,
            arguments=arguments,
            consumer_tag=consumer_tag,
            timeout=timeout,
        )
        tag = result.consumer_tag
        if tag is None:
            raise RuntimeError("Consumer tag is None")
        if robust:
            self._consumers[tag] = {
                "callback": callback,
                "no_ack": no_ack,
                "exclusive": exclusive,
                "arguments": arguments,
                "raw": True,
            }
        return tag


class _Channel(aio_pika.RobustChannel):
    QUEUE_CLASS = _LeanQueue


class NodesConnection(aio_pika.RobustConnection):
    """aio-pika's robust connection over the nodes of a host list.

    Each transport attempt (the first connect and every reconnect) goes to the next node
    of the list, which the process shuffled: after a failure the next node is tried at
    once, and a round in which every node failed waits a full-jitter backoff
    (``workers.core.backoff``), on top of the connection's reconnect interval. Each
    attempt is reported (``broker.connect_retry``, ``broker.connected``) to the
    :class:`startup.Patience` in force when it was made, with the node's address and
    never its credentials. At start-up a refused login gives up at once (:func:`refusal`);
    a command gives up once every node failed; a worker keeps trying (``gave_up``
    stays pending)."""

    CHANNEL_CLASS = _Channel

    def __init__(
        self,
        nodes: Sequence[str],
        *,
        worker: str,
        user: str,
        patience: startup.Patience,
        **kwargs: Any,
    ) -> None:
        super().__init__(URL(nodes[0]), **kwargs)
        self._nodes = [(URL(n), amqp_url.parse(n).nodes[0].address) for n in nodes]
        self._turn = 0
        self._failures = 0  # consecutive failed attempts
        self._delay = 0.0  # before the next attempt
        self._errors: dict[str, str] = {}  # node -> why its last attempt failed
        self._worker = worker
        self._user = user
        self._patience = patience
        self.node = ""  # the node the connection is on (or was on last)
        self.ever_connected = False
        self._lost_at: float | None = None  # monotonic time of the last loss
        self.gave_up: asyncio.Future[errors.CustodyError] = self.loop.create_future()

    async def _RobustConnection__connect_transport(self) -> None:  # noqa: N802 (aio-pika's)
        if self._delay:
            await asyncio.sleep(self._delay)
        url, node = self._nodes[self._turn % len(self._nodes)]
        self._turn += 1
        self.url = url
        try:
            await getattr(super(), _TRANSPORT_STEP)()
        except Exception as exc:
            self._failed(node, exc)
            raise
        lost_at = self._lost_at
        down: dict[str, Any] = {}
        if lost_at is not None:
            down["down_s"] = round(time.monotonic() - lost_at, 3)
        self._patience.report(
            "broker.connected",
            worker=self._worker,
            node=node,
            phase="reconnect" if self.ever_connected else "start",
            failed_attempts=self._failures,
            **down,
        )
        self._lost_at = None
        self.node, self.ever_connected = node, True
        self._failures, self._delay = 0, 0.0
        self._errors.clear()

    async def _on_connection_close(self, closing: asyncio.Future[Any]) -> None:
        """A connection that closed without custody closing it: ``broker.connection_lost``
        (the robust connection then reconnects; ``broker.connected`` with phase
        ``reconnect`` says when it is back)."""
        lost = not self._close_called and not self.is_closed
        try:
            cause: BaseException | None = closing.exception()
        except (asyncio.CancelledError, asyncio.InvalidStateError) as exc:
            cause = exc
        if lost:
            self._lost_at = time.monotonic()
            self._patience.report(
                "broker.connection_lost",
                logging.WARNING,
                worker=self._worker,
                node=self.node,
                error=_why(cause)[:300] if cause is not None else "closed",
            )
        await super()._on_connection_close(closing)

    def _failed(self, node: str, exc: BaseException) -> None:
        self._failures += 1
        why = _why(exc)
        self._errors[node] = why
        starting = not self.ever_connected
        refused = refusal(exc, user=self._user, node=node) if starting else None
        if refused is not None:
            self._give_up(errors.ConfigError(refused))
            return
        if starting and not self._patience.wait and self._failures >= len(self._nodes):
            if len(self._nodes) == 1:
                detail = str(exc) or why
            else:
                tried = "; ".join(f"{n}: {e}" for n, e in self._errors.items())
                detail = f"every node failed: {tried}"
            self._give_up(
                errors.BrokerError(f"cannot connect to RabbitMQ: {detail}", errors.Retry.RETRY)
            )
            return
        self._delay = backoff.before_attempt(self._failures, nodes=len(self._nodes))
        if starting and self._patience.wait:
            self._patience.waiting["broker"] = f"{node}: {why}"[:300]
        self._patience.report(
            "broker.connect_retry",
            logging.WARNING,
            worker=self._worker,
            node=node,
            phase="start" if starting else "reconnect",
            attempt=self._failures,
            retry_in_s=round(self._delay + float(self.reconnect_interval), 3),
            error=why[:300],
        )

    def _give_up(self, error: errors.CustodyError) -> None:
        if not self.gave_up.done():
            self.gave_up.set_result(error)


_NODE_ORDER: Final = random.SystemRandom()


class Broker:
    """A robust connection (to one node, or to one node of a list at a time); channels
    for consuming and for confirmed publishing."""

    def __init__(self, url: str, name: str, tls: Tls | None = None) -> None:
        self.url = url
        self.name = name
        self.tls = tls
        self._conn: NodesConnection | None = None

    async def connect(self) -> None:
        """Connect to one node of the URL. In a worker (``supervisor.run``) this waits
        for as long as the broker is unreachable; elsewhere it fails after one attempt
        per node. A refused login fails at once, everywhere (a :class:`ConfigError`)."""
        address = amqp_url.parse(self.url)
        context = self.tls.context() if self.tls and self.tls.enabled else None
        if context is not None and address.scheme != "amqps":
            raise errors.ConfigError(
                "TLS files are configured, but CUSTODY_AMQP_URL is not amqps://"
            )
        # a lost connection is restored within a second (aio-pika's default is 5 s); the
        # URL's own ``reconnect_interval`` wins
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(address.node_urls()[0]).query)
        interval = None if "reconnect_interval" in query else RECONNECT_INTERVAL_S
        patience = startup.current()
        conn = NodesConnection(
            address.shuffled(_NODE_ORDER),
            worker=self.name,
            user=address.user,
            patience=patience,
            client_properties={"connection_name": f"custody-{self.name}"},
            ssl_context=context,
            reconnect_interval=interval,
            fail_fast=False,
        )
        waiting = patience.waiting_for("broker") if patience.wait else contextlib.nullcontext()
        with waiting:
            connecting = asyncio.ensure_future(conn.connect(timeout=CONNECT_TIMEOUT_S))
            either: set[asyncio.Future[Any]] = {connecting, conn.gave_up}
            try:
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
                if conn.gave_up.done():
                    raise conn.gave_up.result()
                await connecting
            except BaseException:
                connecting.cancel()
                await asyncio.gather(connecting, return_exceptions=True)
                with contextlib.suppress(Exception):
                    await conn.close()
                raise
        self._conn = conn

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.is_closed and self._conn.connected.is_set()

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()

    @property
    def node(self) -> str:
        """The node (``host:port``) the connection is on, or was on last."""
        return "" if self._conn is None else self._conn.node

    def _connection(self) -> AbstractRobustConnection:
        if self._conn is None:
            raise errors.BrokerError("not connected", errors.Retry.FATAL)
        return self._conn

    @contextlib.asynccontextmanager
    async def consume(
        self, queues: Sequence[str], prefetch: int
    ) -> AsyncIterator[asyncio.Queue[Delivery]]:
        """Deliveries of ``queues`` into an asyncio queue, manual ack; cancelled on exit."""
        inbox: asyncio.Queue[Delivery] = asyncio.Queue()
        tags: list[tuple[aio_pika.abc.AbstractQueue, str]] = []
        channel: AbstractChannel | None = None
        ledger = Ledger()

        def on_message(message: DeliveredMessage) -> None:
            ledger.received(message)
            for delivery in _deliveries(message):
                delivery._ledger = ledger
                inbox.put_nowait(delivery)

        async def cleanup() -> None:
            # With the broker gone, the consumers and the channel went with the
            # connection: nothing to cancel, and a robust channel's cancel would wait
            # for a reconnect (a worker stopped during an outage would hold its drain
            # for the whole grace). Bounded either way: the connection's close ends all.
            if not self.connected:
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CLEANUP_TIMEOUT_S):
                    for queue, tag in tags:
                        with contextlib.suppress(Exception):
                            await queue.cancel(tag)
                    if channel is not None:
                        with contextlib.suppress(Exception):
                            await channel.close()

        try:
            channel = await self._connection().channel()
            await channel.set_qos(prefetch_count=prefetch)
            for name in queues:
                queue = cast(_LeanQueue, await channel.get_queue(name, ensure=True))
                tags.append((queue, await queue.consume(on_message, no_ack=False, raw=True)))
        except Exception as exc:
            if not is_transport_error(exc):
                raise
            await cleanup()
            raise errors.BrokerError(
                f"consume {list(queues)}: {type(exc).__name__}: {exc}", errors.Retry.RETRY
            ) from exc
        try:
            yield inbox
        finally:
            await cleanup()

    @contextlib.asynccontextmanager
    async def browse(
        self, queue: str, limit: int, quiet_s: float = 1.0
    ) -> AsyncIterator[list[Delivery]]:
        """The first ``limit`` messages of ``queue``, held unacked on a channel of their
        own: the caller may ack some (a replay); closing the channel on exit returns the
        others to the queue and loses none (a crash closes it too).

        A quorum queue serves returned messages first, in the order they came back, so
        holding *every* message (``limit`` at least the depth) returns them in their
        order; a partial browse of a queue that had returns moves the browsed ones
        behind the others. Each return counts one delivery (``x-delivery-count``):
        browse only a queue that no ``delivery-limit`` applies to (the custody policy
        leaves the dead letters out)."""
        channel: AbstractChannel | None = None
        held: list[Delivery] = []
        try:
            channel = await self._connection().channel()
            await channel.set_qos(prefetch_count=max(1, limit))
            q = await channel.declare_queue(queue, passive=True)
            expected = min(limit, q.declaration_result.message_count or 0)
            inbox: asyncio.Queue[DeliveredMessage] = asyncio.Queue()
            if expected:
                # a plain consumer: what it took stays unacked until the channel closes
                # (aio-pika's iterator would nack its buffer one by one on exit)
                lean = cast(_LeanQueue, q)
                await lean.consume(inbox.put_nowait, no_ack=False, robust=False, raw=True)
            taken = 0  # messages: an envelope is held as its items
            while taken < expected:
                try:
                    held += _deliveries(await asyncio.wait_for(inbox.get(), quiet_s))
                except TimeoutError:
                    break
                taken += 1
        except Exception as exc:
            if channel is not None:
                with contextlib.suppress(Exception):
                    await channel.close()
            if not is_transport_error(exc):
                raise
            raise errors.BrokerError(
                f"browse {queue}: {type(exc).__name__}: {exc}", errors.Retry.FATAL
            ) from exc
        try:
            yield held
        finally:
            with contextlib.suppress(Exception):
                await channel.close()

    async def publisher(
        self, *, window: int, timeout_s: float, user_id: str | None, envelope_max: int = 1
    ) -> Publisher:
        return Publisher(
            self, window=window, timeout_s=timeout_s, user_id=user_id, envelope_max=envelope_max
        )

    async def _confirm_channel(self) -> AbstractChannel:
        return await self._connection().channel(publisher_confirms=True, on_return_raises=True)


class Publisher:
    """Confirmed publishing with a bounded window of unconfirmed messages.

    With ``envelope_max`` above 1, the messages of one :meth:`publish_many` call for the
    same exchange, routing key and tenant leave in envelopes of up to that many
    (``workers.core.envelope``; never a dead letter, nor a message alone), each item
    with the outcome of its envelope's confirm."""

    def __init__(
        self,
        broker: Broker,
        *,
        window: int,
        timeout_s: float,
        user_id: str | None,
        envelope_max: int = 1,
    ) -> None:
        self._envelope_max = min(envelope_max, envelope.MAX_ITEMS)
        self._broker = broker
        self._window = asyncio.Semaphore(window)
        self._timeout_s = timeout_s
        self._user_id = user_id
        self._channel: AbstractChannel | None = None

    async def _ready(self) -> AbstractChannel:
        if self._channel is None or self._channel.is_closed:
            self._channel = await self._broker._confirm_channel()
        return self._channel

    async def publish_many(self, items: Sequence[Outgoing]) -> list[Outcome]:
        """Publish all; each outcome is ok only on a positive, non-returned confirm."""
        try:
            underlay = await (await self._ready()).get_underlay_channel()
        except Exception as exc:
            if not is_transport_error(exc):
                raise
            return [Outcome(i.message_id, False, f"channel: {exc}") for i in items]
        assert isinstance(underlay, aiormq.Channel)
        if len(items) == 1:
            # a lone publish is queued for the writer from this task's own turn, not
            # from a task of its own one turn later (light load: every publish)
            return [await self._one(underlay, items[0])]
        if self._envelope_max < 2:
            return list(await asyncio.gather(*(self._one(underlay, i) for i in items)))
        messages = self._envelopes(items)
        sent = await asyncio.gather(*(self._one(underlay, m, ct) for m, ct, _ in messages))
        outcome: dict[int, Outcome] = {}
        for (_, _, inside), result in zip(messages, sent, strict=True):
            for i in inside:
                outcome[id(i)] = Outcome(i.message_id, result.ok, result.error)
        return [outcome[id(i)] for i in items]

    def _envelopes(self, items: Sequence[Outgoing]) -> list[tuple[Outgoing, str, list[Outgoing]]]:
        """The messages to publish for ``items``: those for one exchange, routing key and
        tenant in envelopes of up to ``envelope_max`` items and
        ``envelope.MAX_PACKED_BYTES`` of bodies, in their order; a dead letter, an item
        whose headers an envelope cannot carry, a large one and one left alone as they
        are. Each with its content type and the items it carries."""

        def route(i: Outgoing) -> tuple[str, str, str | None] | None:
            if i.exchange == EXCHANGE_DEAD or not envelope.packable(i.headers):
                return None
            # one tenant's messages per envelope: a poison message, or an envelope a
            # consumer keeps failing, takes no other tenant's work to the dead letters
            return (i.exchange, i.routing_key, _tenant(i.body))

        out: list[tuple[Outgoing, str, list[Outgoing]]] = []
        for chunk in envelope.group(items, route, lambda i: len(i.body), self._envelope_max):
            if len(chunk) == 1:
                out.append((chunk[0], JSON, chunk))
                continue
            first = chunk[0]
            try:
                body = envelope.pack(
                    [envelope.Item(i.message_id, i.headers, i.body) for i in chunk]
                )
            except ValueError:  # a message id or headers too large for one: alone
                out += [(i, JSON, [i]) for i in chunk]
                continue
            limits = [i.not_after for i in chunk if i.not_after is not None]
            packed = Outgoing(
                first.message_id,
                first.exchange,
                first.routing_key,
                body,
                {},
                min(limits) if limits else None,
            )
            out.append((packed, envelope.CONTENT_TYPE, chunk))
        return out

    async def _one(
        self, channel: aiormq.Channel, item: Outgoing, content_type: str = JSON
    ) -> Outcome:
        # aiormq's own publish on the confirm channel that aio-pika keeps (and restores
        # after a reconnect), with the properties aio-pika's Message would send. Not
        # waiting for the socket drain (wait=False) lets the publishes of a window
        # leave in one write (amqp_writes); the window bounds what is in flight.
        properties = spec.Basic.Properties(
            content_type=content_type,
            delivery_mode=DeliveryMode.PERSISTENT.value,
            headers=dict(item.headers),
            message_id=item.message_id,
            priority=0,
            user_id=self._user_id,
        )
        async with self._window:
            if item.not_after is not None and time.monotonic() > item.not_after:
                # it waited for a place in the window (the broker is slow to confirm)
                # past what its claim allows: left to a later claim, with its checks
                return Outcome(item.message_id, False, f"{UNSENT}: its claim is too old")
            try:
                confirm = await channel.basic_publish(
                    item.body,
                    exchange=item.exchange,
                    routing_key=item.routing_key,
                    properties=properties,
                    mandatory=True,
                    timeout=self._timeout_s,
                    wait=False,
                )
            except aio_pika.exceptions.PublishError as exc:
                return Outcome(item.message_id, False, f"returned: {exc}")
            except aio_pika.exceptions.DeliveryError as exc:
                return Outcome(item.message_id, False, f"nacked: {exc}")
            except TimeoutError:
                return Outcome(item.message_id, False, "confirm timeout (outcome unknown)")
            except (ValueError, TypeError, OverflowError) as exc:  # not encodable: not sent
                return Outcome(item.message_id, False, f"unencodable: {type(exc).__name__}: {exc}")
            except Exception as exc:
                if not is_transport_error(exc):
                    raise
                return Outcome(item.message_id, False, f"channel: {type(exc).__name__}: {exc}")
        if not isinstance(confirm, spec.Basic.Ack):
            return Outcome(item.message_id, False, f"not confirmed: {confirm!r}")
        return Outcome(item.message_id, True)


# Topology -------------------------------------------------------------------------


def policy_definition(delivery_limit: int) -> dict[str, Any]:
    """The one policy for every custody queue: DLX and an explicit delivery limit.

    RabbitMQ 3.10 quorum queues have no default delivery limit, and a limit without a
    dead-letter exchange silently drops the poison message: set both, always.
    """
    return {
        "pattern": POLICY_PATTERN,
        "apply-to": "queues",
        "priority": 10,
        "definition": {
            "dead-letter-exchange": EXCHANGE_DEAD,
            "delivery-limit": delivery_limit,
            "dead-letter-strategy": "at-least-once",
            "overflow": "reject-publish",
        },
    }


def topology(bindings: Sequence[str]) -> dict[str, Any]:
    """Exchanges, quorum queues and bindings, as data (also written to definitions.json)."""
    exchanges = [
        {"name": EXCHANGE_COMMANDS, "type": "direct"},
        {"name": EXCHANGE_RECEIPTS, "type": "direct"},
        {"name": EXCHANGE_REQUESTS, "type": "direct"},
        {"name": EXCHANGE_DEAD, "type": "topic"},
    ]
    queues = [command_queue(b) for b in bindings] + [QUEUE_RECEIPTS, QUEUE_REQUESTS, QUEUE_DEAD]
    binds = (
        [(EXCHANGE_COMMANDS, command_queue(b), b) for b in bindings]
        + [(EXCHANGE_RECEIPTS, QUEUE_RECEIPTS, RECEIPTS_KEY)]
        + [
            (EXCHANGE_REQUESTS, QUEUE_REQUESTS, START_KEY),
            (EXCHANGE_REQUESTS, QUEUE_REQUESTS, CANCEL_KEY),
        ]
        + [(EXCHANGE_DEAD, QUEUE_DEAD, "#")]
    )
    return {"exchanges": exchanges, "queues": queues, "bindings": binds}


async def apply_topology(
    broker: Broker, bindings: Sequence[str], delivery_limit: int, management_url: str
) -> dict[str, Any]:
    """Declare everything idempotently, then set the queue policy. Returns what it did."""
    plan = topology(bindings)
    channel = await broker._connection().channel()
    try:
        for ex in plan["exchanges"]:
            await channel.declare_exchange(ex["name"], ex["type"], durable=True)
        for name in plan["queues"]:
            await channel.declare_queue(name, durable=True, arguments={"x-queue-type": "quorum"})
        for exchange, queue, key in plan["bindings"]:
            q = await channel.get_queue(queue, ensure=False)
            await q.bind(exchange, key)
    except aiormq.exceptions.AMQPError as exc:
        raise errors.BrokerError(f"topology: {exc}", errors.Retry.FATAL) from exc
    finally:
        await channel.close()
    vhost = vhost_of(broker.url)
    await management(
        management_url,
        "PUT",
        f"/api/policies/{_q(vhost)}/{POLICY_NAME}",
        policy_definition(delivery_limit),
    )
    return plan


ENGINE_USERS: Final = ("committer", "publisher", "receipts", "reconciler")


def permissions(principals: Mapping[str, str]) -> dict[str, tuple[str, str, str]]:
    """Least privilege on the broker: (configure, write, read) per broker user.

    Topology is declared by an administrator (``custody topology apply``), so no
    worker may configure anything. ``principals`` maps each participant's broker user
    to its binding.
    """

    def only(*names: str) -> str:
        return "^(" + "|".join(re.escape(n) for n in names) + ")$" if names else "^$"

    users = {
        # the committer publishes the submits it commits (its dead letters too)
        "custody-committer": ("^$", only(EXCHANGE_COMMANDS, EXCHANGE_DEAD), only(QUEUE_REQUESTS)),
        "custody-publisher": ("^$", only(EXCHANGE_COMMANDS), "^$"),
        # the receipt consumer publishes the submits of the successors it activates
        "custody-receipts": ("^$", only(EXCHANGE_COMMANDS, EXCHANGE_DEAD), only(QUEUE_RECEIPTS)),
        "custody-reconciler": ("^$", "^$", "^$"),
        # the workflow front end: start and cancel requests, nothing else
        "custody-frontend": ("^$", only(EXCHANGE_REQUESTS), "^$"),
        # an operator's `custody dead-letters`: reads the dead letters, replays one to
        # its original exchange (a start request, a command; never a receipt)
        "custody-operator": ("^$", only(EXCHANGE_COMMANDS, EXCHANGE_REQUESTS), only(QUEUE_DEAD)),
    }
    # a participant publishes receipts and consumes its own command queue, nothing
    # else: its poison commands are rejected and dead-lettered by the queue's policy
    # (the broker needs no permission of the participant for that)
    for principal, binding in principals.items():
        users[principal] = ("^$", only(EXCHANGE_RECEIPTS), only(command_queue(binding)))
    return users


def url_with_user(url: str, user: str, password: str) -> str:
    """The same broker URL (every node, vhost, options), as another user."""
    return str(amqp_url.parse(url).with_user(user, password))


def vhost_of(url: str) -> str:
    return amqp_url.parse(url).vhost


def user_of(url: str) -> str:
    return amqp_url.parse(url).user


def _q(value: str) -> str:
    return urllib.parse.quote(value, safe="")


async def management(base_url: str, method: str, path: str, body: Any = None) -> Any:
    """Call the RabbitMQ management HTTP API (policies, vhosts, users, queue depths). A
    URL with several nodes (``http://u:p@h1:15672,h2:15672``) is tried node by node until
    one answers: any node of a cluster answers for all of it."""
    bases = amqp_url.management_bases(base_url)

    def call() -> Any:
        unreachable = []
        data = None if body is None else json.dumps(body).encode()
        for base, user, password in bases:
            request = urllib.request.Request(f"{base}{path}", data=data, method=method)
            token = base64.b64encode(f"{user}:{password}".encode()).decode()
            request.add_header("Authorization", f"Basic {token}")
            request.add_header("Content-Type", "application/json")
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    raw = response.read()
            except urllib.error.HTTPError as exc:
                detail = exc.read().decode(errors="replace")[:500]
                raise errors.BrokerError(
                    f"management {method} {path}: HTTP {exc.code} {detail}", errors.Retry.FATAL
                ) from exc
            except OSError as exc:
                unreachable.append(f"{base}: {exc}")
                continue
            return json.loads(raw) if raw else None
        raise errors.BrokerError(
            f"management API unreachable: {'; '.join(unreachable)}", errors.Retry.RETRY
        )

    return await asyncio.to_thread(call)


async def ensure_vhost(management_url: str, vhost: str, users: Sequence[str]) -> None:
    await management(management_url, "PUT", f"/api/vhosts/{_q(vhost)}", {})
    for user in users:
        await management(
            management_url,
            "PUT",
            f"/api/permissions/{_q(vhost)}/{_q(user)}",
            {"configure": ".*", "write": ".*", "read": ".*"},
        )


async def delete_vhost(management_url: str, vhost: str) -> None:
    with contextlib.suppress(errors.BrokerError):
        await management(management_url, "DELETE", f"/api/vhosts/{_q(vhost)}")


async def ensure_user(
    management_url: str,
    user: str,
    password: str,
    vhost: str,
    *,
    configure: str,
    write: str,
    read: str,
) -> None:
    await management(
        management_url, "PUT", f"/api/users/{_q(user)}", {"password": password, "tags": ""}
    )
    await management(
        management_url,
        "PUT",
        f"/api/permissions/{_q(vhost)}/{_q(user)}",
        {"configure": configure, "write": write, "read": read},
    )


async def queue_depths(management_url: str, vhost: str) -> dict[str, int]:
    rows = await management(management_url, "GET", f"/api/queues/{_q(vhost)}?columns=name,messages")
    return {r["name"]: int(r.get("messages") or 0) for r in rows or []}


async def publish_raw(
    broker: Broker,
    exchange: str,
    routing_key: str,
    body: bytes,
    *,
    message_id: str | None = None,
    user_id: str | None = None,
    headers: Mapping[str, Any] | None = None,
) -> bool:
    """One confirmed publish outside any outbox (clients, tests, the demo's starts)."""
    publisher = Publisher(broker, window=1, timeout_s=10, user_id=user_id)
    [outcome] = await publisher.publish_many(
        [Outgoing(message_id or "", exchange, routing_key, body, headers or {})]
    )
    return outcome.ok


def tls(settings: Settings) -> Tls:
    """The broker TLS material ``settings`` name (none: plain AMQP)."""
    return Tls(settings.amqp_tls_ca_file, settings.amqp_tls_cert_file, settings.amqp_tls_key_file)
