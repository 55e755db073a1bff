"""workers.runtime.logs (structlog): one JSON object per line, stable keys, never a crash.

Lines go through the real ``logs.event`` path into a handler with the real formatter,
and are checked against tests/fixtures/log_event.schema.json with ``check-jsonschema``
(installed into .venv-tools by scripts/install-lint-tools.sh), the same schema the
acceptance tier applies to real worker logs.
"""

from __future__ import annotations

import datetime as dt
import decimal
import io
import json
import logging
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from workers.runtime import logs
from workers.settings import ROOT

SCHEMA = ROOT / "tests" / "fixtures" / "log_event.schema.json"
CHECK_JSONSCHEMA = ROOT / ".venv-tools" / "bin" / "check-jsonschema"
STABLE = ("ts", "level", "event", "logger")
EVENT_NAME = re.compile(json.loads(SCHEMA.read_text())["properties"]["event"]["pattern"])
ISO_UTC = re.compile(json.loads(SCHEMA.read_text())["properties"]["ts"]["pattern"])


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    """The ``custody`` logger writing through the real formatter into a buffer (as the
    root handler of ``setup_logging`` would, without touching the root logger)."""
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(logs.formatter("json"))
    logger = logging.getLogger("custody")
    old_level, old_propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        yield buffer
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        logger.propagate = old_propagate


def lines_of(buffer: io.StringIO) -> list[str]:
    text = buffer.getvalue()
    assert text.endswith("\n"), f"a log line must end with a newline: {text!r}"
    return text.splitlines()


def one_object(buffer: io.StringIO) -> dict[str, Any]:
    lines = lines_of(buffer)
    assert len(lines) == 1, f"one event must be exactly one line, got {len(lines)}: {lines}"
    obj = json.loads(lines[0])
    assert isinstance(obj, dict), lines[0]
    return obj


