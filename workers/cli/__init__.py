"""``custody``: the operator and deployment command line.

Every command goes through the same code paths as the workers (named queries, the
codec, the topology plan); none edits runtime rows by hand. Settings come from the
environment (``CUSTODY_*``, see ``custody config show``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from workers import errors
from workers.cli import fleetops, inspect, maintenance, processes, provisioning, recovery
from workers.cli.common import EXIT_USAGE
from workers.core import process, routes
from workers.settings import Settings


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="custody", description=__doc__.split("\n")[0] if __doc__ else ""
    )
    sub = p.add_subparsers(dest="command", required=True)
    # the order of ``custody --help``: retention and audit sit between the recovery
    # commands and the rest of maintenance, hence their own register functions
    provisioning.register(sub)
    processes.register(sub)
    inspect.register(sub)
    recovery.register(sub)
    fleetops.register(sub)
    maintenance.register_retention(sub)
    inspect.register_audit(sub)
    maintenance.register(sub)
    return p


def _one_line(exc: BaseException) -> str:
    """An error's message on one line (libpq's, for one, spans several)."""
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command: its exit code; a custody error (configuration, a refused
    connection, a bad routes or definitions file) is one line on stderr and exit 2, and
    anything else is a bug, with its traceback."""
    args = parser().parse_args(argv)
    try:
        settings = Settings.from_env()
        return int(asyncio.run(args.fn(settings, args)))
    except (errors.ConfigError, routes.RouteConfigError, process.DefinitionError) as exc:
        print(f"custody: configuration error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except errors.CustodyError as exc:
        print(f"custody: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
