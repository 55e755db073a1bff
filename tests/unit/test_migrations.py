"""The migrations directory: ordered, named NNNN_name.sql, one file per number, and the
baseline first (no database: tests/integration/test_migrations.py applies them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers import errors, provision
from workers.io import migrations
from workers.settings import ROOT


def test_the_shipped_migrations_start_with_the_baseline_in_order() -> None:
    found = migrations.discover(ROOT / provision.MIGRATIONS_DIR)
    assert found[0].id == migrations.BASELINE
    assert [m.id for m in found] == sorted(m.id for m in found)
    # the repeatable definitions are not migrations: re-applied every time, they live beside
    for name in provision.REPEATABLE:
        assert (ROOT / name).is_file() and not (ROOT / "migrations" / name).exists()


def test_a_misnamed_or_a_doubly_numbered_file_is_a_configuration_error(tmp_path: Path) -> None:
    (tmp_path / "0001_baseline.sql").write_text("SELECT 1;")
    (tmp_path / "2_late.sql").write_text("SELECT 1;")
    with pytest.raises(errors.ConfigError, match=r"NNNN_name\.sql"):
        migrations.discover(tmp_path)
    (tmp_path / "2_late.sql").unlink()
    (tmp_path / "0001_again.sql").write_text("SELECT 1;")
    with pytest.raises(errors.ConfigError, match="used twice"):
        migrations.discover(tmp_path)


def test_states_say_applied_pending_or_modified(tmp_path: Path) -> None:
    for name in ("0001_baseline.sql", "0002_add.sql", "0003_more.sql"):
        (tmp_path / name).write_text(f"-- {name}\n")
    found = migrations.discover(tmp_path)
    applied = {"0001_baseline": (found[0].checksum, "t1"), "0002_add": ("other", "t2")}
    got = [(s.id, s.state) for s in migrations.states(found, applied)]
    assert got == [("0001_baseline", "applied"), ("0002_add", "modified"), ("0003_more", "pending")]
