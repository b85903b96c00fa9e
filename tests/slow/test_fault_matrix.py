"""Smoke test of the fault-matrix runner: a trainer killed after an iteration and inside a
re-attach bootstrap, a worker kill, and a coordinator away longer than the ranks wait for
it: all exact, nothing lost; over each data path (over UCX without the coordinator's
outage, which no data path takes part in)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_fault_matrix_trainer_and_worker_kill_are_exact(tmp_path, transport):
    data = transport[0].removeprefix("transport.data=")
    scenarios = ["trainer_kill", "trainer_kill_bootstrap", "worker_kill"]
    if data == "zmq":
        scenarios.append("coordinator_outage")
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
            ",".join(scenarios),
            "--json",
            str(out),
            "--workdir",
            str(tmp_path / "work"),
            "--transport",
            data,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=280,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(out.read_text())
    for name in scenarios:
        summary = report["scenarios"][name]["summary"]
        detail = [t["detail"] for t in report["scenarios"][name]["trials"]]
        assert summary["exact"] == summary["trials"] == 1, (name, detail)
        assert summary["training_failures"] == 0 and summary["lost_unexpected"] == 0, (name, detail)
    assert report["scenarios"]["worker_kill"]["trials"][0]["detection_s"] is not None
