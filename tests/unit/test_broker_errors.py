"""What counts as a broker outage (retried, the message stays on the broker) and what is
a bug (raised): aio-pika's own state errors while a robust connection reconnects are the
first, a RuntimeError from custody's code is the second (issue 11: RuntimeError left the
catch-all tuples)."""

from __future__ import annotations

import asyncio

import aio_pika
import aiormq
import pytest

from workers.io.broker import is_transport_error


def test_a_runtime_error_raised_inside_aio_pika_is_a_transport_error() -> None:
    """aio-pika raises bare RuntimeErrors about its own state ("Connection was not
    opened", "Collection frozen"): raised inside the client, they are transport errors."""

    class Sender:
        pass

    sender = Sender()
    callbacks: aio_pika.tools.CallbackCollection[Sender, []] = aio_pika.tools.CallbackCollection(
        sender
    )
    callbacks.freeze()
    with pytest.raises(RuntimeError) as raised:
        callbacks.add(lambda *_: None)
    assert is_transport_error(raised.value)


async def test_a_future_aiormq_fails_without_a_reason_is_a_transport_error() -> None:
    """aiormq fails the futures of a channel or connection that closes without a reason
    (a publish's confirm among them) with a bare ``Exception``: awaited inside the
    client, it is a transport error (a chaos run's receipt consumer crashed on one, its
    sender's confirm, while RabbitMQ restarted); a bare Exception of custody's own is a
    bug."""
    store = aiormq.base.FutureStore(asyncio.get_running_loop())
    confirm = store.create_future()
    await store.reject_all(None)
    with pytest.raises(Exception) as raised:  # noqa: PT011 (the bare Exception is the point)
        await aiormq.tools.awaitable(lambda: confirm)()
    assert type(raised.value) is Exception
    assert is_transport_error(raised.value)

    def ours() -> None:
        raise Exception()

    with pytest.raises(Exception) as raised:  # noqa: PT011
        ours()
    assert not is_transport_error(raised.value)


def test_a_runtime_error_of_custodys_own_is_a_bug() -> None:
    def ours() -> None:
        raise RuntimeError("operation changed under its row lock")

    with pytest.raises(RuntimeError) as raised:
        ours()
    assert not is_transport_error(raised.value)
    assert not is_transport_error(RuntimeError("never raised"))


@pytest.mark.parametrize(
    ("exc", "transport"),
    [
        (ConnectionResetError("reset"), True),
        (aiormq.exceptions.ChannelInvalidStateError("closed"), True),
        (aiormq.exceptions.AMQPConnectionError("gone"), True),
        (ValueError("bad"), False),
        (KeyError("x"), False),
    ],
)
def test_the_client_errors_are_transport_errors(exc: BaseException, transport: bool) -> None:
    assert is_transport_error(exc) is transport
