"""``custody``: the operator and deployment command line.

One grammar, noun then verb (``custody instances list``); ``custody NOUN --help`` lists
a noun's verbs. Every command goes through the same code paths as the workers (named
queries, the codec, the topology plan); none edits runtime rows by hand. Settings come
from the environment (``CUSTODY_*``, see ``custody config show``).
"""

from __future__ import annotations

import sys

from workers.runtime import stopping

if stopping.runs_a_worker(sys.argv[1:]):
    stopping.keep()  # before the imports: a SIGTERM while starting is a stop, not a kill

import importlib.metadata
from collections.abc import Sequence

import click

from workers import errors
from workers.cli import fleetops, inspect, maintenance, processes, provisioning, recovery
from workers.cli.common import EXIT_USAGE, OUTPUTS
from workers.core import process, routes
from workers.io import broker, db
from workers.settings import Settings


def _version() -> str:
    try:
        return importlib.metadata.version("custody")
    except importlib.metadata.PackageNotFoundError:  # a source tree that is not installed
        return "unknown"


@click.group(
    name="custody",
    help="The operator and deployment command line of custody: noun then verb "
    "(custody NOUN --help lists a noun's verbs). Exit codes: 0 ok, 1 failed, 2 bad input "
    "or configuration, 3 refused, 4 not found.",
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    no_args_is_help=True,
)
@click.option(
    "--output",
    "-o",
    type=click.Choice(OUTPUTS),
    default=None,
    help="every command's result format: text (tables for people, the default), json, or "
    "jsonl (one object a line); a command's own --output or --json wins",
)
@click.version_option(
    _version(), "--version", "-V", prog_name="custody", message="%(prog)s %(version)s"
)
def cli(output: str | None) -> None:
    del output  # read by each command (workers.cli.common.run)


def _build() -> click.Group:
    # the order of ``custody --help`` is alphabetical (click's); the groups register
    # their nouns, and the hidden aliases of the old spellings
    provisioning.register(cli)
    processes.register(cli)
    inspect.register(cli)
    recovery.register(cli)
    fleetops.register(cli)
    maintenance.register(cli)
    return cli


_build()


def _one_line(exc: object) -> str:
    """An error's message on one line (libpq's, for one, spans several)."""
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def _usage(exc: click.UsageError) -> str:
    where = exc.ctx.command_path.removeprefix("custody").strip() if exc.ctx else ""
    message = _one_line(exc.format_message())
    return f"{where}: {message}" if where else message


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command: its exit code. Bad input (an option, an id, a name) is one line
    on stderr and exit 2, and so is a custody error (configuration, a refused
    connection, a bad routes or definitions file) and a database or broker error that
    escaped its translation; anything else is a bug, with its traceback."""
    for warning in Settings.unknown_variables():
        print(f"custody: warning: {warning}", file=sys.stderr)
    try:
        code = cli.main(
            args=list(sys.argv[1:] if argv is None else argv),
            prog_name="custody",
            standalone_mode=False,
        )
    except click.exceptions.NoArgsIsHelpError as exc:
        click.echo(exc.ctx.get_help(), err=True)
        return EXIT_USAGE
    except click.UsageError as exc:
        print(f"custody: {_usage(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except click.exceptions.Exit as exc:  # --help, --version
        return int(exc.exit_code)
    except click.Abort:
        return 130
    except click.ClickException as exc:
        print(f"custody: {_one_line(exc.format_message())}", file=sys.stderr)
        return EXIT_USAGE
    except (errors.ConfigError, routes.RouteConfigError, process.DefinitionError) as exc:
        print(f"custody: configuration error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except errors.CustodyError as exc:
        print(f"custody: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except (*db.DRIVER_ERRORS, *broker.DRIVER_ERRORS) as exc:
        print(f"custody: {type(exc).__name__}: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
