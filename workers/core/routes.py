"""Trusted executor routes (deployment configuration, ``deploy/routes.toml``).

A process author names a route; the route says who owns it, which broker user is
its principal, and which binding its commands travel on. Instances pin what they
used: a later file never redirects existing work.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from contracts.models import ExecutorRoute
from workers.errors import RouteConfigError as RouteConfigError  # under the custody root


@dataclass(frozen=True)
class Routes:
    by_name: Mapping[str, ExecutorRoute]

    def get(self, name: str) -> ExecutorRoute:
        try:
            return self.by_name[name]
        except KeyError:
            raise RouteConfigError(f"unknown route {name!r}") from None

    def owned_by(self, owner: str) -> list[ExecutorRoute]:
        return [r for r in self.by_name.values() if r.owner == owner]

    def bindings(self) -> list[str]:
        return sorted({r.binding for r in self.by_name.values()})


def parse(data: Mapping[str, object]) -> Routes:
    raw = data.get("routes")
    if not isinstance(raw, dict) or not raw:
        raise RouteConfigError("a routes file needs a non-empty [routes] table")
    routes: dict[str, ExecutorRoute] = {}
    for name, body in raw.items():
        if not isinstance(body, dict):
            raise RouteConfigError(f"route {name!r} must be a table")
        try:
            routes[name] = ExecutorRoute.model_validate(
                {**body, "name": name, "operations": tuple(body.get("operations", ()))}
            )
        except ValidationError as exc:
            raise RouteConfigError(f"route {name!r}: {exc}") from None
    return Routes(routes)


def load(path: Path) -> Routes:
    """The routes file, or one :class:`RouteConfigError` (a ``ConfigError``: the CLI
    prints its one line and exits 2) naming the file and what is wrong with it."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise RouteConfigError(
            f"routes file {path} does not exist (set CUSTODY_ROUTES_FILE)"
        ) from None
    except OSError as exc:
        raise RouteConfigError(f"routes file {path} cannot be read: {exc.strerror}") from None
    try:
        return parse(tomllib.loads(text))
    except tomllib.TOMLDecodeError as exc:
        raise RouteConfigError(f"routes file {path} is not valid TOML: {exc}") from None
    except RouteConfigError as exc:
        raise RouteConfigError(f"routes file {path}: {exc}") from None
