"""The folder is the architecture, and `lint-imports` (make lint) enforces it: each layer
imports only the layers below it (cli > harness > engine | participant | provision >
runtime > io > core > settings > errors), and only workers.io talks to Postgres or
RabbitMQ. These tests show the contracts can fail: a deliberate violation, planted in a
copy of the tree, breaks them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
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
