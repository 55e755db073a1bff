"""Operator authorization (``deploy/operators.toml``): who may do what, per tenant.

Parsed and checked here (pure); enforced in the database, which holds a copy
(``custody.operators``, synced by ``custody db migrate`` / ``custody operators apply``):
``custody.refusal`` in ``transitions.sql`` decides every command, and row-level
security limits what each operator's login reads to its tenants."""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from workers.errors import ConfigError

ACTIONS: Final = frozenset(
    {"reconcile", "retry-safe", "pause", "resume", "cancel", "cancel-start", "restore", "replay"}
)
ALL_TENANTS: Final = "*"  # and the only scope that may act globally


@dataclass(frozen=True)
class Grant:
    actions: frozenset[str]
    tenants: frozenset[str]


@dataclass(frozen=True)
class Roles:
    operators: Mapping[str, Grant]


def parse(data: Mapping[str, object]) -> Roles:
    raw = data.get("operators")
    if not isinstance(raw, dict):
        raise ConfigError("an operators file needs an [operators] table")
    operators: dict[str, Grant] = {}
    for name, body in raw.items():
        if not isinstance(body, dict) or set(body) - {"actions", "tenants"}:
            raise ConfigError(f"operator {name!r}: only actions and tenants are allowed")
        actions = frozenset(body.get("actions", ()))
        unknown = actions - ACTIONS
        if unknown:
            raise ConfigError(f"operator {name!r}: unknown actions {sorted(unknown)}")
        operators[name] = Grant(actions, frozenset(body.get("tenants", ())))
    return Roles(operators)


def load(path: Path) -> Roles:
    try:
        return parse(tomllib.loads(path.read_text()))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