def schema_errors(objects: list[dict[str, Any]], tmp_path: Path) -> str:
    """check-jsonschema's complaints about each object ('' when all are valid)."""
    assert CHECK_JSONSCHEMA.exists(), (
        f"{CHECK_JSONSCHEMA} is missing: run `bash scripts/install-lint-tools.sh`"
    )
    files = []
    for i, obj in enumerate(objects):
        path = tmp_path / f"line-{i:03d}.json"
        path.write_text(json.dumps(obj))
        files.append(str(path))
    done = subprocess.run(
        [str(CHECK_JSONSCHEMA), "--schemafile", str(SCHEMA), *files],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return "" if done.returncode == 0 else done.stdout + done.stderr


def test_the_schema_itself_is_a_valid_draft_2020_12_schema() -> None:
    assert CHECK_JSONSCHEMA.exists(), "run `bash scripts/install-lint-tools.sh`"
    done = subprocess.run(
        [str(CHECK_JSONSCHEMA), "--check-metaschema", str(SCHEMA)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_an_event_with_fields_is_one_json_line_with_the_stable_keys(
    stream: io.StringIO, tmp_path: Path
) -> None:
    logs.event(
        "outbox.publish_failed",
        logging.WARNING,
        owner="engine",
        failed=3,
        first_error="returned: NO_ROUTE\nsecond line",
        ratio=0.25,
        ok=False,
        nothing=None,
        nested={"a": [1, 2]},
    )
    obj = one_object(stream)
    assert list(obj)[:4] == list(STABLE), f"stable keys first, in order: {list(obj)}"
    assert ISO_UTC.match(obj["ts"]), obj["ts"]
    when = dt.datetime.fromisoformat(obj["ts"])
    assert when.utcoffset() == dt.timedelta(0)
    assert abs((dt.datetime.now(dt.UTC) - when).total_seconds()) < 60
    assert obj["level"] == "warning"
    assert obj["event"] == "outbox.publish_failed"
    assert EVENT_NAME.match(obj["event"])
    assert obj["logger"] == "custody"
    assert obj["owner"] == "engine" and obj["failed"] == 3 and obj["ratio"] == 0.25
    assert obj["first_error"] == "returned: NO_ROUTE\nsecond line", "newlines escaped, kept"
    assert obj["ok"] is False and obj["nothing"] is None and obj["nested"] == {"a": [1, 2]}
    assert not schema_errors([obj], tmp_path)


@pytest.mark.parametrize(
    ("level", "name"),
    [
        (logging.DEBUG, "debug"),
        (logging.INFO, "info"),
        (logging.WARNING, "warning"),
        (logging.ERROR, "error"),
        (logging.CRITICAL, "critical"),
    ],
)
def test_levels_are_lower_case_names(stream: io.StringIO, level: int, name: str) -> None:
    logs.event("worker.started", level, worker="committer")
    assert one_object(stream)["level"] == name


def test_an_exception_is_included_as_a_string_on_the_same_line(
    stream: io.StringIO, tmp_path: Path
) -> None:
    try:
        raise ValueError("boom\nwith a second line")
    except ValueError:
        logging.getLogger("custody").exception(
            "worker.crashed", extra={"fields": {"worker": "receipts", "error": "ValueError"}}
        )
    obj = one_object(stream)
    assert obj["event"] == "worker.crashed" and obj["level"] == "error"
    assert obj["worker"] == "receipts"
    assert isinstance(obj["exc"], str)
    assert "Traceback (most recent call last)" in obj["exc"]
    assert "ValueError: boom" in obj["exc"] and "test_logging.py" in obj["exc"]
    assert not schema_errors([obj], tmp_path)


class _Opaque:
    def __repr__(self) -> str:
        return "<opaque thing>"


def test_non_json_serialisable_fields_do_not_crash_the_formatter(
    stream: io.StringIO, tmp_path: Path
) -> None:
    when = dt.datetime(2024, 5, 1, 12, 30, tzinfo=dt.UTC)
    ident = uuid.UUID("12345678-1234-5678-1234-567812345678")
    logs.event(
        "unit.retry",
        logging.WARNING,
        when=when,
        ident=ident,
        amount=decimal.Decimal("12.50"),
        raw=b"\x00\xffbytes",
        tags={"b"},
        path=Path("/tmp/x"),
        error=RuntimeError("db down"),
        thing=_Opaque(),
        nested={"at": when, "ids": (ident,)},
    )
    obj = one_object(stream)
    assert obj["event"] == "unit.retry"
    assert obj["when"] == str(when)
    assert obj["ident"] == str(ident)
    assert obj["amount"] == "12.50"
    assert isinstance(obj["raw"], str)
    assert obj["tags"] == "{'b'}"
    assert obj["path"] == "/tmp/x"
    assert obj["error"] == "db down"
    assert obj["thing"] == "<opaque thing>"
    assert obj["nested"] == {"at": str(when), "ids": [str(ident)]}
    assert not schema_errors([obj], tmp_path)


def test_a_field_whose_str_raises_still_yields_one_json_line(stream: io.StringIO) -> None:
    class Hostile:
        def __str__(self) -> str:
            raise RuntimeError("no str for you")

        __repr__ = __str__

    logs.event("unit.retry", logging.WARNING, thing=Hostile(), attempt=2)
    obj = one_object(stream)
    assert obj["event"] == "unit.retry" and obj["attempt"] == 2
    assert isinstance(obj["thing"], str)


def test_a_dict_field_with_non_string_keys_does_not_crash_the_formatter(
    stream: io.StringIO,
) -> None:
    logs.event("outbox.stats", counts={("engine", "pending"): 3, 7: 1})
    obj = one_object(stream)
    assert obj["event"] == "outbox.stats"
    assert isinstance(obj["counts"], dict) and len(obj["counts"]) == 2


def test_nan_and_infinity_are_not_written_as_invalid_json(stream: io.StringIO) -> None:
    logs.event("metrics.sampled", ratio=float("nan"), age=float("-inf"))
    line = lines_of(stream)[0]
    constants: list[str] = []
    obj = json.loads(line, parse_constant=constants.append)
    assert obj["event"] == "metrics.sampled"
    assert not constants, f"non-JSON constants {constants} in {line}"


def test_fields_cannot_replace_the_stable_keys(stream: io.StringIO) -> None:
    logs.event("worker.started", ts="yesterday", logger="someone-else", worker="x")
    obj = one_object(stream)
    assert obj["event"] == "worker.started"
    assert obj["logger"] == "custody"
    assert ISO_UTC.match(obj["ts"])
    assert obj["field_ts"] == "yesterday" and obj["field_logger"] == "someone-else"


def test_a_third_party_record_gets_a_stable_event_name_and_keeps_its_message(
    tmp_path: Path,
) -> None:
    record = logging.LogRecord(
        "aio_pika.robust_connection",
        logging.WARNING,
        __file__,
        1,
        'Connection attempt to "%s" failed: %s. Reconnecting after %r seconds.',
        ("amqp://guest:******@127.0.0.1:5672/", "ConnectionResetError", 5),
        None,
    )
    obj = json.loads(logs.formatter("json").format(record))
    assert obj["logger"] == "aio_pika.robust_connection"
    assert obj["event"] == "log.library" and obj["level"] == "warning"
    assert obj["message"].startswith('Connection attempt to "amqp://guest:******@127.0.0.1')
    assert ISO_UTC.match(obj["ts"])
    assert not schema_errors([obj], tmp_path)


def test_an_event_with_exc_info_carries_the_traceback(stream: io.StringIO) -> None:
    try:
        raise KeyError("missing")
    except KeyError:
        logs.event("worker.crashed", logging.ERROR, exc_info=True, worker="committer")
    obj = one_object(stream)
    assert obj["event"] == "worker.crashed" and "KeyError: 'missing'" in obj["exc"]
    assert "exc_info" not in obj


def test_a_field_named_event_does_not_replace_the_name(stream: io.StringIO) -> None:
    logs.event("history.written", event="instance.started")
    obj = one_object(stream)
    assert obj["event"] == "history.written" and obj["field_event"] == "instance.started"


def test_lines_inside_a_unit_carry_its_ids_library_lines_and_errors_included(
    stream: io.StringIO, tmp_path: Path
) -> None:
    """Every line logged inside ``logs.bound`` carries the unit's ids (after the stable
    keys), a nested scope adds to the outer one, and the ids are gone after it."""
    library = logging.getLogger("aiormq.connection")
    library.addHandler(logging.StreamHandler(stream))
    library.handlers[-1].setFormatter(logs.formatter("json"))
    library.propagate, old = False, library.propagate
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    try:
        with logs.bound(worker="receipts", trace_id=trace, message_id="m-1"):
            with logs.bound(operation_id="op-1", instance_id="in-1", nothing=None):
                logs.event("unit.done", logging.DEBUG, outcome="apply")
                library.warning("Unexpected connection close from remote %s", "x")
                try:
                    raise RuntimeError("db down")
                except RuntimeError:
                    logs.event("unit.retry", logging.WARNING, exc_info=True)
            logs.event("unit.done", logging.DEBUG, outcome="apply")
        logs.event("worker.stopped")
    finally:
        library.handlers.pop()
        library.propagate = old
    objects = [json.loads(line) for line in lines_of(stream)]
    inner, library_line, error, outer, after = objects
    ids = {
        "worker": "receipts",
        "trace_id": trace,
        "message_id": "m-1",
        "operation_id": "op-1",
        "instance_id": "in-1",
    }
    for obj in (inner, library_line, error):
        assert {k: obj.get(k) for k in ids} == ids, obj
        assert list(obj)[:4] == list(STABLE), obj
        assert "nothing" not in obj, "None ids are left out"
    assert library_line["event"] == "log.library" and "connection close" in library_line["message"]
    assert "RuntimeError: db down" in error["exc"]
    assert "operation_id" not in outer and outer["message_id"] == "m-1"
    assert not set(ids) & set(after), after
    assert not schema_errors(objects, tmp_path)


def test_setup_logging_writes_to_stdout_at_the_level_asked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        logs.setup_logging("json", logs.level_of("info"))
        logs.event("unit.done", logging.DEBUG, outcome="silent at info")
        logs.event("worker.started", worker="committer")
        assert not logs.enabled(logging.DEBUG)
        logs.setup_logging("json", logs.level_of("debug"))
        logs.event("unit.done", logging.DEBUG, outcome="apply")
        assert logs.enabled(logging.DEBUG)
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    out, err = capsys.readouterr()
    assert not err, "logs go to stdout"
    events = [json.loads(line)["event"] for line in out.splitlines()]
    assert events == ["worker.started", "unit.done"], out


def test_the_text_format_is_one_readable_line(capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        logs.setup_logging("text")
        with logs.bound(message_id="m-1"):
            logs.event("quarantine.recorded", logging.WARNING, reason="malformed_json")
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    line = capsys.readouterr().out.strip()
    assert "quarantine.recorded" in line and "[warning" in line, line
    assert "message_id=m-1" in line and "reason=malformed_json" in line, line
    assert ISO_UTC.match(line.split(" ", 1)[0]), line


@pytest.mark.parametrize("name", ["verbose", "loud"])
def test_an_unknown_level_name_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match=name):
        logs.level_of(name)


def test_a_disabled_level_costs_next_to_nothing() -> None:
    """At info, the debug ``unit.done`` of each delivery costs one level check: the hot
    path (~1000 units/s) pays well under a microsecond per unit for it."""
    logger = logging.getLogger("custody")
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        n = 20_000
        began = time.perf_counter()
        for _ in range(n):
            logs.event("unit.done", logging.DEBUG, message_id="m", outcome="apply")
        per_call = (time.perf_counter() - began) / n
    finally:
        logger.setLevel(old)
    assert per_call < 20e-6, f"{per_call * 1e6:.2f} us per disabled event"


async def test_a_polling_loops_unit_that_did_something_logs_unit_done_at_debug(
    stream: io.StringIO, tmp_path: Path
) -> None:
    """ "A debug level shows each unit": a loop's unit (outbox.publish, the successors,
    the reconciler's sweeps, the participant's executor) gets a ``unit.done`` line with
    its name, rows and duration when it did something; an idle poll writes nothing."""
    from workers.runtime import supervisor

    stop = supervisor.Stop(1.0)

    async def nothing() -> None:
        return None

    async def three() -> int:
        return 3

    async def idle() -> int:
        return 0

    assert (
        await supervisor.redo(
            three, worker="publisher", stop=stop, on_fenced=nothing, name="outbox.publish"
        )
        == 3
    )
    assert (
        await supervisor.redo(
            idle, worker="publisher", stop=stop, on_fenced=nothing, name="outbox.publish"
        )
        == 0
    )
    assert await supervisor.redo(three, worker="publisher", stop=stop, on_fenced=nothing) == 3
    [obj] = [json.loads(line) for line in lines_of(stream)]
    assert obj["event"] == "unit.done" and obj["level"] == "debug"
    assert (obj["unit"], obj["rows"], obj["attempts"]) == ("outbox.publish", 3, 1)
    assert obj["duration_ms"] >= 0
    assert not schema_errors([obj], tmp_path)
