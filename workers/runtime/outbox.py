"""The outbox publisher: owner of the *broker confirmation* boundary.

Claims pending rows in batches (``FOR UPDATE SKIP LOCKED`` plus a claim expiry, in a
short transaction fenced before the claim runs and again at its commit), publishes them
with a bounded window of unconfirmed messages while that COMMIT waits for its flush, and
marks a row published — in a second short transaction, once the claim committed — only
after a positive, non-returned confirm. A nack, a return or a timeout leaves the row
pending, to be sent again with backoff under the same message id; so does a claim that
does not commit (its publishes left: the same ids again, deduplicated by every
consumer). No transaction waits on the broker. The same code serves the engine's outbox
and a participant's.

A participant's receipts and the committer's submits skip the claim: the commit queues
them already claimed by a publisher of the same process (``p_outbox_insert``,
``activation_insert``) and hands them over after the commit
(:meth:`OutboxPublisher.hand`), so they leave without a claim transaction or a wake-up;
handed to a sender that waits for work, they leave at once, from the committing task.
Marked the same way; a process that dies first leaves them claimed until the claim
expires (then the publisher worker claims them), and a stopping one gives the claims
back.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from workers import errors
from workers.errors import backoff_seconds
from workers.io import broker, db
from workers.runtime import faults, logs, metrics, otel, supervisor

ACTOR = "publisher"  # the actor of the history rows its confirm marks write


@dataclass
class _Sending:
    """A batch's publishes under way: their outcomes, spans and start."""

    outcomes: asyncio.Future[list[broker.Outcome]]
    spans: Any
    started: float


