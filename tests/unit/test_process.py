"""Versioned process definitions and the pure decisions over them (workers/core/process.py).

"A process author names a route, never a URL or queue." "Process definitions are
versioned files; an instance pins its definition version." A definition that does
not fit the routes is refused when it is loaded, not when an instance reaches it.
"""

from __future__ import annotations

import copy
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from workers.core import process, routes
from workers.core.process import END_COMPLETED, END_FAILED, DefinitionError, InputError

ROOT = Path(__file__).resolve().parents[2]
ROUTES = routes.load(ROOT / "deploy" / "routes.toml")
DEPLOYED = ROOT / "deploy" / "processes"
ORDER_FILE = DEPLOYED / "order-fulfilment.v1.toml"
ORDER: dict[str, Any] = tomllib.loads(ORDER_FILE.read_text())


def order(**top: Any) -> dict[str, Any]:
    data = copy.deepcopy(ORDER)
    data.update(top)
    return data


def with_node(node: str, **body: Any) -> dict[str, Any]:
    data = order()
    data["nodes"][node].update(body)
    return data


def write(directory: Path, name: str, data: dict[str, Any] | str) -> Path:
    directory.mkdir(exist_ok=True)
    path = directory / name
    path.write_text(data if isinstance(data, str) else to_toml(data))
    return path


