"""Smoke test of the fault-matrix runner: a trainer killed after an iteration and inside a
re-attach bootstrap, a worker kill, and a coordinator away longer than the ranks wait for
it: all exact, nothing lost. Over ZeroMQ only: over UCX its worker kill still fails in
about one trial in four (a rank's stream to the restarted worker stalls; docs/ucx.md), so
`tools/fault_matrix.py --transport ucx` is run by hand until that is fixed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_fault_matrix_trainer_and_worker_kill_are_exact(tmp_path):
    out = tmp_path / "matrix.json"
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "fault_matrix.py"),
            "--trials",
            "1",
            "--steps",
            "16",
            "--scenarios",
            "trainer_kill,trainer_kill_bootstrap,worker_kill,coordinator_outage",
            "--json",
            str(out),
            "--workdir",
            str(tmp_path / "work"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=280,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(out.read_text())
    for name in ("trainer_kill", "trainer_kill_bootstrap", "worker_kill", "coordinator_outage"):
        summary = report["scenarios"][name]["summary"]
        detail = [t["detail"] for t in report["scenarios"][name]["trials"]]
        assert summary["exact"] == summary["trials"] == 1, (name, detail)
        assert summary["training_failures"] == 0 and summary["lost_unexpected"] == 0, (name, detail)
    assert report["scenarios"]["worker_kill"]["trials"][0]["detection_s"] is not None
