"""Running the ``shadow`` command line as a user would, for tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def shadow_cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m shadow *args`` from the repository root, its output captured as text;
    ``env`` adds to this process's environment. COLUMNS is wide: rich wraps a pipe at 80."""
    return subprocess.run(
        [sys.executable, "-m", "shadow", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "220", **(env or {})},
        check=False,
    )
