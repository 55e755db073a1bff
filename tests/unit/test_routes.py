"""Trusted executor routes (DESIGN §5, workers/core/routes.py).

"The documented ExecutorRoute is trusted deployment configuration, not a URL supplied
by a process author." A malformed routes file is refused at start-up with
RouteConfigError, never half-loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from contracts.models import ExecutorRoute
from workers.core import routes
from workers.core.routes import RouteConfigError

ROOT = Path(__file__).resolve().parents[2]
DEPLOYED = ROOT / "deploy" / "routes.toml"

INVENTORY = """
[routes.inventory]
owner = "inventory"
principal = "custody-inventory"
binding = "inventory.v1"
operations = ["inventory.reserve", "inventory.release"]
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "routes.toml"
    path.write_text(text)
    return path


def test_the_deployed_routes_file_loads() -> None:
    loaded = routes.load(DEPLOYED)
    assert set(loaded.by_name) == {"inventory", "payments", "shipping"}
    inventory = loaded.get("inventory")
    assert inventory == ExecutorRoute(
        name="inventory",
        owner="inventory",
        principal="custody-inventory",
        binding="inventory.v1",
        operations=("inventory.reserve", "inventory.release"),
    )


def test_a_route_says_who_owns_it_its_principal_and_its_binding() -> None:
    loaded = routes.load(DEPLOYED)
    assert [r.name for r in loaded.owned_by("payments")] == ["payments"]
    assert loaded.owned_by("nobody") == []
    assert loaded.bindings() == ["inventory.v1", "payments.v1", "shipping.v1"]
    for route in loaded.by_name.values():
        assert route.principal == f"custody-{route.owner}"


def test_an_unknown_route_is_refused() -> None:
    """A process author names a route; a name that is not configured is an error,
    never a guess."""
    with pytest.raises(RouteConfigError, match="unknown route 'billing'"):
        routes.load(DEPLOYED).get("billing")


def test_the_route_name_is_the_table_name(tmp_path: Path) -> None:
    text = INVENTORY.replace('owner = "inventory"', 'name = "payments"\nowner = "inventory"')
    assert routes.load(write(tmp_path, text)).get("inventory").name == "inventory"


def test_one_command_queue_per_route_binding() -> None:
    """One command queue per route binding: routes sharing a binding list it once."""
    data: dict[str, Any] = {
        "routes": {
            "a": {"owner": "o", "principal": "p", "binding": "b.v1", "operations": ["x"]},
            "b": {"owner": "o", "principal": "p", "binding": "b.v1", "operations": ["y"]},
        }
    }
    assert routes.parse(data).bindings() == ["b.v1"]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "non-empty"),
        ("[routes]\n", "non-empty"),
        ("routes = 1\n", "non-empty"),
        ("[routes]\ninventory = 1\n", "must be a table"),
        (INVENTORY + 'url = "http://inventory.internal/run"\n', "inventory"),
        (INVENTORY.replace('owner = "inventory"\n', ""), "owner"),
        (INVENTORY.replace('principal = "custody-inventory"\n', ""), "principal"),
        (INVENTORY.replace('binding = "inventory.v1"\n', ""), "binding"),
        (INVENTORY.replace('"inventory.v1"', '"Inventory V1"'), "binding"),
        (INVENTORY.replace("[routes.inventory]", "[routes.Inventory]"), "Inventory"),
        (
            INVENTORY.replace(
                'operations = ["inventory.reserve", "inventory.release"]',
                'operations = "inventory.reserve"',
            ),
            "operations",
        ),
        (INVENTORY.replace('owner = "inventory"', "owner = 7"), "owner"),
    ],
    ids=[
        "empty-file",
        "empty-table",
        "not-a-table",
        "route-not-a-table",
        "unknown-key-url",
        "missing-owner",
        "missing-principal",
        "missing-binding",
        "bad-binding",
        "bad-name",
        "operations-not-a-list",
        "owner-not-a-string",
    ],
)
def test_a_malformed_routes_file_is_refused(tmp_path: Path, text: str, match: str) -> None:
    """The route is trusted configuration: anything it does not declare (a URL, a
    queue) is refused rather than ignored."""
    with pytest.raises(RouteConfigError, match=match):
        routes.load(write(tmp_path, text))


def test_a_missing_routes_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RouteConfigError, match=r"missing\.toml"):
        routes.load(tmp_path / "missing.toml")


def test_a_routes_file_that_is_not_toml_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "[routes.inventory\nowner = ")
    with pytest.raises(RouteConfigError, match=r"routes\.toml"):
        routes.load(path)


def test_a_loaded_route_cannot_be_mutated_in_place() -> None:
    """A loaded ExecutorRoute object is immutable. (That instances pin their route and a
    changed file redirects nothing is checked through the workers in
    test_routes_and_topology.py and test_seed_rules.py.)"""
    route = routes.load(DEPLOYED).get("inventory")
    with pytest.raises(ValueError, match="frozen"):
        route.binding = "elsewhere.v1"  # type: ignore[misc]
