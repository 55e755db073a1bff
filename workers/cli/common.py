"""What every command group shares: the exit codes, the output of a result, the option
types that refuse a bad value at the edge, and the one way a command runs.

A command is a click command whose body is an async function of the settings and the
parsed options (:class:`Args`); :func:`command` makes one. Bad input raises
:class:`click.UsageError` (or a :class:`click.BadParameter` from an option's type),
which :func:`workers.cli.main` prints as one ``custody: ...`` line with exit 2.
"""

from __future__ import annotations

import asyncio
import datetime
import sys
from collections.abc import Callable, Coroutine, Sequence
from types import SimpleNamespace
from typing import Any, Final, TypeVar

import click
import orjson
import pydantic

from contracts import identity, models
from workers.core import process
from workers.runtime import loops
from workers.settings import Settings

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_REFUSED, EXIT_NOT_FOUND = 0, 1, 2, 3, 4

OUTPUTS: Final = ("text", "json", "jsonl")


class Args(SimpleNamespace):
    """A command's parsed options by name, and ``output`` (text, json or jsonl) with
    ``json`` (any structured output) derived from it."""

    output: str
    json: bool


Body = Callable[[Settings, Args], Coroutine[Any, Any, int]]
F = TypeVar("F", bound=Callable[..., Any])
Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def emit(data: Any, output: str) -> None:
    """A result on stdout: a list of rows as an aligned table (``text``), one JSON object
    a line (``jsonl``) or an indented JSON array (``json``); one object as ``key value``
    lines, one compact line or indented JSON."""
    if output == "json":
        text = orjson.dumps(data, default=str, option=orjson.OPT_INDENT_2).decode()
        sys.stdout.write(text + "\n")
    elif output == "jsonl":
        for item in data if isinstance(data, list) else [data]:
            sys.stdout.write(orjson.dumps(item, default=str).decode() + "\n")
    elif isinstance(data, list):
        sys.stdout.write(table(data))
    else:
        width = max((len(str(k)) for k in data), default=0)
        sys.stdout.writelines(f"{k:<{width}}  {_cell(v)}\n" for k, v in data.items())


def table(rows: Sequence[dict[str, Any]]) -> str:
    """Rows as a table for people: a header of the column names, every column as wide as
    its widest cell; nested values as compact JSON. No rows: no output."""
    if not rows:
        return ""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    cells = [columns, *([_cell(row.get(c)) for c in columns] for row in rows)]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() + "\n"
        for line in cells
    )


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime.datetime):
        return value.isoformat()  # one word, as in the JSON
    if isinstance(value, dict | list):
        return orjson.dumps(value, default=str).decode()
    return str(value)


# -- option types: refuse a bad value at the edge, in one line ------------------------


class _Uuid(click.ParamType[str]):
    """An id (instance, operation, start request): any UUID spelling, canonicalised."""

    name = "uuid"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        ident = identity.canonical(str(value))
        if ident is None:
            self.fail(f"{value!r} is not a UUID (such as 0b8f9d5e-7c1a-4e2b-9f00-3d4c5b6a7e81)")
        return ident


_NAME_RULE: Final = pydantic.TypeAdapter(models.Name)


class _Name(click.ParamType[str]):
    """A tenant, process or actor name, as the wire contracts allow it."""

    name = "name"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = str(value)
        try:
            _NAME_RULE.validate_python(text, strict=True)
        except pydantic.ValidationError:
            self.fail(
                f"{text!r}: lower-case letters, digits, '_', '.' and '-', starting with a "
                "letter or digit, at most 63 characters"
            )
        return text


class _JsonObject(click.ParamType[dict[str, Any]]):
    name = "json-object"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> dict[str, Any]:
        if isinstance(value, dict):
            return value
        try:
            data = orjson.loads(value)
        except orjson.JSONDecodeError as exc:
            self.fail(f"not JSON ({exc})")
        if not isinstance(data, dict):
            self.fail(f"a JSON object ({{...}}), not a JSON {type(data).__name__}")
        return data


UUID: Final = _Uuid()
NAME: Final = _Name()
JSON_OBJECT: Final = _JsonObject()
LIMIT: Final = click.IntRange(min=1, max=2**31 - 1)


