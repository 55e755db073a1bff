"""The participant runtime: the library a participant service embeds.

It owns two commit boundaries in the participant's own database:

* *acceptance*: a batch of commands is retained (inbox row with its identity and
  semantic digest, plus an ``accepted`` receipt in the participant's outbox, unless an
  inline handler completed the command in the same commit) in one transaction; the
  deliveries are acked only after that commit;
* *completion*: the business effect and the terminal receipt commit together; the
  handlers of a claimed batch share a transaction up to a small time budget (the
  batch is *claimed* in a short transaction of its own: acceptance never waits behind
  a running handler).

A handler that fails leaves no effect, and the others of its batch keep theirs. A
handler runs without a savepoint of its own (two statements per command, a fifth of
a participant's work): one that fails before it wrote anything had nothing to undo,
and one that fails after it wrote rolls back its whole unit, which runs again at once
with that operation's handlers each in a savepoint (for its next ``CAREFUL_RUNS``
commands, twice as many after each further redo), the way every handler ran before.
Nothing of the first run is kept: the deliveries of an acceptance are acked only after
the commit of the run that stands. A handler without a savepoint sends its writes that
return no rows (a plain INSERT, UPDATE or DELETE) without waiting for their answers, so
that a batch's writes are answered together, not one round trip each. Such a write
that fails raises its error later, in another statement, where it is no known
handler's: the unit then runs again with every handler in a savepoint, whose writes
are answered before it ends, which raises the error in the handler that caused it.

A participant may declare some operations *inline*: handlers fast enough to run in
the acceptance transaction itself. Both durable facts then commit together before the
ack (inbox row, effect, terminal receipt); no ``accepted`` receipt is made for such a
command (it would be overtaken before it could be sent, said to no one). A handler that
fails with a bug, or meets a transient conflict, leaves its command accepted for the
executor, as if it had not been inline.

A repeated command with the same digest gets the existing receipt again (same id,
same bytes) and never runs the handler again; the same identity with a different
digest is a conflict, recorded and answered, never executed. Receipts leave through
the participant's own outbox publisher, under the participant's broker user.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import uuid
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from contracts import codec, identity
from contracts.models import (
    CancelCommand,
    OperationReceipt,
    QueryAnswer,
    QueryCommand,
    ReceiptError,
    SubmitCommand,
)
from workers import errors
from workers.core import acceptance, names, records, tracing
from workers.core.reasons import Reason
from workers.errors import BusinessFailure as BusinessFailure  # under the custody root
from workers.io import broker, db
from workers.participant import retention
from workers.runtime import consume, faults, logs, metrics, otel, outbox, probes, supervisor
from workers.settings import Settings

AckPolicy = "ack after the acceptance commit; refused commands are recorded and acked"
MAX_EXECUTIONS = acceptance.MAX_EXECUTIONS
CANCEL_LOCK_TRIES = 3  # a cancel finding its row locked by a short transaction
CANCEL_LOCK_RETRY_S = 0.02
CLEANUP_EVERY_S = 60.0
# handler time one executor transaction may gather before it commits: fast handlers
# share a commit, a slow one holds back few receipts
EXEC_TX_BUDGET_S = 0.05


class _Conflict(Exception):
    """A handler hit a transient database conflict: its savepoint is rolled back, and
    the batch's transaction commits what ran before it."""


class _Redo(Exception):
    """A handler run without a savepoint failed after it had written: its writes cannot
    be undone alone, so the unit's transaction is rolled back whole and the unit runs
    again, with this operation's handlers in savepoints. ``operation`` None: a write
    sent without waiting failed, and which handler's it was is not known (its error
    was raised later, in another statement): the unit runs again with every handler in
    a savepoint, whose writes are answered before it ends."""

    def __init__(self, operation: str | None, request_id: str, error: BaseException) -> None:
        super().__init__(operation)
        self.operation = operation
        self.request_id = request_id
        self.error = error


# after a handler failed with writes of its own, the next runs of its operation each
# get a savepoint (a failure then costs a rolled-back savepoint, not a rolled-back
# unit): 256 runs, doubled at each redo of the same operation (one that often fails
# after writing keeps its savepoints; a redo costs its whole unit), up to 65,536
CAREFUL_RUNS = 256
CAREFUL_RUNS_MAX = 65_536

# The unit being run is a rerun with every handler in a savepoint (its writes answered
# before it ends), after a write sent without waiting failed whose handler is not known.
# Per task: acceptance and the executor run at once on one participant, and one loop's
# rerun is not the other's (Participant._redone sets it, for the unit it runs).
_CAREFUL_UNIT: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "custody_careful_unit", default=False
)


def careful_unit() -> bool:
    """Whether the unit this task runs is a rerun with every handler in a savepoint."""
    return _CAREFUL_UNIT.get()


@dataclass(frozen=True)
class Call:
    """What a handler gets: the command's identity and input, and the transaction in
    which its effect commits together with the terminal receipt."""

    tx: db.Tx
    tenant: str
    operation_id: str
    request_id: str
    attempt: int
    operation: str
    input: Mapping[str, Any]


Handler = Callable[[Call], Awaitable[Mapping[str, Any]]]
# May the accepted, not yet completed command still be prevented? (default: yes — its
# handler has not run, so there is no effect to undo)
CancelHook = Callable[[Call], Awaitable[bool]]
_U = TypeVar("_U")


