"""Run ``python -m chaos`` as a subprocess and read its JSON report."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from workers.settings import ROOT

CLEANUP_S = 90.0  # a run stopped by SIGTERM: time to stop its fleet and services


def workdir(name: str) -> Path:
    """A fresh work dir under the repository's ``.chaos/`` (the private Postgres runs as
    the ``postgres`` user when the tests run as root, and pytest's tmp dirs are 0700)."""
    path = ROOT / ".chaos" / "pytest" / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def chaos(
    args: Sequence[str], *, workdir: Path, timeout: float, env: Mapping[str, str] | None = None
) -> tuple[int, str, dict[str, Any]]:
    """Exit code, output and report of one run (its seed is in ``args``)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CUSTODY_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "chaos", *args, "--workdir", str(workdir)],
        cwd=ROOT,
        env={**clean, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM, not SIGKILL: the run then stops its fleet and its private Postgres and
        # RabbitMQ as on Ctrl-C; killed, it would leave them running (and taking the
        # cores) for the rest of the suite
        proc.terminate()
        how = "stopped by SIGTERM"
        try:
            stdout, stderr = proc.communicate(timeout=CLEANUP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            how = f"killed, {CLEANUP_S:g}s after SIGTERM"
        stderr += f"\n[the run did not finish within {timeout:g}s: {how}]"
    output = stdout + stderr
    reports = sorted(workdir.glob("*/report.json"))
    report = json.loads(reports[-1].read_text()) if reports else {}
    return proc.returncode, output, report
