"""Versioned process definitions and the pure decisions over them.

A definition (``deploy/processes/<name>.v<version>.toml``) is a graph of nodes; each
node is one operation on a named route, with an input template and the next node
for each outcome. Instances pin the definition version they started with.

Input templates are JSON objects whose string values may reference data:
``"$input.a.b"`` (the instance's input) or ``"$result.<node>.a"`` (the result of a
node that succeeded earlier); a trailing ``?`` makes a missing path null instead of
an error. Anything else is taken literally.
"""

from __future__ import annotations

import datetime as dt
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, get_args

from pydantic import StringConstraints, TypeAdapter, ValidationError

from contracts import digest
from contracts.models import Attempt, Name
from workers.core import routes
from workers.core.routes import Routes
from workers.errors import DefinitionError as DefinitionError  # under the custody root
from workers.errors import InputError as InputError
from workers.settings import Settings

END_COMPLETED: Final = "@completed"
END_FAILED: Final = "@failed"
_FILE = re.compile(r"^(?P<name>[a-z0-9][a-z0-9_.\-]*)\.v(?P<version>[1-9][0-9]*)\.toml$")
# What activation later feeds to the contracts is checked here, with the contracts' own
# validators, so a bad file is refused at load instead of failing every activation.
_NAME: Final = TypeAdapter(Name)
_NAME_PATTERN: Final = next(
    m.pattern for m in get_args(Name)[1:] if isinstance(m, StringConstraints)
)
_MAX_ATTEMPTS: Final = TypeAdapter(Attempt).json_schema()["maximum"]
_MAX_VERSION: Final = 2**31 - 1  # instances.process_version is an integer column
_NODE_KEYS: Final = frozenset(
    {"route", "operation", "input", "on_succeeded", "on_failed", "deadline_seconds", "retry"}
)


@dataclass(frozen=True)
class RetryPolicy:
    """Another attempt is allowed only after an authoritative failure with effect
    ``none`` whose error code is listed, up to ``max_attempts`` attempts in all."""

    max_attempts: int
    backoff_seconds: float
    on: frozenset[str]

    def allows(self, attempt: int, error_code: str | None) -> bool:
        return attempt < self.max_attempts and error_code in self.on

    def delay(self, attempt: int) -> float:
        return float(self.backoff_seconds * 2 ** (attempt - 1))


@dataclass(frozen=True)
class Node:
    name: str
    route: str
    operation: str
    input: Mapping[str, Any]
    on_succeeded: str
    on_failed: str
    deadline_seconds: int
    retry: RetryPolicy | None = None


@dataclass(frozen=True)
class Definition:
    name: str
    version: int
    start: str
    nodes: Mapping[str, Node]

    def node(self, name: str) -> Node:
        return self.nodes[name]

    def successor(self, node: str, outcome: str) -> str:
        """The next node (or an ``@`` end marker) after ``node`` ended in ``outcome``."""
        n = self.nodes[node]
        if outcome == "succeeded":
            return n.on_succeeded
        if outcome == "failed":
            return n.on_failed
        raise ValueError(f"no successor for outcome {outcome!r}")


@dataclass(frozen=True)
class Catalog:
    """Every loaded version of every process."""

    definitions: Mapping[tuple[str, int], Definition]

    def get(self, name: str, version: int) -> Definition:
        try:
            return self.definitions[(name, version)]
        except KeyError:
            raise DefinitionError(f"unknown process {name!r} version {version}") from None

    def latest(self, name: str) -> Definition:
        versions = [v for (n, v) in self.definitions if n == name]
        if not versions:
            raise DefinitionError(f"unknown process {name!r}")
        return self.definitions[(name, max(versions))]


