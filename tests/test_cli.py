"""The shadow CLI: config validation, status, errors."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shadow.cli._args import UsageError, parse
from shadow.config import ClusterConfig, RestoreConfig, StatusConfig
from tests.conftest import ROOT, free_port


def shadow(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shadow", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


@pytest.mark.parametrize("cls,args,needle", [
    (ClusterConfig, ["workers=0"], "workers=0"),
    (ClusterConfig, ["port=abc"], "port"),
    (ClusterConfig, ["port=70000"], "port=70000"),
    (ClusterConfig, ["log_level=LOUD"], "log_level"),
    (StatusConfig, ["address=localhost:5555"], "address="),
    (StatusConfig, ["nope=1"], "nope"),
    (RestoreConfig, ["format=onnx"], "format='onnx'"),
    (RestoreConfig, ["out"], "key=value"),
])
def test_config_errors_name_the_key(cls, args, needle):
    with pytest.raises(UsageError) as ei:
        parse(cls, args)
    assert needle in str(ei.value)


def test_config_overrides_are_typed():
    cfg = parse(ClusterConfig, ["workers=3", "port=6000", "threads_per_worker=2"])
    assert (cfg.workers, cfg.port, cfg.threads()) == (3, 6000, 2)


def test_cli_usage_and_exit_codes():
    assert shadow("--help").returncode == 0
    res = shadow("cluster", "workers=0")
    assert res.returncode == 2 and "workers=0" in res.stderr
    res = shadow("frobnicate")
    assert res.returncode == 2 and "unknown command" in res.stderr
    assert "example" in shadow("status", "--help").stdout.lower() or "e.g." in shadow("status", "--help").stdout


def test_status_and_restore_against_nothing_fail_clearly():
    addr = f"tcp://127.0.0.1:{free_port()}"
    res = shadow("status", f"address={addr}", "timeout=1")
    assert res.returncode == 1 and "no shadow coordinator answered" in res.stderr
    res = shadow("restore", f"source={addr}", "timeout=1", "out=/tmp/never.pt")
    assert res.returncode == 1 and "no shadow coordinator answered" in res.stderr


@pytest.mark.slow
def test_status_reports_workers(cluster):
    res = shadow("status", f"address={cluster.address}", "json=true")
    assert res.returncode == 0, res.stderr
    st = json.loads(res.stdout)
    assert len(st["workers"]) == 2 and all(w["health"] == "ok" for w in st["workers"]) and st["job"] is None
    res = shadow("status", f"address={cluster.address}")
    assert res.returncode == 0 and "no job attached" in res.stdout
    res = shadow("restore", f"source={cluster.address}", "out=/tmp/never.pt")
    assert res.returncode == 1 and "no checkpoint yet" in res.stderr
