"""``make bench``: custody's end-to-end throughput as a ratio against a naive baseline.

In one invocation, on the same Postgres and RabbitMQ:

1. the baseline (``bench/baseline.py``): a hand-rolled outbox pipeline doing one
   message at a time, on its own database and vhost;
2. the custody fleet, started like ``custody demo`` (real processes, its own
   databases and vhost), once per ``--replicas`` setting, with K order-fulfilment
   instances; exactly-once effects are checked, and a wrong answer fails the run;
3. a report: operations/s, the ratio against the baseline, latency percentiles, the
   CPU seconds each process spent in the measured window, the machine, versions and
   the command; printed, and written to ``bench/results/latest.md``.

See ``bench/README.md`` for how to read it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from bench.baseline_run import run_baseline
from bench.common import BenchFailure
from bench.custody_run import run_custody
from bench.report import Report, command, machine_facts
from workers.settings import ROOT, Settings

RESULTS = ROOT / "bench" / "results" / "latest.md"


@dataclass(frozen=True)
class Options:
    instances: int
    baseline_ops: int
    baseline_warmup: int
    warmup: int
    replicas: tuple[int, ...]
    output: Path


def parse(argv: Sequence[str] | None = None) -> Options:
    p = argparse.ArgumentParser(
        prog="python -m bench.run",
        description="custody's end-to-end throughput against a naive baseline (bench/README.md)",
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
    p.add_argument("--quick", action="store_true", help="a small run for smoke-testing")
    p.add_argument(
        "--output",
        type=Path,
        default=RESULTS,
        help=f"markdown report (default {RESULTS.relative_to(ROOT)})",
    )
    a = p.parse_args(argv)
    replicas_text = a.replicas or ("1" if a.quick else "1,2")
    try:
        replicas = tuple(int(x) for x in replicas_text.split(",") if x.strip())
    except ValueError:
        p.error(f"--replicas {replicas_text!r}: expected e.g. 1,2")
    if not replicas or min(replicas) < 1:
        p.error("--replicas: at least one setting, each at least 1")
    opts = Options(
        instances=a.instances or (150 if a.quick else 2500),
        baseline_ops=a.baseline_ops or (300 if a.quick else 3000),
        baseline_warmup=50 if a.quick else 200,
        warmup=a.warmup if a.warmup is not None else (10 if a.quick else 20),
        replicas=replicas,
        output=a.output,
    )
    if opts.instances < 1 or opts.baseline_ops < 1 or opts.warmup < 0:
        p.error("sizes must be positive")
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


async def main_async(opts: Options) -> int:
    started = time.monotonic()
    settings = Settings.from_env()
    machine = await machine_facts(settings)
    report_time = datetime.now(UTC)
    with _log_dir() as logs:
        b = await run_baseline(
            settings, ops=opts.baseline_ops, warmup=opts.baseline_warmup, logs=logs
        )
        print(f"  baseline: {b.ops_per_s:,.0f} operations/s", flush=True)
        report = Report(report_time, command(), machine, settings, b)
        for replicas in opts.replicas:
            c = await run_custody(
                settings,
                replicas=replicas,
                instances=opts.instances,
                warmup=opts.warmup,
                logs=logs,
            )
            print(
                f"  custody r{replicas}: {c.ops_per_s:,.0f} operations/s"
                f" ({c.ops_per_s / b.ops_per_s:.2f} x baseline)",
                flush=True,
            )
            report.custody.append(c)
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
