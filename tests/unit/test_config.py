"""One frozen settings object, built once from the environment (workers/settings.py).

"Configuration is missing or invalid: refuse to start, say what and why." Secrets may
come from *_FILE variables (Docker and Kubernetes secrets) and never appear in
Settings.redacted().
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from workers.errors import ConfigError, CustodyError
from workers.settings import Settings


def test_no_environment_gives_the_defaults() -> None:
    settings = Settings.from_env({})
    assert settings == Settings()
    assert settings.prefetch >= settings.batch_size


def test_settings_come_from_custody_variables_with_their_types() -> None:
    settings = Settings.from_env(
        {
            "CUSTODY_DATABASE_URL": "postgresql://custody:pw@db.internal:5432/custody",
            "CUSTODY_BATCH_SIZE": "50",
            "CUSTODY_PREFETCH": "100",
            "CUSTODY_CONFIRM_TIMEOUT_S": "2.5",
            "CUSTODY_LOG_FORMAT": "text",
            "DATABASE_URL": "postgresql://ignored@elsewhere/x",  # no prefix: not ours
        }
    )
    assert settings.database_url == "postgresql://custody:pw@db.internal:5432/custody"
    assert settings.batch_size == 50
    assert settings.prefetch == 100
    assert settings.confirm_timeout_s == 2.5
    assert settings.log_format == "text"


def test_a_setting_can_be_read_from_a_file(tmp_path: Path) -> None:
    """Every setting may instead be read from a file named by CUSTODY_<NAME>_FILE;
    the trailing newline secret files usually have is not part of the value."""
    secret = tmp_path / "amqp_url"
    secret.write_text("amqp://custody:s3cret@rabbit:5672/%2F\n")
    size = tmp_path / "batch"
    size.write_text("25\n")
    settings = Settings.from_env(
        {"CUSTODY_AMQP_URL_FILE": str(secret), "CUSTODY_BATCH_SIZE_FILE": str(size)}
    )
    assert settings.amqp_url == "amqp://custody:s3cret@rabbit:5672/%2F"
    assert settings.batch_size == 25


def test_a_setting_given_both_directly_and_as_a_file_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "url"
    secret.write_text("postgresql://a@b/c")
    with pytest.raises(ConfigError, match="CUSTODY_DATABASE_URL or CUSTODY_DATABASE_URL_FILE"):
        Settings.from_env(
            {"CUSTODY_DATABASE_URL": "postgresql://x@y/z", "CUSTODY_DATABASE_URL_FILE": str(secret)}
        )


def test_a_missing_setting_file_is_refused_naming_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="CUSTODY_AMQP_URL_FILE"):
        Settings.from_env({"CUSTODY_AMQP_URL_FILE": str(tmp_path / "absent")})


@pytest.mark.parametrize(
    ("variable", "raw"),
    [
        ("CUSTODY_BATCH_SIZE", "lots"),
        ("CUSTODY_BATCH_SIZE", "1.5"),
        ("CUSTODY_PREFETCH", ""),
        ("CUSTODY_METRICS_PORT", "0x1F"),
        ("CUSTODY_LEASE_TTL_S", "fifteen"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_naming_the_variable(variable: str, raw: str) -> None:
    """Refuse to start, say what and why."""
    with pytest.raises(ConfigError, match=variable) as info:
        Settings.from_env({variable: raw})
    assert repr(raw) in str(info.value)


def test_a_bad_value_in_a_file_is_refused_naming_the_variable(tmp_path: Path) -> None:
    path = tmp_path / "prefetch"
    path.write_text("many")
    with pytest.raises(ConfigError, match="CUSTODY_PREFETCH"):
        Settings.from_env({"CUSTODY_PREFETCH_FILE": str(path)})


def test_a_prefetch_smaller_than_the_batch_is_refused() -> None:
    """Batches never fill if the broker delivers fewer messages than a batch."""
    with pytest.raises(ConfigError, match=r"CUSTODY_PREFETCH.*CUSTODY_BATCH_SIZE"):
        Settings.from_env({"CUSTODY_BATCH_SIZE": "100", "CUSTODY_PREFETCH": "99"})
    assert Settings.from_env({"CUSTODY_BATCH_SIZE": "100", "CUSTODY_PREFETCH": "100"}).prefetch


@pytest.mark.parametrize(
    "variable",
    [
        "CUSTODY_BATCH_SIZE",
        "CUSTODY_PREFETCH",
        "CUSTODY_CONFIRM_WINDOW",
        "CUSTODY_MAX_MESSAGE_BYTES",
    ],
)
@pytest.mark.parametrize("raw", ["0", "-1"])
def test_sizes_below_one_are_refused(variable: str, raw: str) -> None:
    env = {variable: raw}
    if variable == "CUSTODY_BATCH_SIZE":
        env["CUSTODY_PREFETCH"] = "400"
    with pytest.raises(ConfigError, match=variable):
        Settings.from_env(env)


def test_an_unknown_log_format_is_refused() -> None:
    with pytest.raises(ConfigError, match="CUSTODY_LOG_FORMAT"):
        Settings.from_env({"CUSTODY_LOG_FORMAT": "xml"})


def test_the_event_loop_is_uvloop_unless_asyncio_is_asked_for() -> None:
    assert Settings.from_env({}).event_loop == "uvloop"
    assert Settings.from_env({"CUSTODY_EVENT_LOOP": "asyncio"}).event_loop == "asyncio"
    with pytest.raises(ConfigError, match="CUSTODY_EVENT_LOOP must be one of uvloop, asyncio"):
        Settings.from_env({"CUSTODY_EVENT_LOOP": "trio"})


def test_a_worker_collects_garbage_less_often_than_python_by_default() -> None:
    """Issue 14: a worker's youngest-generation threshold is 10,000 (Python's is 700),
    settable, and never so low that collecting would be most of the work."""
    assert Settings.from_env({}).gc_threshold == 10_000
    assert Settings.from_env({"CUSTODY_GC_THRESHOLD": "700"}).gc_threshold == 700
    for bad in ("0", "99", "1000001", str(2**31)):  # 2**31: gc.set_threshold overflows
        with pytest.raises(ConfigError, match="CUSTODY_GC_THRESHOLD must be between 100 and"):
            Settings.from_env({"CUSTODY_GC_THRESHOLD": bad})


def test_config_error_is_a_custody_error() -> None:
    assert issubclass(ConfigError, CustodyError)


def test_settings_are_frozen() -> None:
    """One frozen settings object, built once."""
    with pytest.raises(dataclasses.FrozenInstanceError):
        Settings().batch_size = 1  # type: ignore[misc]


def test_redacted_hides_every_password_in_urls() -> None:
    """Secrets never appear in Settings.redacted() (custody config show)."""
    settings = Settings.from_env(
        {
            "CUSTODY_DATABASE_URL": "postgresql://custody:db-s3cret@db.internal:5432/custody",
            "CUSTODY_PARTICIPANT_DATABASE_URL": "postgres://p:pa:rt@h/x",
            "CUSTODY_AMQP_URL": "amqps://custody:mq-s3cret@rabbit:5671/%2F",
            "CUSTODY_AMQP_MANAGEMENT_URL": "https://admin:mgmt-s3cret@rabbit:15671",
        }
    )
    shown = settings.redacted()
    text = repr(shown)
    for secret in ("db-s3cret", "pa:rt", "mq-s3cret", "mgmt-s3cret"):
        assert secret not in text
    assert shown["database_url"] == "postgresql://custody:***@db.internal:5432/custody"
    assert shown["amqp_url"] == "amqps://custody:***@rabbit:5671/%2F"
    assert shown["amqp_management_url"] == "https://admin:***@rabbit:15671"
    assert shown["batch_size"] == settings.batch_size
    assert set(shown) == {f.name for f in dataclasses.fields(Settings)}


def test_redacted_keeps_urls_without_a_password() -> None:
    shown = Settings.from_env({"CUSTODY_DATABASE_URL": "postgresql://custody@db/custody"})
    assert shown.redacted()["database_url"] == "postgresql://custody@db/custody"


def test_redacted_hides_a_password_read_from_a_file(tmp_path: Path) -> None:
    secret = tmp_path / "amqp"
    secret.write_text("amqp://custody:from-a-file@rabbit/%2F")
    shown = Settings.from_env({"CUSTODY_AMQP_URL_FILE": str(secret)}).redacted()
    assert "from-a-file" not in repr(shown)


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://custody@db.internal/custody?password=q-s3cret",
        "postgresql://db.internal/custody?sslmode=require&password=q-s3cret",
        "host=db.internal dbname=custody user=custody password=q-s3cret",
    ],
    ids=["query-parameter", "second-query-parameter", "keyword-dsn"],
)
def test_redacted_hides_a_libpq_password_parameter(url: str) -> None:
    """Secrets never appear in Settings.redacted(), however libpq is given them."""
    shown = Settings.from_env({"CUSTODY_DATABASE_URL": url}).redacted()
    assert "q-s3cret" not in repr(shown)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://oncall:p@ss@db:5432/custody", "postgresql://oncall:***@db:5432/custody"),
        ("postgresql://oncall:a:b:c@db/custody", "postgresql://oncall:***@db/custody"),
        ("postgresql://oncall:pa/ss@db/custody", "postgresql://oncall:***@db/custody"),
        ("postgresql://oncall:p@s/s:w@db/custody", "postgresql://oncall:***@db/custody"),
        ("postgresql://oncall:p%40ss@db/custody", "postgresql://oncall:***@db/custody"),
        (
            "amqp://cli:p@w/d@rabbit-0,rabbit-1:5673/%2F",
            "amqp://cli:***@rabbit-0,rabbit-1:5673/%2F",
        ),
        ("http://admin:p@ss@rabbit:15672", "http://admin:***@rabbit:15672"),
        ("postgresql://oncall:@db/custody", "postgresql://oncall:***@db/custody"),
        (
            "postgresql://db/custody?password=p@s&sslmode=require",
            "postgresql://db/custody?password=***&sslmode=require",
        ),
        ("host=db password='p@ss w/rd' user=oncall", "host=db password=*** user=oncall"),
    ],
    ids=[
        "at",
        "colons",
        "slash",
        "at-slash-colon",
        "percent-encoded",
        "amqp-host-list",
        "management",
        "empty",
        "query-with-at",
        "quoted-keyword",
    ],
)
def test_redacted_masks_a_password_with_at_colon_or_slash_whole(url: str, shown: str) -> None:
    """An unencoded ``@``, ``:`` or ``/`` in a password half-leaked before: the userinfo
    ends at the last ``@`` before the query, however the password is spelled."""
    settings = Settings.from_env({"CUSTODY_DATABASE_URL": url, "CUSTODY_AMQP_MANAGEMENT_URL": url})
    assert settings.redacted()["database_url"] == shown
    assert settings.redacted()["amqp_management_url"] == shown


def test_an_unknown_custody_variable_is_named_with_the_likely_intended_one() -> None:
    env = {
        "CUSTODY_DATABSE_URL": "x",  # a typo
        "CUSTODY_COLOUR": "blue",  # nothing close
        "CUSTODY_DATABASE_URL": "postgresql://db/custody",
        "CUSTODY_AMQP_URL_FILE": "/run/secrets/amqp",
        "CUSTODY_CRASH_POINTS": "",  # read by workers.runtime.faults
        "CUSTODY_TEST_PG": "postgresql://db/postgres",  # the tests' own
        "PGHOST": "db",
    }
    assert Settings.unknown_variables(env) == [
        "CUSTODY_COLOUR is not a custody setting and is ignored",
        "CUSTODY_DATABSE_URL is not a custody setting and is ignored; "
        "did you mean CUSTODY_DATABASE_URL?",
    ]
    assert Settings.unknown_variables({}) == []


def test_the_sql_directory_is_a_setting(tmp_path: Path) -> None:
    """CUSTODY_SQL_DIR (the image sets /app) is read by Settings like every other one;
    Settings.read gives one setting alone, for a module that needs only it."""
    assert Settings().sql_dir == str(Path(__file__).resolve().parents[2])
    assert Settings.from_env({"CUSTODY_SQL_DIR": "/app"}).sql_dir == "/app"
    assert Settings.read("sql_dir", {"CUSTODY_SQL_DIR": "/app"}) == "/app"
    assert Settings.read("sql_dir", {}) == Settings().sql_dir
    where = tmp_path / "dir"
    where.write_text("/srv/sql\n")
    assert Settings.read("sql_dir", {"CUSTODY_SQL_DIR_FILE": str(where)}) == "/srv/sql"
    assert Settings.read("batch_size", {"CUSTODY_BATCH_SIZE": "7"}) == 7
    with pytest.raises(ConfigError, match="CUSTODY_BATCH_SIZE='x' is not a valid int"):
        Settings.read("batch_size", {"CUSTODY_BATCH_SIZE": "x"})
    with pytest.raises(KeyError):
        Settings.read("no_such_setting", {})
