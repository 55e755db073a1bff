"""Reading deploy/: the files the checks look at, and every PromQL expression in them
with where it is (so a problem names its file and object)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from workers.core import routes

# Grafana's built-in range variables, replaced by a literal duration for parsing.
GRAFANA_MACROS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


@dataclass(frozen=True)
class Expression:
    """One PromQL expression and where it is written."""

    where: str
    text: str


@dataclass(frozen=True)
class Deploy:
    """The deploy/ tree under ``root`` (the repository, or a test's altered copy)."""

    root: Path

    @property
    def deploy(self) -> Path:
        return self.root / "deploy"

    @property
    def k8s_base(self) -> Path:
        return self.deploy / "k8s" / "base"

    @property
    def alerts_file(self) -> Path:
        return self.deploy / "prometheus" / "alerts.yaml"

    @property
    def definitions_file(self) -> Path:
        return self.deploy / "rabbitmq" / "definitions.json"

    def rel(self, path: Path) -> str:
        return str(path.relative_to(self.root))

    @cached_property
    def routes(self) -> routes.Routes:
        return routes.load(self.deploy / "routes.toml")

    def alerts(self) -> list[dict[str, Any]]:
        groups = yaml.safe_load(self.alerts_file.read_text())["groups"]
        return [rule for group in groups for rule in group["rules"]]

    def dashboards(self) -> dict[Path, dict[str, Any]]:
        folder = self.deploy / "grafana" / "dashboards"
        return {p: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}

    def k8s_docs(self) -> Iterator[tuple[Path, dict[str, Any]]]:
        """Every object of the base manifests, with its file."""
        for path in sorted(self.k8s_base.glob("*.yaml")):
            if path.name in ("kustomization.yaml", "kustomizeconfig.yaml"):
                continue
            for doc in yaml.safe_load_all(path.read_text()):
                if doc:
                    yield path, doc

    def scaled_objects(self) -> list[tuple[Path, dict[str, Any]]]:
        return [(p, d) for p, d in self.k8s_docs() if d.get("kind") == "ScaledObject"]

    def definitions(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.definitions_file.read_text())
        return data

    def expressions(self) -> list[Expression]:
        """Every PromQL expression: each alert's, each dashboard target's (Grafana
        macros replaced), each KEDA prometheus trigger's query."""
        out = [
            Expression(f"{self.rel(self.alerts_file)}: alert {r.get('alert')}", str(r["expr"]))
            for r in self.alerts()
        ]
        for path, dashboard in self.dashboards().items():
            for panel in walk_panels(dashboard.get("panels", [])):
                for target in panel.get("targets", []):
                    expr = target.get("expr")
                    if expr:
                        where = (
                            f"{self.rel(path)}: panel {panel.get('id')} "
                            f"({panel.get('title')!r}) target {target.get('refId')}"
                        )
                        out.append(Expression(where, grafana_expr(str(expr))))
        for path, so in self.scaled_objects():
            for trigger in so.get("spec", {}).get("triggers", []):
                if trigger.get("type") == "prometheus":
                    where = (
                        f"{self.rel(path)}: ScaledObject {so['metadata']['name']} "
                        f"trigger {trigger.get('name')}"
                    )
                    out.append(Expression(where, str(trigger["metadata"].get("query", ""))))
        return out


def walk_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from walk_panels(panel.get("panels", []))


def grafana_expr(expr: str) -> str:
    for macro, value in GRAFANA_MACROS.items():
        expr = expr.replace(macro, value)
    return re.sub(r"\$\{?__\w+\}?", "1m", expr)  # any other built-in interval variable
