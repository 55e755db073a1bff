"""The CLI's grammar and output, without sockets: noun then verb with help on every
group and verb, ``--version``, one global ``--output``, tables for people, jsonl for
pipes, and the deterministic ids of a retried batch of starts."""

from __future__ import annotations

import datetime
import json
import os
from importlib.metadata import version

import click
import pytest

from contracts import identity
from workers import cli
from workers.cli import common
from workers.settings import Settings


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CUSTODY_* variable of the caller's shell: the defaults, and what a test sets."""
    for name in [n for n in os.environ if n.startswith("CUSTODY_")]:
        monkeypatch.delenv(name)


def _visible(group: click.Group) -> dict[str, click.Command]:
    return {n: c for n, c in group.commands.items() if not c.hidden}


def test_every_group_and_verb_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    top = capsys.readouterr().out
    for name, noun in _visible(cli.cli).items():
        assert isinstance(noun, click.Group), f"{name}: a noun (the grammar is noun verb)"
        assert noun.help and name in top, name
        assert cli.main([name, "--help"]) == 0
        assert noun.help in " ".join(capsys.readouterr().out.split()), name
        assert _visible(noun), name
        for verb, command in _visible(noun).items():
            assert command.help, f"{name} {verb}"
            assert cli.main([name, verb, "--help"]) == 0
            assert f"Usage: custody {name} {verb}" in capsys.readouterr().out


def test_the_top_level_help_offers_no_way_to_make_an_unknown_effect_succeed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["--help"]) == 0
    top = capsys.readouterr().out
    assert "succeed" not in top and "replay" not in top


def test_a_noun_alone_shows_its_verbs_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["instances"]) == 2
    assert "Commands:" in capsys.readouterr().err


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"custody {version('custody')}"


def test_the_old_spellings_are_hidden_aliases_of_the_same_commands() -> None:
    for old, noun, verb in (
        ("run", "workers", "run"),
        ("start", "instances", "start"),
        ("reconcile", "operations", "reconcile"),
        ("retry-safe", "operations", "retry-safe"),
        ("cancel", "instances", "cancel"),
        ("cancel-start", "start-requests", "cancel"),
    ):
        alias = cli.cli.commands[old]
        target = cli.cli.commands[noun].commands[verb]  # type: ignore[attr-defined]
        assert alias.hidden
        assert [p.name for p in alias.params] == [p.name for p in target.params]


ROWS = [
    {"id": "a", "n": 1, "at": datetime.datetime(2026, 1, 2, 3, 4, 5), "x": None},
    {"id": "bbbb", "n": 22, "at": None, "x": {"k": [1]}},
]


def test_text_lists_are_aligned_tables(capsys: pytest.CaptureFixture[str]) -> None:
    common.emit(ROWS, "text")
    assert capsys.readouterr().out.splitlines() == [
        "id    n   at                   x",
        "a     1   2026-01-02T03:04:05  -",
        'bbbb  22  -                    {"k":[1]}',
    ]
    common.emit([], "text")
    assert capsys.readouterr().out == ""


def test_jsonl_is_one_object_a_line_and_json_one_document(
    capsys: pytest.CaptureFixture[str],
) -> None:
    common.emit(ROWS, "jsonl")
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["id"] for line in lines] == ["a", "bbbb"]
    common.emit(ROWS, "json")
    assert [r["n"] for r in json.loads(capsys.readouterr().out)] == [1, 22]
    common.emit({"one": 1}, "jsonl")
    assert capsys.readouterr().out == '{"one":1}\n'


def test_the_ids_of_a_retried_batch_of_starts_are_the_same() -> None:
    first = "0b8f9d5e-7c1a-4e2b-9f00-3d4c5b6a7e81"
    ids = identity.start_request_ids(first, 50)
    assert ids == identity.start_request_ids(first, 50)
    assert ids[0] == first and len(set(ids)) == 50
    assert identity.start_request_ids(first, 3) == ids[:3]  # --count 3 then --count 50
    assert all(identity.canonical(i) == i for i in ids)


def test_a_misspelled_setting_is_named_with_its_likely_intent(
    clean_env: None, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUSTODY_DATABSE_URL", "postgresql://nobody@nowhere/none")
    assert cli.main(["config", "show"]) == 0
    out, err = capsys.readouterr()
    assert err.strip() == (
        "custody: warning: CUSTODY_DATABSE_URL is not a custody setting and is ignored; "
        "did you mean CUSTODY_DATABASE_URL?"
    )
    assert json.loads(out)["database_url"] == Settings().database_url


def test_config_show_masks_a_password_with_at_colon_and_slash(
    clean_env: None, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "p@ss:w/rd@x"
    monkeypatch.setenv("CUSTODY_AMQP_URL", f"amqp://custody-cli:{secret}@rabbit-0,rabbit-1/%2F")
    monkeypatch.setenv("CUSTODY_DATABASE_URL", f"postgresql://oncall:{secret}@db:5432/custody")
    for argv in (["config", "show"], ["config", "show", "--output", "text"]):
        assert cli.main(argv) == 0
        out, _ = capsys.readouterr()
        for fragment in ("p@ss", "ss:w", "w/rd", "rd@x", "@x@"):
            assert fragment not in out, (argv, out)
    assert cli.main(["config", "show", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["amqp_url"] == "amqp://custody-cli:***@rabbit-0,rabbit-1/%2F"
    assert shown["database_url"] == "postgresql://oncall:***@db:5432/custody"
