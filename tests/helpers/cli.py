"""Running the ``shadow`` command line as a user would, for tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from shadow.testing.procs import communicate

ROOT = Path(__file__).resolve().parents[2]


def shadow_cli(
    *args: str, env: dict | None = None, timeout: float = 120, limit: float = 600
) -> subprocess.CompletedProcess:
    """``python -m shadow *args`` from the repository root, its output captured as text;
    ``env`` adds to this process's environment. COLUMNS is wide: rich wraps a pipe at 80.

    It runs as long as it works: it fails (killed, with what it wrote) once neither it nor
    anything else this test started (a cluster it talks to) has used CPU time for ``timeout``
    s, or after ``limit`` s (against a hang); a loaded machine makes it slower, not a failure."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "shadow", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "220", **(env or {})},
    )
    out, err = communicate(proc, f"`shadow {' '.join(args)}` to end", stall=timeout, limit=limit)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