def known_participant(settings: Settings, name: str, option: str = "--participant") -> str:
    """``name`` if it owns routes in the routes file, else a usage error naming them."""
    table_, _ = process.load_config(settings)
    owners = sorted({r.owner for r in table_.by_name.values()})
    if name not in owners:
        raise click.UsageError(
            f"{option} {name!r}: no such participant; one of {', '.join(owners)}"
        )
    return name


# -- commands ---------------------------------------------------------------------------


def output_options(f: F) -> F:
    """``--output`` (here, after the command, or before it: ``custody --output json ...``)
    and ``--json``, the short form of ``--output json``."""
    f = click.option("--json", "as_json", is_flag=True, help="the same as --output json")(f)
    return click.option(
        "--output",
        "-o",
        type=click.Choice(OUTPUTS),
        default=None,
        help="text (tables for people), json or jsonl (one object a line); "
        "default: the global --output, else text",
    )(f)


def audited_options(f: F) -> F:
    """What every audited operator command takes: why (the audit row's reason)."""
    return click.option("--reason", required=True, help="why (audited)")(f)


def command(
    group: click.Group,
    name: str,
    body: Body,
    *,
    help: str,
    emits: bool = True,
    default_output: str = "text",
    hidden: bool = False,
    params: Sequence[Decorator] = (),
) -> click.Command:
    """Add ``name`` to ``group``: its options (``params``, outermost first), the output
    options if it prints a result, and ``body`` run with the settings. A command that
    shows one thing in full keeps JSON as its ``default_output``."""

    def callback(**kwargs: Any) -> int:
        return run(body, kwargs, default_output)

    for decorate in reversed(params):
        callback = decorate(callback)
    if emits:
        callback = output_options(callback)
    return group.command(name, help=help, hidden=hidden)(callback)


def run(body: Body, kwargs: dict[str, Any], default_output: str = "text") -> int:
    """Build the settings, resolve the output format (the command's ``--json`` or
    ``--output``, else the global ``--output``, else the command's default), and run the
    body to its exit code."""
    ctx = click.get_current_context()
    output = kwargs.pop("output", None) or ctx.find_root().params.get("output") or default_output
    if kwargs.pop("as_json", False):
        output = "json"
    settings = Settings.from_env()
    with asyncio.Runner(loop_factory=loops.factory(settings.event_loop)) as runner:
        return runner.run(body(settings, Args(**kwargs, output=output, json=output != "text")))


def with_options(body: Body, **fixed: Any) -> Body:
    """``body`` with options that the command's name chose (the verb of a loop of verbs)
    added to the parsed ones."""

    async def with_fixed(settings: Settings, args: Args) -> int:
        return await body(settings, Args(**vars(args), **fixed))

    return with_fixed


# Every noun's help, in one place: ``custody --help`` reads as a table of contents.
NOUNS: Final = {
    "audit": "the audit trail of operator commands and refusals",
    "broker": "broker users (development and tests)",
    "config": "the effective settings",
    "contracts": "the wire contracts' JSON Schemas",
    "db": "the database schema",
    # (not the word "replay" at the top level: no command replays an operation)
    "dead-letters": "the dead-letter queue: read it, send a letter back where it came from",
    "definitions": "process definitions",
    "demo": "the whole fleet and sample participants doing real work",
    "dispatch": "pause or resume effect dispatch",
    "instances": "process instances: start, list, show, history, cancel",
    "operations": "operations: list, show, reconcile, retry-safe",
    "operators": "operator logins and grants",
    "quarantine": "quarantined messages and participants' refused commands",
    "restore": "the restore runbook (README: Restore)",
    "retention": "history retention and the archive",
    "start-requests": "start requests: cancel one before or after it started",
    "topology": "the RabbitMQ topology",
    "workers": "the engine fleet: run a worker, list the leases",
}


def group(parent: click.Group, name: str) -> click.Group:
    """A noun: a group of verbs, with its help from :data:`NOUNS` (the same group if a
    module before this one made it: ``instances`` has verbs of several modules)."""
    existing = parent.commands.get(name)
    if isinstance(existing, click.Group):
        return existing
    return parent.group(name, help=NOUNS[name], no_args_is_help=True)(_noun)


def _noun() -> None:
    """A group's callback: a noun does nothing by itself."""