@dataclass(frozen=True)
class Identity:
    owner: str
    principal: str
    bindings: frozenset[str]


def make_receipt(
    cmd: Mapping[str, Any],
    me: Identity,
    *,
    status: str,
    effect: str,
    revision: int,
    in_reply_to: str,
    digest: str,
    result: Mapping[str, Any] | None = None,
    error: ReceiptError | None = None,
) -> OperationReceipt:
    return OperationReceipt(
        receipt_id=identity.receipt_id(cmd["request_id"], revision),
        tenant=cmd["tenant"],
        operation_id=cmd["operation_id"],
        attempt=cmd["attempt"],
        request_id=cmd["request_id"],
        in_reply_to=in_reply_to,
        owner=me.owner,
        principal=me.principal,
        command_digest=digest,
        owner_revision=revision,
        status=status,  # type: ignore[arg-type]
        effect=effect,  # type: ignore[arg-type]
        result=dict(result) if result is not None else None,
        error=error,
        emitted_at=datetime.now(UTC),
    )


def _outbox_row(
    message_id: str, body: bytes, operation_id: str, traceparent: str | None
) -> dict[str, Any]:
    """A receipt continues the trace of the command it answers (a new span)."""
    headers = {"traceparent": tracing.child(traceparent)} if traceparent else {}
    return {
        "id": message_id,
        "exchange": broker.EXCHANGE_RECEIPTS,
        "routing_key": broker.RECEIPTS_KEY,
        "body": body,
        "headers": headers,
        "operation_id": operation_id,
    }


@dataclass
class Queued:
    """What a commit queued in the outbox: the rows it offered (claimed by our publisher,
    when there is one, to hand to it after the commit), the answer naming those its
    insert took (read after the commit: it comes with the commit's, in one round trip),
    and whether it queued rows that only a claim of the table finds."""

    offered: list[dict[str, Any]]
    claimable: bool
    inserted: db.Answer | None = None


