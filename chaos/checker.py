"""A read-only checker over the engine database, the participants' databases and the
broker's queues, with the categories of RabbitMQ's and Jepsen's queue checkers.

* **lost**: an operation the engine committed that is neither terminal nor in a
  custody state with a reason (``outcome_unknown``); an instance or a successor intent
  left behind; an outbox row never sent; a start request confirmed to its sender with
  neither an instance nor a tombstone; a legitimate message in a dead-letter queue.
* **duplicated**: a participant effect applied more than once for one operation.
* **unexpected**: an effect with no engine operation (or one the engine recorded as
  failed or cancelled, or a success without its effect); a receipt applied that the
  owner never issued, or a success that no applied receipt of the owner reported; a
  new operation after an instance's cancellation committed, or
  an effect after a tombstone; a status that moved backward; an attempt created while
  the effect was unknown.
* **unknown**: operations still ``outcome_unknown``, each with its query history.
* **recovered** (counted, allowed): operations that went through ``outcome_unknown``
  and were settled by evidence.

Only SELECTs (in read-only transactions) and, for the dead-letter queue, the
management API's ``get`` with ``ack_requeue_true`` (messages stay in the queue).

    python -m chaos.checker --engine-dsn ... --participant-dsn ... --amqp ... \\
        [--management http://guest:guest@127.0.0.1:15672] [--starts starts.json]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import sys
import urllib.parse
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import psycopg

from workers.core import amqp_url, envelope
from workers.io import broker

# effect table → (participant, operation name)
EFFECTS: Final[Mapping[str, tuple[str, str]]] = {
    "participant_inventory.reservations": ("inventory", "inventory.reserve"),
    "participant_inventory.releases": ("inventory", "inventory.release"),
    "participant_payments.charges": ("payments", "payments.charge"),
    "participant_shipping.shipments": ("shipping", "shipping.ship"),
}
PARTICIPANTS: Final = ("inventory", "payments", "shipping")
TERMINAL: Final = frozenset({"succeeded", "failed", "cancelled"})
INSTANCE_TERMINAL: Final = frozenset({"completed", "failed", "cancelled"})
EXAMPLES: Final = 20  # rows of evidence kept per finding kind


@dataclass
class Findings:
    lost: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    duplicated: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    unexpected: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    unknown: list[dict[str, Any]] = field(default_factory=list)
    recovered: int = 0
    stats: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def _count(d: Mapping[str, list[dict[str, Any]]]) -> int:
        return sum(len(v) for v in d.values())

    @property
    def ok(self) -> bool:
        return not (
            self._count(self.lost) or self._count(self.duplicated) or self._count(self.unexpected)
        )

    def counts(self) -> dict[str, int]:
        return {
            "lost": self._count(self.lost),
            "duplicated": self._count(self.duplicated),
            "unexpected": self._count(self.unexpected),
            "unknown": len(self.unknown),
            "recovered": self.recovered,
        }

    def report(self) -> dict[str, Any]:
        def trim(d: Mapping[str, list[dict[str, Any]]]) -> dict[str, Any]:
            return {k: {"count": len(v), "examples": v[:EXAMPLES]} for k, v in sorted(d.items())}

        return {
            "ok": self.ok,
            "counts": self.counts(),
            "lost": trim(self.lost),
            "duplicated": trim(self.duplicated),
            "unexpected": trim(self.unexpected),
            "unknown": self.unknown[:200],
            "stats": self.stats,
        }

    def line(self) -> str:
        c = self.counts()
        return (
            f"lost={c['lost']} duplicated={c['duplicated']} unexpected={c['unexpected']} "
            f"unknown={c['unknown']} recovered={c['recovered']}"
        )


def _rows(conn: psycopg.Connection[Any], query: str, params: Any = None) -> list[dict[str, Any]]:
    cur = conn.execute(query, params)
    if cur.description is None:
        return []
    names = [d.name for d in cur.description]
    return [dict(zip(names, (_plain(v) for v in row), strict=True)) for row in cur.fetchall()]


def _plain(value: Any) -> Any:
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(value, dict | list):
        return value
    return str(value)


def _connect(dsn: str) -> psycopg.Connection[Any]:
    conn = psycopg.connect(dsn, autocommit=False)
    conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
    return conn


def check(
    engine_dsn: str,
    participant_dsn: str,
    *,
    management_url: str | None = None,
    vhost: str = "/",
    starts: Iterable[str] = (),
    extra_legit_ids: Iterable[str] = (),
) -> Findings:
    f = Findings()
    with _connect(engine_dsn) as eng, _connect(participant_dsn) as part:
        _check(f, eng, part, set(starts))
        legit = _legit_ids(eng, part) | set(extra_legit_ids) | set(starts)
    if management_url:
        _check_dead_letters(f, management_url, vhost, legit)
    return f


def _check(
    f: Findings, eng: psycopg.Connection[Any], part: psycopg.Connection[Any], starts: set[str]
) -> None:
    ops = _rows(
        eng,
        "SELECT id, tenant, instance_id, node, operation, owner, attempt, status::text AS status,"
        " effect::text AS effect, created_at FROM custody.operations",
    )
    by_id = {o["id"]: o for o in ops}
    instances = {
        r["id"]: r
        for r in _rows(
            eng,
            "SELECT id, start_request_id, status::text AS status, suspended_reason"
            " FROM custody.instances",
        )
    }
    f.stats["instances"] = dict(Counter(i["status"] for i in instances.values()))
    f.stats["operations"] = dict(Counter(o["status"] for o in ops))
    f.stats["operations_total"] = len(ops)

    # -- lost: committed work not terminal and not in custody with a reason ------------
    open_by_instance: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for o in ops:
        if o["status"] in TERMINAL:
            continue
        open_by_instance[o["instance_id"]].append(o)
        if o["status"] == "outcome_unknown":
            continue
        f.lost["operation_not_settled"].append(
            {k: o[k] for k in ("id", "instance_id", "operation", "status", "attempt")}
        )
    for iid, inst in instances.items():
        if inst["status"] in INSTANCE_TERMINAL or open_by_instance.get(iid):
            continue
        f.lost["instance_not_finished"].append(inst)
    for r in _rows(
        eng,
        "SELECT id, instance_id, from_operation_id, next_node FROM custody.successor_intents"
        " WHERE status = 'pending'",
    ):
        f.lost["successor_intent_pending"].append(r)
    for r in _rows(
        eng,
        "SELECT b.id, b.kind, b.operation_id, b.publish_attempts, b.last_error,"
        " o.status::text AS operation_status FROM custody.outbox b"
        " LEFT JOIN custody.operations o ON o.id = b.operation_id WHERE b.status = 'pending'",
    ):
        f.lost["engine_outbox_not_sent"].append(r)
    known_starts = {i["start_request_id"] for i in instances.values()}
    tombstoned = {
        r["start_request_id"]
        for r in _rows(eng, "SELECT start_request_id FROM custody.start_tombstones")
    }
    for sid in sorted(starts - known_starts - tombstoned):
        f.lost["start_request_without_instance_or_tombstone"].append({"start_request_id": sid})
    f.stats["start_requests_confirmed"] = len(starts)
    f.stats["start_tombstones"] = len(tombstoned)

    # -- participant side ---------------------------------------------------------
    inbox: dict[str, dict[str, Any]] = {}
    journal: set[str] = set()
    tombstones: dict[str, dict[str, Any]] = {}
    refused: Counter[str] = Counter()
    conflicts = 0
    for p in PARTICIPANTS:
        s = f"participant_{p}"
        for r in _rows(
            part,
            f"SELECT request_id, operation_id, attempt, operation, status, effect,"
            f" executions, accepted_at, completed_at FROM {s}.inbox",
        ):
            r["participant"] = p
            inbox[r["request_id"]] = r
            if r["status"] == "accepted":
                f.lost["participant_accepted_never_finished"].append(r)
        journal |= {r["receipt_id"] for r in _rows(part, f"SELECT receipt_id FROM {s}.receipts")}
        for r in _rows(
            part, f"SELECT request_id, operation_id, reason, created_at FROM {s}.tombstones"
        ):
            r["participant"] = p
            tombstones[r["request_id"]] = r
        for r in _rows(
            part,
            f"SELECT b.id, b.operation_id, b.publish_attempts, b.last_error FROM {s}.outbox b"
            " WHERE b.status = 'pending'",
        ):
            r["participant"] = p
            f.lost["participant_outbox_not_sent"].append(r)
        for r in _rows(part, f"SELECT reason, count(*) AS n FROM {s}.refused GROUP BY 1"):
            refused[f"{p}:{r['reason']}"] += int(r["n"])
        conflicts += int(_rows(part, f"SELECT count(*) AS n FROM {s}.conflicts")[0]["n"])
    f.stats["participant_refused"] = dict(refused)
    f.stats["participant_conflicts"] = conflicts
    f.stats["participant_tombstones"] = len(tombstones)

    # -- a command the broker confirmed that its participant never received (INV-1):
    # after the settle phase every queue is drained, so it was lost on the way
    delivered = set(inbox) | set(tombstones)
    for r in _rows(
        eng,
        "SELECT b.id, b.operation_id, b.routing_key, o.status::text AS operation_status"
        " FROM custody.outbox b JOIN custody.operations o ON o.id = b.operation_id"
        " WHERE b.kind = 'submit' AND b.status = 'published'",
    ):
        if r["id"] not in delivered:
            f.lost["command_confirmed_never_delivered"].append(r)

    # -- duplicated and unexpected effects ------------------------------------------
    effects_total: dict[str, int] = {}
    effect_ops: dict[str, set[str]] = {}
    for table, (_owner, operation) in EFFECTS.items():
        rows = _rows(part, f"SELECT id, operation_id, at FROM {table}")
        effects_total[table] = len(rows)
        per: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in rows:
            per[r["operation_id"]].append(r)
        effect_ops[operation] = set(per)
        for op_id, group in per.items():
            if len(group) > 1:
                f.duplicated["effect_applied_more_than_once"].append(
                    {"table": table, "operation_id": op_id, "rows": group}
                )
            op = by_id.get(op_id)
            if op is None or op["operation"] != operation:
                f.unexpected["effect_without_engine_operation"].append(
                    {"table": table, "operation_id": op_id, "rows": group[:3]}
                )
            elif op["status"] in ("failed", "cancelled"):
                f.unexpected["effect_of_failed_or_cancelled_operation"].append(
                    {"table": table, "operation": op, "rows": group[:3]}
                )
    for o in ops:
        if o["status"] == "succeeded" and o["id"] not in effect_ops.get(o["operation"], set()):
            f.unexpected["success_without_effect"].append(o)
    f.stats["effects"] = effects_total

    # -- receipts applied that the owner never issued --------------------------------
    applied = _rows(
        eng,
        "SELECT r.receipt_id, r.operation_id, r.attempt, r.owner_revision, r.status"
        " FROM custody.receipt_inbox r WHERE r.decision = 'apply'",
    )
    f.stats["receipts_applied"] = len(applied)
    for r in applied:
        if r["receipt_id"] not in journal:
            f.unexpected["applied_receipt_not_issued_by_owner"].append(r)
    # a success is the owner's word: the receipt applied for it says succeeded (one that
    # said accepted, or anything else, never ends an operation as succeeded)
    reported = {str(r["operation_id"]) for r in applied if r["status"] == "succeeded"}
    for o in ops:
        if o["status"] == "succeeded" and str(o["id"]) not in reported:
            f.unexpected["success_the_owner_never_reported"].append(o)

    # -- effects after a tombstone (INV-7) ------------------------------------------
    for rid, t in tombstones.items():
        row = inbox.get(rid)
        if row is not None and row["status"] == "succeeded":
            f.unexpected["executed_after_tombstone"].append({"tombstone": t, "inbox": row})

    # -- history: cancellation, backward moves, attempts ------------------------------
    history = _rows(
        eng,
        "SELECT id, instance_id, operation_id, event, detail, actor FROM custody.history"
        " ORDER BY id",
    )
    transitions = {
        (r["from_status"], r["to_status"])
        for r in _rows(
            eng,
            "SELECT from_status::text AS from_status, to_status::text AS to_status"
            " FROM custody.operation_transitions",
        )
    }
    cancelled_at: dict[str, int] = {}
    instance_end: dict[str, dict[str, Any]] = {}
    went_unknown: set[str] = set()
    retry_waiting: Counter[str] = Counter()
    events: Counter[str] = Counter()
    for h in history:
        events[h["event"]] += 1
        iid = h["instance_id"]
        ev = h["event"]
        if ev == "instance.cancelling" and iid not in cancelled_at:
            cancelled_at[iid] = h["id"]
        if ev == "node.activated" and iid in cancelled_at:
            f.unexpected["operation_created_after_cancellation"].append(h)
        end = instance_end.get(iid)
        if end is not None and (ev.startswith("instance.") or ev == "node.activated"):
            f.unexpected["instance_event_after_terminal"].append({"terminal": end, "event": h})
        if ev in ("instance.completed", "instance.failed", "instance.cancelled"):
            instance_end.setdefault(iid, h)
        if ev.startswith("operation.") and h["operation_id"]:
            to = ev.split(".", 1)[1]
            detail = h["detail"] if isinstance(h["detail"], dict) else {}
            src = detail.get("from")
            if to == "outcome_unknown":
                went_unknown.add(h["operation_id"])
            if to == "retry_waiting":
                retry_waiting[h["operation_id"]] += 1
            if isinstance(src, str) and src != to and src in TERMINAL:
                f.unexpected["status_moved_backward"].append(h)
            if isinstance(src, str) and src != to and (src, to) not in transitions:
                f.unexpected["status_transition_not_in_lifecycle"].append(h)
    f.stats["history_events"] = dict(sorted(events.items()))
    f.recovered = sum(1 for op_id in went_unknown if by_id.get(op_id, {}).get("status") in TERMINAL)

    attempts = _rows(
        eng,
        "SELECT request_id, operation_id, attempt, kind FROM custody.attempts ORDER BY attempt",
    )
    submits: dict[tuple[str, int], str] = {}
    queries: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for a in attempts:
        if a["kind"] == "submit":
            submits[(a["operation_id"], a["attempt"])] = a["request_id"]
        elif a["kind"] == "query":
            queries[a["operation_id"]].append(a)
    for (op_id, n), _rid in submits.items():
        if n <= 1:
            continue
        prev = submits.get((op_id, n - 1))
        prev_row = inbox.get(prev) if prev else None
        evidence_none = (
            prev_row is not None and prev_row["status"] == "failed" and prev_row["effect"] == "none"
        )
        if not evidence_none or retry_waiting[op_id] < n - 1:
            f.unexpected["attempt_created_while_effect_unknown"].append(
                {
                    "operation_id": op_id,
                    "attempt": n,
                    "previous_request": prev,
                    "previous_at_participant": prev_row,
                    "retry_waiting_events": retry_waiting[op_id],
                }
            )

    # -- unknown: still outcome_unknown, with its query history ------------------------
    by_op_history: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for h in history:
        if h["operation_id"]:
            by_op_history[h["operation_id"]].append(h)
    for o in ops:
        if o["status"] != "outcome_unknown":
            continue
        f.unknown.append(
            {
                **{k: o[k] for k in ("id", "instance_id", "operation", "attempt", "effect")},
                "queries": queries.get(o["id"], []),
                "history": [
                    {k: h[k] for k in ("id", "event", "detail", "actor")}
                    for h in by_op_history[o["id"]]
                ],
                "at_participant": [r for r in inbox.values() if r["operation_id"] == o["id"]],
            }
        )
    f.stats["quarantine"] = {
        r["reason"]: int(r["n"])
        for r in _rows(eng, "SELECT reason, count(*) AS n FROM custody.quarantine GROUP BY 1")
    }
    f.stats["outbox"] = {
        r["status"]: int(r["n"])
        for r in _rows(eng, "SELECT status, count(*) AS n FROM custody.outbox GROUP BY 1")
    }


def _legit_ids(eng: psycopg.Connection[Any], part: psycopg.Connection[Any]) -> set[str]:
    """Message ids of legitimate messages: every command the engine issued, every receipt
    a participant issued, every start request that created an instance."""
    ids = {r["id"] for r in _rows(eng, "SELECT id FROM custody.outbox")}
    ids |= {r["id"] for r in _rows(eng, "SELECT start_request_id AS id FROM custody.instances")}
    for p in PARTICIPANTS:
        ids |= {r["id"] for r in _rows(part, f"SELECT id FROM participant_{p}.outbox")}
    return ids


def _letters(messages: list[dict[str, Any]]) -> list[tuple[dict[str, Any], str | None]]:
    """Each dead letter with its message id; each item of an envelope is one."""
    out: list[tuple[dict[str, Any], str | None]] = []
    for m in messages:
        props = m.get("properties") or {}
        mid = props.get("message_id")
        if props.get("content_type") == envelope.CONTENT_TYPE:
            payload = str(m.get("payload") or "")
            raw = (
                base64.b64decode(payload)
                if m.get("payload_encoding") == "base64"
                else payload.encode("utf-8", "surrogateescape")
            )
            with contextlib.suppress(envelope.Malformed):
                out += [(m, item.message_id) for item in envelope.unpack(raw)]
                continue
        out.append((m, mid))
    return out


def _check_dead_letters(f: Findings, management_url: str, vhost: str, legit: set[str]) -> None:
    q = urllib.parse.quote
    path = f"/api/queues/{q(vhost, safe='')}/{q(broker.QUEUE_DEAD, safe='')}/get"
    # whole payloads (an envelope is at most envelope.MAX_BYTES), base64 when binary
    body = {"count": 100000, "ackmode": "ack_requeue_true", "encoding": "auto"}
    messages = asyncio.run(broker.management(management_url, "POST", path, body)) or []
    reasons: Counter[str] = Counter()
    for m, mid in _letters(messages):
        props = m.get("properties") or {}
        headers = props.get("headers") or {}
        reason = str(headers.get("x-custody-reason") or _death_reason(headers) or "?")
        reasons[reason] += 1
        if mid in legit:
            f.lost["legitimate_message_dead_lettered"].append(
                {
                    "message_id": mid,
                    "routing_key": m.get("routing_key"),
                    "reason": reason,
                    "payload": str(m.get("payload"))[:300],
                }
            )
    f.stats["dead_letters"] = {
        "count": sum(reasons.values()),
        "messages": len(messages),
        "by_reason": dict(reasons),
    }
    depths = asyncio.run(broker.queue_depths(management_url, vhost))
    f.stats["queue_depths"] = depths


def _death_reason(headers: Mapping[str, Any]) -> str | None:
    deaths = headers.get("x-death")
    if isinstance(deaths, list) and deaths and isinstance(deaths[0], dict):
        return str(deaths[0].get("reason"))
    return None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chaos.checker", description=__doc__)
    p.add_argument("--engine-dsn", required=True)
    p.add_argument("--participant-dsn", required=True)
    p.add_argument("--amqp", help="the AMQP URL (its vhost is the one checked)")
    p.add_argument("--management", help="management API URL (default: the AMQP host, 15672)")
    p.add_argument("--starts", help="a JSON file: start request ids confirmed to their sender")
    p.add_argument("--report", help="write the JSON report here (default: stdout)")
    args = p.parse_args(argv)
    starts: list[str] = json.loads(Path(args.starts).read_text()) if args.starts else []
    management, vhost = args.management, "/"
    if args.amqp:
        vhost = broker.vhost_of(args.amqp)
        if management is None:  # every node of the URL, on the management port
            parsed = amqp_url.parse(args.amqp)
            quote = urllib.parse.quote
            creds = f"{quote(parsed.user, safe='')}:{quote(parsed.password, safe='')}"
            hosts = ",".join(f"{n.host or '127.0.0.1'}:15672" for n in parsed.nodes)
            management = f"http://{creds}@{hosts}"
    f = check(
        args.engine_dsn, args.participant_dsn, management_url=management, vhost=vhost, starts=starts
    )
    text = json.dumps(f.report(), indent=2, default=str)
    if args.report:
        Path(args.report).write_text(text + "\n")
    else:
        print(text)
    print(("OK " if f.ok else "FAILED ") + f.line(), file=sys.stderr)
    return 0 if f.ok else 1


if __name__ == "__main__":
    sys.exit(main())