def parse(data: Mapping[str, Any], routes: Routes) -> Definition:
    try:
        name, version, start = data["name"], data["version"], data["start"]
        raw_nodes = data["nodes"]
    except KeyError as exc:
        raise DefinitionError(f"missing key {exc}") from None
    _check_name("process", "name", name)
    if (
        isinstance(version, bool)
        or not isinstance(version, int)
        or not 1 <= version <= _MAX_VERSION
    ):
        raise DefinitionError(f"version must be an integer >= 1, not {version!r}")
    if not isinstance(raw_nodes, dict) or not raw_nodes:
        raise DefinitionError("nodes must be a non-empty table of nodes")
    nodes: dict[str, Node] = {}
    for node_name, body in raw_nodes.items():
        _check_name(f"node {node_name!r}", "name", node_name)
        if not isinstance(body, dict):
            raise DefinitionError(f"node {node_name!r}: must be a table")
        unknown = set(body) - _NODE_KEYS
        if unknown:
            raise DefinitionError(f"node {node_name!r}: unknown keys {sorted(unknown)}")
        try:
            node = Node(
                name=node_name,
                route=_string(node_name, "route", body["route"]),
                operation=body["operation"],
                input=_template(node_name, body.get("input", {})),
                on_succeeded=_string(
                    node_name, "on_succeeded", body.get("on_succeeded", END_COMPLETED)
                ),
                on_failed=_string(node_name, "on_failed", body.get("on_failed", END_FAILED)),
                deadline_seconds=_positive_int(
                    node_name, "deadline_seconds", body.get("deadline_seconds", 60)
                ),
                retry=_retry(node_name, body.get("retry")),
            )
        except KeyError as exc:
            raise DefinitionError(f"node {node_name!r}: missing {exc}") from None
        _check_name(f"node {node_name!r}", "operation", node.operation)
        route = routes.by_name.get(node.route)
        if route is None:
            raise DefinitionError(f"node {node_name!r}: unknown route {node.route!r}")
        if node.operation not in route.operations:
            raise DefinitionError(
                f"node {node_name!r}: route {node.route!r} does not serve {node.operation!r}"
            )
        nodes[node_name] = node
    if not isinstance(start, str):
        raise DefinitionError(f"start must be the name of a node, not {start!r}")
    if start in (END_COMPLETED, END_FAILED):
        raise DefinitionError(f"start must be the name of a node, not the end marker {start!r}")
    targets = (
        {start} | {n.on_succeeded for n in nodes.values()} | {n.on_failed for n in nodes.values()}
    )
    for target in sorted(targets):
        if target not in nodes and target not in (END_COMPLETED, END_FAILED):
            raise DefinitionError(f"{name} v{version}: unknown node {target!r}")
    return Definition(name=name, version=version, start=start, nodes=nodes)


def _check_name(where: str, field: str, value: Any) -> None:
    """``value`` must be a contract ``Name`` (it becomes Lineage.process, Lineage.node or
    the command's operation)."""
    try:
        _NAME.validate_python(value, strict=True)
    except ValidationError:
        raise DefinitionError(
            f"{where}: {field} must match {_NAME_PATTERN} (a contract Name), not {value!r}"
        ) from None


