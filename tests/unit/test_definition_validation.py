"""A definition is validated against the contracts when it is loaded (workers/core/process.py).

"ServiceCommand and OperationReceipt represent the documented command and receipt
boundaries. A command binds its tenant, target, operation, attempt, immutable input and
relevant business lineage." Everything a definition later feeds to those contracts (the
process and node names of the lineage, the operation name, the input template that is
digested, the version) is checked with the contracts' own validators at load, so a bad
file is refused with its file, node and field named, instead of loading fine and then
failing every activation (a pydantic ValidationError that crash-loops the committer).
"""

from __future__ import annotations

import datetime as dt
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from contracts import digest
from contracts.models import Lineage
from tests.unit.test_process import ORDER, ORDER_FILE, ROUTES, order, with_node, write
from workers.core import process
from workers.core.process import DefinitionError
from workers.settings import ROOT

NAME_RULE = re.escape("must match ^[a-z0-9][a-z0-9_.\\-]{0,62}$")
FILE = "order-fulfilment.v1.toml"
IID = "00000000-0000-4000-8000-000000000001"


def renamed(old: str, new: str) -> dict[str, Any]:
    """ORDER with node ``old`` called ``new`` (and every reference to it)."""
    data = order()
    data["nodes"] = {new if k == old else k: v for k, v in data["nodes"].items()}
    for body in data["nodes"].values():
        for key in ("on_succeeded", "on_failed"):
            if body.get(key) == old:
                body[key] = new
    if data["start"] == old:
        data["start"] = new
    return data


def lineage_accepts(**fields: Any) -> bool:
    base = {
        "instance_id": IID,
        "process": "order-fulfilment",
        "process_version": 1,
        "node": "reserve",
        "activation": 1,
    }
    try:
        Lineage(**(base | fields))
    except ValidationError:
        return False
    return True


# --- names ------------------------------------------------------------------------------

BAD_NAMES = ["Bad Node", "Reserve", "-reserve", ".reserve", "re serve", "x" * 64, "", "ré"]
GOOD_NAMES = ["reserve", "r", "0", "re.serve-2_b", "x" * 63]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_node_name_outside_the_contract_name_is_refused_at_load(
    tmp_path: Path, name: str
) -> None:
    """A command binds its ... relevant business lineage: the node name becomes
    Lineage.node, so one the contract refuses is refused when the file is loaded."""
    assert not lineage_accepts(node=name)
    write(tmp_path, FILE, renamed("ship", name))
    with pytest.raises(DefinitionError) as caught:
        process.load_dir(tmp_path, ROUTES)
    message = str(caught.value)
    assert message.startswith(f"{tmp_path / FILE}: node {name!r}: name ")
    assert re.search(NAME_RULE, message)


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_a_node_name_the_contract_accepts_loads(tmp_path: Path, name: str) -> None:
    """The load-time rule is the contract's rule, not a stricter one."""
    assert lineage_accepts(node=name)
    write(tmp_path, FILE, renamed("ship", name))
    assert name in process.load_dir(tmp_path, ROUTES).get("order-fulfilment", 1).nodes


@pytest.mark.parametrize("name", ["Order", "order fulfilment", "o" * 64, 7])
def test_a_process_name_outside_the_contract_name_is_refused(name: Any) -> None:
    """The process name becomes Lineage.process."""
    with pytest.raises(DefinitionError, match=r"^process: name " + NAME_RULE):
        process.parse(order(name=name), ROUTES)


def test_an_operation_name_outside_the_contract_name_is_refused() -> None:
    """A command binds its ... operation: SubmitCommand.operation is a contract Name."""
    with pytest.raises(DefinitionError, match=r"^node 'charge': operation " + NAME_RULE):
        process.parse(with_node("charge", operation="Payments Charge"), ROUTES)


@pytest.mark.parametrize("version", [0, -1, True, "1", 1.0, 2**31])
def test_a_version_that_is_not_an_integer_of_at_least_one_is_refused(version: Any) -> None:
    """Instances pin their definition version (Lineage.process_version >= 1, an
    integer; a TOML string or boolean is not silently turned into one)."""
    with pytest.raises(DefinitionError, match=r"^version must be an integer >= 1"):
        process.parse(order(version=version), ROUTES)


@pytest.mark.parametrize("start", ["@completed", "@failed", 3])
def test_start_must_be_a_node(start: Any) -> None:
    """The first activation is of the start node: an end marker (or a non-string) as
    start would fail the first activation of every instance."""
    with pytest.raises(DefinitionError, match=r"^start must be the name of a node"):
        process.parse(order(start=start), ROUTES)


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"route": 5}, "'charge': route must be a string"),
        ({"on_failed": ["release"]}, "'charge': on_failed must be a string"),
        ({"input": "order"}, "'charge': input must be a table"),
        ({"retry": {"max_attempts": 10_001, "on": ["busy"]}}, "'charge': retry.max_attempts"),
    ],
    ids=["route", "successor", "input", "max-attempts-over-the-contract-attempt"],
)
def test_a_node_field_of_the_wrong_type_is_a_definition_error(
    body: dict[str, Any], match: str
) -> None:
    with pytest.raises(DefinitionError, match=match):
        process.parse(with_node("charge", **body), ROUTES)


def test_a_node_that_is_not_a_table_is_refused() -> None:
    data = order()
    data["nodes"]["ship"] = "shipping.ship"
    with pytest.raises(DefinitionError, match="node 'ship': must be a table"):
        process.parse(data, ROUTES)


# --- the input template and the digest's domain -----------------------------------------

