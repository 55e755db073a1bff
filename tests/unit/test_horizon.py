"""The archive horizon (workers/core/horizon.py): a finished instance leaves the hot
tables only after every row that refers to it has. The receipts that deduplicate its
operations are kept for CUSTODY_RETENTION_S, so the archive horizon is never shorter."""

from __future__ import annotations

import pytest

from workers.core import horizon, process
from workers.errors import ConfigError
from workers.settings import Settings

NO_DEFINITIONS = process.Catalog(definitions={})
DAY = 86400.0


def test_the_archive_horizon_is_the_retention_horizon_unless_set() -> None:
    assert horizon.archive_after(Settings.from_env({})) == 30 * DAY
    settings = Settings.from_env({"CUSTODY_RETENTION_S": str(40 * DAY)})
    assert horizon.archive_after(settings) == 40 * DAY
    settings = Settings.from_env({"CUSTODY_ARCHIVE_AFTER_S": str(90 * DAY)})
    assert horizon.archive_after(settings) == 90 * DAY
    horizon.check(settings, NO_DEFINITIONS)


@pytest.mark.parametrize("after", [str(29 * DAY), "-1"])
def test_start_up_refuses_an_archive_horizon_shorter_than_the_retention_horizon(
    after: str,
) -> None:
    settings = Settings.from_env({"CUSTODY_ARCHIVE_AFTER_S": after})
    with pytest.raises(ConfigError) as refused:
        horizon.check(settings, NO_DEFINITIONS)
    assert f"CUSTODY_ARCHIVE_AFTER_S={float(after):g}s is shorter than CUSTODY_RETENTION_S" in (
        str(refused.value)
    )
    assert "(2.592e+06s)" in str(refused.value)


def test_an_archive_horizon_equal_to_the_retention_horizon_is_accepted() -> None:
    settings = Settings.from_env({"CUSTODY_ARCHIVE_AFTER_S": str(30 * DAY)})
    horizon.check(settings, NO_DEFINITIONS)
