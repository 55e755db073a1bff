"""Processes: spawning one with its log, and stopping a set (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from workers.settings import ROOT


def spawn(
    args: Sequence[str],
    log: Path,
    *,
    stdin: int | None = None,
    stdout: int | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start a process in the repository root, its output appended to ``log``; ``env``
    is added to this process's environment."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        return subprocess.Popen(
            list(args),
            cwd=ROOT,
            stdin=stdin,
            stdout=stdout if stdout is not None else out,
            stderr=out,
            env={**os.environ, **env} if env else None,
        )


def stop_all(procs: Sequence[subprocess.Popen[bytes]], grace_s: float = 15.0) -> list[int]:
    """SIGTERM, wait up to the grace period, SIGKILL what is left; exit codes."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    return codes