def to_toml(data: dict[str, Any]) -> str:
    """Just enough TOML for a definition (strings, integers, flat inline tables)."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int | float):
            return repr(v)
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, dict):
            return "{ " + ", ".join(f'"{k}" = {value(x)}' for k, x in v.items()) + " }"
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        raise TypeError(v)

    lines = [f"{k} = {value(v)}" for k, v in data.items() if k != "nodes"]
    for name, body in data.get("nodes", {}).items():
        lines.append(f'\n[nodes."{name}"]')
        lines.extend(f"{k} = {value(v)}" for k, v in body.items())
    return "\n".join(lines) + "\n"


# --- the deployed definition ------------------------------------------------------------


def test_the_deployed_definitions_load_and_fit_the_routes() -> None:
    catalog = process.load_dir(DEPLOYED, ROUTES)
    definition = catalog.get("order-fulfilment", 1)
    assert catalog.latest("order-fulfilment") is definition
    assert definition.start == "reserve"
    assert set(definition.nodes) == {"reserve", "charge", "ship", "release"}
    for node in definition.nodes.values():
        assert node.operation in ROUTES.get(node.route).operations
        assert node.deadline_seconds == 60


def test_the_helper_writes_the_same_definition() -> None:
    assert tomllib.loads(to_toml(ORDER)) == ORDER


@pytest.mark.parametrize(
    ("node", "outcome", "expected"),
    [
        ("reserve", "succeeded", "charge"),
        ("reserve", "failed", END_FAILED),
        ("charge", "succeeded", "ship"),
        ("charge", "failed", "release"),
        ("ship", "succeeded", END_COMPLETED),
        ("ship", "failed", END_FAILED),
        ("release", "succeeded", END_FAILED),
        ("release", "failed", END_FAILED),
    ],
)
def test_successor_branches_on_the_outcome(node: str, outcome: str, expected: str) -> None:
    """Reserve stock, charge the card, ship. A failed charge releases the reservation."""
    definition = process.parse(ORDER, ROUTES)
    assert definition.successor(node, outcome) == expected


@pytest.mark.parametrize("outcome", ["cancelled", "outcome_unknown", "accepted", ""])
def test_the_definition_names_no_successor_for_a_cancelled_or_unresolved_outcome(
    outcome: str,
) -> None:
    """Definition.successor is refused for any outcome but succeeded and failed:
    cancelled or unresolved work has no next node in a definition. (That a cancelled
    instance gets no successors after a success that won the race is checked through
    the workers in test_cancellation.py.)"""
    definition = process.parse(ORDER, ROUTES)
    with pytest.raises(ValueError, match="no successor"):
        definition.successor("charge", outcome)


def test_omitted_successors_end_the_instance() -> None:
    data = order()
    for key in ("on_succeeded", "on_failed", "deadline_seconds", "input"):
        data["nodes"]["ship"].pop(key)
    ship = process.parse(data, ROUTES).node("ship")
    assert (ship.on_succeeded, ship.on_failed) == (END_COMPLETED, END_FAILED)
    assert ship.deadline_seconds == 60
    assert ship.input == {}


# --- refusals ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (with_node("charge", route="billing"), "unknown route 'billing'"),
        (with_node("charge", operation="inventory.reserve"), "does not serve"),
        (with_node("charge", route="inventory"), "does not serve 'payments.charge'"),
        (with_node("charge", on_failed="refund"), "unknown node 'refund'"),
        (with_node("ship", on_succeeded="notify"), "unknown node 'notify'"),
        (order(start="begin"), "unknown node 'begin'"),
        (with_node("charge", url="http://payments.internal/charge"), "unknown keys"),
        (with_node("charge", queue="custody.commands.payments.v1"), "unknown keys"),
        (with_node("ship", on_success="@completed"), "unknown keys"),
    ],
    ids=[
        "unknown-route",
        "operation-not-served",
        "route-not-serving-it",
        "unknown-failure-successor",
        "unknown-success-successor",
        "unknown-start",
        "a-url",
        "a-queue",
        "misspelt-key",
    ],
)
def test_a_definition_that_does_not_fit_the_routes_is_refused(
    data: dict[str, Any], match: str
) -> None:
    """The documented ExecutorRoute is trusted deployment configuration, not a URL
    supplied by a process author."""
    with pytest.raises(DefinitionError, match=match):
        process.parse(data, ROUTES)


@pytest.mark.parametrize("key", ["name", "version", "start", "nodes"])
def test_a_definition_missing_a_top_level_key_is_refused(key: str) -> None:
    data = order()
    del data[key]
    with pytest.raises(DefinitionError, match=key):
        process.parse(data, ROUTES)


@pytest.mark.parametrize("key", ["route", "operation"])
def test_a_node_missing_its_route_or_operation_is_refused(key: str) -> None:
    data = order()
    del data["nodes"]["charge"][key]
    with pytest.raises(DefinitionError, match=f"'charge'.*{key}"):
        process.parse(data, ROUTES)


@pytest.mark.parametrize(
    "deadline",
    ["soon", "60", True, 1.5, 0, -5],
    ids=["word", "string", "bool", "fraction", "zero", "negative"],
)
def test_a_malformed_deadline_is_refused(tmp_path: Path, deadline: Any) -> None:
    """A process definition is malformed -> DefinitionError naming the file."""
    write(tmp_path, "order-fulfilment.v1.toml", with_node("ship", deadline_seconds=deadline))
    with pytest.raises(DefinitionError, match=r"order-fulfilment\.v1\.toml"):
        process.load_dir(tmp_path, ROUTES)


# --- the files --------------------------------------------------------------------------


def test_an_instance_can_pin_any_loaded_version(tmp_path: Path) -> None:
    """Process definitions are versioned files; an instance pins its definition
    version, and a newer file does not change an older version."""
    write(tmp_path, "order-fulfilment.v1.toml", ORDER)
    v2 = with_node("charge", on_failed="@failed")
    v2["version"] = 2
    write(tmp_path, "order-fulfilment.v2.toml", v2)
    catalog = process.load_dir(tmp_path, ROUTES)
    assert catalog.latest("order-fulfilment").version == 2
    assert catalog.get("order-fulfilment", 1).successor("charge", "failed") == "release"
    assert catalog.get("order-fulfilment", 2).successor("charge", "failed") == END_FAILED
    with pytest.raises(DefinitionError, match="version 3"):
        catalog.get("order-fulfilment", 3)
    with pytest.raises(DefinitionError, match="unknown process 'returns'"):
        catalog.latest("returns")


@pytest.mark.parametrize(
    ("filename", "top"),
    [
        ("order-fulfilment.v2.toml", {}),
        ("order-fulfilment.v1.toml", {"version": 2}),
        ("returns.v1.toml", {}),
        ("order-fulfilment.v1.toml", {"name": "returns"}),
    ],
    ids=["file-says-v2", "content-says-v2", "file-says-returns", "content-says-returns"],
)
def test_a_file_whose_name_and_version_differ_from_its_content_is_refused(
    tmp_path: Path, filename: str, top: dict[str, Any]
) -> None:
    write(tmp_path, filename, order(**top))
    with pytest.raises(DefinitionError, match="name/version differ"):
        process.load_dir(tmp_path, ROUTES)


@pytest.mark.parametrize(
    "filename",
    [
        "order-fulfilment.toml",
        "order-fulfilment.v0.toml",
        "Order.v1.toml",
        "order-fulfilment.v01.toml",
        "order-fulfilment.1.toml",
    ],
)
def test_a_file_not_named_name_v_version_toml_is_refused(tmp_path: Path, filename: str) -> None:
    write(tmp_path, filename, ORDER)
    with pytest.raises(DefinitionError, match=re.escape("expected <name>.v<version>.toml")):
        process.load_dir(tmp_path, ROUTES)


def test_a_definition_error_names_its_file(tmp_path: Path) -> None:
    write(tmp_path, "order-fulfilment.v1.toml", with_node("charge", route="billing"))
    with pytest.raises(DefinitionError, match=r"order-fulfilment\.v1\.toml.*billing"):
        process.load_dir(tmp_path, ROUTES)


def test_a_file_that_is_not_toml_is_refused(tmp_path: Path) -> None:
    write(tmp_path, "order-fulfilment.v1.toml", 'name = "order-fulfilment"\n[nodes.x\n')
    with pytest.raises(DefinitionError, match=r"order-fulfilment\.v1\.toml"):
        process.load_dir(tmp_path, ROUTES)


def test_an_empty_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DefinitionError, match="no process definitions"):
        process.load_dir(tmp_path, ROUTES)


# --- render_input -----------------------------------------------------------------------

INSTANCE_INPUT = {
    "order_id": "o-1",
    "sku": "SKU-1",
    "quantity": 2,
    "amount_cents": 1999,
    "address": {"city": "Lyon", "lines": ["1 rue X"]},
}
RESULTS = {"reserve": {"reservation_id": "r-9", "detail": {"warehouse": "w-3"}}}


def test_render_input_fills_the_deployed_charge_node() -> None:
    charge = process.parse(ORDER, ROUTES).node("charge")
    assert process.render_input(charge.input, INSTANCE_INPUT, RESULTS) == {
        "order_id": "o-1",
        "amount_cents": 1999,
        "reservation": "r-9",
        "flaky": None,  # "$input.flaky?": optional, absent → null
    }


def test_render_input_resolves_references_at_any_depth_and_keeps_literals() -> None:
    template = {
        "city": "$input.address.city",
        "address": "$input.address",
        "warehouse": "$result.reserve.detail.warehouse",
        "nested": {"list": ["$input.sku", 3, None, True, "plain", {"q": "$input.quantity"}]},
        "literal": "input.sku",
        "dollar": "$inputs.sku",
        "bare": "$input",
        "price": "$5",
    }
    assert process.render_input(template, INSTANCE_INPUT, RESULTS) == {
        "city": "Lyon",
        "address": {"city": "Lyon", "lines": ["1 rue X"]},
        "warehouse": "w-3",
        "nested": {"list": ["SKU-1", 3, None, True, "plain", {"q": 2}]},
        "literal": "input.sku",
        "dollar": "$inputs.sku",
        "bare": "$input",
        "price": "$5",
    }


def test_render_input_is_deterministic_and_leaves_its_arguments_alone() -> None:
    """Re-creating the same transition yields the same command: the same template and
    data give the same input, every time."""
    template = copy.deepcopy(ORDER["nodes"]["charge"]["input"])
    before = (copy.deepcopy(template), copy.deepcopy(INSTANCE_INPUT), copy.deepcopy(RESULTS))
    first = process.render_input(template, INSTANCE_INPUT, RESULTS)
    assert process.render_input(template, INSTANCE_INPUT, RESULTS) == first
    assert (template, INSTANCE_INPUT, RESULTS) == before


@pytest.mark.parametrize(
    ("reference", "missing"),
    [
        ("$input.coupon", "coupon"),
        ("$input.address.zip", "zip"),
        ("$input.order_id.x", "x"),
        ("$input.address.lines.0", "0"),
        ("$result.charge.payment_id", "charge"),
        ("$result.reserve.missing", "missing"),
        ("$input.", ""),
    ],
)
def test_a_reference_to_data_that_is_not_there_raises_input_error(
    reference: str, missing: str
) -> None:
    """An input template references data that is not there: InputError naming the
    reference, never a silent null."""
    with pytest.raises(InputError, match=re.escape(f"{reference}: '{missing}' not found")):
        process.render_input({"x": {"y": [reference]}}, INSTANCE_INPUT, RESULTS)


# --- retry policy -----------------------------------------------------------------------


def test_a_node_without_a_retry_policy_never_retries() -> None:
    assert process.parse(ORDER, ROUTES).node("reserve").retry is None


def test_a_retry_policy_allows_listed_errors_up_to_max_attempts() -> None:
    """Retry-safe creates the allowed new attempt: only for the error codes the node
    lists, and never beyond max_attempts attempts in all."""
    retry = {"max_attempts": 3, "backoff_seconds": 2.0, "on": ["busy", "rate_limited"]}
    policy = process.parse(with_node("charge", retry=retry), ROUTES).node("charge").retry
    assert policy is not None
    assert policy.allows(1, "busy")
    assert policy.allows(2, "rate_limited")
    assert not policy.allows(3, "busy")
    assert not policy.allows(1, "declined")
    assert not policy.allows(1, None)
    assert [policy.delay(n) for n in (1, 2, 3)] == [2.0, 4.0, 8.0]


def test_a_retry_policy_survives_the_file(tmp_path: Path) -> None:
    retry = {"max_attempts": 2, "backoff_seconds": 1, "on": ["busy"]}
    write(tmp_path, "order-fulfilment.v1.toml", with_node("ship", retry=retry))
    policy = process.load_dir(tmp_path, ROUTES).get("order-fulfilment", 1).node("ship").retry
    assert policy is not None
    assert policy.on == frozenset({"busy"})


@pytest.mark.parametrize(
    "retry",
    [
        "always",
        {"max_attempts": 3, "on": ["busy"], "jitter": True},
        {"max_attempts": 0, "on": ["busy"]},
        {"max_attempts": 3, "on": []},
        {"max_attempts": 3},
        {"max_attempts": 3, "backoff_seconds": -1, "on": ["busy"]},
    ],
    ids=["not-a-table", "unknown-key", "no-attempts", "no-codes", "codes-missing", "negative"],
)
def test_a_malformed_retry_policy_is_refused(retry: Any) -> None:
    with pytest.raises(DefinitionError, match=r"'charge'.*retry"):
        process.parse(with_node("charge", retry=retry), ROUTES)


@pytest.mark.parametrize(
    "retry",
    [{"max_attempts": "three", "on": ["busy"]}, {"backoff_seconds": "soon", "on": ["busy"]}],
    ids=["max_attempts", "backoff_seconds"],
)
def test_a_non_numeric_retry_setting_is_a_definition_error(retry: Any) -> None:
    with pytest.raises(DefinitionError, match="'charge'"):
        process.parse(with_node("charge", retry=retry), ROUTES)
