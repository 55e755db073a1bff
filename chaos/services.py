"""The harness's own Postgres clusters and RabbitMQ node(s), never the shared ones.

Everything lives under the run's work directory (``.chaos/`` by default): data
directories (Postgres listens on TCP only), logs, the Erlang cookie and a private epmd port, so
that no command here can reach the shared ``rabbit@<host>`` node or the shared
Postgres on 5432. Every process started here is stopped by :meth:`stop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

PG_BIN = Path(shutil.which("pg_ctl") or "/usr/local/bin/pg_ctl").parent
RABBIT_BIN = Path("/usr/lib/rabbitmq/bin")
COOKIE = "CUSTODYCHAOSCOOKIE"


class ServiceError(RuntimeError):
    pass


async def run(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120.0, check: bool = True
) -> tuple[int, str]:
    """Run a command (asynchronously: the fault proxy shares this event loop)."""
    proc = await asyncio.create_subprocess_exec(
        *args,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise ServiceError(f"timed out after {timeout}s: {' '.join(args)}") from None
    text = out.decode(errors="replace")
    if check and proc.returncode != 0:
        raise ServiceError(f"{' '.join(args)} exited {proc.returncode}: {text[-2000:]}")
    return proc.returncode or 0, text


def _as_postgres(args: list[str]) -> list[str]:
    """Postgres refuses to run as root: run its tools as the ``postgres`` user then."""
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *args]
    return args


@dataclass
class Postgres:
    """A private cluster: trust auth, its own port, TCP only."""

    name: str
    root: Path
    port: int

    @property
    def data(self) -> Path:
        return self.root / self.name / "data"

    @property
    def log(self) -> Path:
        return self.root / self.name / "postgres.log"

    def dsn(self, dbname: str = "postgres", port: int | None = None) -> str:
        return f"postgresql://postgres@127.0.0.1:{port or self.port}/{dbname}"

    async def init(self) -> None:
        base = self.root / self.name
        if base.exists():
            await self.stop_quietly()
            shutil.rmtree(base)
        self.data.mkdir(parents=True)
        if os.geteuid() == 0:
            shutil.chown(base, "postgres")
            shutil.chown(self.data, "postgres")
        await run(
            *_as_postgres(
                [
                    *(str(PG_BIN / "initdb"), "-D", str(self.data), "-A", "trust"),
                    *("-U", "postgres", "-E", "UTF8", "--no-sync"),
                ]
            )
        )
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(
                f"\nport = {self.port}\nlisten_addresses = '127.0.0.1'\n"
                # TCP only: a Unix socket path is limited to 107 bytes, and the work
                # dir may be deeper than that (CI's checkout is)
                "unix_socket_directories = ''\nmax_connections = 400\n"
                "fsync = off\nsynchronous_commit = on\nfull_page_writes = off\n"
                "shared_buffers = 64MB\nlog_min_messages = warning\n"
            )

    async def start(self) -> None:
        if os.geteuid() == 0 and not self.log.exists():
            self.log.touch()
            shutil.chown(self.log, "postgres")
        try:
            await run(
                *_as_postgres(
                    [
                        *(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-l", str(self.log)),
                        *("-w", "-t", "60", "start"),
                    ]
                )
            )
        except ServiceError as exc:
            log = self.log.read_text(errors="replace") if self.log.exists() else "(no log)"
            raise ServiceError(f"{exc}\n{self.log}:\n{log[-2000:]}") from None

    async def stop(self, mode: str = "fast") -> None:
        await run(
            *_as_postgres([str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", mode, "stop"]),
            check=False,
        )

    async def stop_quietly(self) -> None:
        if (self.data / "postmaster.pid").exists():
            await self.stop("immediate")

    async def crash_restart(self, down_s: float) -> None:
        """``pg_ctl stop -m immediate`` (a crash: recovery replays the WAL), then start."""
        await self.stop("immediate")
        await asyncio.sleep(down_s)
        await self.start()


@dataclass
class RabbitNode:
    """One RabbitMQ node with its own name, ports, directories and epmd."""

    name: str  # short name: chaos1 → chaos1@localhost
    root: Path
    amqp_port: int
    mgmt_port: int
    dist_port: int
    epmd_port: int
    popen: asyncio.subprocess.Process | None = None

    @property
    def node(self) -> str:
        return f"{self.name}@localhost"

    @property
    def base(self) -> Path:
        return self.root / self.name

    def env(self) -> dict[str, str]:
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.base / "home"),
            "LANG": "C.UTF-8",
            "ERL_EPMD_PORT": str(self.epmd_port),
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.amqp_port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.base / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.base / "log"),
            "RABBITMQ_CONFIG_FILE": str(self.base / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.base / "advanced.config"),
            "RABBITMQ_CONF_ENV_FILE": str(self.base / "rabbitmq-env.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.base / "enabled_plugins"),
            "RABBITMQ_PID_FILE": str(self.base / "rabbit.pid"),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
        }

    def amqp_url(self, vhost: str = "/", port: int | None = None) -> str:
        from urllib.parse import quote

        return f"amqp://guest:guest@127.0.0.1:{port or self.amqp_port}/{quote(vhost, safe='')}"

    @property
    def mgmt_url(self) -> str:
        return f"http://guest:guest@127.0.0.1:{self.mgmt_port}"

    def prepare(self) -> None:
        if self.base.exists():
            shutil.rmtree(self.base)
        for d in ("home", "mnesia", "log"):
            (self.base / d).mkdir(parents=True)
        cookie = self.base / "home" / ".erlang.cookie"
        cookie.write_text(COOKIE)
        cookie.chmod(0o400)
        (self.base / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = {self.amqp_port}\n"
            f"management.tcp.port = {self.mgmt_port}\n"
            "management.tcp.ip = 127.0.0.1\n"
            "loopback_users = none\n"
            "heartbeat = 10\n"
            "vm_memory_high_watermark.relative = 0.2\n"
            "disk_free_limit.absolute = 50MB\n"
            "log.console = false\nlog.file.level = warning\n"
        )
        (self.base / "advanced.config").write_text("[].\n")
        (self.base / "rabbitmq-env.conf").write_text("")
        (self.base / "enabled_plugins").write_text("[rabbitmq_management].\n")

    async def ctl(self, *args: str, timeout: float = 60.0, check: bool = True) -> str:
        _, out = await run(
            str(RABBIT_BIN / "rabbitmqctl"),
            "-n",
            self.node,
            *args,
            env=self.env(),
            timeout=timeout,
            check=check,
        )
        return out

    async def start(self) -> None:
        log = (self.base / "server.out").open("ab")
        self.popen = await asyncio.create_subprocess_exec(
            str(RABBIT_BIN / "rabbitmq-server"),
            env=self.env(),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        await self.await_startup()

    async def await_startup(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            code, _ = await run(
                str(RABBIT_BIN / "rabbitmqctl"),
                "-n",
                self.node,
                "await_startup",
                "--timeout",
                "30",
                env=self.env(),
                timeout=45,
                check=False,
            )
            if code == 0:
                return
            if time.monotonic() > deadline:
                raise ServiceError(f"{self.node} did not start; see {self.base / 'log'}")
            await asyncio.sleep(1)

    def beam_pid(self) -> int | None:
        try:
            pid = int((self.base / "rabbit.pid").read_text().strip())
        except (OSError, ValueError):
            return None
        try:
            os.kill(pid, 0)
        except OSError:
            return None
        return pid

    async def kill(self) -> None:
        """SIGKILL the node's Erlang VM (a crash), and reap its start script."""
        pid = self.beam_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.popen is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.popen.wait(), 15)
            self.popen = None
        (self.base / "rabbit.pid").unlink(missing_ok=True)

    async def kill_restart(self, down_s: float) -> None:
        await self.kill()
        await asyncio.sleep(down_s)
        await self.start()

    async def app_restart(self, down_s: float) -> None:
        """``rabbitmqctl stop_app``, then ``start_app``: every connection is closed."""
        await self.ctl("stop_app")
        await asyncio.sleep(down_s)
        await self.ctl("start_app")
        await self.await_startup()

    async def stop(self) -> None:
        if self.beam_pid() is not None:
            await self.ctl("stop", timeout=60, check=False)
        await self.kill()
        await run(
            "epmd", "-port", str(self.epmd_port), "-kill", env=self.env(), timeout=10, check=False
        )


