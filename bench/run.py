"""``make bench``: custody's end-to-end throughput against a naive baseline and against
the peers a user would pick instead (Celery, pgqueuer).

In one invocation, on the same Postgres and RabbitMQ:

1. the baseline (``bench/baseline.py``): a hand-rolled outbox pipeline doing one
   message at a time, on its own database and vhost;
2. the custody fleet, started like ``custody demo`` (real processes, its own
   databases and vhost), once per ``--replicas`` setting, with K order-fulfilment
   instances; exactly-once effects are checked, and a wrong answer fails the run;
3. the peers, each on its own database (and vhost): Celery (a chain of three tasks per
   workflow on a quorum queue) and pgqueuer (three chained jobs), the same workload
   shape, each step's effect written exactly once and checked (``bench/peers.py``);
4. custody once more (one replica) on a backlog seeded into its tables
   (``bench/backlog.py``), unless ``--no-backlog``;
5. a report: operations/s, the ratios (custody against each peer, the backlog against
   the empty tables, against the baseline), latency percentiles, CPU per operation,
   peak memory, the CPU seconds each process spent in the measured window, the
   machine, versions and the command; printed, and written to
   ``bench/results/latest.md``.

See ``bench/README.md`` for how to read it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from bench import hop
from bench.backlog import Backlog
from bench.baseline_run import run_baseline
from bench.celery_run import run_celery
from bench.common import BenchFailure
from bench.custody_run import CustodyResult, run_custody
from bench.peers import PeerResult
from bench.pgqueuer_run import run_pgqueuer
from bench.profile import Sampler
from bench.report import Report, Round, command, machine_facts
from bench.resources import exclusive
from workers.settings import ROOT, Settings

RESULTS = ROOT / "bench" / "results" / "latest.md"
PEERS = ("celery", "pgqueuer")


# one custody run and one peer's run (later_rounds takes them as arguments: a test's own)
CustodyRun = Callable[..., Awaitable[CustodyResult]]
PeerRun = Callable[..., Awaitable[PeerResult]]


@dataclass(frozen=True)
class Options:
    instances: int
    baseline_ops: int
    baseline_warmup: int
    warmup: int
    replicas: tuple[int, ...]
    output: Path
    light: int = 50
    peers: tuple[str, ...] = PEERS
    peer_workflows: int = 2500
    peer_warmup: int = 100
    celery_concurrency: int = 8
    pgqueuer_workers: int = 2
    backlog: Backlog | None = None
    profile: bool = False
    rounds: int = 1


def parse(argv: Sequence[str] | None = None) -> Options:
    p = argparse.ArgumentParser(
        prog="python -m bench.run",
        description="custody's end-to-end throughput against a naive baseline and the peers"
        " (bench/README.md)",
    )
    p.add_argument(
        "--instances",
        type=int,
        help="order-fulfilment instances per custody run (default 2500, --quick 150)",
    )
    p.add_argument(
        "--baseline-ops", type=int, help="measured baseline operations (default 3000, --quick 300)"
    )
    p.add_argument(
        "--replicas",
        default=None,
        help="comma-separated replicas per worker, one custody run each (default 1,2; --quick 1)",
    )
    p.add_argument("--warmup", type=int, help="custody warm-up instances (default 20)")
    p.add_argument(
        "--light",
        type=int,
        help="instances (custody) and workflows (peers) run one at a time for the"
        " light-load latency (default 50, --quick 10)",
    )
    p.add_argument(
        "--peers",
        default=",".join(PEERS),
        help=f"comma-separated peers to run beside custody, or 'none' (default {','.join(PEERS)})",
    )
    p.add_argument(
        "--peer-workflows",
        type=int,
        help="workflows (3 steps each) in each peer's burst (default 2500, --quick 150)",
    )
    p.add_argument(
        "--celery-concurrency", type=int, default=8, help="Celery prefork pool size (default 8)"
    )
    p.add_argument(
        "--pgqueuer-workers", type=int, default=2, help="pgqueuer worker processes (default 2)"
    )
    p.add_argument(
        "--backlog",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one more custody run (1 replica) on tables seeded with a backlog (default on)",
    )
    p.add_argument(
        "--backlog-finished",
        type=int,
        help="finished operations seeded for the backlog run (default 100000, --quick 5000)",
    )
    p.add_argument(
        "--backlog-pending",
        type=int,
        help="pending (accepted, far deadline) operations seeded (default 20000, --quick 1000)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="sample every custody worker with py-spy during each custody burst and report"
        " where its busy time goes (the bench extra has py-spy; `make profile`)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        help="custody r1's burst and each peer's, alternated this many times; the report"
        " gives each round's ratios and their median (default 3, --quick 1; with no"
        " peers, 1). With --profile, every round's custody burst is sampled",
    )
    p.add_argument("--quick", action="store_true", help="a small run for smoke-testing")
    p.add_argument(
        "--output",
        type=Path,
        default=RESULTS,
        help=f"markdown report (default {RESULTS.relative_to(ROOT)})",
    )
    a = p.parse_args(argv)
    if a.rounds is not None and a.rounds < 1:
        p.error("--rounds: at least 1")
    replicas_text = a.replicas or ("1" if a.quick else "1,2")
    try:
        replicas = tuple(int(x) for x in replicas_text.split(",") if x.strip())
    except ValueError:
        p.error(f"--replicas {replicas_text!r}: expected e.g. 1,2")
    if not replicas or min(replicas) < 1:
        p.error("--replicas: at least one setting, each at least 1")
    peers = tuple(x.strip() for x in a.peers.split(",") if x.strip() and x.strip() != "none")
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        p.error(f"--peers: unknown {unknown}; known: {', '.join(PEERS)}")
    backlog = None
    if a.backlog:
        backlog = Backlog(
            finished=a.backlog_finished or (5000 if a.quick else 100_000),
            pending=a.backlog_pending or (1000 if a.quick else 20_000),
        )
    opts = Options(
        instances=a.instances or (150 if a.quick else 2500),
        baseline_ops=a.baseline_ops or (300 if a.quick else 3000),
        baseline_warmup=50 if a.quick else 200,
        warmup=a.warmup if a.warmup is not None else (10 if a.quick else 20),
        replicas=replicas,
        output=a.output,
        light=a.light if a.light is not None else (10 if a.quick else 50),
        peers=peers,
        peer_workflows=a.peer_workflows or (150 if a.quick else 2500),
        peer_warmup=20 if a.quick else 100,
        celery_concurrency=a.celery_concurrency,
        pgqueuer_workers=a.pgqueuer_workers,
        backlog=backlog,
        profile=a.profile,
        rounds=(a.rounds if a.rounds is not None else (1 if a.quick else 3)) if peers else 1,
    )
    if (
        opts.instances < 1
        or opts.baseline_ops < 1
        or opts.warmup < (1 if backlog else 0)
        or opts.light < 0
        or opts.peer_workflows < 1
        or opts.celery_concurrency < 1
        or opts.pgqueuer_workers < 1
        or (backlog is not None and (backlog.finished < 1 or backlog.pending < 1))
    ):
        p.error("sizes must be positive (--warmup too: the backlog copies the warm-up)")
    return opts


@contextlib.contextmanager
def _log_dir() -> Iterator[Path]:
    """Worker logs: removed after a good run, kept (and named) after a failed one."""
    path = Path(tempfile.mkdtemp(prefix="custody-bench-"))
    try:
        yield path
    except BaseException:
        print(f"worker logs kept in {path}", file=sys.stderr)
        raise
    shutil.rmtree(path, ignore_errors=True)


# the modules each peer needs: the optional extra `bench` (pyproject.toml)
PEER_MODULES = {"celery": ("celery",), "pgqueuer": ("pgqueuer", "asyncpg")}


def _check_installed(peers: Sequence[str]) -> None:
    """Fail before the first run, not after the baseline and custody have run."""
    missing = [m for p in peers for m in PEER_MODULES[p] if importlib.util.find_spec(m) is None]
    if missing:
        raise BenchFailure(
            f"not installed: {', '.join(missing)} (the bench extra): `make bench` installs"
            " it, or `.venv/bin/pip install -e '.[bench]'`; `--peers none` skips the peers"
        )


async def main_async(opts: Options) -> int:
    _check_installed(opts.peers)
    if opts.profile and Sampler.available() is None:
        raise BenchFailure(
            "--profile: py-spy is not installed (the bench extra): `make profile` installs"
            " it, or `.venv/bin/pip install -e '.[bench]'`"
        )
    settings = Settings.from_env()
    async with exclusive(settings):
        return await _runs(opts, settings)


def reference_first(replicas: Sequence[int]) -> tuple[int, list[int]]:
    """The replica setting every ratio is taken against (1 when it is run, else the
    first given: the report's head), then the others in their order."""
    ref = 1 if 1 in replicas else replicas[0]
    others = list(replicas)
    others.remove(ref)
    return ref, others


async def _runs(opts: Options, settings: Settings) -> int:
    started = time.monotonic()
    machine = await machine_facts(settings)
    report_time = datetime.now(UTC)
    with _log_dir() as logs:
        b = await run_baseline(
            settings, ops=opts.baseline_ops, warmup=opts.baseline_warmup, logs=logs
        )
        print(f"  baseline: {b.ops_per_s:,.0f} operations/s", flush=True)
        report = Report(report_time, command(), machine, settings, b)
        # custody r1 first and the peers right after it: the ratios that matter most
        # are measured close together; then the other replica settings, the backlog
        first, others = reference_first(opts.replicas)
        head = await _custody(opts, settings, report, logs, first)
        report.custody.append(head)
        if opts.light:
            # the broker's own hop, alone, right after custody r1's run: the floor under
            # its light-load legs (bench/hop.py)
            report.broker_hops = await hop.run(messages=200)
            for h in report.broker_hops:
                print(f"  {h.line()}", flush=True)
        for peer in opts.peers:
            report.peers.append(await _peer(opts, settings, logs, peer, head, light=opts.light))
        await later_rounds(opts, settings, report, logs, first)
        for replicas in others:
            report.custody.append(await _custody(opts, settings, report, logs, replicas))
        if opts.backlog is not None:
            report.custody.append(await _custody(opts, settings, report, logs, 1, opts.backlog))
    report.total_s = time.monotonic() - started
    text = report.markdown()
    print()
    print(text)
    opts.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = opts.output.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(opts.output)
    print(f"written to {opts.output}")
    return 0


async def later_rounds(
    opts: Options,
    settings: Settings,
    report: Report,
    logs: Path,
    first: int,
    *,
    custody: CustodyRun | None = None,
    peer: PeerRun | None = None,
) -> None:
    """The ratios again, alternated: custody's burst and light load, then each peer's
    (each checked exactly once the same way), rounds 2 to ``opts.rounds``; the report
    takes the rounds' medians, of the light-load latencies too (one window's pace moves
    them most). ``custody`` and ``peer``: the runs (this module's, unless given)."""
    run_custody_once = custody or _custody
    run_peer = peer or _peer
    for n in range(2, opts.rounds + 1):
        print(f"  round {n} of {opts.rounds}: custody r{first} and the peers again", flush=True)
        again = Round(await run_custody_once(opts, settings, report, logs, first))
        report.rounds.append(again)
        for name in opts.peers:
            again.peers.append(
                await run_peer(opts, settings, logs, name, again.custody, light=opts.light)
            )


async def _peer(
    opts: Options,
    settings: Settings,
    logs: Path,
    peer: str,
    of: CustodyResult,
    *,
    light: int,
) -> PeerResult:
    """One peer's run, compared in the log with ``of``, the custody burst of its round."""
    if peer == "celery":
        r = await run_celery(
            settings,
            workflows=opts.peer_workflows,
            warmup=opts.peer_warmup,
            light=light,
            concurrency=opts.celery_concurrency,
            logs=logs,
        )
    else:
        r = await run_pgqueuer(
            settings,
            workflows=opts.peer_workflows,
            warmup=opts.peer_warmup,
            light=light,
            workers=opts.pgqueuer_workers,
            logs=logs,
        )
    print(
        f"  {r.system}: {r.ops_per_s:,.0f} operations/s, {r.workflows_per_s:,.0f}"
        f" workflows/s (custody r{of.replicas} / {r.system}:"
        f" {of.ops_per_s / r.ops_per_s:.2f})",
        flush=True,
    )
    return r


async def _custody(
    opts: Options,
    settings: Settings,
    report: Report,
    logs: Path,
    replicas: int,
    backlog: Backlog | None = None,
    *,
    light: int | None = None,
) -> CustodyResult:
    """One custody run (with the light-load phase unless ``light`` or a backlog says
    otherwise); the caller records it, in the main table or as a round."""
    c = await run_custody(
        settings,
        replicas=replicas,
        instances=opts.instances,
        warmup=opts.warmup,
        light=(0 if backlog else opts.light) if light is None else light,
        backlog=backlog,
        logs=logs,
        profile=opts.profile,
    )
    b = report.baseline
    print(
        f"  {c.label}: {c.ops_per_s:,.0f} operations/s"
        f" ({c.ops_per_s / b.ops_per_s:.2f} x baseline)",
        flush=True,
    )
    return c


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse(argv)
    loop = asyncio.new_event_loop()
    task = loop.create_task(main_async(opts))
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        return loop.run_until_complete(task)
    except BenchFailure as exc:
        print(f"BENCH FAILED: {exc}", file=sys.stderr)
        return 1
    except (asyncio.CancelledError, KeyboardInterrupt):
        print("bench interrupted; everything it started was stopped", file=sys.stderr)
        return 130
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


if __name__ == "__main__":
    sys.exit(main())