DOMAIN_CASES = [
    ("amount = 19.99", "input.amount", "a TOML float"),
    ("amount = 1e3", "input.amount", "a TOML float"),
    ("amount = nan", "input.amount", "a TOML float"),
    ("when = 2024-05-01T10:00:00Z", "input.when", "a TOML datetime"),
    ("when = 2024-05-01T10:00:00", "input.when", "a TOML datetime"),
    ("when = 2024-05-01", "input.when", "a TOML date"),
    ("when = 10:00:00", "input.when", "a TOML time"),
    ("meta = { rate = 0.5 }", "input.meta.rate", "a TOML float"),
    ('lines = ["a", [1, 2.5]]', "input.lines[1][1]", "a TOML float"),
    ("big = 9007199254740992", "input.big", "a value"),
    ('text = "a\\u0000b"', "input.text", "a value"),
]


@pytest.mark.parametrize(("literal", "path", "what"), DOMAIN_CASES)
def test_an_input_literal_outside_the_digest_domain_is_refused_at_load(
    tmp_path: Path, literal: str, path: str, what: str
) -> None:
    """A command binds its ... immutable input, and the participant persists the semantic
    command digest: an input literal the digest cannot put in canonical form (a TOML
    float, datetime, date or time, a huge integer) is refused when the file is loaded,
    naming the file, the node and the field."""
    text = ORDER_FILE.read_text().replace(
        'input = { order_id = "$input.order_id", sku',
        f'input = {{ {literal}, order_id = "$input.order_id", sku',
        1,  # the first one: node reserve
    )
    assert literal in text
    write(tmp_path, FILE, text)
    with pytest.raises(DefinitionError) as caught:
        process.load_dir(tmp_path, ROUTES)
    message = str(caught.value)
    assert message.startswith(f"{tmp_path / FILE}: node 'reserve': {path}: {what} ")
    assert "outside the digest's domain" in message


def test_an_input_nested_deeper_than_the_digest_allows_is_refused() -> None:
    deep: Any = "leaf"
    for _ in range(digest.MAX_DEPTH):
        deep = {"d": deep}
    with pytest.raises(DefinitionError, match=r"node 'ship': input(\.d)+: .*deeper than"):
        process.parse(with_node("ship", input=deep), ROUTES)


def test_references_and_json_literals_in_a_template_load() -> None:
    """$input./$result. references are strings, and integers, booleans, strings, lists
    and tables are in the digest's domain."""
    template = {
        "order_id": "$input.order_id",
        "reservation": "$result.reserve.reservation_id?",
        "count": 3,
        "max": 2**53 - 1,
        "gift": False,
        "tags": ["a", 1, [True]],
        "meta": {"channel": "web", "note": "$5"},
    }
    node = process.parse(with_node("ship", input=template), ROUTES).node("ship")
    assert node.input == template


@pytest.mark.parametrize("value", [1.5, dt.date(2024, 5, 1), 2**53])
def test_what_the_load_refuses_is_what_the_command_would_refuse(value: Any) -> None:
    """The load-time check is the digest's own check (contracts.digest), so it refuses
    exactly the literals that would fail at activation."""
    with pytest.raises(digest.CanonicalFormError):
        digest.check_json_value({"input": {"x": value}})
    with pytest.raises(DefinitionError, match=r"input\.x"):
        process.parse(with_node("ship", input={"x": value}), ROUTES)


def test_the_deployed_definitions_still_load() -> None:
    assert process.parse(ORDER, ROUTES).name == "order-fulfilment"


# --- the operator command and the worker start-up ----------------------------------------


def _custody(*args: str, processes: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUSTODY_")}
    return subprocess.run(
        [sys.executable, "-m", "workers.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env | {"CUSTODY_PROCESSES_DIR": str(processes), "CUSTODY_LOG_FORMAT": "json"},
    )


def test_custody_definitions_check_names_the_file_node_and_field(tmp_path: Path) -> None:
    """`custody definitions check` loads the configured files as a worker would: exit 0
    with a one-line summary, or exit 2 with one line naming the file, node and field."""
    good = _custody("definitions", "check", processes=ROOT / "deploy" / "processes")
    assert good.returncode == 0, good.stderr
    assert good.stdout.count("\n") == 1
    assert "order-fulfilment v1" in good.stdout

    bad_dir = tmp_path / "processes"
    write(bad_dir, FILE, renamed("ship", "Bad Node"))
    bad = _custody("definitions", "check", processes=bad_dir)
    assert bad.returncode == 2
    assert bad.stdout == ""
    lines = bad.stderr.splitlines()
    assert len(lines) == 1, bad.stderr  # no traceback
    assert f"{bad_dir / FILE}: node 'Bad Node': name must match" in lines[0]

    float_dir = tmp_path / "floats"
    write(float_dir, FILE, with_node("charge", input={"amount": 19.99}))
    flagged = _custody("definitions", "check", "--dir", str(float_dir), processes=bad_dir)
    assert flagged.returncode == 2
    assert "node 'charge': input.amount: a TOML float is outside the digest's domain" in (
        flagged.stderr
    )


def test_a_worker_refuses_to_start_on_a_bad_definition(tmp_path: Path) -> None:
    """A bad file makes a worker exit non-zero at start-up, saying why (before it
    touches the database or the broker)."""
    bad_dir = tmp_path / "processes"
    write(bad_dir, FILE, renamed("ship", "Bad Node"))
    done = _custody("run", "publisher", processes=bad_dir)
    assert done.returncode != 0
    assert "node 'Bad Node': name must match" in done.stdout + done.stderr
