"""Frozen wire models: commands, receipts, query answers, start requests, routes.

Every message carries a literal ``type`` with its version; unknown versions are
refused, never guessed. Models are strict (no coercion) and forbid extra keys.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints
from pydantic_core import PydanticCustomError

from contracts import digest

UUID_PATTERN = r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"
Id = Annotated[str, StringConstraints(pattern=UUID_PATTERN)]
Name = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9_.\-]{0,62}$")]
Tenant = Name
Digest = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
Text = Annotated[str, StringConstraints(max_length=2000)]
Attempt = Annotated[int, Field(ge=1, le=10_000)]
# Every integer is bounded by the column that stores it (Postgres int4), so an absurd
# value is refused by the contract, never by the database halfway through a batch.
Positive = Annotated[int, Field(ge=1, le=2**31 - 1)]


def _json_object(value: dict[str, Any]) -> dict[str, Any]:
    try:
        # depth 1: inside a command the input sits one level below the digested object
        digest.check_json_value(value, depth=1)
    except digest.CanonicalFormError as exc:
        raise PydanticCustomError("non_canonical_value", str(exc)) from None
    return value


JsonObject = Annotated[dict[str, Any], AfterValidator(_json_object)]

CommandStatus = Literal["accepted", "succeeded", "failed", "cancelled", "rejected"]
Effect = Literal["none", "applied", "unknown"]


class Contract(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class Target(Contract):
    """The pinned executor of an operation: route name, owner and broker binding."""

    route: Name
    owner: Name
    binding: Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9_.\-]{0,120}$")]


class Lineage(Contract):
    """The business lineage that makes an operation's identity deterministic."""

    instance_id: Id
    process: Name
    process_version: Positive
    node: Name
    activation: Positive


class _CommandBase(Contract):
    request_id: Id
    tenant: Tenant
    operation_id: Id
    attempt: Attempt
    operation: Name
    target: Target
    digest: Digest
    issued_at: datetime


class SubmitCommand(_CommandBase):
    """Execute the operation: the immutable input and lineage are bound by ``digest``."""

    type: Literal["custody.command.submit.v1"] = "custody.command.submit.v1"
    input: JsonObject
    lineage: Lineage
    deadline: datetime | None = None

    def semantic_digest(self) -> str:
        """Recompute the digest from the command's own fields."""
        return digest.command_digest(
            tenant=self.tenant,
            operation_id=self.operation_id,
            attempt=self.attempt,
            operation=self.operation,
            route=self.target.route,
            owner=self.target.owner,
            binding=self.target.binding,
            input=self.input,
            lineage=self.lineage.model_dump(mode="json"),
        )


class QueryCommand(_CommandBase):
    """Ask the pinned executor for its durable state of the submit ``submit_request_id``."""

    type: Literal["custody.command.query.v1"] = "custody.command.query.v1"
    submit_request_id: Id


class CancelCommand(_CommandBase):
    """Ask the pinned executor to settle the submit ``submit_request_id`` as cancelled."""

    type: Literal["custody.command.cancel.v1"] = "custody.command.cancel.v1"
    submit_request_id: Id
    reason: Text


ServiceCommand = Annotated[
    SubmitCommand | QueryCommand | CancelCommand, Field(discriminator="type")
]


class ReceiptError(Contract):
    code: Name
    message: Text


class OperationReceipt(Contract):
    """A participant's durable statement about one command identity.

    ``owner_revision`` increases with every new statement the owner makes about the
    operation; a repeated statement keeps its revision and its ``receipt_id``.
    """

    type: Literal["custody.receipt.v1"] = "custody.receipt.v1"
    receipt_id: Id
    tenant: Tenant
    operation_id: Id
    attempt: Attempt
    request_id: Id
    in_reply_to: Id
    owner: Name
    principal: Name
    command_digest: Digest
    owner_revision: Positive
    status: CommandStatus
    effect: Effect
    result: JsonObject | None = None
    error: ReceiptError | None = None
    emitted_at: datetime

    def content(self) -> dict[str, Any]:
        """The statement without transport facts: equal revisions must agree on it."""
        return self.model_dump(mode="json", exclude={"receipt_id", "in_reply_to", "emitted_at"})


class QueryAnswer(Contract):
    """The answer to a query: the owner's latest receipt, or ``None`` (no receipt).

    ``None`` means no receipt was returned; it is not proof that no effect occurred.
    """

    type: Literal["custody.query-answer.v1"] = "custody.query-answer.v1"
    answer_id: Id
    tenant: Tenant
    operation_id: Id
    attempt: Attempt
    request_id: Id
    in_reply_to: Id
    owner: Name
    principal: Name
    receipt: OperationReceipt | None
    emitted_at: datetime


ReceiptMessage = Annotated[OperationReceipt | QueryAnswer, Field(discriminator="type")]


class StartRequest(Contract):
    """Ask the engine to start an instance of a process for a tenant."""

    type: Literal["custody.start.v1"] = "custody.start.v1"
    tenant: Tenant
    start_request_id: Id
    process: Name
    input: JsonObject
    requested_by: Name


class CancelRequest(Contract):
    """Ask the engine to cancel the instance started by ``start_request_id`` — or, if
    that start has not arrived yet, to make sure it never creates anything."""

    type: Literal["custody.cancel.v1"] = "custody.cancel.v1"
    tenant: Tenant
    start_request_id: Id
    reason: Text
    requested_by: Name


RequestMessage = Annotated[StartRequest | CancelRequest, Field(discriminator="type")]


class ExecutorRoute(Contract):
    """Trusted deployment configuration: who executes a route, and where it listens."""

    name: Name
    owner: Name
    principal: Name
    binding: Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9_.\-]{0,120}$")]
    operations: tuple[Name, ...]
