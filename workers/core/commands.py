"""The executor adapter: Submit, Query and Cancel against the same immutable command
and the pinned route (the seed's IExecutorAdapter).

The AMQP adapter writes each command as an outbox row plus the record that the
request id was issued (``attempts``), to be committed by the caller's transaction:
every command, recovery ones included, leaves through the outbox and the confirmed
publisher like any other. Pure: it builds rows, it performs no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, Literal

from contracts import codec, identity
from contracts.models import (
    CancelCommand,
    Lineage,
    QueryCommand,
    SubmitCommand,
    Target,
)
from workers.core import tracing

EXCHANGE_COMMANDS: Final = "custody.commands"  # workers.io.broker declares it


@dataclass(frozen=True)
class Pinned:
    """The immutable command identity of one attempt of an operation, as pinned."""

    operation_id: str
    tenant: str
    attempt: int
    operation: str
    route: str
    owner: str
    binding: str
    input: Mapping[str, Any]
    lineage: Mapping[str, Any]

    @classmethod
    def from_row(cls, row: Mapping[str, Any], attempt: int | None = None) -> Pinned:
        return cls(
            operation_id=str(row["id"]),
            tenant=row["tenant"],
            attempt=attempt or row["attempt"],
            operation=row["operation"],
            route=row["route"],
            owner=row["owner"],
            binding=row["binding"],
            input=row["input"],
            lineage=row["lineage"],
        )

    @property
    def target(self) -> Target:
        return Target(route=self.route, owner=self.owner, binding=self.binding)

    @property
    def submit_request_id(self) -> str:
        return identity.request_id(self.operation_id, self.attempt, "submit")

    def digest(self) -> str:
        return self._submit().semantic_digest()

    def _submit(self) -> SubmitCommand:
        return SubmitCommand(
            request_id=self.submit_request_id,
            tenant=self.tenant,
            operation_id=self.operation_id,
            attempt=self.attempt,
            operation=self.operation,
            target=self.target,
            digest="0" * 64,
            issued_at=datetime.now(UTC),
            input=dict(self.input),
            lineage=Lineage.model_validate(self.lineage, strict=False),
        )


@dataclass(frozen=True)
class CommandRows:
    """What one command writes: the issued identity and the dispatch intent."""

    request_id: str
    digest: str
    attempt_row: dict[str, Any]
    outbox_row: dict[str, Any]


def _rows(
    pinned: Pinned, kind: str, request_id: str, digest: str, body: bytes, traceparent: str | None
) -> CommandRows:
    return CommandRows(
        request_id=request_id,
        digest=digest,
        attempt_row={
            "request_id": request_id,
            "operation_id": pinned.operation_id,
            "attempt": pinned.attempt,
            "kind": kind,
            "digest": digest,
        },
        outbox_row={
            "id": request_id,
            "kind": kind,
            "exchange": EXCHANGE_COMMANDS,
            "routing_key": pinned.binding,
            "body": body,
            "headers": {"traceparent": tracing.child(traceparent)},
            "operation_id": pinned.operation_id,
        },
    )


def submit(pinned: Pinned, *, traceparent: str | None = None) -> CommandRows:
    command = pinned._submit()
    command = command.model_copy(update={"digest": command.semantic_digest()})
    return _rows(
        pinned, "submit", command.request_id, command.digest, codec.encode(command), traceparent
    )


def _about_the_submit(
    pinned: Pinned, kind: Literal["query", "cancel"], sequence: int
) -> dict[str, Any]:
    """The fields a query or a cancel shares: the same immutable command identity."""
    return {
        "request_id": identity.request_id(pinned.operation_id, pinned.attempt, kind, sequence),
        "tenant": pinned.tenant,
        "operation_id": pinned.operation_id,
        "attempt": pinned.attempt,
        "operation": pinned.operation,
        "target": pinned.target,
        "digest": pinned.digest(),
        "issued_at": datetime.now(UTC),
        "submit_request_id": pinned.submit_request_id,
    }


def query(pinned: Pinned, *, sequence: int, traceparent: str | None = None) -> CommandRows:
    command = QueryCommand(**_about_the_submit(pinned, "query", sequence))
    return _rows(
        pinned, "query", command.request_id, command.digest, codec.encode(command), traceparent
    )


def cancel(
    pinned: Pinned, *, sequence: int, reason: str, traceparent: str | None = None
) -> CommandRows:
    command = CancelCommand(**_about_the_submit(pinned, "cancel", sequence), reason=reason[:2000])
    return _rows(
        pinned, "cancel", command.request_id, command.digest, codec.encode(command), traceparent
    )
