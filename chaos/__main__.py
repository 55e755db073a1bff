"""``python -m chaos run|soak|cluster``: a chaos run with a printed seed, progress
lines, one summary line and a JSON report (exit 1 on any lost, duplicated or
unexpected); ``python -m chaos schedule --seed N`` prints a schedule only."""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from collections.abc import Sequence
from pathlib import Path

from chaos import schedule
from chaos.runner import Config, run_chaos

PRESETS = {
    # instances, seconds of faults
    "run": (800, 70.0),
    "soak": (7000, 720.0),
    "cluster": (800, 90.0),
}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chaos", description=__doc__)
    p.add_argument("mode", choices=[*PRESETS, "schedule"])
    p.add_argument("--seed", type=int, help="the schedule's seed (default: a random one, printed)")
    p.add_argument("--instances", type=int)
    p.add_argument("--duration", type=float, help="seconds of fault injection")
    p.add_argument("--settle", type=float, default=240.0, help="bound on the settle phase (s)")
    p.add_argument("--base-port", type=int, default=21000, help="below the ephemeral port range")
    p.add_argument("--workdir", type=Path)
    p.add_argument("--kinds", help="comma-separated fault kinds (default: all)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every fault rate")
    p.add_argument("--keep", action="store_true", help="leave the private services running")
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 1 << 31)
    kinds = tuple(args.kinds.split(",")) if args.kinds else schedule.KINDS
    unknown = set(kinds) - set(schedule.KINDS)
    if unknown:
        p.error(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(schedule.KINDS)}")
    if args.mode == "schedule":
        for f in schedule.build(seed, args.duration or 90.0, kinds=kinds, scale=args.scale):
            print(f.describe())
        return 0
    instances, duration = PRESETS[args.mode]
    cfg = Config(
        seed=seed,
        instances=args.instances or instances,
        duration_s=args.duration or duration,
        settle_s=args.settle,
        base_port=args.base_port,
        kinds=kinds,
        scale=args.scale,
        nodes=3 if args.mode == "cluster" else 1,
        label=args.mode,
        keep=args.keep,
    )
    if args.workdir:
        cfg.workdir = args.workdir
    try:
        return asyncio.run(run_chaos(cfg))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted: private services and the fleet were stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