def _string(node: str, key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise DefinitionError(f"node {node!r}: {key} must be a string, not {value!r}")
    return value


_TOML_TYPES: Final = (
    (float, "a TOML float"),
    (dt.datetime, "a TOML datetime"),  # before date: a datetime is a date
    (dt.date, "a TOML date"),
    (dt.time, "a TOML time"),
)


def _template(node: str, template: Any) -> Mapping[str, Any]:
    """An input template whose literals are all in the digest's domain (the rendered
    input is digested; ``$input.``/``$result.`` references are strings, and fine)."""
    if not isinstance(template, dict):
        raise DefinitionError(f"node {node!r}: input must be a table, not {template!r}")
    found = _outside_domain(template, "input", depth=1)  # as contracts.models.JsonObject
    if found is not None:
        path, value, exc = found
        what = next((text for kind, text in _TOML_TYPES if isinstance(value, kind)), "a value")
        hint = "; write it as a quoted string" if isinstance(value, dt.date | dt.time) else ""
        raise DefinitionError(
            f"node {node!r}: {path}: {what} is outside the digest's domain ({exc}{hint})"
        )
    return template


def _outside_domain(
    value: Any, path: str, depth: int
) -> tuple[str, Any, digest.CanonicalFormError] | None:
    """The innermost path at which the digest's own check refuses ``value``, if any."""
    try:
        digest.check_json_value(value, depth)
    except digest.CanonicalFormError as exc:
        children: Any = ()
        if isinstance(value, dict):
            children = ((_key_path(path, k), v) for k, v in value.items())
        elif isinstance(value, list):
            children = ((f"{path}[{i}]", v) for i, v in enumerate(value))
        for child_path, child in children:
            found = _outside_domain(child, child_path, depth + 1)
            if found is not None:
                return found
        return path, value, exc
    return None


def _key_path(path: str, key: Any) -> str:
    if isinstance(key, str) and re.fullmatch(r"[A-Za-z0-9_\-]+", key):
        return f"{path}.{key}"
    return f"{path}[{key!r}]"


def _positive_int(node: str, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DefinitionError(f"node {node!r}: {key} must be a positive integer, not {value!r}")
    return value


def _retry(node: str, raw: Any) -> RetryPolicy | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) - {"max_attempts", "backoff_seconds", "on"}:
        raise DefinitionError(f"node {node!r}: retry takes max_attempts, backoff_seconds, on")
    backoff = raw.get("backoff_seconds", 1.0)
    codes = raw.get("on", ())
    if (
        isinstance(backoff, bool)
        or not isinstance(backoff, (int, float))
        or not isinstance(codes, list)
        or not all(isinstance(c, str) for c in codes)
    ):
        raise DefinitionError(
            f"node {node!r}: retry.backoff_seconds is a number, retry.on a list of error codes"
        )
    max_attempts = _positive_int(node, "retry.max_attempts", raw.get("max_attempts", 1))
    if max_attempts > _MAX_ATTEMPTS:
        raise DefinitionError(
            f"node {node!r}: retry.max_attempts must be at most {_MAX_ATTEMPTS} (a contract "
            f"Attempt), not {max_attempts}"
        )
    policy = RetryPolicy(
        max_attempts=max_attempts,
        backoff_seconds=float(backoff),
        on=frozenset(codes),
    )
    if policy.backoff_seconds < 0 or not policy.on:
        raise DefinitionError(f"node {node!r}: retry needs max_attempts >= 1 and error codes")
    return policy


def load_dir(path: Path, routes: Routes) -> Catalog:
    definitions: dict[tuple[str, int], Definition] = {}
    for file in sorted(path.glob("*.toml")):
        match = _FILE.match(file.name)
        if not match:
            raise DefinitionError(f"{file.name}: expected <name>.v<version>.toml")
        try:
            definition = parse(tomllib.loads(file.read_text()), routes)
        except (OSError, tomllib.TOMLDecodeError, DefinitionError) as exc:
            raise DefinitionError(f"{file}: {exc}") from None
        if (definition.name, definition.version) != (
            match["name"],
            int(match["version"]),
        ):
            raise DefinitionError(f"{file.name}: name/version differ from the file name")
        definitions[(definition.name, definition.version)] = definition
    if not definitions:
        raise DefinitionError(f"no process definitions in {path}")
    return Catalog(definitions)


def render_input(
    template: Mapping[str, Any], instance_input: Mapping[str, Any], results: Mapping[str, Any]
) -> dict[str, Any]:
    """The operation input for a node, from its template, deterministically."""

    def resolve(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: resolve(v) for k, v in value.items()}
        if isinstance(value, list):
            return [resolve(v) for v in value]
        if isinstance(value, str) and value.startswith(("$input.", "$result.")):
            optional = value.endswith("?")
            head, *path = value[1:].rstrip("?").split(".")
            current: Any = instance_input if head == "input" else results
            for key in path:
                if not isinstance(current, dict) or key not in current:
                    if optional:
                        return None
                    raise InputError(f"{value}: {key!r} not found")
                current = current[key]
            return current
        return value

    return {k: resolve(v) for k, v in template.items()}


def load_config(settings: Settings) -> tuple[Routes, Catalog]:
    """The routes file and every process definition of ``settings``, checked together."""
    table = routes.load(Path(settings.routes_file))
    return table, load_dir(Path(settings.processes_dir), table)
