"""One frozen settings object, built once from the environment (prefix ``CUSTODY_``).

Every setting may instead be read from a file named by ``CUSTODY_<NAME>_FILE``
(Docker and Kubernetes secrets). libpq's ``PG*`` variables work when the database
URL is left empty. Secrets never appear in :meth:`Settings.redacted`.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import Field, asdict, dataclass, fields
from pathlib import Path
from typing import Any

from workers.errors import ConfigError

PREFIX = "CUSTODY_"
# Variables of the prefix that are not settings but are read elsewhere: the fault
# points and broken builds of the tests and chaos runs (workers.runtime.faults), the
# variable whose use is refused with an explanation (the CLI's controlled commands),
# the chaos self-test switch and the scripts' own; ``CUSTODY_TEST_*`` are the tests'.
OTHER_VARIABLES = frozenset(
    PREFIX + name
    for name in (
        "CRASH_POINTS",
        "STOP_POINTS",
        "BROKEN",
        "FAULT_POISON_MARKER",
        "OPERATOR",
        "CHAOS_SELFTEST",
        "TOOLS_VENV",
        "PY",
        "PGHOST",
        "PGPORT",
        "AMQP_PORT",
        "MGMT_PORT",
    )
)
OTHER_PREFIXES = (PREFIX + "TEST_",)
ROOT = Path(__file__).resolve().parent.parent
LOG_LEVELS = ("debug", "info", "warning", "error")
EVENT_LOOPS = ("uvloop", "asyncio")
ENVELOPE_LIMIT = 256  # workers.core.envelope.MAX_ITEMS: what a consumer accepts


@dataclass(frozen=True)
class Settings:
    database_url: str = "postgresql://postgres@127.0.0.1:5432/custody"
    participant_database_url: str = "postgresql://postgres@127.0.0.1:5432/custody_participants"
    amqp_url: str = "amqp://guest:guest@127.0.0.1:5672/%2F"
    amqp_management_url: str = "http://guest:guest@127.0.0.1:15672"
    amqp_tls_ca_file: str = ""
    amqp_tls_cert_file: str = ""
    amqp_tls_key_file: str = ""
    routes_file: str = str(ROOT / "deploy" / "routes.toml")
    processes_dir: str = str(ROOT / "deploy" / "processes")
    operators_file: str = str(ROOT / "deploy" / "operators.toml")
    # Where migrations/, commands.sql, queries.sql, participant_schema.sql,
    # participant_queries.sql, ... are (the image sets /app).
    sql_dir: str = str(ROOT)
    auto_reconcile_s: float = 0.0
    # Start-up switch: no submit leaves the outbox, whatever the database says. It
    # survives a database restore, which the database's own pause flag cannot.
    dispatch_paused: bool = False
    # Receipt, inbox and tombstone history is kept this long, and it must cover every
    # permitted retry, replay and restore horizon (checked at start-up).
    retention_s: float = 30 * 86400.0
    replay_horizon_s: float = 7 * 86400.0
    restore_horizon_s: float = 7 * 86400.0
    # A finished instance moves to the archive (custody_archive) this long after it
    # finished, with its operations and history; 0: the retention horizon. Never shorter
    # than the retention horizon (checked at start-up).
    archive_after_s: float = 0.0
    max_message_bytes: int = 256 * 1024
    batch_size: int = 200
    prefetch: int = 400
    linger_ms: int = 5
    confirm_window: int = 64
    # A sender's messages for one queue that leave together (the submits of one commit
    # for one participant, the receipts of one participant commit, a client's start
    # requests) travel in envelopes of up to this many, one AMQP message each
    # (workers.core.envelope): the broker and every worker pay a message's cost once
    # per envelope. 1: every message alone, for a consumer that does not read them.
    envelope_max: int = 64
    confirm_timeout_s: float = 10.0
    poll_interval_s: float = 1.0
    # A participant runs its fast handlers (those it declares inline) in the acceptance
    # transaction: acceptance, effect and terminal receipt commit together before the
    # ack. Off: every handler runs in the executor, after acceptance.
    participant_inline: bool = True
    # The receipt consumer activates a successor in the receipt's own transaction when
    # it can lock the instance at once and finds it running. Off: every successor
    # intent waits for the committer's claim (one more commit and wake-up per step).
    receipts_activate: bool = True
    # The reconciler's gauge of settled operations counts a table that only grows: it
    # is refreshed this often (the live statuses are counted on every poll).
    settled_sample_s: float = 60.0
    # A successor whose instance's pinned process version is not loaded is tried again
    # after this long (the instance stays suspended until then).
    definition_retry_s: float = 30.0
    lease_ttl_s: float = 15.0
    delivery_limit: int = 50  # a backstop: custody dead-letters what fails on its own
    metrics_port: int = 0
    # The source revision custody_build_info shows (the image's build sets it; empty: a
    # git checkout's HEAD if there is one, else "unknown").
    git_revision: str = ""
    log_format: str = "json"
    # debug: also one ``unit.done`` line per unit of work (its ids, outcome, duration)
    log_level: str = "info"
    # The asyncio event loop every command and worker runs on: uvloop (libuv's, in C:
    # less CPU per delivery, statement and wake-up) or asyncio (the standard library's)
    event_loop: str = "uvloop"
    # The cyclic garbage collector's youngest-generation threshold, in a worker: how many
    # more container objects allocated than freed between its collections (Python's
    # default is 700). A worker's batch makes and drops thousands of short-lived objects;
    # at 700 it collected several times per batch, 3-8 % of a worker's CPU
    # (docs/performance.md). Cycles are still collected, only less often.
    gc_threshold: int = 10_000
    # SIGTERM: stop claiming, then drain in-flight work this long (keep it below the
    # platform's grace period: terminationGracePeriodSeconds 30, stop_grace_period 30s)
    drain_grace_s: float = 20.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            found, value = _read(f, env)
            if found:
                values[f.name] = value
        settings = cls(**values)
        settings.check()
        return settings

    @classmethod
    def read(cls, name: str, env: Mapping[str, str] | None = None) -> Any:
        """One setting from the environment (or its default), read as :meth:`from_env`
        reads it, for a module that needs that setting alone when it is first used."""
        env = os.environ if env is None else env
        for f in fields(cls):
            if f.name == name:
                found, value = _read(f, env)
                return value if found else f.default
        raise KeyError(name)

    @classmethod
    def unknown_variables(cls, env: Mapping[str, str] | None = None) -> list[str]:
        """One warning per ``CUSTODY_*`` variable that no setting reads (a misspelling
        is otherwise silently ignored), naming the likely intended one if there is."""
        env = os.environ if env is None else env
        settings = [PREFIX + f.name.upper() for f in fields(cls)]
        known = {*settings, *(s + "_FILE" for s in settings), *OTHER_VARIABLES}
        warnings = []
        for name in sorted(env):
            if not name.startswith(PREFIX) or name in known or name.startswith(OTHER_PREFIXES):
                continue
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.8)
            hint = f"; did you mean {close[0]}?" if close else ""
            warnings.append(f"{name} is not a custody setting and is ignored{hint}")
        return warnings

    def check(self) -> None:
        for name in ("batch_size", "prefetch", "confirm_window", "max_message_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{PREFIX}{name.upper()} must be at least 1")
        if not 1 <= self.envelope_max <= ENVELOPE_LIMIT:
            raise ConfigError(f"{PREFIX}ENVELOPE_MAX must be between 1 and {ENVELOPE_LIMIT}")
        if self.prefetch < self.batch_size:
            raise ConfigError(
                f"{PREFIX}PREFETCH ({self.prefetch}) must be at least "
                f"{PREFIX}BATCH_SIZE ({self.batch_size}), or batches never fill"
            )
        if self.log_format not in ("json", "text"):
            raise ConfigError(f"{PREFIX}LOG_FORMAT must be json or text")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"{PREFIX}LOG_LEVEL must be one of {', '.join(LOG_LEVELS)}")
        if self.event_loop not in EVENT_LOOPS:
            raise ConfigError(f"{PREFIX}EVENT_LOOP must be one of {', '.join(EVENT_LOOPS)}")
        if not 100 <= self.gc_threshold <= 1_000_000:
            raise ConfigError(
                f"{PREFIX}GC_THRESHOLD must be between 100 and 1000000 (Python's own default"
                " is 700; far above the default, cycles are left to pile up)"
            )

    def redacted(self) -> dict[str, Any]:
        """The settings with every password replaced, for ``custody config show``."""
        return {k: _redact(v) if isinstance(v, str) else v for k, v in asdict(self).items()}


def _read(f: Field[Any], env: Mapping[str, str]) -> tuple[bool, object]:
    """``(found, value)`` of one field: ``CUSTODY_<NAME>`` or the file that
    ``CUSTODY_<NAME>_FILE`` names, converted to the field's type."""
    key = PREFIX + f.name.upper()
    raw = env.get(key)
    file_key = key + "_FILE"
    if file_key in env:
        if raw is not None:
            raise ConfigError(f"set {key} or {file_key}, not both")
        try:
            raw = Path(env[file_key]).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"{file_key}: {exc}") from None
    if raw is None:
        return False, None
    default: object = f.default
    convert: Callable[[str], object] = _bool if isinstance(default, bool) else type(default)
    try:
        return True, convert(raw)
    except ValueError:
        raise ConfigError(f"{key}={raw!r} is not a valid {type(default).__name__}") from None


def _bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(raw)


_CONNINFO_PASSWORD = re.compile(r"(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'|\S*)", re.IGNORECASE)
_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#]*", re.IGNORECASE)


def _redact(value: str) -> str:
    """A URL or libpq conninfo with its password masked, however the password is
    spelled: percent-encoded or not, with ``@``, ``:`` or ``/`` in it. A URL's userinfo
    ends at its last ``@`` before the query (a host, a port, a path and a vhost are
    never the secret), so an unencoded ``@`` or ``/`` in the password stays masked."""
    scheme, sep, rest = value.partition("://")
    if sep and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
        at = rest.split("?", 1)[0].rfind("@")
        if at != -1:
            user, colon, _ = rest[:at].partition(":")
            rest = f"{user}{colon}{'***' if colon else ''}{rest[at:]}"
        return scheme + "://" + _QUERY_PASSWORD.sub(r"\1***", rest)
    return _CONNINFO_PASSWORD.sub(r"\1***", value)
