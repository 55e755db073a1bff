"""Cancellation races and unknown outcomes, as a Hypothesis state machine (FAULTS §2.3 item 1).

"Cancellation is a request to settle work consistently with the executor's durable
state. Work with an unresolved effect remains Cancelling until authoritative evidence
resolves it. A success that wins the race remains Succeeded on the operation, even
when cancellation prevents further successors."

"Cancellation before acceptance also requires a durable record. Otherwise a delayed
command could arrive after an apparently successful cancellation and still execute."

"A lost response does not establish whether the remote effect happened." "A timeout
can produce OutcomeUnknown ... It does not interpret timeout as permission to create
a new operation." "A null query result means no receipt was returned; it is not proof
that no effect occurred."

One operation of one instance. The engine side is an ``OperationView`` plus the
instance status, changed only through the real pure logic: ``lifecycle.next_status``
for the confirm, deadline, cancel, reconcile, query-none, query-timeout and
retry-safe events, and ``validation.decide`` for every receipt the engine is handed;
the result is applied the way ``workers/engine/receipts.py`` applies it (``_one``, then
``core.effects.of_receipt`` / ``of_no_news``) and cancels the way ``transitions.sql``'s
``custody.cancel_in`` issues them.
Commands and receipts are the real wire models (commands built by ``workers.core.commands``,
receipts by the participant runtime's own ``make_receipt``).

The participant is a small model of ``workers/participant/service.py``'s rules: an inbox by
request id, tombstones, an effects counter and a journal of receipts. The broker is
two bags of in-flight messages, delivered in any order, duplicated or dropped.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from contracts import codec, identity
from contracts.models import (
    CancelCommand,
    OperationReceipt,
    QueryAnswer,
    QueryCommand,
    ReceiptError,
    SubmitCommand,
)
from workers.core import acceptance, commands, lifecycle, validation
from workers.core.lifecycle import IGNORE, TERMINAL, Effect, Event, InstanceStatus, Status
from workers.core.validation import IssuedRequest, OperationView, Verdict
from workers.participant import service

T0 = datetime(2024, 1, 1, 12, 0, tzinfo=UTC)
TENANT = "acme"
OWNER = "inventory"
PRINCIPAL = "custody-inventory"
BINDING = "inventory"
INSTANCE = identity.instance_id(TENANT, "3f0b6c1e-8a1d-4d2b-9f3a-2c5e7d9b1a00")
OP_ID = identity.operation_id(TENANT, INSTANCE, "reserve", 1)
LINEAGE = {
    "instance_id": INSTANCE,
    "process": "order",
    "process_version": 1,
    "node": "reserve",
    "activation": 1,
}
INPUT = {"sku": "A-1", "qty": 1}
CHANGED_INPUT = {"sku": "A-1", "qty": 9}
ME = service.Identity(owner=OWNER, principal=PRINCIPAL, bindings=frozenset({BINDING}))
# the node's retry policy (process.RetryPolicy.allows): transient failures, 3 attempts
MAX_ATTEMPTS = 3
RETRY_ON = frozenset({"transient"})
OUTCOMES = ("success", "transient", "declined")  # handler: effect, or a business failure

IN_FLIGHT = (Status.PENDING, Status.DISPATCHED, Status.ACCEPTED)
UNKNOWN = (Status.OUTCOME_UNKNOWN, Status.RECONCILE_PENDING)  # effects.UNKNOWN
VISIBLE_UNRESOLVED = (Status.CANCELLING, Status.OUTCOME_UNKNOWN)

Command = SubmitCommand | QueryCommand | CancelCommand
Message = OperationReceipt | QueryAnswer


def pinned(attempt: int, input_: dict[str, Any] = INPUT) -> commands.Pinned:
    return commands.Pinned(
        operation_id=OP_ID,
        tenant=TENANT,
        attempt=attempt,
        operation="reserve",
        route="inventory",
        owner=OWNER,
        binding=BINDING,
        input=input_,
        lineage=LINEAGE,
    )


def built(rows: commands.CommandRows) -> Command:
    """The command exactly as the participant decodes it off the wire."""
    command: Command = codec.decode_command(rows.outbox_row["body"])
    return command


# --- the participant: a model of workers/participant/service.py's rules -----------------------


@dataclass
class Entry:
    """An inbox row: the command identity, its digest and the owner's durable state."""

    ident: dict[str, Any]  # request_id, tenant, operation_id, attempt
    digest: str
    status: str  # accepted | succeeded | failed | cancelled
    effect: str
    revision: int