class Participant:
    def __init__(
        self,
        me: Identity,
        handlers: Mapping[str, Handler],
        settings: Settings,
        database: db.Database,
        cancel_hooks: Mapping[str, CancelHook] | None = None,
        inline: Collection[str] = (),
    ) -> None:
        self.me = me
        self.handlers = dict(handlers)
        self.cancel_hooks = dict(cancel_hooks or {})
        # operations whose handlers are fast enough to run in the acceptance transaction
        self.inline = frozenset(inline)
        self.settings = settings
        self.db = database
        # This executor's claims. One execute() at a time per instance (serve runs one
        # loop), so a redo after a transient failure takes its unfinished claims back.
        self._claim_token = str(uuid.uuid4())
        # set by an acceptance that left accepted commands to the executor (not all ran
        # inline): the consumer then wakes the executor at once, instead of on its poll
        self.executor_due = False
        # the in-process publisher of this participant's receipts (``serve`` sets it): a
        # commit queues its receipts claimed by it and hands them over after the commit
        self.sender: outbox.OutboxPublisher | None = None
        # set by a commit that queued rows only a claim of the table finds (answers,
        # re-emitted receipts; every row when there is no sender)
        self.outbox_due = False
        # operation -> runs left that get a savepoint each, and the last window given
        # (see _Redo)
        self._careful: dict[str, int] = {}
        self._careful_window: dict[str, int] = {}

    async def _redone(self, unit: Callable[[], Awaitable[_U]]) -> _U:
        """Run ``unit`` (one transaction that runs handlers) until no handler run
        without a savepoint failed after it wrote. Each redo gives the operation that
        asked for it careful runs for at least a whole batch, so the unit run again
        asks no redo for it: there are at most as many redos as operations. A redo
        whose operation is not known runs the unit once with every handler careful
        (a careful handler never asks for a redo); a handler that fails after writing
        in that run gets its operation careful runs instead. That rerun is this task's
        alone (:func:`careful_unit`): the other loop's units run as they would."""
        token = _CAREFUL_UNIT.set(False)
        try:
            while True:
                try:
                    return await unit()
                except _Redo as redo:
                    if redo.operation is None:
                        _CAREFUL_UNIT.set(True)
                    else:
                        self._be_careful(redo.operation)
                    logs.event(
                        "participant.handler_redo",
                        owner=self.me.owner,
                        operation=redo.operation or "(not known: a write sent without waiting)",
                        request_id=redo.request_id,
                        error=repr(redo.error)[:300],
                    )
        finally:
            _CAREFUL_UNIT.reset(token)

    @contextlib.asynccontextmanager
    async def _unit(self) -> AsyncIterator[db.Tx]:
        """A transaction that runs handlers. The writes they sent without waiting, and
        the completion of their inbox rows, are answered with its COMMIT (one round
        trip for the whole last flight): an error of one of them there is no known
        handler's, so the unit runs again with every handler in a savepoint
        (:class:`_Redo` without an operation), as for such an error raised earlier.
        Not in a unit that runs so already (there the error is the unit's own), nor
        for a COMMIT whose outcome is not known (redone as any other)."""
        tx: db.Tx | None = None
        careful = careful_unit()
        try:
            async with self.db.transaction() as tx:
                yield tx
        except errors.DatabaseError as exc:
            if (
                tx is not None
                and exc.kind is not errors.Retry.IN_DOUBT
                and _nobodys(tx, exc.__cause__, careful=careful)
            ):
                raise _Redo(None, "", exc) from exc
            raise

    def _be_careful(self, operation: str) -> None:
        """The next runs of ``operation`` each get a savepoint (see :class:`_Redo`)."""
        last = self._careful_window.get(operation)
        window = CAREFUL_RUNS if last is None else min(2 * last, CAREFUL_RUNS_MAX)
        self._careful_window[operation] = window
        # at least a batch: the unit run again cannot use it up
        self._careful[operation] = max(window, self.settings.batch_size)

    async def accept(self, deliveries: Sequence[broker.Delivery]) -> list[str]:
        """Retain a batch of commands in one transaction; returns each one's decision."""
        return await self._redone(lambda: self._accept(deliveries))

    async def _accept(self, deliveries: Sequence[broker.Delivery]) -> list[str]:
        decisions: list[acceptance.Verdict] = []
        receipts: list[OperationReceipt] = []
        refused: list[records.Refusal] = []
        conflicts: list[records.Conflict] = []
        fresh: list[tuple[SubmitCommand, str, str]] = []  # (command, status, error code)
        reemit: list[str] = []
        queries: list[QueryCommand] = []
        conflict_answers: list[OperationReceipt] = []  # not journaled: not about our work
        cancels: list[tuple[broker.Delivery, CancelCommand]] = []
        worker = names.participant_worker(self.me.owner)
        async with (
            otel.transaction("acceptance", worker) as span,
            self._unit() as tx,
        ):
            commands: list[tuple[broker.Delivery, acceptance.Command | None]] = []
            for d in deliveries:
                try:
                    command: acceptance.Command = codec.decode_command(
                        d.payload(), self.settings.max_message_bytes
                    )
                    commands.append((d, command))
                    d.ids["operation_id"] = command.operation_id
                except codec.DecodeError as exc:
                    refused.append(_refused(d, Reason(exc.reason), exc.detail))
                    commands.append((d, None))
            # tracing on: each delivery's consume span, whatever its message carried
            trace: dict[str, str | None] = {
                c.request_id: otel.delivery_context(d) or tracing.from_headers(d.headers)
                for d, c in commands
                if c
            }
            checked = [(d, c, None if c is None else self._refusal(c)) for d, c in commands]
            ids = list({c.request_id for _, c, _ in checked if isinstance(c, SubmitCommand)})
            # The first admissible submit of each identity is offered to the inbox; the
            # outcome comes from the insert itself, never from a read before it (a
            # replica may be inserting the same identity right now). The tombstones of
            # every submit id come back with it, and a tombstoned identity is not offered.
            admissible: dict[str, SubmitCommand] = {}
            for _, c, why in checked:
                if isinstance(c, SubmitCommand) and why is None:
                    admissible.setdefault(c.request_id, c)
            inserted, tombstoned = await self._insert(tx, ids, list(admissible.values()), trace)
            offered = {i: c for i, c in admissible.items() if i not in tombstoned}
            # Rows the insert did not return were there already, or were just taken by a
            # concurrent transaction: the insert waited for it to commit (READ COMMITTED),
            # so this new statement sees them. They are duplicates or conflicts.
            again = [i for i in offered if i not in inserted]
            stored = (
                {r["request_id"]: r for r in await tx.rows("p_inbox_get", {"ids": again})}
                if again
                else {}
            )
            missing = [i for i in offered if i not in inserted and i not in stored]
            if missing:  # gone again at once (retention past its horizon): decide afresh
                raise errors.DatabaseError(
                    f"inbox rows {missing} neither inserted nor found", errors.Retry.RETRY
                )
            held = {
                i: acceptance.Stored(r["digest"], int(r["owner_revision"]))
                for i, r in stored.items()
            }
            for d, c, why in checked:
                if c is None:
                    decisions.append(acceptance.Verdict.REFUSED)
                    continue
                k = acceptance.classify(
                    c,
                    refused=why,
                    tombstoned=tombstoned,
                    inserted=inserted,
                    offered=offered,
                    stored=held,
                    handled=self.handlers,
                )
                decisions.append(k.verdict)
                if k.refusal is not None:
                    refused.append(_refused(d, k.refusal.reason, k.refusal.detail))
                if k.verdict is acceptance.Verdict.QUERY:
                    assert isinstance(c, QueryCommand)
                    queries.append(c)
                elif k.verdict is acceptance.Verdict.CANCEL:
                    assert isinstance(c, CancelCommand)
                    cancels.append((d, c))
                elif k.verdict is acceptance.Verdict.TOMBSTONED:
                    reemit.append(c.request_id)
                elif k.verdict in (acceptance.Verdict.ACCEPTED, acceptance.Verdict.REJECTED):
                    assert isinstance(c, SubmitCommand)
                    fresh.append((c, k.verdict.value, k.error_code))
                elif k.verdict is acceptance.Verdict.DUPLICATE:
                    reemit.append(c.request_id)
                elif k.verdict is acceptance.Verdict.CONFLICT:
                    assert isinstance(c, SubmitCommand)
                    conflicts.append(
                        records.Conflict(
                            c.request_id, k.stored_digest, c.digest, c.model_dump(mode="json")
                        )
                    )
                    answer = make_receipt(
                        _cmd(c),
                        self.me,
                        status="rejected",
                        effect="none",
                        revision=k.revision,
                        in_reply_to=c.request_id,
                        digest=c.digest,
                        error=ReceiptError(
                            code="digest_conflict",
                            message="this identity holds a command with another digest",
                        ),
                    )
                    conflict_answers.append(
                        answer.model_copy(
                            update={
                                "receipt_id": identity.conflict_receipt_id(c.request_id, c.digest)
                            }
                        )
                    )
            settled: list[OperationReceipt] = []  # the cancels' receipts
            for d, c in cancels:
                receipt = await self._cancel(tx, c, refused, conflicts, d)
                if receipt is None:
                    reemit.append(c.submit_request_id)
                else:
                    settled.append(receipt)
            done = await self._complete_inline(tx, fresh, settled, trace)
            # A command whose handler completed inline says only its terminal receipt:
            # its acceptance is durable all the same (the inbox row, in this commit), and
            # an ``accepted`` receipt overtaken before it could be sent would be said to
            # no one, so it is neither made nor journaled (revision 1 is then unused).
            ran = {r.request_id for r in done}
            for c, status, code in fresh:
                if c.request_id in ran:
                    continue
                receipts.append(
                    make_receipt(
                        _cmd(c),
                        self.me,
                        status=status,
                        effect="none",
                        revision=1,
                        in_reply_to=c.request_id,
                        digest=c.digest,
                        error=ReceiptError(code=code, message=f"no handler for {c.operation}")
                        if code
                        else None,
                    )
                )
            receipts += settled
            # accepted commands that did not complete inline wait for the executor
            left = sum(1 for _, status, _ in fresh if status == acceptance.Verdict.ACCEPTED.value)
            left_for_executor = left > len(done)
            # journal first: a query in the same batch sees what this batch accepted
            queued = await self._emit(
                tx, [*receipts, *done], unjournaled=conflict_answers, trace=trace
            )
            if queries:
                answered = await self._emit(tx, [], await self._answers(tx, queries), trace=trace)
                queued.claimable = queued.claimable or answered.claimable
            if reemit:
                await tx.send("p_reemit_latest", {"ids": reemit})
                queued.claimable = True
            await tx.send_many("p_conflict_insert", [x.params(db.jsonb) for x in conflicts])
            await tx.send_many("p_refused_insert", [r.params() for r in refused])
            if span.recording:
                span.set(
                    operation_id=[c.operation_id for _, c in commands if c],
                    message_id=[d.message_id for d in deliveries],
                    decision=[d.value for d in decisions],
                )
        if left_for_executor:
            self.executor_due = True
        if done:  # before the hand-over: the receipts leave within it (hand_over)
            faults.crash_point("after_effect_before_receipt_sent")
        await self._queued(queued)
        faults.crash_point("after_commit_before_ack")
        for decision in decisions:
            metrics.PARTICIPANT_COMMANDS.labels(self.me.owner, decision).inc()
        for r in refused:
            consume.quarantined(
                metrics.participant_source(self.me.owner),
                r.reason,
                r.detail,
                message_id=r.message_id,
                trace_id=r.trace_id,
                operation_id=r.operation_id,
            )
        return [d.value for d in decisions]

    async def _complete_inline(
        self,
        tx: db.Tx,
        fresh: Sequence[tuple[SubmitCommand, str, str]],
        receipts: Sequence[OperationReceipt],
        trace: dict[str, str | None],
    ) -> list[OperationReceipt]:
        """Run the handlers of the batch's new commands whose operations are ``inline``,
        in this acceptance transaction (see :meth:`_run_one`), so that acceptance, effect
        and terminal receipt commit together before the ack. Returns the terminal
        receipts. A command cancelled in this batch (``receipts``: the cancels') does not
        run; one whose handler failed with a bug or hit a transient conflict stays
        accepted for the executor. A terminal receipt continues its handler's span in
        ``trace``."""
        if not self.inline:
            return []
        cancelled = {r.request_id for r in receipts if r.status == "cancelled"}
        done: list[OperationReceipt] = []
        for c, status, _ in fresh:
            if (
                status != acceptance.Verdict.ACCEPTED.value
                or c.operation not in self.inline
                or c.request_id in cancelled
            ):
                continue
            row = {
                **_cmd(c),
                "operation": c.operation,
                "digest": c.digest,
                "command": c.model_dump(mode="json"),
                "owner_revision": 1,
                "executions": 0,
                "traceparent": trace.get(c.request_id),
            }
            try:
                receipt, traceparent = await self._run_one(tx, row)
            except _Conflict:
                continue  # the executor runs it again (its row is accepted, unclaimed)
            if receipt is not None:
                done.append(receipt)
                trace[c.request_id] = traceparent
        await complete(tx, done)
        return done

    async def _insert(
        self,
        tx: db.Tx,
        ids: Sequence[str],
        offered: Sequence[SubmitCommand],
        trace: Mapping[str, str | None],
    ) -> tuple[set[str], set[str]]:
        """Offer new identities to the inbox, and read the tombstones of ``ids`` (every
        submit id of the batch) in the same statement; returns the identities this
        transaction took and the tombstoned ones (never taken)."""
        if not ids:
            return set(), set()
        rows = await tx.rows(
            "p_inbox_accept",
            {
                "ids": ids,
                "rows": db.jsonb(
                    [
                        {
                            "request_id": c.request_id,
                            "tenant": c.tenant,
                            "operation_id": c.operation_id,
                            "attempt": c.attempt,
                            "operation": c.operation,
                            "digest": c.digest,
                            "command": c.model_dump(mode="json"),
                            "status": acceptance.admission(c, self.handlers)[0].value,
                            "effect": "none",
                            "owner_revision": 1,
                            "traceparent": trace.get(c.request_id),
                        }
                        for c in offered
                    ]
                ),
            },
        )
        return (
            {r["request_id"] for r in rows if r["inserted"]},
            {r["request_id"] for r in rows if not r["inserted"]},
        )

    async def _cancel(
        self,
        tx: db.Tx,
        c: CancelCommand,
        refused: list[records.Refusal],
        conflicts: list[records.Conflict],
        d: broker.Delivery,
    ) -> OperationReceipt | None:
        """Settle a cancel against our durable state: a tombstone before acceptance,
        ``cancelled`` if the accepted work can still be prevented, otherwise the real
        state (None: re-emit our latest receipt). One row lock decides races."""
        identity_ = {
            "request_id": c.submit_request_id,
            "tenant": c.tenant,
            "operation_id": c.operation_id,
            "attempt": c.attempt,
        }
        row, busy = await self._lock_for_cancel(tx, c.submit_request_id)
        if busy:
            return None  # being executed right now: its terminal receipt is the evidence
        if row is None:
            won = await tx.rows(
                "p_inbox_tombstoned",
                {
                    **identity_,
                    "operation": c.operation,
                    "digest": c.digest,
                    "command": db.jsonb(c.model_dump(mode="json")),
                },
            )
            if won:
                # the cancel came first: its durable record, committed with the row that
                # takes the identity (a submit that won the insert leaves none)
                await tx.send("p_tombstone_insert", {**identity_, "reason": c.reason})
                return make_receipt(
                    identity_,
                    self.me,
                    status="cancelled",
                    effect="none",
                    revision=1,
                    in_reply_to=c.request_id,
                    digest=c.digest,
                )
            row, busy = await self._lock_for_cancel(tx, c.submit_request_id)  # a submit won
            if busy:
                return None
            assert row is not None
        if row["digest"] != c.digest:
            conflicts.append(
                records.Conflict(
                    c.submit_request_id, row["digest"], c.digest, c.model_dump(mode="json")
                )
            )
            refused.append(
                _refused(d, Reason.DIGEST_CONFLICT, "cancel for other work under this id")
            )
            return None
        if row["status"] != "accepted":
            return None  # settled already: the real state is the answer
        hook = self.cancel_hooks.get(row["operation"])
        call = Call(
            tx=tx,
            tenant=row["tenant"],
            operation_id=row["operation_id"],
            request_id=row["request_id"],
            attempt=row["attempt"],
            operation=row["operation"],
            input=row["command"]["input"],
        )
        if hook is not None and not await hook(call):
            return None  # the effect can no longer be prevented: the engine keeps cancelling
        revision = int(row["owner_revision"]) + 1
        await tx.send(
            "p_inbox_cancel", {"request_id": row["request_id"], "owner_revision": revision}
        )
        return make_receipt(
            row,
            self.me,
            status="cancelled",
            effect="none",
            revision=revision,
            in_reply_to=c.request_id,
            digest=row["digest"],
        )

    async def _lock_for_cancel(self, tx: db.Tx, request_id: str) -> tuple[db.Row | None, bool]:
        """Lock an inbox row for a cancel without ever waiting behind execution.

        Returns (row, False) with the row locked, (None, False) if there is no row, or
        (None, True) if the row is busy. A handler's transaction holds its row's lock
        for as long as the handler runs, and only a handler's transaction holds an
        inbox row lock beside short acceptance and claim transactions; so a row that is
        locked while an executor's claim on it is current is being executed right now.
        That cancel can no longer prevent the effect: it is answered with the current
        state (our latest receipt is re-emitted), the engine stays cancelling, and the
        handler's terminal receipt, which commits with its effect, is the authoritative
        evidence that settles it. A row locked without a current claim is held by a
        short transaction (a claim being made, another replica's acceptance): tried
        again briefly, then treated as busy too — acceptance never blocks on a lock.
        """
        for attempt in range(CANCEL_LOCK_TRIES):
            row = await tx.one("p_inbox_lock", {"id": request_id})
            if row is not None:
                return row, False
            peek = await tx.one("p_inbox_peek", {"id": request_id})
            if peek is None:
                return None, False
            if peek["claimed"] or attempt + 1 == CANCEL_LOCK_TRIES:
                return None, True
            await asyncio.sleep(CANCEL_LOCK_RETRY_S)
        raise AssertionError("unreachable")

    def _refusal(self, c: acceptance.Command) -> acceptance.Refusal | None:
        return acceptance.refusal(c, owner=self.me.owner, bindings=self.me.bindings)

    async def _answers(self, tx: db.Tx, queries: Sequence[QueryCommand]) -> list[QueryAnswer]:
        if not queries:
            return []
        latest = {
            r["request_id"]: r
            for r in await tx.rows(
                "p_latest_receipts", {"ids": list({q.submit_request_id for q in queries})}
            )
        }
        answers = []
        for q in queries:
            row = latest.get(q.submit_request_id)
            stored = codec.decode_receipt(bytes(row["body"])) if row else None
            # the journal holds this participant's receipts, never a query answer
            journaled = stored if isinstance(stored, OperationReceipt) else None
            answers.append(
                acceptance.query_answer(
                    q,
                    journaled,
                    owner=self.me.owner,
                    principal=self.me.principal,
                    now=datetime.now(UTC),
                )
            )
        return answers

    async def _emit(
        self,
        tx: db.Tx,
        receipts: Sequence[OperationReceipt],
        answers: Sequence[QueryAnswer] = (),
        unjournaled: Sequence[OperationReceipt] = (),
        trace: Mapping[str, str | None] | None = None,
    ) -> Queued:
        """Journal our receipts (they answer later queries) and queue everything we say.
        The receipts are queued claimed by our own publisher (``self.sender``), to be
        handed to it after the commit; answers are queued for any publisher's claim."""
        bodies = [(r, codec.encode(r)) for r in receipts]
        await tx.send_many(
            "p_receipt_insert",
            [
                {
                    "receipt_id": r.receipt_id,
                    "request_id": r.request_id,
                    "owner_revision": r.owner_revision,
                    "body": b,
                }
                for r, b in bodies
            ],
        )
        trace = trace or {}

        def tp(*keys: str) -> str | None:
            return next((trace[k] for k in keys if trace.get(k)), None)

        rows = [
            _outbox_row(r.receipt_id, b, r.operation_id, tp(r.in_reply_to, r.request_id))
            for r, b in bodies
        ]
        rows += [
            _outbox_row(r.receipt_id, codec.encode(r), r.operation_id, tp(r.in_reply_to))
            for r in unjournaled
        ]
        queued = Queued(rows, bool(answers))
        if rows:
            sender = self.sender
            queued.inserted = await tx.ask(
                "p_outbox_insert",
                {
                    "rows": db.jsonb(rows),
                    "holder": sender.holder if sender else None,
                    "ttl": sender.claim_ttl_s if sender else None,
                },
            )
        # an answer is (re)sent for every query received, a repeated one included (one
        # statement per answer: its headers a jsonb parameter of their own)
        upserts = [
            _outbox_row(a.answer_id, codec.encode(a), a.operation_id, tp(a.in_reply_to))
            for a in answers
        ]
        await tx.send_many(
            "p_answer_upsert", [{**u, "headers": db.jsonb(u["headers"])} for u in upserts]
        )
        return queued

    async def execute(self) -> int:
        """Run the handlers of a batch of accepted commands; returns how many it claimed.

        The batch is claimed in a short transaction that commits at once (a claim token
        and an expiry, no lock kept), so acceptance never waits behind a handler. The
        handlers then run in order, several to a transaction (up to
        ``EXEC_TX_BUDGET_S`` of handler time each, so that one commit serves many fast
        handlers and a slow one holds back few receipts). Each handler re-locks its
        row just before it runs and re-checks that it is still accepted and still ours
        (a cancel may have settled it since), runs (see :meth:`_run_one`), and its
        business effect commits together with its terminal receipt; a handler that
        fails leaves no effect, and the others keep theirs. The row lock, held until
        that commit, is what keeps a command from executing twice at once: claims skip
        locked rows, and a claim that expired (a crashed or slow executor) is
        re-checked under the lock before anything runs again. A transient database
        conflict in a handler (a deadlock with another executor) ends the transaction
        early: what ran before it commits, and the rest, still claimed by this
        executor, runs again at once.
        """
        async with self.db.transaction() as tx:
            claimed = await tx.rows(
                "p_exec_claim",
                {
                    "limit": self.settings.batch_size,
                    "ttl": self.settings.lease_ttl_s,
                    "token": self._claim_token,
                },
            )
        todo = [
            c["request_id"]
            for c in sorted(claimed, key=lambda r: (r["accepted_at"], r["request_id"]))
        ]
        while todo:
            done, conflicted = await self._redone(functools.partial(self._execute_some, todo))
            todo = todo[done:]
            if conflicted:
                break  # the rest keep this executor's claim: the next batch retakes them
        return len(claimed)

    async def _execute_some(self, request_ids: Sequence[str]) -> tuple[int, bool]:
        """One transaction over a prefix of ``request_ids``; returns how many of them it
        settled (ran, deferred or skipped) and whether a transient conflict ended it."""
        receipts: list[tuple[OperationReceipt, str | None]] = []
        done = 0
        conflicted = False
        loop = asyncio.get_running_loop()
        async with (
            otel.claimed("completion", names.participant_worker(self.me.owner)) as span,
            self._unit() as tx,
        ):
            began = loop.time()
            for request_id in request_ids:
                with _deferred_errors(tx):  # the answer of earlier handlers' writes too
                    row = await tx.one(
                        "p_exec_lock", {"request_id": request_id, "token": self._claim_token}
                    )
                if row is not None:  # else settled meanwhile (a cancel won), or not ours
                    try:
                        with logs.bound(
                            trace_id=tracing.trace_id(row["traceparent"]),
                            operation_id=str(row["operation_id"]),
                            request_id=request_id,
                        ):
                            receipt, traceparent = await self._run_one(tx, row)
                    except _Conflict:
                        conflicted = True
                        break
                    if receipt is not None:
                        receipts.append((receipt, traceparent))
                done += 1
                if loop.time() - began >= EXEC_TX_BUDGET_S:
                    break
            trace = {r.request_id: tp for r, tp in receipts if tp}
            await complete(tx, [r for r, _ in receipts])
            queued = await self._emit(tx, [r for r, _ in receipts], trace=trace)
            await tx.send_many(
                "p_outbox_supersede",
                [
                    {
                        "id": identity.receipt_id(r.request_id, r.owner_revision - 1),
                        "by": r.receipt_id,
                    }
                    for r, _ in receipts
                    if r.owner_revision > 1
                ],
            )
            if receipts and isinstance(span, otel.Claimed):
                span.parent(receipts[0][1])
                span.set(
                    operation_id=[r.operation_id for r, _ in receipts],
                    request_id=[r.request_id for r, _ in receipts],
                    status=[r.status for r, _ in receipts],
                )
        if receipts:  # before the hand-over: the receipts leave within it (hand_over)
            faults.crash_point("after_effect_before_receipt_sent")
        await self._queued(queued)
        return done, conflicted

    async def _queued(self, queued: Queued) -> None:
        """After a commit: the receipts it queued claimed by our publisher go to it (the
        ones its insert took: a repeated id is a row queued before, not ours to send);
        the publisher claims from the table when the commit queued rows only a claim
        finds."""
        if queued.inserted is not None:
            mine = {r["id"] for r in await queued.inserted.rows()}
            if self.sender is None:
                queued.claimable = queued.claimable or bool(mine)
            else:
                await self.sender.hand_over([r for r in queued.offered if r["id"] in mine])
        if queued.claimable:
            self.outbox_due = True

    async def _run_one(
        self, tx: db.Tx, row: dict[str, Any]
    ) -> tuple[OperationReceipt | None, str | None]:
        """The handler's receipt (None: deferred) and the trace context it continues
        (the handler's span when tracing is on, else the command's)."""
        command, operation = row["command"], row["operation"]
        call = Call(
            tx=tx,
            tenant=row["tenant"],
            operation_id=row["operation_id"],
            request_id=row["request_id"],
            attempt=row["attempt"],
            operation=operation,
            input=command["input"],
        )
        handler = self.handlers[operation]
        revision = int(row["owner_revision"]) + 1
        result: Mapping[str, Any] | None = None
        failure: Exception | None = None
        traced = otel.handler(
            operation, row["traceparent"], names.participant_worker(self.me.owner)
        )
        runs = self._careful.get(operation, 0)
        if runs:
            self._careful[operation] = runs - 1
        careful = bool(runs) or careful_unit()
        if careful:
            # what earlier handlers sent without waiting is answered before this one
            # starts: an error of theirs is never taken for one of this handler's
            await _settle(tx)
        written = tx.statements - tx.reads  # what it may have written (Tx.read: nothing)
        # the handler's writes that return nothing are sent without waiting
        # (db.Tx.business): without a savepoint they are answered with the batch's, in a
        # savepoint before it ends (an error there is this handler's, rolled back alone)
        tx.defer_writes = True
        try:
            with traced:
                if traced.recording:
                    traced.set(
                        operation_id=row["operation_id"],
                        request_id=row["request_id"],
                        attempt=row["attempt"],
                    )
                async with tx.savepoint() if careful else contextlib.nullcontext():
                    result = await handler(call)
                    faults.crash_point("mid_effect")
        except Exception as exc:  # a business failure, or a handler bug: rolled back
            if not careful and (tx.statements - tx.reads != written or db.statement_error(exc)):
                # it wrote (or a statement failed, which aborts the transaction); a
                # statement's error may be that of a write sent earlier without waiting
                # (another handler's): then whose is not known. One that only read
                # (Tx.read) and failed had nothing to undo: its failure is its receipt
                unknown = tx.deferred > 0 and db.statement_error(exc)
                raise _Redo(None if unknown else operation, row["request_id"], exc) from exc
            if careful_unit() and db.statement_error(exc):
                # its own write failed (answered in its savepoint): its next runs are
                # careful, so they fail alone, not the whole unit
                self._be_careful(operation)
            if db.transient(exc):
                logs.event(
                    "participant.handler_conflict",
                    logging.WARNING,
                    owner=self.me.owner,
                    request_id=row["request_id"],
                    error=repr(exc)[:300],
                )
                raise _Conflict from exc
            failure = exc
        finally:
            tx.defer_writes = False
        done = acceptance.completion(result, failure, executions=row["executions"])
        if isinstance(done, acceptance.Deferred):
            logs.event(
                "participant.handler_error",
                logging.WARNING,
                owner=self.me.owner,
                request_id=row["request_id"],
                error=repr(failure)[:300],
            )
            await tx.send("p_exec_defer", {"request_id": row["request_id"], "delay": done.delay})
            return None, None
        status, effect, result, error = done.status, done.effect, done.result, done.error
        # the inbox row is completed with the batch's other ones (_complete), from this
        # receipt, in the same transaction: its lock is held until then
        receipt = make_receipt(
            row,
            self.me,
            status=status,
            effect=effect,
            revision=revision,
            in_reply_to=row["request_id"],
            digest=row["digest"],
            result=result,
            error=error,
        )
        return receipt, traced.traceparent or row["traceparent"]


