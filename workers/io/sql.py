"""Named SQL queries: loaded once, on first use, from the SQL directory.

Engine queries live in ``queries.sql`` (``search_path`` = custody) and participant
queries (prefix ``p_``) in ``participant_queries.sql`` beside ``participant_schema.sql``
(``search_path`` = the participant's schema). Each statement follows a
``-- name: <name>`` line; a name is unique across both files. A statement whose one
parameter is ``%(rows)s`` takes all its rows at once, as a jsonb array of row objects
(``jsonb_to_recordset``): :meth:`workers.io.db.Tx.run_many` sends one statement. The
statements on every receipt's way whose plan would otherwise change with a growing table
(the receipt consumer's reads, its writes, the ends of instances and the engine's confirm
mark) are calls of functions of their names in ``transitions.sql`` (``-- planned once, by
its keys``): each plans its statements once per session, with settings that keep those
plans by keys (an array of keys, ``= ANY``, or one row's key at a time) whatever the
tables' size when they were made. The
directory is the ``sql_dir`` setting (``CUSTODY_SQL_DIR``), read when the queries are
first needed:
importing this module reads neither the environment nor a file.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import LiteralString

from workers import errors
from workers.settings import Settings

FILES = ("queries.sql", "participant_queries.sql")

_NAME = re.compile(r"^--\s*name:\s*([a-z_0-9]+)\s*$")
_lock = threading.Lock()
_directory: Path | None = None
_queries: Mapping[str, str] | None = None


def parse(text: str, source: str = "<sql>") -> dict[str, str]:
    """The named statements of one file's text, in file order. A statement is the text
    after its ``-- name:`` line (its own leading comments included) up to the next one;
    comment lines after its last line (a group heading) are not part of it."""
    queries: dict[str, str] = {}
    name: str | None = None
    lines: list[str] = []

    def close() -> None:
        if name is None:
            return
        if name in queries:
            raise errors.ConfigError(f"{source}: query {name!r} is defined twice")
        body = list(lines)
        while body and (not body[-1].strip() or body[-1].lstrip().startswith("--")):
            body.pop()  # the next group's heading, not this statement's
        statement = "\n".join(body).strip().rstrip(";").strip()
        if not statement:
            raise errors.ConfigError(f"{source}: query {name!r} is empty")
        queries[name] = statement

    for line in text.splitlines():
        match = _NAME.match(line)
        if match:
            close()
            name, lines = match.group(1), []
        elif name is not None:
            lines.append(line)
    close()
    return queries


def directory() -> Path:
    """Where the SQL files are: the ``sql_dir`` setting, read once."""
    global _directory
    if _directory is None:
        _directory = Path(Settings.read("sql_dir"))
    return _directory


def path(filename: str) -> Path:
    """A file of the SQL directory (``schema.sql``, ``participant_schema.sql``, ...)."""
    return directory() / filename


def configure(sql_dir: str | Path | None) -> None:
    """Use ``sql_dir`` from now on (None: the setting again); the queries are reloaded
    on next use. For a caller holding a :class:`Settings`, and for tests."""
    global _directory, _queries
    with _lock:
        _directory = None if sql_dir is None else Path(sql_dir)
        _queries = None


def _load(where: Path) -> Mapping[str, str]:
    merged: dict[str, str] = {}
    for filename in FILES:
        file = where / filename
        try:
            text = file.read_text()
        except OSError as exc:
            raise errors.ConfigError(
                f"cannot read {file} (CUSTODY_SQL_DIR is {str(where)!r}): {exc.strerror or exc}"
            ) from None
        for name, statement in parse(text, filename).items():
            if name in merged:
                raise errors.ConfigError(f"query {name!r} is defined in more than one file")
            merged[name] = statement
    return MappingProxyType(merged)


def queries() -> Mapping[str, str]:
    """Every named query (name -> statement), loaded on the first call."""
    global _queries
    loaded = _queries
    if loaded is None:
        with _lock:
            if _queries is None:
                _queries = _load(directory())
            loaded = _queries
    return loaded


def takes_rows(name: str) -> bool:
    """Whether the statement takes all its rows at once in ``%(rows)s``."""
    return ROWS in query(name)


ROWS = "%(rows)s"


def query(name: str) -> LiteralString:
    """The statement named ``name``."""
    try:
        return queries()[name]  # mypy treats LiteralString as str; these are our own files
    except KeyError:
        raise errors.CustodyError(f"no query named {name!r} in {' or '.join(FILES)}") from None
