"""Operator authorization (``deploy/operators.toml``): who may do what, per tenant. Pure."""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from workers.errors import ConfigError

ACTIONS: Final = frozenset(
    {"reconcile", "retry-safe", "pause", "resume", "cancel", "cancel-start", "restore"}
)
ALL_TENANTS: Final = "*"
MIN_REASON: Final = 8


@dataclass(frozen=True)
class Grant:
    actions: frozenset[str]
    tenants: frozenset[str]


@dataclass(frozen=True)
class Roles:
    operators: Mapping[str, Grant]

    def refusal(self, actor: str, action: str, tenant: str | None, reason: str) -> str | None:
        """Why ``actor`` may not do ``action`` on ``tenant`` (None: global), or None."""
        if len(reason.strip()) < MIN_REASON:
            return f"a reason of at least {MIN_REASON} characters is required"
        grant = self.operators.get(actor)
        if grant is None:
            return f"{actor!r} is not an operator"
        if action not in grant.actions:
            return f"{actor!r} may not {action}"
        if ALL_TENANTS in grant.tenants:
            return None
        if tenant is None:
            return f"{actor!r} may not {action} for every tenant"
        if tenant not in grant.tenants:
            return f"{actor!r} may not {action} for tenant {tenant!r}"
        return None


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
