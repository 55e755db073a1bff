"""Dead letters (``custody.dead-letters``): where one came from, why, and whether and how
it may be replayed. Pure: ``workers.io.broker`` reads the queue and
``workers.engine.deadletters`` replays.

Two kinds reach the queue. An engine worker publishes its poison message to
``custody.dead`` itself, with ``x-custody-reason``, ``-worker``, ``-routing-key`` and
``-exchange`` headers (``workers.runtime.consume``); a participant rejects its poison
command and the queue's policy dead-letters it, with RabbitMQ's ``x-death``. A replay
publishes the same message_id, body and headers (without the dead-letter ones) to the
original exchange and routing key: the consumers deduplicate by deterministic
identities, so a replay (or a duplicate of one) is applied at most once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

# the exchanges a replay may publish to (workers.io.broker's names, checked by a test)
COMMANDS: Final = "custody.commands"
REQUESTS: Final = "custody.requests"
RECEIPTS: Final = "custody.receipts"
CANCEL_KEY: Final = "cancel"
# dead letters of an earlier release carry no x-custody-exchange: the worker tells it
LEGACY_EXCHANGES: Final = {"committer": REQUESTS, "receipts": RECEIPTS}
# set by the broker, or by the dead-lettering worker: never replayed
DEATH_HEADERS: Final = frozenset(
    {
        "x-death",
        "x-delivery-count",
        "x-first-death-exchange",
        "x-first-death-queue",
        "x-first-death-reason",
        "x-last-death-exchange",
        "x-last-death-queue",
        "x-last-death-reason",
    }
)
CUSTODY_PREFIX: Final = "x-custody-"
# what the dead-lettering worker says of a dead letter (workers.runtime.consume)
CUSTODY_HEADERS: Final = frozenset(
    CUSTODY_PREFIX + k for k in ("reason", "worker", "routing-key", "exchange")
)


@dataclass(frozen=True)
class DeadLetter:
    message_id: str
    reason: str  # x-custody-reason, or x-death's reason (rejected, delivery_limit, ...)
    worker: str  # the worker that dead-lettered it, or the queue it died in
    exchange: str  # where it was first published: where a replay goes
    routing_key: str
    deaths: int
    deliveries: int  # returns to the dead-letter queue (each list counts one)
    body: bytes
    headers: Mapping[str, Any] = field(default_factory=dict)
    undecodable: str | None = None

    @classmethod
    def from_message(
        cls,
        message_id: str | None,
        headers: Mapping[str, Any],
        body: bytes,
        undecodable: str | None = None,
    ) -> DeadLetter:
        deaths = headers.get("x-death")
        death: Mapping[str, Any] = {}
        if isinstance(deaths, list) and deaths and isinstance(deaths[0], Mapping):
            death = deaths[0]  # the most recent
        keys = death.get("routing-keys")
        worker = str(headers.get("x-custody-worker") or "")
        exchange = headers.get("x-custody-exchange") or LEGACY_EXCHANGES.get(worker, "")
        if death:
            exchange = death.get("exchange", "")
            routing_key = str(keys[0]) if isinstance(keys, list) and keys else ""
            worker = worker or str(death.get("queue", ""))
            reason = str(headers.get("x-custody-reason") or death.get("reason", ""))
        else:
            routing_key = str(headers.get("x-custody-routing-key") or "")
            reason = str(headers.get("x-custody-reason") or "")
        return cls(
            message_id=message_id or "",
            reason=reason,
            worker=worker,
            exchange=str(exchange),
            routing_key=routing_key,
            deaths=int(death.get("count", 1) or 1) if death else 1,
            deliveries=_int(headers.get("x-delivery-count")),
            body=body,
            headers=dict(headers),
            undecodable=undecodable,
        )

    def unreplayable(self) -> str | None:
        """Why this dead letter may not be replayed, or None."""
        if self.undecodable is not None:
            return f"its properties are undecodable ({self.undecodable}): it cannot be re-sent"
        if not self.message_id:
            return "it has no message_id: its consumer could not deduplicate a replay"
        if self.exchange == RECEIPTS:
            return (
                "a receipt is authenticated by its participant's broker user, which a replay "
                "cannot carry: reconcile its operation instead (custody reconcile)"
            )
        if self.exchange == REQUESTS and self.routing_key == CANCEL_KEY:
            return (
                "a cancel request is authorized as its publisher's broker user, which a "
                "replay cannot carry: send it again (or custody cancel-start)"
            )
        if self.exchange not in (COMMANDS, REQUESTS) or not self.routing_key:
            return f"no original destination to replay to (exchange {self.exchange!r})"
        return None

    def replay_headers(self) -> dict[str, Any]:
        """Its headers, without the dead-letter ones."""
        return {
            k: v
            for k, v in self.headers.items()
            if k not in DEATH_HEADERS and not k.startswith(CUSTODY_PREFIX)
        }

    def summary(self) -> dict[str, Any]:
        return {
            "message_id": self.message_id,
            "reason": self.reason,
            "worker": self.worker,
            "exchange": self.exchange,
            "routing_key": self.routing_key,
            "deaths": self.deaths,
            "deliveries": self.deliveries,
            "bytes": len(self.body),
        }


def _int(value: Any) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0