class ParticipantModel:
    def __init__(self) -> None:
        self.inbox: dict[str, Entry] = {}
        self.tombstones: set[str] = set()
        self.effects: Counter[str] = Counter()  # business effects applied, by identity
        self.journal: dict[str, list[OperationReceipt]] = {}  # by request id, by revision

    def _say(self, entry: Entry, in_reply_to: str, **extra: Any) -> list[Message]:
        receipt = service.make_receipt(
            entry.ident,
            ME,
            status=entry.status,
            effect=entry.effect,
            revision=entry.revision,
            in_reply_to=in_reply_to,
            digest=entry.digest,
            **extra,
        )
        self.journal.setdefault(receipt.request_id, []).append(receipt)
        return [receipt]

    def latest(self, request_id: str) -> OperationReceipt | None:
        journal = self.journal.get(request_id)
        return journal[-1] if journal else None

    def _reemit(self, request_id: str) -> list[Message]:
        """p_reemit_latest: the existing receipt again, same id and bytes."""
        latest = self.latest(request_id)
        return [latest] if latest is not None else []

    def deliver(self, command: Command, *, hook_allows: bool = True) -> list[Message]:
        if isinstance(command, QueryCommand):
            return self._query(command)
        if isinstance(command, CancelCommand):
            return self._cancel(command, hook_allows)
        return self._submit(command)

    def _submit(self, c: SubmitCommand) -> list[Message]:
        if c.request_id in self.tombstones:
            return self._reemit(c.request_id)  # cancelled before acceptance: refused
        known = self.inbox.get(c.request_id)
        if known is None:
            ident = {
                "request_id": c.request_id,
                "tenant": c.tenant,
                "operation_id": c.operation_id,
                "attempt": c.attempt,
            }
            entry = Entry(ident, c.digest, "accepted", "none", 1)
            self.inbox[c.request_id] = entry
            return self._say(entry, c.request_id)
        if known.digest == c.digest:
            return self._reemit(c.request_id)
        conflict = service.make_receipt(  # answered, recorded, never journaled or executed
            known.ident,
            ME,
            status="rejected",
            effect="none",
            revision=known.revision,
            in_reply_to=c.request_id,
            digest=c.digest,
            error=ReceiptError(code="digest_conflict", message="another digest"),
        )
        receipt_id = identity.conflict_receipt_id(c.request_id, c.digest)
        return [conflict.model_copy(update={"receipt_id": receipt_id})]

    def _cancel(self, c: CancelCommand, hook_allows: bool) -> list[Message]:
        entry = self.inbox.get(c.submit_request_id)
        if entry is None:  # before acceptance: a tombstone that takes the identity
            self.tombstones.add(c.submit_request_id)
            ident = {
                "request_id": c.submit_request_id,
                "tenant": c.tenant,
                "operation_id": c.operation_id,
                "attempt": c.attempt,
            }
            entry = Entry(ident, c.digest, "cancelled", "none", 1)
            self.inbox[c.submit_request_id] = entry
            return self._say(entry, c.request_id)
        if entry.digest != c.digest or entry.status != "accepted" or not hook_allows:
            return self._reemit(c.submit_request_id)  # the real state is the answer
        entry.status, entry.effect, entry.revision = "cancelled", "none", entry.revision + 1
        return self._say(entry, c.request_id)

    def _query(self, q: QueryCommand) -> list[Message]:
        # the participant's real pure rule: its latest receipt for that command, if any
        latest = self.latest(q.submit_request_id)
        return [acceptance.query_answer(q, latest, owner=OWNER, principal=PRINCIPAL, now=T0)]

    def accepted(self) -> list[str]:
        return sorted(r for r, e in self.inbox.items() if e.status == "accepted")

    def execute(self, request_id: str, outcome: str) -> list[Message]:
        """The handler runs once: effect and terminal receipt commit together."""
        entry = self.inbox[request_id]
        assert entry.status == "accepted"
        entry.revision += 1
        if outcome == "success":
            self.effects[request_id] += 1
            entry.status, entry.effect = "succeeded", "applied"
            return self._say(entry, request_id, result={"reserved": 1})
        entry.status, entry.effect = "failed", "none"
        return self._say(entry, request_id, error=ReceiptError(code=outcome, message="no"))


