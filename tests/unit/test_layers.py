"""The folder is the architecture, and `lint-imports` (make lint) enforces it: each layer
imports only the layers below it (cli > harness > engine | participant | provision >
runtime > io > core > settings > errors), and only workers.io talks to Postgres or
RabbitMQ. These tests show the contracts can fail: a deliberate violation, planted in a
copy of the tree, breaks them. The contracts name packages, not lists of modules, so
they also hold for workers' own __init__ and for a module added later."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.settings import ROOT

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _copy(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    for package in ("workers", "contracts", "participants"):
        shutil.copytree(
            ROOT / package, tree / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    return tree


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _plant(tree: Path, module: str, line: str) -> None:
    path = tree / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = path.with_suffix("") / "__init__.py"
    text = path.read_text()
    head, sep, rest = text.partition("from __future__ import annotations\n")
    path.write_text(head + sep + line + "\n" + rest if sep else line + "\n" + text)


def test_the_tree_as_it_is_keeps_every_contract(tmp_path: Path) -> None:
    result = _lint(_copy(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("workers.engine.restore", "import psycopg", "only workers.io talks to Postgres"),
        ("workers", "import psycopg", "only workers.io talks to Postgres"),
        ("workers.runtime.supervisor", "import aio_pika", "only workers.io talks to Postgres"),
        ("workers.harness.fleet", "import psycopg", "only workers.io talks to Postgres"),
        ("workers.core.lifecycle", "import psycopg", "pure decisions import no I/O"),
        ("workers.core.validation", "from workers.io import db", "layers"),
        ("workers.io.db", "from workers.runtime import metrics", "layers"),
        ("workers.engine.committer", "from workers.participant import service", "layers"),
        ("workers.participant.service", "from workers.engine import receipts", "layers"),
        ("workers.runtime.outbox", "from workers.engine import transitions", "layers"),
        ("workers.harness.demo", "from workers import cli", "layers"),
    ],
)
def test_a_planted_violation_breaks_its_contract(
    tmp_path: Path, module: str, line: str, contract: str
) -> None:
    """`import psycopg` outside workers/io, or an import of a higher layer (or of a sibling
    package of the same layer), fails lint."""
    tree = _copy(tmp_path)
    _plant(tree, module, line)
    result = _lint(tree)
    assert result.returncode != 0
    broken = result.stdout[result.stdout.index("Broken contracts") :]
    assert contract in broken, result.stdout


def test_a_new_module_needs_a_layer_and_stays_off_the_io_libraries(tmp_path: Path) -> None:
    """The layers contract is exhaustive: a module added directly under workers/ belongs
    to no layer until pyproject.toml gives it one; outside workers/io it may not import
    psycopg either."""
    tree = _copy(tmp_path)
    (tree / "workers" / "newcomer.py").write_text("import psycopg\n")
    result = _lint(tree)
    assert result.returncode != 0
    broken = result.stdout[result.stdout.index("Broken contracts") :]
    assert "are not listed as layers" in broken and "workers.newcomer" in broken, result.stdout
    assert "only workers.io talks to Postgres" in broken, result.stdout


# Private names ----------------------------------------------------------------------
# The other half of the layout rule, which lint-imports cannot see: no module uses a
# private name of another package.

SCANNED = ("workers", "bench", "tests", "participants", "chaos", "contracts")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _names_used(tree: ast.Module, here: str, known: set[str]) -> Iterator[tuple[int, str, str]]:
    """(line, module, name) for each name this module takes from a project module:
    ``from m import x``, ``m.x`` and ``getattr(m, "x")`` (also setattr, monkeypatch's)
    on a name an import bound to a project module. Instance attributes are not seen."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    top = alias.name.partition(".")[0]
                    bound[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                base = here.split(".")[: here.count(".") + 2 - node.level]
                source = ".".join([*base, *([node.module] if node.module else [])])
            if source in known:
                for alias in node.names:
                    yield node.lineno, source, alias.name
                    if f"{source}.{alias.name}" in known:
                        bound[alias.asname or alias.name] = f"{source}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain: list[str] = []
            inner: ast.expr = node
            while isinstance(inner, ast.Attribute):
                chain.insert(0, inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id in bound:
                target = bound[inner.id]
                for attr in chain:
                    if f"{target}.{attr}" not in known:
                        yield node.lineno, target, attr
                        break
                    target = f"{target}.{attr}"
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            first, second = node.args[:2]
            if (
                isinstance(first, ast.Name)
                and first.id in bound
                and isinstance(second, ast.Constant)
                and isinstance(second.value, str)
            ):
                yield node.lineno, bound[first.id], second.value


def private_uses(root: Path) -> list[str]:
    """Every use of a private name (``_x``; ``__x__`` is not private) of a project module
    from outside that module's package. A package is a folder: its modules may share
    their private names (tests/integration is one package, tests/unit another)."""
    modules: dict[str, Path] = {}
    for top in SCANNED:
        for path in sorted((root / top).rglob("*.py")):
            if "__pycache__" not in path.parts:
                parts = path.relative_to(root).with_suffix("").parts
                modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    package = {
        m: m if path.name == "__init__.py" else m.rpartition(".")[0] for m, path in modules.items()
    }
    known = set(modules) | set(package.values())
    found: set[str] = set()
    for module, path in modules.items():
        here = package[module]
        for line, target, name in _names_used(ast.parse(path.read_text()), here, known):
            if _private(name) and package.get(target, target) != here:
                found.add(f"{path.relative_to(root)}:{line}: {target}.{name}")
    return sorted(found)


def test_no_module_uses_a_private_name_of_another_package() -> None:
    assert private_uses(ROOT) == []


def test_the_private_name_scan_sees_imports_attributes_and_getattr(tmp_path: Path) -> None:
    files = {
        "workers/io/db.py": "_pool = None\n",
        "workers/io/broker.py": (
            "from workers.io import db\nfrom . import db as same\nprint(db._pool, same._pool)\n"
        ),
        "workers/core/a.py": "from workers.io.db import _pool\n",
        "tests/unit/test_a.py": (
            "import workers.io.db\n"
            "from workers.io import db as d\n"
            "class C:\n"
            "    _x = 1\n"
            "print(workers.io.db._pool)\n"
            "print(getattr(d, '_pool'), d.__name__, C()._x)\n"
        ),
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert private_uses(tmp_path) == [
        "tests/unit/test_a.py:5: workers.io.db._pool",
        "tests/unit/test_a.py:6: workers.io.db._pool",
        "workers/core/a.py:1: workers.io.db._pool",
    ]