@contextlib.contextmanager
def _deferred_errors(tx: db.Tx) -> Iterator[None]:
    """Around a statement that waits for the answers of writes handlers sent without
    waiting: an error there is no known handler's, so the unit runs again with every
    handler in a savepoint (:class:`_Redo` without an operation). Not in such a rerun:
    there every handler's writes were answered in its savepoint, and an error is the
    statement's own (a deadlock is redone with backoff, not rerun at once)."""
    try:
        yield
    except _Redo:
        raise
    except Exception as exc:
        if _nobodys(tx, exc, careful=careful_unit()):
            raise _Redo(None, "", exc) from exc
        raise


def _nobodys(tx: db.Tx, error: BaseException | None, *, careful: bool) -> bool:
    """A statement's error that may be that of a write a handler sent without waiting,
    in a unit whose handlers ran without savepoints: which handler's is not known. In a
    rerun with every handler in a savepoint (``careful``) each handler's writes were
    answered in its savepoint, so such an error is the statement's own."""
    return bool(tx.deferred) and not careful and db.statement_error(error)


async def _settle(tx: db.Tx) -> None:
    """The answers of the writes handlers sent without waiting (see
    :func:`_deferred_errors`)."""
    with _deferred_errors(tx):
        await tx.settle()


async def complete(tx: db.Tx, receipts: Sequence[OperationReceipt]) -> None:
    """The inbox rows of these terminal receipts take their status, effect, revision,
    result and error, in one statement sent without waiting: it leaves and is answered
    with the COMMIT. A row that changed under this transaction's lock fails it there
    (CU004: the unit is redone). An error of a write a handler sent without waiting is
    raised there too, where it is no known handler's (:meth:`Participant._unit`)."""
    await tx.send_many(
        "p_exec_complete",
        [
            {
                "request_id": r.request_id,
                "status": r.status,
                "effect": r.effect,
                "owner_revision": r.owner_revision,
                "result": r.result,
                "error": r.error.model_dump() if r.error else None,
            }
            for r in receipts
        ],
    )