# --- the engine: the real pure logic, applied like workers/engine/receipts.py ----------------


class EngineModel:
    def __init__(self) -> None:
        self.view = OperationView(
            id=OP_ID,
            tenant=TENANT,
            owner=OWNER,
            principal=PRINCIPAL,
            attempt=1,
            status=Status.PENDING,
            effect=Effect.UNKNOWN,
            owner_revision=0,
            receipt_hash=None,
        )
        self.instance = InstanceStatus.RUNNING
        self.issued: dict[str, IssuedRequest] = {}
        self.seen: dict[str, str] = {}  # receipts_seen: receipt id -> content hash
        self.sequences: Counter[tuple[int, str]] = Counter()
        self.unpublished: SubmitCommand | None = self._issue_submit()
        self.published_unconfirmed = False
        self.cancel_requested = False
        self.successors: list[bool] = []  # per successor: was a cancel requested by then
        self.applied: Counter[str] = Counter()  # receipt id -> times it changed state
        self.quarantined: list[tuple[str, OperationReceipt]] = []
        self.history: list[Status] = [Status.PENDING]

    # commands (adapter + the issued record, as the outbox transaction writes them)
    def _issue(self, rows: commands.CommandRows, kind: str) -> Command:
        self.issued[rows.request_id] = IssuedRequest(
            rows.request_id, OP_ID, self.view.attempt, kind, rows.digest
        )
        return built(rows)

    def _issue_submit(self) -> SubmitCommand:
        command = self._issue(commands.submit(pinned(self.view.attempt)), "submit")
        assert isinstance(command, SubmitCommand)
        return command

    def _next_sequence(self, kind: str) -> int:
        self.sequences[(self.view.attempt, kind)] += 1
        return self.sequences[(self.view.attempt, kind)]

    def _set(self, status: Status, **changes: Any) -> None:
        self.view = replace(self.view, status=status, **changes)
        self.history.append(status)

    def _event(self, event: Event) -> Status | lifecycle.Ignore:
        target = lifecycle.next_status(self.view.status, event)
        if target is not IGNORE:
            self._set(target)
        return target

    # timers and operator / policy commands
    def confirm(self) -> None:
        self.published_unconfirmed = False
        self._event(Event.CONFIRMED)

    def deadline(self) -> None:
        """reconciler.sweep_deadlines: in flight past the deadline -> outcome_unknown."""
        assert self.view.status in IN_FLIGHT
        self._event(Event.DEADLINE)
        self._suspend()

    def query_timeout(self) -> None:
        self._event(Event.QUERY_TIMEOUT)

    def reconcile(self) -> QueryCommand:
        self._event(Event.RECONCILE)
        rows = commands.query(pinned(self.view.attempt), sequence=self._next_sequence("query"))
        command = self._issue(rows, "query")
        assert isinstance(command, QueryCommand)
        return command

    def retry_safe(self) -> None:
        assert self.view.status is Status.RETRY_WAITING and self.view.effect is Effect.NONE
        target = lifecycle.next_status(self.view.status, Event.RETRY_SAFE)
        assert isinstance(target, Status)
        self.view = replace(
            self.view,
            attempt=self.view.attempt + 1,
            effect=Effect.UNKNOWN,
            owner_revision=0,
            receipt_hash=None,
        )
        self._set(target)
        self.unpublished = self._issue_submit()

    def cancel(self) -> CancelCommand | None:
        """custody.cancel_in (transitions.sql) for the instance's one unresolved operation."""
        assert self.instance not in (InstanceStatus.CANCELLED, InstanceStatus.COMPLETED)
        assert self.view.status not in TERMINAL
        self.cancel_requested = True
        self.instance = InstanceStatus.CANCELLING
        command: CancelCommand | None = None
        if self.view.status is not Status.CANCELLING:  # a repeated cancel re-sends
            target = lifecycle.next_status(self.view.status, Event.CANCEL)
            assert isinstance(target, Status)
            if target is Status.CANCELLED:  # retry_waiting: nothing in flight to ask
                self._set(target, effect=Effect.NONE)
            else:
                self._set(target)
        if self.view.status is Status.CANCELLING:
            rows = commands.cancel(
                pinned(self.view.attempt), reason="ops", sequence=self._next_sequence("cancel")
            )
            issued = self._issue(rows, "cancel")
            assert isinstance(issued, CancelCommand)
            command = issued
        self._settle()
        return command

    # instance bookkeeping (instance_suspend / _unsuspend / _settle_cancel)
    def _suspend(self) -> None:
        if self.instance is InstanceStatus.RUNNING:
            self.instance = InstanceStatus.SUSPENDED

    def _unsuspend(self) -> None:
        if self.instance is InstanceStatus.SUSPENDED and self.view.status not in UNKNOWN:
            self.instance = InstanceStatus.RUNNING

    def _settle(self) -> None:
        if self.instance is InstanceStatus.CANCELLING and self.view.status in TERMINAL:
            self.instance = InstanceStatus.CANCELLED

    # receipts and query answers: ReceiptConsumer._one
    def _retryable(self, receipt: OperationReceipt) -> bool:
        if receipt.status != "failed" or receipt.effect != "none":
            return False
        code = receipt.error.code if receipt.error else None
        return receipt.attempt < MAX_ATTEMPTS and code in RETRY_ON

    def receive(self, message: Message, user_id: str) -> str:
        answer: QueryAnswer | None = None
        if isinstance(message, QueryAnswer):
            query = self.issued.get(message.in_reply_to)
            # an honest answer passes validation.refuse_answer
            assert user_id == message.principal and query is not None and query.kind == "query"
            answer = message
            if message.receipt is None:
                return self._no_news()
            receipt = message.receipt
        else:
            receipt = message
        decision = validation.decide(
            receipt,
            user_id=user_id,
            op=self.view,
            issued=self.issued,
            seen_hash=self.seen.get(receipt.receipt_id),
            retryable=self._retryable(receipt),
        )
        if decision.verdict is Verdict.QUARANTINE:
            self.quarantined.append((decision.reason, receipt))
            return "quarantine"
        if decision.verdict is Verdict.DUPLICATE:
            return self._no_news() if answer is not None else "duplicate"
        self.seen[receipt.receipt_id] = decision.content_hash
        if decision.verdict is not Verdict.APPLY:
            return self._no_news() if answer is not None else decision.verdict.value
        assert decision.status is not None and decision.effect is not None
        if answer is not None and decision.status not in TERMINAL | {
            Status.RETRY_WAITING,
            Status.OUTCOME_UNKNOWN,
        }:
            return self._no_news()
        self._apply(receipt, decision)
        return "apply"

    def _apply(self, receipt: OperationReceipt, decision: validation.Decision) -> None:
        assert decision.status is not None and decision.effect is not None
        before = self.view.status
        self.applied[receipt.receipt_id] += 1
        self._set(
            decision.status,
            effect=decision.effect,
            owner_revision=receipt.owner_revision,
            receipt_hash=decision.content_hash,
        )
        if decision.status is Status.OUTCOME_UNKNOWN:
            self._suspend()
        elif before in UNKNOWN:
            self._unsuspend()
        if decision.status in TERMINAL:
            if before is Status.CANCELLING:
                # a success that wins the race stays succeeded; no successors
                self._settle()
                return
            if decision.status is not Status.CANCELLED:
                self.successors.append(self.cancel_requested)

    def _no_news(self) -> str:
        try:
            target = lifecycle.next_status(self.view.status, Event.QUERY_NONE)
        except lifecycle.IllegalTransition:
            return "ignored"
        if target is IGNORE:
            return "ignored"
        self._set(target)
        return "no_news"

    @property
    def submit_request_id(self) -> str:
        return identity.request_id(OP_ID, self.view.attempt, "submit")


