"""One frozen settings object, built once from the environment (prefix ``CUSTODY_``).

Every setting may instead be read from a file named by ``CUSTODY_<NAME>_FILE``
(Docker and Kubernetes secrets). libpq's ``PG*`` variables work when the database
URL is left empty. Secrets never appear in :meth:`Settings.redacted`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import Field, asdict, dataclass, fields
from pathlib import Path
from typing import Any

from workers.errors import ConfigError

PREFIX = "CUSTODY_"
ROOT = Path(__file__).resolve().parent.parent
LOG_LEVELS = ("debug", "info", "warning", "error")


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
    # Where schema.sql, queries.sql, participant_schema.sql, participant_queries.sql, ...
    # are (the image sets /app).
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
    confirm_timeout_s: float = 10.0
    poll_interval_s: float = 1.0
    # A participant runs its fast handlers (those it declares inline) in the acceptance
    # transaction: acceptance, effect and terminal receipt commit together before the
    # ack. Off: every handler runs in the executor, after acceptance.
    participant_inline: bool = True
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

    def check(self) -> None:
        for name in ("batch_size", "prefetch", "confirm_window", "max_message_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{PREFIX}{name.upper()} must be at least 1")
        if self.prefetch < self.batch_size:
            raise ConfigError(
                f"{PREFIX}PREFETCH ({self.prefetch}) must be at least "
                f"{PREFIX}BATCH_SIZE ({self.batch_size}), or batches never fill"
            )
        if self.log_format not in ("json", "text"):
            raise ConfigError(f"{PREFIX}LOG_FORMAT must be json or text")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"{PREFIX}LOG_LEVEL must be one of {', '.join(LOG_LEVELS)}")

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


def _redact(value: str) -> str:
    value = re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", value)
    return re.sub(r"(password=)[^&\s]*", r"\1***", value, flags=re.IGNORECASE)