class OutboxPublisher:
    def __init__(
        self,
        *,
        owner: str,
        database: db.Database,
        lease: db.Lease | None,
        publisher: broker.Publisher,
        batch_size: int,
        claim_ttl_s: float,
        engine: bool,
        hold_submits: bool = False,
        before_sample: Callable[[db.Tx], Awaitable[object]] | None = None,
        worker: str = ACTOR,
    ) -> None:
        self.hold_submits = hold_submits
        self.before_sample = before_sample
        self.owner = owner
        self.db = database
        self.lease = lease
        self.publisher = publisher
        self.batch_size = batch_size
        self.claim_ttl_s = claim_ttl_s
        self.engine = engine
        self.holder = lease.holder if lease else f"{owner}-{id(self):x}"
        # the worker whose logs say what it did (the committer runs an engine sender)
        self.worker = worker
        # rows its own process committed already claimed by this holder
        # (``p_outbox_insert``, ``activation_insert``), to send without a claim
        # transaction, each stamped with the moment it was handed over: see hand()
        self.handed: list[dict[str, Any]] = []
        self.ready = asyncio.Event()
        # rows handed over to an idle sender, whose publishes left at once (hand()),
        # for the sender's next cycle to settle and mark; and whether that is allowed:
        # only while its loop waits for work (``loop``)
        self._early: tuple[list[dict[str, Any]], _Sending] | None = None
        self._looping = False

    def hand(self, rows: Sequence[dict[str, Any]]) -> None:
        """Rows committed by this process, already claimed by ``self.holder``, to send
        next (called after their commit). A row not sent before a crash waits for its
        claim to expire, then any publisher claims it. A row still here once half its
        claim's life has passed (the broker stalled, the process was paused) is not
        sent from here any more (:meth:`_drop_stale`). Each is sent as a claim would have
        returned it: on its first attempt."""
        if not rows:
            return
        now = time.monotonic()
        fresh = [{**r, "publish_attempts": 1, "handed_at": now} for r in rows]
        idle = self._looping and not self.handed and self._early is None
        self.handed.extend(fresh)
        if idle and len(fresh) <= self.batch_size:
            # the sender waits for work: their publishes leave now, from the committing
            # task's turn of the event loop, not after the sender's wake-up (and the
            # acks of the unit that committed them); its next cycle settles and marks
            # them as it would have sent them (run_once)
            self._early = (fresh, self._send(fresh))
        self.ready.set()

    async def hand_over(self, rows: Sequence[dict[str, Any]]) -> None:
        """:meth:`hand`, then, when their publishes left at once, two turns of the event
        loop: one for the publish to queue its frames, one for the connection's writer to
        write them. The committing unit's own tail (its acks, its metrics and logs) then
        runs with the submit or receipt already on the wire, not before it: at light
        load, every hop of an operation's way waited for that tail.

        The caller's crash points "before the send" come before this call. A stop that
        cancels the caller in these two turns cancels a unit that committed and did not
        ack: its deliveries come again and are deduplicated, and the rows handed over
        are settled by the sender's loop or given back (:meth:`release_handed`)."""
        before = self._early
        self.hand(rows)
        if self._early is not None and self._early is not before:
            await asyncio.sleep(0)
            await asyncio.sleep(0)

    def _drop_stale(self) -> None:
        """Leave the rows handed over more than half a claim's life ago to the claim of
        the table: a send must start well inside its claim, never after it expired
        (then the row may be retired, or held by a pause or a suspension since, which
        only a claim checks). Their claims expire; a publisher claims what is still
        to be sent, with every check of its claim."""
        limit = time.monotonic() - self.claim_ttl_s / 2
        stale = sum(1 for r in self.handed if r["handed_at"] < limit)
        if not stale:
            return
        self.handed = [r for r in self.handed if r["handed_at"] >= limit]
        logs.event(
            "outbox.handed_left_to_claim",
            logging.WARNING,
            worker=self.worker,
            owner=self.owner,
            rows=stale,
        )

    async def release_handed(self) -> None:
        """At shutdown: give the claims of rows handed over but not sent back, so that
        a publisher claims them at its next poll (or the next start sends them), not
        after the claim expiry.
        Bounded; the claim's expiry covers a database that cannot be reached."""
        if self._early is not None:
            # publishes that left but were never settled by a cycle (its loop ended
            # otherwise than by a stop): let them settle (bounded by the confirm
            # timeout); unmarked, they are sent again under the same message ids after
            # the claims given back here, deduplicated by every consumer
            _, sending = self._early
            self._early = None
            with contextlib.suppress(BaseException):
                await sending.outcomes
        if not self.handed:
            return
        ids = [str(r["id"]) for r in self.handed]
        self.handed = []
        try:
            async with asyncio.timeout(db.RELEASE_TIMEOUT_S):
                async with self.db.transaction() as tx:
                    await tx.send("outbox_unclaim", {"ids": ids, "holder": self.holder})
        except (TimeoutError, errors.DatabaseError) as exc:
            logs.event(
                "outbox.release_failed",
                logging.WARNING,
                owner=self.owner,
                rows=len(ids),
                error=str(exc)[:300],
            )

    async def _ask_claim(self, tx: db.Tx) -> db.Answer:
        """The claim of a batch, sent after a fence: a publisher whose lease was taken
        back claims and reads nothing (the commit checks the lease again)."""
        await tx.fence()
        return await tx.ask(
            "outbox_claim" if self.engine else "p_outbox_claim",
            {
                "holder": self.holder,
                "ttl": self.claim_ttl_s,
                "limit": self.batch_size,
                "held": self.hold_submits,
            },
        )

    async def claim(self) -> list[dict[str, Any]]:
        """Claim a batch without publishing it (tools, tests): the rows are read with
        the commit's answer, in one round trip. A claim that did not commit (fenced,
        failed) raises, and none of its rows is read."""
        async with self.db.transaction(self.lease) as tx:
            claimed = await self._ask_claim(tx)
        return await claimed.rows()

    async def _claim_and_send(self) -> tuple[list[dict[str, Any]], _Sending | None]:
        """Claim a batch and publish it while the claim commits: the rows are read with
        the fence's answer, and their publishes leave while the COMMIT waits for its
        flush.

        The mark still waits for both the confirms and the claim's commit, and marks
        only rows that this publisher's committed claim holds. A claim that does not
        commit (the database failed, or the commit's fence found the lease taken back
        since the first check) raises once its publishes settled: its rows stay
        pending and unclaimed, and are sent again under the same message ids, which
        every consumer deduplicates, as after a publisher that died between a publish
        and its mark."""
        sending: _Sending | None = None
        try:
            async with self.db.transaction(self.lease) as tx:
                rows = await (await self._ask_claim(tx)).rows()
                if rows:
                    sending = self._send(rows)
        except BaseException:
            if sending is not None:
                # under way: let them settle (bounded by the confirm timeout), so that
                # none is left running unowned; the unit is then redone
                with contextlib.suppress(BaseException):
                    await sending.outcomes
            raise
        return rows, sending

    def _send(self, rows: Sequence[dict[str, Any]]) -> _Sending:
        # each publish starts within half its claim's life, or not at all: a batch
        # waits for room in the confirm window, and a broker slow to confirm could
        # otherwise send a row after its claim expired (retired, or held by a pause,
        # since); one not sent is released for a later claim, with its checks
        now = time.monotonic()
        outgoing: Sequence[broker.Outgoing] = [
            broker.Outgoing(
                str(r["id"]),
                r["exchange"],
                r["routing_key"],
                bytes(r["body"]),
                r["headers"] or {},
                not_after=r.get("handed_at", now) + self.claim_ttl_s / 2,
            )
            for r in rows
        ]
        # a producer span per row, if tracing is on: the wire carries its context
        outgoing, spans = otel.publishing(outgoing, self.owner)
        return _Sending(
            asyncio.ensure_future(self.publisher.publish_many(outgoing)), spans, time.monotonic()
        )

    async def run_once(self, *, claim: bool = True) -> int:
        """One claim → publish → mark cycle; returns how many rows it claimed. Rows
        handed over (:meth:`hand`) go first, without a claim; ``claim=False``: only
        those.

        The mark is fenced by the epoch the claim was made under: a publisher paused
        past its lease (its rows may have been claimed and published by a replica
        since) cannot mark them; it drops the batch and the claims expire."""
        epoch = self.lease.epoch if self.lease else None
        # handed rows leave the list once marked (sent, or released for a retry): a
        # unit redone after a failure sends them again, under the same message ids
        sending: _Sending | None = None
        if self._early is not None:
            # handed to an idle sender and sent at once (hand): the first rows of the
            # list, fresh (handed since the last cycle), settled and marked here
            rows, sending = self._early
            self._early = None
        else:
            self._drop_stale()
            rows = self.handed[: self.batch_size]
        handed = bool(rows)
        if not rows and claim:
            rows, sending = await self._claim_and_send()
        if not rows:
            return 0
        if sending is None:
            sending = self._send(rows)
        spans = sending.spans
        if faults.enabled("after_publish_before_confirm"):
            await asyncio.sleep(0.05)
            faults.crash_point("after_publish_before_confirm")
        try:
            outcomes = await sending.outcomes
        except BaseException as exc:
            if spans is not None:
                spans.failed(exc)
            raise
        if faults.broken("mark_before_confirm"):  # chaos self-test only
            outcomes = [broker.Outcome(o.message_id, True) for o in outcomes]
        metrics.CONFIRM_LATENCY.labels(self.owner).observe(time.monotonic() - sending.started)
        if spans is not None:
            spans.settled(outcomes)
        faults.crash_point("after_confirm_before_mark")
        try:
            await self.mark(rows, outcomes, epoch)
            if handed:
                del self.handed[: len(rows)]
        except errors.Fenced as exc:
            # not a lease loss of its own: the loss is counted once, by the lease's
            # keeper taking it back (custody_lease_losses_total{worker}). Rows handed
            # over are dropped as a claimed batch is: their claims may have expired and
            # been taken since; the publisher's claim finds the ones still pending
            if handed:
                del self.handed[: len(rows)]
            logs.event(
                "lease.fenced",
                logging.WARNING,
                worker=self.worker,
                owner=self.owner,
                epoch=epoch,
                dropped=len(rows),
                error=str(exc)[:300],
            )
        return len(rows)

    async def mark(
        self,
        rows: Sequence[dict[str, Any]],
        outcomes: Sequence[broker.Outcome],
        epoch: int | None = None,
    ) -> None:
        by_id = {str(r["id"]): r for r in rows}
        ok = [o.message_id for o in outcomes if o.ok]
        failed = [o for o in outcomes if not o.ok]
        # one flight: the mark (for the engine, with the dispatch of the confirmed
        # submits and their history: outbox_mark_dispatched), the releases of the
        # failed rows, the fence and the COMMIT; how many it marked is read with the
        # commit's answer
        async with self.db.transaction(self.lease, epoch=epoch) as tx:
            if self.engine:
                answer = await tx.ask(
                    "outbox_mark_dispatched", {"ids": ok, "holder": self.holder, "actor": ACTOR}
                )
            else:
                answer = await tx.ask("outbox_mark_published", {"ids": ok, "holder": self.holder})
            await tx.send_many(
                "outbox_release",
                [
                    {
                        "id": o.message_id,
                        "holder": self.holder,
                        "error": o.error[:500],
                        "delay": backoff_seconds(int(by_id[o.message_id]["publish_attempts"])),
                    }
                    for o in failed
                ],
            )
        found = await answer.rows()
        marked = int(found[0]["marked"]) if self.engine else len(found)
        metrics.PUBLISHED.labels(self.owner).inc(marked)
        for o in failed:
            kind = o.error.split(":", 1)[0]
            metrics.PUBLISH_FAILURES.labels(self.owner, kind).inc()
        if failed:
            logs.event(
                "outbox.publish_failed",
                logging.WARNING,
                owner=self.owner,
                failed=len(failed),
                first_error=failed[0].error[:300],
            )

    async def sample(self) -> None:
        if self.before_sample is not None:  # the engine's: retire undeliverable submits
            async with self.db.transaction(self.lease) as tx:
                await self.before_sample(tx)
        async with self.db.transaction() as tx:
            row = await tx.one("outbox_stats")
        if row:
            metrics.OUTBOX_PENDING.labels(self.owner).set(row["pending"])
            metrics.OUTBOX_OLDEST_AGE.labels(self.owner).set(row["oldest_age_s"])


