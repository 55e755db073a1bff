"""``custody dead-letters``: read the dead-letter queue without losing or reordering a
message, and replay one through the normal path, authorized and audited.

Reading holds every dead letter unacked on a channel of its own and closes it: the
broker returns them all, in their order (``broker.Broker.browse``); the custody policy's
``delivery-limit`` does not apply to ``custody.dead-letters``, so reading never pushes
one toward a limit. A replay: the database authorizes it (as the operator's login;
a refusal is audited), the message is published with a confirm to its original
exchange and routing key (same message_id, body and headers), the database records
the replay (the audit row), and only then is the dead letter acked. A crash in
between leaves a duplicate, which the consumers' deterministic identities absorb;
nothing is lost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from workers.core import deadletters
from workers.engine import transitions
from workers.io import broker, db

MAX_BROWSE: Final = 10_000  # a deeper dead-letter queue is read by its first messages


@dataclass(frozen=True)
class Listing:
    depth: int  # the letters held: messages, each item of an envelope one (MAX_BROWSE messages)
    letters: list[deadletters.DeadLetter]


def _letter(d: broker.Delivery) -> deadletters.DeadLetter:
    return deadletters.DeadLetter.from_message(d.message_id, d.headers, d.body, d.undecodable)


async def read(amqp: broker.Broker) -> Listing:
    """Every dead letter (up to MAX_BROWSE), left in the queue as it was."""
    async with amqp.browse(broker.QUEUE_DEAD, MAX_BROWSE) as held:
        letters = [_letter(d) for d in held]
    return Listing(len(letters), letters)


@dataclass(frozen=True)
class Replayed:
    message_id: str
    result: str  # done, refused, not_found, failed
    message: str

    def row(self) -> dict[str, Any]:
        return {"message_id": self.message_id, "result": self.result, "message": self.message}


async def replay(
    amqp: broker.Broker,
    database: db.Database,
    message_ids: Sequence[str],
    reason: str,
    *,
    confirm_timeout_s: float,
) -> list[Replayed]:
    """Replay the dead letters with these message ids (each one held: a duplicate id
    is replayed once per copy, each audited)."""
    out: list[Replayed] = []
    operator = transitions.Operator(database)
    publisher = await amqp.publisher(window=1, timeout_s=confirm_timeout_s, user_id=None)
    async with amqp.browse(broker.QUEUE_DEAD, MAX_BROWSE) as held:
        wanted = set(message_ids)
        for d in held:
            if d.message_id not in wanted:
                continue
            letter = _letter(d)
            out.append(await _replay_one(operator, publisher, d, letter, reason))
        found = {d.message_id for d in held}
        out += [
            Replayed(m, "not_found", f"no dead letter with message_id {m}")
            for m in dict.fromkeys(message_ids)
            if m not in found
        ]
    return out


async def _replay_one(
    operator: transitions.Operator,
    publisher: broker.Publisher,
    d: broker.Delivery,
    letter: deadletters.DeadLetter,
    reason: str,
) -> Replayed:
    why = letter.unreplayable()
    detail: dict[str, Any] = {"dead_letter_reason": letter.reason, "worker": letter.worker}
    if why is not None:
        detail["unreplayable"] = why
    params = {
        "message_id": letter.message_id,
        "exchange": letter.exchange,
        "routing_key": letter.routing_key,
        "reason": reason,
        "detail": db.jsonb(detail),
    }
    asked = await operator.call("dead_letter_replay", None, {**params, "published": False})
    if asked.result is not transitions.Result.DONE:
        return Replayed(letter.message_id, asked.result.value, asked.message)
    [sent] = await publisher.publish_many(
        [
            broker.Outgoing(
                letter.message_id,
                letter.exchange,
                letter.routing_key,
                letter.body,
                letter.replay_headers(),
            )
        ]
    )
    if not sent.ok:
        # not confirmed: the dead letter stays where it is (unacked, returned)
        return Replayed(letter.message_id, "failed", f"not replayed: {sent.error}")
    done = await operator.call("dead_letter_replay", None, {**params, "published": True})
    await d.ack()
    return Replayed(letter.message_id, done.result.value, done.message)