@dataclass
class Services:
    """The run's private Postgres clusters (engine, participants) and RabbitMQ nodes."""

    root: Path
    base_port: int = 21000
    nodes: int = 1
    engine_pg: Postgres = field(init=False)
    part_pg: Postgres = field(init=False)
    rabbits: list[RabbitNode] = field(init=False)

    def __post_init__(self) -> None:
        p = self.base_port
        self.engine_pg = Postgres("pg-engine", self.root, p + 1)
        self.part_pg = Postgres("pg-participants", self.root, p + 2)
        self.rabbits = [
            RabbitNode(
                f"chaos{i + 1}",
                self.root,
                amqp_port=p + 10 + 10 * i,
                mgmt_port=p + 11 + 10 * i,
                dist_port=p + 12 + 10 * i,
                epmd_port=p + 9,
            )
            for i in range(self.nodes)
        ]

    @property
    def rabbit(self) -> RabbitNode:
        return self.rabbits[0]

    async def start(self, log: object = print) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:  # Postgres runs as ``postgres``: it must reach its data dir
            for d in (self.root, *self.root.parents):
                if d.stat().st_mode & 0o005 != 0o005:
                    raise ServiceError(f"{d} is not world-traversable; use another --workdir")
        for pg in (self.engine_pg, self.part_pg):
            await pg.init()
            await pg.start()
        for node in self.rabbits:
            node.prepare()
        await asyncio.gather(*(n.start() for n in self.rabbits))
        if len(self.rabbits) > 1:
            first = self.rabbits[0]
            for node in self.rabbits[1:]:
                await node.ctl("stop_app")
                await node.ctl("join_cluster", first.node)
                await node.ctl("start_app")
                await node.await_startup()

    async def stop(self) -> None:
        for node in self.rabbits:
            with contextlib.suppress(Exception):
                await node.stop()
        for pg in (self.engine_pg, self.part_pg):
            with contextlib.suppress(Exception):
                await pg.stop("fast")
            with contextlib.suppress(Exception):
                await pg.stop_quietly()