# --- the machine: engine, participant and a fake broker -------------------------------

PICK = st.integers(min_value=0, max_value=7)


class CancellationRaces(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.engine = EngineModel()
        self.part = ParticipantModel()
        self.commands: list[Command] = []  # engine -> participant, in flight
        self.receipts: list[tuple[Message, str]] = []  # participant -> engine (user id)
        self.dropped_in_attempt = False  # a message of the current attempt was lost
        self.first_terminal: Status | None = None
        # which actors take part in this run (all of them unless a run draws otherwise)
        self.cancels = self.lossy = self.timers = True

    @initialize(cancels=st.booleans(), lossy=st.booleans(), timers=st.booleans())
    def who_takes_part(self, cancels: bool, lossy: bool, timers: bool) -> None:
        """Some runs have no cancel, no loss or no deadline, so that successes,
        failures and retries are reached as often as the races against them."""
        self.cancels, self.lossy, self.timers = cancels, lossy, timers

    def quiet(self) -> bool:
        return not (
            self.commands or self.receipts or self.part.accepted() or self.engine.unpublished
        )

    @precondition(quiet)
    @rule()
    def nothing_is_in_flight(self) -> None:
        """Time passes; a run without cancels or deadlines may have nothing to do."""

    # the engine
    @precondition(lambda self: self.engine.unpublished is not None)
    @rule()
    def engine_dispatches_the_submit(self) -> None:
        assert self.engine.unpublished is not None
        self.commands.append(self.engine.unpublished)
        self.engine.unpublished = None
        self.engine.published_unconfirmed = True

    @precondition(lambda self: self.engine.published_unconfirmed)
    @rule()
    def broker_confirms_the_submit(self) -> None:
        self.engine.confirm()

    @precondition(lambda self: self.cancels and self.engine.view.status not in TERMINAL)
    @rule()
    def engine_cancels(self) -> None:
        command = self.engine.cancel()
        if command is not None:
            self.commands.append(command)

    @precondition(lambda self: self.timers and self.engine.view.status in IN_FLIGHT)
    @rule()
    def deadline_fires(self) -> None:
        self.engine.deadline()

    @precondition(lambda self: self.engine.view.status is Status.OUTCOME_UNKNOWN)
    @rule()
    def operator_reconciles(self) -> None:
        self.commands.append(self.engine.reconcile())

    @precondition(lambda self: self.engine.view.status is Status.RECONCILE_PENDING)
    @rule()
    def query_times_out(self) -> None:
        self.engine.query_timeout()

    @precondition(
        lambda self: (
            self.engine.view.status is Status.RETRY_WAITING
            and self.engine.view.effect is Effect.NONE
        )
    )
    @rule()
    def retry_safe(self) -> None:
        self.engine.retry_safe()
        self.dropped_in_attempt = False

    # the participant
    @precondition(lambda self: self.commands)
    @rule(pick=PICK, hook_allows=st.booleans())
    def participant_takes_a_command(self, pick: int, hook_allows: bool) -> None:
        command = self.commands.pop(pick % len(self.commands))
        for message in self.part.deliver(command, hook_allows=hook_allows):
            self.receipts.append((message, PRINCIPAL))

    @precondition(lambda self: self.engine.submit_request_id in self.part.inbox)
    @rule()
    def participant_gets_changed_input_under_the_same_identity(self) -> None:
        command = built(commands.submit(pinned(self.engine.view.attempt, CHANGED_INPUT)))
        assert command.request_id == self.engine.submit_request_id
        for message in self.part.deliver(command):
            self.receipts.append((message, PRINCIPAL))

    @precondition(lambda self: self.part.accepted())
    @rule(pick=PICK, outcome=st.sampled_from(OUTCOMES))
    def participant_executes(self, pick: int, outcome: str) -> None:
        accepted = self.part.accepted()
        for message in self.part.execute(accepted[pick % len(accepted)], outcome):
            self.receipts.append((message, PRINCIPAL))

    @precondition(lambda self: self.receipts)
    @rule(pick=PICK)
    def engine_takes_a_receipt(self, pick: int) -> None:
        message, user_id = self.receipts.pop(pick % len(self.receipts))
        self.engine.receive(message, user_id)

    # the broker's faults
    @precondition(lambda self: self.commands)
    @rule(pick=PICK)
    def broker_duplicates_a_command(self, pick: int) -> None:
        self.commands.append(self.commands[pick % len(self.commands)])

    @precondition(lambda self: self.receipts)
    @rule(pick=PICK)
    def broker_duplicates_a_receipt(self, pick: int) -> None:
        self.receipts.append(self.receipts[pick % len(self.receipts)])

    @precondition(lambda self: self.lossy and self.commands)
    @rule(pick=PICK)
    def broker_loses_a_command(self, pick: int) -> None:
        lost = self.commands.pop(pick % len(self.commands))
        self._lost(lost.attempt)

    @precondition(lambda self: self.lossy and self.receipts)
    @rule(pick=PICK)
    def broker_loses_a_response(self, pick: int) -> None:
        lost, _ = self.receipts.pop(pick % len(self.receipts))
        self._lost(lost.attempt)

    def _lost(self, attempt: int) -> None:
        if attempt == self.engine.view.attempt:
            self.dropped_in_attempt = True

    # invariants (FAULTS §2.1), after every step
    @invariant()
    def a_success_that_wins_the_race_remains_succeeded(self) -> None:
        history = self.engine.history
        if Status.SUCCEEDED in history:
            assert self.engine.view.status is Status.SUCCEEDED, history

    @invariant()
    def a_terminal_state_is_never_left(self) -> None:
        status = self.engine.view.status
        if self.first_terminal is None and status in TERMINAL:
            self.first_terminal = status
        assert self.first_terminal in (None, status), self.engine.history

    @invariant()
    def at_most_one_effect_per_command_identity(self) -> None:
        assert all(n <= 1 for n in self.part.effects.values()), self.part.effects
        assert sum(self.part.effects.values()) <= 1, self.part.effects

    @invariant()
    def every_cancelled_operation_had_effect_none(self) -> None:
        if self.engine.view.status is Status.CANCELLED:
            assert self.engine.view.effect is Effect.NONE
            assert sum(self.part.effects.values()) == 0, self.part.effects

    @invariant()
    def no_success_without_evidence(self) -> None:
        if self.engine.view.status is Status.SUCCEEDED:
            rid = self.engine.submit_request_id
            assert self.engine.view.effect is Effect.APPLIED
            assert self.part.effects[rid] == 1
            assert self.part.inbox[rid].status == "succeeded"

    @invariant()
    def both_sides_observe_one_durable_outcome(self) -> None:
        status = self.engine.view.status
        if status in TERMINAL:
            owner = self.part.inbox[self.engine.submit_request_id].status
            allowed = {
                Status.SUCCEEDED: {"succeeded"},
                Status.FAILED: {"failed"},
                # cancelled by the owner, or a retryable failure settled by the cancel
                Status.CANCELLED: {"cancelled", "failed"},
            }[status]
            assert owner in allowed, (status, owner)

    @invariant()
    def cancellation_prevents_further_successors(self) -> None:
        assert not any(self.engine.successors), "a successor after the cancel request"
        assert len(self.engine.successors) <= 1

    @invariant()
    def an_unknown_outcome_suspends_progression(self) -> None:
        if self.engine.view.status in UNKNOWN:
            assert self.engine.instance in (InstanceStatus.SUSPENDED, InstanceStatus.CANCELLING)
        if self.engine.successors:
            assert self.engine.view.status in TERMINAL

    @invariant()
    def a_tombstone_means_no_participant_accepts_it(self) -> None:
        for rid in self.part.tombstones:
            assert self.part.inbox[rid].status == "cancelled"
            assert self.part.effects[rid] == 0

    @invariant()
    def each_receipt_changes_engine_state_at_most_once(self) -> None:
        assert all(n == 1 for n in self.engine.applied.values()), self.engine.applied

    @invariant()
    def reusing_an_identity_with_changed_input_conflicts(self) -> None:
        """Only the conflict answers to changed input are refused (digest_mismatch):
        the owner's honest receipts always pass validation."""
        for reason, receipt in self.engine.quarantined:
            assert reason == "digest_mismatch", (reason, receipt.status)
            assert receipt.error is not None and receipt.error.code == "digest_conflict"

    # quiescence: faults stop, everything in flight is delivered, time passes
    def drain(self) -> None:
        for _ in range(4 * MAX_ATTEMPTS + 4):
            if self.engine.unpublished is not None:
                self.engine_dispatches_the_submit()
            while self.commands:
                self.participant_takes_a_command(0, hook_allows=True)
            for rid in self.part.accepted():
                for message in self.part.execute(rid, "success"):
                    self.receipts.append((message, PRINCIPAL))
            while self.receipts:
                self.engine_takes_a_receipt(0)
            if (
                self.engine.view.status is Status.RETRY_WAITING
                and self.engine.view.effect is Effect.NONE
            ):
                self.retry_safe()  # the node's retry policy (reconciler.retry_due)
                continue
            if not (self.commands or self.receipts or self.part.accepted()):
                break
        if self.engine.view.status in IN_FLIGHT:
            self.engine.deadline()
        if self.engine.view.status is Status.RECONCILE_PENDING:
            self.engine.query_timeout()
        self.check_invariants_now()

    def check_invariants_now(self) -> None:
        """Every @invariant, for steps run outside Hypothesis (drain, fixed scenarios)."""
        checks = [
            getattr(type(self), name)
            for name in dir(type(self))
            if getattr(getattr(type(self), name), "hypothesis_stateful_invariant", None)
        ]
        assert len(checks) >= 11
        for check in checks:
            check(self)

    def no_effect_without_a_matching_terminal_receipt(self) -> None:
        status = self.engine.view.status
        if sum(self.part.effects.values()):
            assert status is Status.SUCCEEDED or status in VISIBLE_UNRESOLVED, status
        if not self.dropped_in_attempt:
            assert status in TERMINAL, (status, self.engine.history)
        else:
            assert status in TERMINAL or status in VISIBLE_UNRESOLVED, status

    def operator_recovery_converges(self) -> None:
        """INV-8: reconcile what is unknown, cancel what stays unknown, re-send cancels:
        every operation ends terminal, and an effect only with its success receipt."""
        for _ in range(4):
            if self.engine.view.status is Status.OUTCOME_UNKNOWN:
                self.operator_reconciles()
                self.drain()
            if self.engine.view.status is Status.OUTCOME_UNKNOWN:
                self.engine_cancels()  # unknown effects never become success by assertion
                self.drain()
            if self.engine.view.status is Status.CANCELLING:
                self.engine_cancels()
                self.drain()
        status = self.engine.view.status
        assert status in TERMINAL, (status, self.engine.history)
        assert (sum(self.part.effects.values()) == 1) == (status is Status.SUCCEEDED)
        if self.engine.cancel_requested:
            assert self.engine.instance is InstanceStatus.CANCELLED

    def teardown(self) -> None:
        if sys.exc_info()[1] is not None:
            return  # the run already failed: report that failure, not a follow-on one
        self.drain()
        self.no_effect_without_a_matching_terminal_receipt()
        self.operator_recovery_converges()


CancellationRaces.TestCase.settings = settings(
    max_examples=500,  # about 6 s; 20 000 examples of 60 steps found nothing either
    stateful_step_count=50,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCancellationIsARequestToSettleWorkConsistentlyWithTheExecutorsDurableState = (
    CancellationRaces.TestCase
)


# --- the seed's sentences as fixed sequences of the same machine ----------------------


def machine() -> CancellationRaces:
    return CancellationRaces()


def status(m: CancellationRaces) -> Status:
    return m.engine.view.status


def instance(m: CancellationRaces) -> InstanceStatus:
    return m.engine.instance


def test_cancellation_before_acceptance_also_requires_a_durable_record() -> None:
    """A delayed command that arrives after an apparently successful cancellation is
    refused by the tombstone and answered with the cancellation; it never executes."""
    m = machine()
    m.engine_dispatches_the_submit()  # the submit is delayed in the broker
    m.engine_cancels()
    m.participant_takes_a_command(1, hook_allows=True)  # the cancel overtakes it
    m.engine_takes_a_receipt(0)
    assert status(m) is Status.CANCELLED
    m.participant_takes_a_command(0, hook_allows=True)  # the late submit
    assert m.part.accepted() == [] and m.part.effects.total() == 0
    assert [(type(r).__name__, getattr(r, "status", None)) for r, _ in m.receipts] == [
        ("OperationReceipt", "cancelled")
    ]
    m.engine_takes_a_receipt(0)
    m.check_invariants_now()
    m.teardown()
    assert status(m) is Status.CANCELLED and m.part.effects.total() == 0


def test_a_success_that_wins_the_race_remains_succeeded_without_successors() -> None:
    """The cancel hook says the effect can no longer be prevented: the operation stays
    cancelling until the success arrives, then stays succeeded, and the cancelled
    instance gets no successor."""
    m = machine()
    m.engine_dispatches_the_submit()
    m.participant_takes_a_command(0, hook_allows=True)
    m.engine_takes_a_receipt(0)
    assert status(m) is Status.ACCEPTED
    m.engine_cancels()
    m.participant_takes_a_command(0, hook_allows=False)
    m.engine_takes_a_receipt(0)  # the latest receipt again: accepted, a duplicate
    assert status(m) is Status.CANCELLING
    m.participant_executes(0, "success")
    m.engine_takes_a_receipt(0)
    m.check_invariants_now()
    assert status(m) is Status.SUCCEEDED
    assert instance(m) is InstanceStatus.CANCELLED
    assert m.engine.successors == []
    m.teardown()


def test_work_with_an_unresolved_effect_remains_cancelling_until_evidence() -> None:
    """A lost success receipt leaves the operation visibly cancelling; a repeated
    cancel is answered with the owner's real state, which settles it as succeeded."""
    m = machine()
    m.engine_dispatches_the_submit()
    m.participant_takes_a_command(0, hook_allows=True)
    m.participant_executes(0, "success")
    m.engine_cancels()
    m.receipts.clear()  # accepted and succeeded are both lost
    m._lost(1)
    m.participant_takes_a_command(0, hook_allows=True)
    m.engine_takes_a_receipt(0)  # the latest receipt, succeeded, answers the cancel
    m.check_invariants_now()
    assert status(m) is Status.SUCCEEDED
    assert instance(m) is InstanceStatus.CANCELLED
    m.teardown()


def test_a_null_query_result_is_not_proof_that_no_effect_occurred() -> None:
    """Deadline, reconcile, the query overtakes the submit and finds no receipt: the
    operation goes back to outcome_unknown, and the late success still settles it."""
    m = machine()
    m.engine_dispatches_the_submit()
    m.deadline_fires()
    assert status(m) is Status.OUTCOME_UNKNOWN
    assert instance(m) is InstanceStatus.SUSPENDED
    m.operator_reconciles()
    m.participant_takes_a_command(1, hook_allows=True)  # the query, before the submit
    m.engine_takes_a_receipt(0)
    assert status(m) is Status.OUTCOME_UNKNOWN
    m.participant_takes_a_command(0, hook_allows=True)
    m.participant_executes(0, "success")
    m.engine_takes_a_receipt(1)  # the success
    m.check_invariants_now()
    assert status(m) is Status.SUCCEEDED
    assert instance(m) is InstanceStatus.RUNNING and m.engine.successors == [False]
    m.teardown()


def test_retry_safe_requires_authoritative_retry_waiting_with_effect_none() -> None:
    """A transient failure with effect none retries under a new command identity;
    late receipts of the old attempt are stale, and a cancel then settles the new one
    before its submit arrives."""
    m = machine()
    m.engine_dispatches_the_submit()
    m.participant_takes_a_command(0, hook_allows=True)
    m.participant_executes(0, "transient")
    m.broker_duplicates_a_receipt(1)
    m.engine_takes_a_receipt(1)  # failed, retryable
    assert status(m) is Status.RETRY_WAITING
    m.retry_safe()
    assert m.engine.view.attempt == 2
    m.engine_dispatches_the_submit()
    m.engine_cancels()
    m.participant_takes_a_command(1, hook_allows=True)  # cancel before the new submit
    while m.receipts:
        m.engine_takes_a_receipt(0)
    m.check_invariants_now()
    assert status(m) is Status.CANCELLED
    m.teardown()
    assert m.part.effects.total() == 0


@pytest.mark.parametrize("hook_allows", [True, False])
def test_cancelling_an_unknown_outcome_settles_with_the_owners_state(hook_allows: bool) -> None:
    """Outcome unknown, then cancel: whatever the owner durably holds decides."""
    m = machine()
    m.engine_dispatches_the_submit()
    m.participant_takes_a_command(0, hook_allows=True)
    m.broker_loses_a_response(0)
    m.deadline_fires()
    m.engine_cancels()
    assert status(m) is Status.CANCELLING
    m.participant_takes_a_command(0, hook_allows=hook_allows)
    if not hook_allows:
        m.participant_executes(0, "declined")
    while m.receipts:
        m.engine_takes_a_receipt(0)
    m.check_invariants_now()
    assert status(m) is (Status.CANCELLED if hook_allows else Status.FAILED)
    assert instance(m) is InstanceStatus.CANCELLED and m.engine.successors == []
