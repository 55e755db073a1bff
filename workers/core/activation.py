"""A node activation and a start request, decided without I/O. Pure.

:func:`plan_activation` is everything one new node activation writes (the node, the
operation pinned to its route, its first attempt and the outbox row that is its
dispatch intent, the history), on the route the instance pinned at start;
:func:`pin_routes` is what an instance pins; :func:`plan_start` decides a start
request: a plan, or a refusal with its closed reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import pydantic

from contracts import digest, identity
from contracts.models import ExecutorRoute, Lineage, StartRequest
from workers.core import commands, process, routes
from workers.core.reasons import Reason
from workers.core.records import History, Jsonb

# What building one activation can raise for one instance's data or definition: that
# instance fails (or its start is quarantined) with the reason; the worker goes on.
ACTIVATION_ERRORS: Final = (
    process.InputError,
    digest.CanonicalFormError,
    KeyError,
    pydantic.ValidationError,
)


@dataclass(frozen=True)
class OperationInsert:
    """A new operation row (``activation_insert``), pinned to its route."""

    id: str
    tenant: str
    instance_id: str
    node: str
    activation: int
    operation: str
    route: ExecutorRoute
    input: Mapping[str, Any]
    lineage: Mapping[str, Any]
    digest: str
    deadline_seconds: int
    attempt: int = 1

    def params(self, jsonb: Jsonb) -> dict[str, Any]:
        return {
            "id": self.id,
            "tenant": self.tenant,
            "instance_id": self.instance_id,
            "node": self.node,
            "activation": self.activation,
            "operation": self.operation,
            "route": self.route.name,
            "owner": self.route.owner,
            "principal": self.route.principal,
            "binding": self.route.binding,
            "input": jsonb(dict(self.input)),
            "lineage": jsonb(dict(self.lineage)),
            "attempt": self.attempt,
            "digest": self.digest,
            "deadline_seconds": self.deadline_seconds,
        }


@dataclass(frozen=True)
class Plan:
    """The rows of one new node activation, decided without I/O."""

    instance_id: str
    node: dict[str, Any]
    operation: OperationInsert
    command: commands.CommandRows
    history: History

    @property
    def attempt(self) -> dict[str, Any]:
        return self.command.attempt_row

    @property
    def outbox(self) -> dict[str, Any]:
        return self.command.outbox_row


def plan_activation(
    *,
    tenant: str,
    instance_id: str,
    definition: process.Definition,
    node_name: str,
    activation: int,
    instance_input: Mapping[str, Any],
    results: Mapping[str, Any],
    pinned: Mapping[str, ExecutorRoute],
    traceparent: str | None,
    actor: str,
) -> Plan:
    """Everything one activation writes, on the route the instance pinned at start.
    Raises one of :data:`ACTIVATION_ERRORS` when the data or definition does not fit."""
    node = definition.node(node_name)
    route = pinned[node.route]
    op_id = identity.operation_id(tenant, instance_id, node_name, activation)
    op_input = process.render_input(node.input, instance_input, results)
    lineage = Lineage(
        instance_id=instance_id,
        process=definition.name,
        process_version=definition.version,
        node=node_name,
        activation=activation,
    ).model_dump(mode="json")
    command = commands.submit(
        commands.Pinned(
            operation_id=op_id,
            tenant=tenant,
            attempt=1,
            operation=node.operation,
            route=route.name,
            owner=route.owner,
            binding=route.binding,
            input=op_input,
            lineage=lineage,
        ),
        traceparent=traceparent,
    )
    return Plan(
        instance_id=instance_id,
        node={
            "instance_id": instance_id,
            "node": node_name,
            "activation": activation,
            "operation_id": op_id,
        },
        operation=OperationInsert(
            id=op_id,
            tenant=tenant,
            instance_id=instance_id,
            node=node_name,
            activation=activation,
            operation=node.operation,
            route=route,
            input=op_input,
            lineage=lineage,
            digest=command.digest,
            deadline_seconds=node.deadline_seconds,
        ),
        command=command,
        history=History(
            instance_id=instance_id,
            operation_id=op_id,
            event="node.activated",
            detail={
                "node": node_name,
                "activation": activation,
                "operation": node.operation,
                "route": route.name,
                "binding": route.binding,
            },
            actor=actor,
        ),
    )


def pin_routes(definition: process.Definition, table: routes.Routes) -> dict[str, ExecutorRoute]:
    """The routes an instance of ``definition`` will use, as configured right now."""
    return {n.route: table.get(n.route) for n in definition.nodes.values()}


@dataclass(frozen=True)
class Started:
    """A start request that becomes an instance: its definition, pinned routes and
    first activation."""

    definition: process.Definition
    pinned: dict[str, ExecutorRoute]
    plan: Plan


@dataclass(frozen=True)
class StartRefused:
    reason: Reason
    detail: str


def plan_start(
    start: StartRequest,
    *,
    instance_id: str,
    catalog: process.Catalog,
    table: routes.Routes,
    traceparent: str | None,
    actor: str,
) -> Started | StartRefused:
    """A new start request (not a repeat): its instance's first activation on the
    latest version of its process, or why it is refused."""
    try:
        definition = catalog.latest(start.process)
    except process.DefinitionError as exc:
        return StartRefused(Reason.UNKNOWN_PROCESS, str(exc))
    pinned = pin_routes(definition, table)
    try:
        plan = plan_activation(
            tenant=start.tenant,
            instance_id=instance_id,
            definition=definition,
            node_name=definition.start,
            activation=1,
            instance_input=start.input,
            results={},
            pinned=pinned,
            traceparent=traceparent,
            actor=actor,
        )
    except (process.InputError, digest.CanonicalFormError) as exc:
        return StartRefused(Reason.BAD_START_INPUT, str(exc))
    except ACTIVATION_ERRORS as exc:
        # the definition cannot be activated for this start: kept, with why
        return StartRefused(Reason.ACTIVATION_FAILED, str(exc))
    return Started(definition, pinned, plan)


def start_conflict(stored_input: Any, start: StartRequest) -> StartRefused | None:
    """A repeated start request id: the same input is a duplicate (nothing to do), other
    input a conflict."""
    if stored_input != start.input:
        return StartRefused(Reason.START_CONFLICT, "same start request id with different input")
    return None