def _cmd(c: SubmitCommand) -> dict[str, Any]:
    return {
        "request_id": c.request_id,
        "tenant": c.tenant,
        "operation_id": c.operation_id,
        "attempt": c.attempt,
    }


def _refused(d: broker.Delivery, reason: Reason, detail: str) -> records.Refusal:
    return records.Refusal(
        reason,
        detail,
        d.message_id,
        d.body,
        trace_id=tracing.trace_id_of(d.headers),
        operation_id=d.ids.get("operation_id"),
    )


async def serve(
    me: Identity,
    handlers: Mapping[str, Handler],
    settings: Settings,
    stop: supervisor.Stop,
    health: probes.Health,
    *,
    schema: str,
    cancel_hooks: Mapping[str, CancelHook] | None = None,
    inline: Collection[str] = (),
) -> None:
    """Run a participant: acceptance consumer, executor and receipt publisher.
    ``inline``: operations whose handlers run in the acceptance transaction."""
    # the worker name of the logs and the ``worker`` metric label (the Deployment's)
    worker = names.participant_worker(me.owner)
    database = db.Database(
        settings.participant_database_url, schema=schema, name=worker, max_size=4
    )
    amqp = broker.Broker(
        settings.amqp_url,
        worker,
        broker.Tls(
            settings.amqp_tls_ca_file, settings.amqp_tls_cert_file, settings.amqp_tls_key_file
        ),
    )
    await database.open()
    await amqp.connect()
    health.checks["broker"] = lambda: amqp.connected
    health.checks["database"] = lambda: database.healthy
    part = Participant(me, handlers, settings, database, cancel_hooks, inline)
    exec_waker = supervisor.Waker(settings.poll_interval_s)
    pub_waker = supervisor.Waker(settings.poll_interval_s)
    pub = outbox.OutboxPublisher(
        owner=me.owner,
        database=database,
        lease=None,
        publisher=await amqp.publisher(
            window=settings.confirm_window,
            timeout_s=settings.confirm_timeout_s,
            user_id=me.principal,
            envelope_max=settings.envelope_max,
        ),
        batch_size=settings.batch_size,
        claim_ttl_s=settings.lease_ttl_s,
        engine=False,
    )
    part.sender = pub

    async def nothing() -> None:
        return None

    def kick() -> None:
        # the executor only when acceptance left it work, the publisher's claim only
        # when the commit queued rows for it (receipts are handed to it directly); the
        # polls cover the rest: expired claims, deferred handlers, retries
        if part.executor_due:
            part.executor_due = False
            exec_waker.kick()
        if part.outbox_due:
            part.outbox_due = False
            pub_waker.kick()

    async def commands_in() -> None:
        await consume.run(
            amqp,
            [broker.command_queue(b) for b in sorted(me.bindings)],
            settings=settings,
            stop=stop,
            worker=worker,
            handle=part.accept,
            on_fenced=nothing,
            after_commit=kick,
            publish_dead_letters=False,
        )

    async def execute() -> None:
        while not stop.requested:
            n = await supervisor.redo(
                part.execute,
                worker=worker,
                stop=stop,
                on_fenced=nothing,
                name="participant.execute",
            )
            if part.outbox_due:
                part.outbox_due = False
                pub_waker.kick()
            if n < settings.batch_size:
                await exec_waker.wait()

    async def cleanup() -> None:
        while not await stop.sleep(CLEANUP_EVERY_S):
            removed = await supervisor.redo(
                lambda: retention.cleanup(database, settings.retention_s),
                worker=worker,
                stop=stop,
                on_fenced=nothing,
            )
            if any(removed.values()):
                logs.event("retention.cleanup", owner=me.owner, **removed)

    try:
        await supervisor.supervise(
            main=[
                commands_in(),
                execute(),
                outbox.loop(pub, stop, pub_waker, nothing, worker),
                cleanup(),
            ]
        )
    finally:
        # a unit that was committing when the stop came hands its receipts over after
        # the publisher's loop may have ended: their claims are given back here, once
        # no loop can hand more, so the next start sends them at once
        await pub.release_handed()
        await amqp.close()
        await database.close()
