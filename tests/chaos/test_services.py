"""The harness's private services start wherever the checkout lives.

CI checks the repository out at a longer path than a session does; a Unix socket
path is limited to 107 bytes, and a private Postgres whose socket lived under the
work dir failed to start there (``pg-participants`` did, ``pg-engine`` did not).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import psycopg
import pytest

from chaos.services import Postgres, ServiceError
from tests.chaos.support import workdir


@pytest.mark.chaos
@pytest.mark.timeout(120)
def test_a_private_postgres_starts_under_a_work_dir_deeper_than_a_socket_path_allows(
    tmp_path: Path,
) -> None:
    deep = workdir(tmp_path.name) / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    pg = Postgres("pg-participants", deep, 21090)

    async def run() -> None:
        await pg.init()
        try:
            await pg.start()
            with psycopg.connect(pg.dsn(), connect_timeout=5) as conn:
                assert conn.execute("select 1").fetchone() == (1,)
        finally:
            await pg.stop("immediate")

    assert len(str(deep)) > 120
    asyncio.run(run())


@pytest.mark.chaos
@pytest.mark.timeout(120)
def test_a_private_postgres_that_cannot_start_says_why(tmp_path: Path) -> None:
    """The error carries the server's own log, not only "Examine the log output"."""
    root = workdir(tmp_path.name)
    pg = Postgres("pg-broken", root, 21091)

    async def run() -> None:
        await pg.init()
        with (pg.data / "postgresql.conf").open("a") as conf:
            conf.write("\nshared_buffers = 'not a size'\n")
        await pg.start()

    with pytest.raises(ServiceError, match="shared_buffers"):
        asyncio.run(run())
