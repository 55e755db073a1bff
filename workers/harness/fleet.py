"""Start and stop real worker processes (the demo, the acceptance tests, the bench)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from workers.core import names
from workers.io import broker, db
from workers.settings import ROOT, Settings

ENGINE_WORKERS = names.ENGINE_WORKERS
PARTICIPANTS = ("inventory", "payments", "shipping")


DEV_PASSWORD = "custody-dev"  # the broker users' password in the demo and the tests


def role_env(worker: str, name: str | None, env: Mapping[str, str]) -> dict[str, str]:
    """Connect each worker as its own Postgres role (the baseline migration's grants) and its own
    broker user (``custody broker dev-users``), never as an administrator."""
    amqp = env.get("CUSTODY_AMQP_URL", Settings().amqp_url)
    if worker == "participant":
        url = env.get("CUSTODY_PARTICIPANT_DATABASE_URL", Settings().participant_database_url)
        return {
            "CUSTODY_PARTICIPANT_DATABASE_URL": db.with_user(url, f"custody_participant_{name}"),
            "CUSTODY_AMQP_URL": broker.url_with_user(amqp, f"custody-{name}", DEV_PASSWORD),
        }
    url = env.get("CUSTODY_DATABASE_URL", Settings().database_url)
    return {
        "CUSTODY_DATABASE_URL": db.with_user(url, f"custody_{worker}"),
        "CUSTODY_AMQP_URL": broker.url_with_user(amqp, f"custody-{worker}", DEV_PASSWORD),
    }


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    metrics_port: int = 0  # 0: none (CUSTODY_METRICS_PORT unset)


# Ports handed out by free_port: below the kernel's ephemeral range (32768-60999 by
# default), where no process's bind(0) lands, so that a port found free is not given to
# another process's listener (another pytest-xdist worker's proxy, say) before the
# worker it is meant for binds it. Each pytest-xdist worker walks a block of its own;
# any other process (the demo, a single pytest) the last one. The chaos harness keeps
# 21000-21999 (its --base-port).
PORTS_FROM = 24000
PORT_BLOCK = 1000
PORT_BLOCKS = 8
_port_offset = [os.getpid()]


def free_port() -> int:
    """A TCP port on the loopback nobody listens on now, from this process's block."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    n = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else -1
    block = PORTS_FROM + (n % PORT_BLOCKS) * PORT_BLOCK
    for _ in range(PORT_BLOCK):
        port = block + _port_offset[0] % PORT_BLOCK
        _port_offset[0] += 1
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # the block is full
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Fleet:
    """A set of worker processes sharing one environment (database, vhost, routes)."""

    env: Mapping[str, str]
    log_dir: Path
    procs: list[Proc] = field(default_factory=list)
    least_privilege: bool = True
    # each process serves /metrics on a port of its own (the demo's --keep prints them)
    metrics: bool = False
    # each process in a session of its own: a terminal's Ctrl-C reaches only the caller,
    # which then drains the fleet with SIGTERM
    own_session: bool = False

    def start(
        self, worker: str, *, name: str | None = None, extra_env: Mapping[str, str] | None = None
    ) -> Proc:
        label = f"{worker}-{name}" if name else worker
        label = f"{label}-{sum(p.name.startswith(label) for p in self.procs) + 1}"
        log = self.log_dir / f"{label}.log"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        args = [sys.executable, "-m", "workers.cli", "run", worker]
        if name:
            args += ["--name", name]
        env = {**os.environ, **self.env}
        if self.least_privilege:
            given = {**env, **(extra_env or {})}
            env.update(
                {k: v for k, v in role_env(worker, name, env).items() if f"{k}_FILE" not in given}
            )
        env.update(extra_env or {})
        port = free_port() if self.metrics else 0
        if port:
            env["CUSTODY_METRICS_PORT"] = str(port)
        with log.open("ab") as out:
            popen = subprocess.Popen(
                args,
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=self.own_session,
            )
        proc = Proc(label, popen, log, port)
        self.procs.append(proc)
        return proc

    def start_all(
        self, replicas: int = 1, participant_env: Mapping[str, Mapping[str, str]] | None = None
    ) -> None:
        for _ in range(replicas):
            for worker in ENGINE_WORKERS:
                self.start(worker)
            for name in PARTICIPANTS:
                self.start("participant", name=name, extra_env=(participant_env or {}).get(name))

    def alive(self) -> list[str]:
        return [p.name for p in self.procs if p.popen.poll() is None]

    def dead(self) -> list[tuple[str, int]]:
        return [(p.name, p.popen.returncode) for p in self.procs if p.popen.poll() is not None]

    def signal(self, proc: Proc, sig: signal.Signals) -> None:
        if proc.popen.poll() is None:
            proc.popen.send_signal(sig)

    def stop(self, grace_s: float = 30.0) -> dict[str, int]:
        """SIGTERM everyone, wait for the drain, SIGKILL what is left; exit codes."""
        for p in self.procs:
            self.signal(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        codes: dict[str, int] = {}
        for p in self.procs:
            try:
                codes[p.name] = p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                codes[p.name] = p.popen.wait()
        return codes
