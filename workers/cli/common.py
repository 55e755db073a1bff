"""What every command group shares: the exit codes and the output of a result."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TypeAlias

import orjson

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_REFUSED, EXIT_NOT_FOUND = 0, 1, 2, 3, 4

# what a group's ``register(sub)`` adds its commands to: ``parser().add_subparsers()``
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def emit(data: Any, as_json: bool) -> None:
    """A result on stdout: indented JSON, or (a list of rows) one ``key=value`` line a row."""
    if as_json:
        sys.stdout.write(
            orjson.dumps(data, default=str, option=orjson.OPT_INDENT_2).decode() + "\n"
        )
        return
    if isinstance(data, list):
        for row in data:
            sys.stdout.write("  ".join(f"{k}={v}" for k, v in row.items()) + "\n")
    else:
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def audited_args(p: argparse.ArgumentParser) -> None:
    """What every audited operator command takes: why (the audit row's reason), and
    whether to print JSON."""
    p.add_argument("--reason", required=True, help="why (audited)")
    p.add_argument("--json", action="store_true")