async def loop(
    pub: OutboxPublisher,
    stop: supervisor.Stop,
    waker: supervisor.Waker,
    on_fenced: Any,
    worker: str,
    *,
    claims: bool = True,
) -> None:
    """Claim while there is work; otherwise wait for a NOTIFY, a kick, rows handed over
    or the poll interval. Rows handed over are sent without a claim; the table is
    claimed from after a NOTIFY, a kick or the poll interval (rows that only a claim
    finds: another process's, retried ones, expired claims). Rows still handed over
    when it ends are the handing process's to give back (:meth:`release_handed`), once
    nothing can hand more: a participant's ``serve``, the committer's ``main``.

    ``claims=False``: only the rows handed over, never a claim of the table nor the
    outbox's gauges (the committer's sender: the publisher worker claims and samples)."""
    last_sample = 0.0
    claim = claims
    # a stop that came while publishes handed over were leaving (hand) ends the loop
    # once they are settled and marked, not sent again after their claims are given back
    while not stop.requested or pub._early is not None:
        n = await supervisor.redo(
            functools.partial(pub.run_once, claim=claim),
            worker=worker,
            stop=stop,
            on_fenced=on_fenced,
            name="outbox.publish",
        )
        if claims and time.monotonic() - last_sample > 5:
            await supervisor.redo(pub.sample, worker=worker, stop=stop, on_fenced=on_fenced)
            last_sample = time.monotonic()
        if pub.handed:
            claim = False  # handed over while this batch was out: those first
        elif stop.requested:
            continue  # ends here, with nothing of its own left out
        elif not (claim and n >= pub.batch_size):
            # rows handed over from here on leave at once (hand), while it waits
            pub._looping = True
            try:
                claim = await waker.wait(also=pub.ready) and claims
            finally:
                pub._looping = False
