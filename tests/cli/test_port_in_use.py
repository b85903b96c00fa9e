"""A cluster or coordinator whose port is taken fails with a message naming the address and
the fix, and a non-zero exit (issue 53, item 8: ``shadow cluster`` logged a traceback from
its coordinator thread and exited 0, so a script or a unit manager took it for a clean
stop)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.parametrize("command", ["cluster", "coordinator"])
def test_a_port_in_use_is_an_error_that_names_it(command, tmp_path):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    env = dict(os.environ, XDG_DATA_HOME=str(tmp_path / "data"), XDG_STATE_HOME=str(tmp_path / "state"))
    try:
        args = [f"port={port}", "persist.durable=false"] + (["workers=1"] if command == "cluster" else [])
        res = subprocess.run(
            [sys.executable, "-m", "shadow", command, *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=env,
            timeout=120,
            check=False,
        )
    finally:
        held.close()
    assert res.returncode == 1, (res.returncode, res.stderr[-2000:])
    assert f"cannot listen on tcp://127.0.0.1:{port}" in res.stderr, res.stderr[-2000:]
    assert "choose another with port=" in res.stderr
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
