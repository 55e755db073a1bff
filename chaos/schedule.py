"""The seeded fault schedule: a pure function of (seed, duration, kinds).

The same seed and duration always give the same list of faults at the same offsets
with the same targets and parameters, so a failing run is reproduced by its seed
(the timing of the workload around the faults is, of course, not replayed).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

ENGINE: Final = ("committer", "publisher", "receipts", "reconciler")
PARTICIPANTS: Final = ("inventory", "payments", "shipping")
WORKERS: Final = ENGINE + PARTICIPANTS

# crash points (workers/runtime/faults.py) by the worker that reaches them
CRASH_POINTS: Final[Mapping[str, tuple[str, ...]]] = {
    # the committer sends the submits it commits: the confirm boundary's points are its
    # too (the publisher reaches them with what it claims: retries, queries, cancels,
    # what a dead committer left)
    "committer": (
        "before_commit",
        "starts_locked",
        "successor_claimed",
        "after_commit_before_send",
        "after_publish_before_confirm",
        "after_confirm_before_mark",
    ),
    "publisher": ("after_publish_before_confirm", "after_confirm_before_mark"),
    # the receipt consumer sends the submits of the successors it activates: the confirm
    # boundary's points are its too
    "receipts": (
        "receipts_locked",
        "receipts_between_result_and_successor",
        "after_commit_before_send",
        "receipts_after_commit_before_ack",
        "after_publish_before_confirm",
        "after_confirm_before_mark",
    ),
    "reconciler": ("deadlines_claimed",),
    "participant": ("after_commit_before_ack", "mid_effect", "after_effect_before_receipt_sent"),
}
# points inside a unit's transaction, where a worker can freeze itself (a zombie)
STOP_POINTS: Final[Mapping[str, tuple[str, ...]]] = {
    "committer": ("starts_locked", "successor_claimed"),
    "receipts": ("receipts_locked",),
    "reconciler": ("deadlines_claimed",),
}
PROXIES: Final = ("amqp", "pg-engine", "pg-participants")

# kind → how many per minute of fault schedule (at least MIN_PER_RUN of each)
RATES: Final[Mapping[str, float]] = {
    "kill": 6.0,
    "crash_point": 6.0,
    "pause": 2.0,
    "stop_point": 1.5,
    "rabbit_app_restart": 0.6,
    "rabbit_kill": 0.6,
    "pg_restart": 1.0,
    "proxy_cut": 2.0,
    "proxy_stall": 1.5,
    "proxy_slow": 1.5,
    "republish": 2.0,
    "drop_replies": 1.5,
    "late_replies": 1.5,
    "cancel": 2.0,
    "cancel_start": 2.0,
    "hostile": 2.0,
}
KINDS: Final = tuple(RATES)
MIN_PER_RUN: Final = 2
# faults that stop a service or the whole bus: never two of them at the same moment
EXCLUSIVE: Final = frozenset({"rabbit_app_restart", "rabbit_kill", "pg_restart"})


@dataclass(frozen=True)
class Fault:
    at_s: float
    kind: str
    target: str = ""
    params: Mapping[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        extra = " ".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"t+{self.at_s:6.1f}s {self.kind} {self.target} {extra}".rstrip()


def _one(rng: random.Random, kind: str, at: float, lease_ttl_s: float) -> Fault:
    if kind == "kill":
        return Fault(at, kind, rng.choice(WORKERS), {"down_s": round(rng.uniform(0.2, 3.0), 2)})
    if kind == "crash_point":
        worker = rng.choice(WORKERS)
        group = "participant" if worker in PARTICIPANTS else worker
        return Fault(at, kind, worker, {"point": rng.choice(CRASH_POINTS[group])})
    if kind == "pause":
        return Fault(
            at,
            kind,
            rng.choice(WORKERS),
            {"stopped_s": round(lease_ttl_s + rng.uniform(1.0, 6.0), 2)},
        )
    if kind == "stop_point":
        worker = rng.choice(sorted(STOP_POINTS))
        return Fault(
            at,
            kind,
            worker,
            {
                "point": rng.choice(STOP_POINTS[worker]),
                "stopped_s": round(lease_ttl_s + rng.uniform(1.0, 5.0), 2),
            },
        )
    if kind in ("rabbit_app_restart", "rabbit_kill"):
        return Fault(at, kind, "rabbit", {"down_s": round(rng.uniform(0.5, 4.0), 2)})
    if kind == "pg_restart":
        return Fault(
            at,
            kind,
            rng.choice(("engine", "participants")),
            {"down_s": round(rng.uniform(0.2, 3.0), 2)},
        )
    if kind == "proxy_cut":
        return Fault(at, kind, rng.choice(PROXIES), {"refuse_s": round(rng.uniform(0, 3.0), 2)})
    if kind == "proxy_stall":
        return Fault(at, kind, rng.choice(PROXIES), {"stall_s": round(rng.uniform(1.0, 15.0), 2)})
    if kind == "proxy_slow":
        return Fault(
            at,
            kind,
            rng.choice(PROXIES),
            {"for_s": round(rng.uniform(3, 12), 2), "delay_s": round(rng.uniform(0.01, 0.2), 3)},
        )
    if kind == "republish":
        return Fault(
            at,
            kind,
            rng.choice(("commands", "receipts")),
            {"count": rng.randint(5, 60), "delay_s": round(rng.uniform(0.5, 20.0), 2)},
        )
    if kind == "drop_replies":
        return Fault(
            at,
            kind,
            "receipts",
            {"for_s": round(rng.uniform(1.0, 4.0), 2), "fraction": round(rng.uniform(0.2, 1), 2)},
        )
    if kind == "late_replies":
        return Fault(
            at,
            kind,
            "receipts",
            {"for_s": round(rng.uniform(1.0, 3.0), 2), "fraction": round(rng.uniform(0.2, 1), 2)},
        )
    if kind == "cancel":
        return Fault(at, kind, "instances", {"count": rng.randint(1, 8)})
    if kind == "cancel_start":
        return Fault(at, kind, "starts", {"count": rng.randint(1, 6)})
    if kind == "hostile":
        return Fault(
            at,
            kind,
            rng.choice(("requests", "receipts", "commands", "frames")),
            {"seed": rng.randrange(1 << 30)},
        )
    raise ValueError(f"unknown fault kind {kind!r}")


def build(
    seed: int,
    duration_s: float,
    *,
    kinds: Iterable[str] = KINDS,
    lease_ttl_s: float = 6.0,
    warmup_s: float = 3.0,
    scale: float = 1.0,
) -> list[Fault]:
    """Faults at random moments in [warmup_s, duration_s), sorted by time; each kind
    at least MIN_PER_RUN times. Service restarts are kept apart by 15 s."""
    rng = random.Random(seed)
    chosen = [k for k in KINDS if k in set(kinds)]
    span = max(1.0, duration_s - warmup_s)
    out: list[Fault] = []
    for kind in chosen:
        n = max(MIN_PER_RUN, round(RATES[kind] * scale * span / 60.0))
        if kind in EXCLUSIVE:
            n = min(n, max(1, int(span // 15)))
        for _ in range(n):
            at = round(warmup_s + rng.random() * span, 2)
            out.append(_one(rng, kind, at, lease_ttl_s))
    # keep the service restarts apart so that each one is a separate event
    restarts = sorted((f for f in out if f.kind in EXCLUSIVE), key=lambda f: f.at_s)
    others = [f for f in out if f.kind not in EXCLUSIVE]
    spaced: list[Fault] = []
    last = -1e9
    for f in restarts:
        at = max(f.at_s, last + 15.0)
        if at >= duration_s + 30:
            continue
        spaced.append(Fault(round(at, 2), f.kind, f.target, f.params))
        last = at
    return sorted(others + spaced, key=lambda f: (f.at_s, f.kind, f.target))


def counts(schedule: Iterable[Fault]) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in schedule:
        out[f.kind] = out.get(f.kind, 0) + 1
    return dict(sorted(out.items()))
