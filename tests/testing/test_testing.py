"""The shared harness (shadow/testing): waits, fault wrappers, state comparison, and a
cluster that is always stopped."""

from __future__ import annotations

import errno
import os
import time

import numpy as np
import pytest
import torch

from shadow.persist import shardfile, writer
from shadow.testing import (
    LocalCluster,
    ServiceFaults,
    assert_same_state,
    procs,
    state_differences,
    ulp_report,
    wait_until,
)
from shadow.testing import faults as F
from shadow.testing.wait import WaitTimeout, wait_progressing
from shadow.worker import shard


def test_wait_until_returns_the_value_and_names_what_timed_out():
    calls = []
    assert wait_until(lambda: calls.append(1) or (len(calls) >= 3 and "ready"), 5, period=0.01) == "ready"
    t0 = time.monotonic()
    with pytest.raises(WaitTimeout, match=r"after 0\.2 s waiting for the flag: last=7"):
        wait_until(lambda: False, 0.2, "the flag", period=0.02, detail=lambda: "last=7")
    assert 0.2 <= time.monotonic() - t0 < 2
    with pytest.raises(ZeroDivisionError):  # a broken condition is not a timeout
        wait_until(lambda: 1 / 0, 1)


def test_wait_progressing_waits_while_it_moves_and_names_a_stall_or_the_cap():
    moves = iter(range(1000))
    calls = []
    # 0.3 s of waiting, more than the stall, goes on because the progress keeps changing
    got = wait_progressing(
        lambda: calls.append(1) or (len(calls) >= 30 and "done"), lambda: next(moves), stall=0.1, period=0.01
    )
    assert got == "done"
    with pytest.raises(WaitTimeout, match=r"the flag, the last 0\.[0-9] s without progress \(still 7\): seen=3"):
        wait_progressing(lambda: False, lambda: 7, stall=0.2, what="the flag", period=0.02, detail=lambda: "seen=3")
    with pytest.raises(WaitTimeout, match=r"waited 0\.3 s for the flag, the cap against a hang, though it kept moving"):
        wait_progressing(lambda: False, lambda: next(moves), stall=0.1, limit=0.3, what="the flag", period=0.01)


def test_cpu_seconds_count_a_child_that_works_and_not_one_that_sleeps():
    import subprocess
    import sys

    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 60: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        meter = procs.cpu_meter(busy.pid, own=True, step=0.2)
        first = meter()
        wait_progressing(lambda: meter() > first + 1, meter, stall=30, what="the busy child's CPU time")
        time.sleep(0.5)  # the idle one's start is behind it
        before = procs.cpu_seconds(idle.pid)
        time.sleep(0.5)
        assert procs.cpu_seconds(idle.pid) - before < 0.1
        assert procs.cpu_seconds(os.getpid(), own=False) >= procs.cpu_seconds(busy.pid)
        assert procs.sleeping(idle.pid) in (True, None) and not procs.sleeping(busy.pid)
    finally:
        busy.kill()
        idle.kill()
        busy.wait()
        idle.wait()
    assert procs.cpu_seconds(busy.pid) == 0.0  # gone


def test_communicate_returns_the_output_or_kills_a_process_that_stalls():
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "print('hello')"], stdout=subprocess.PIPE, text=True)
    assert procs.communicate(p, "a greeting")[0] == "hello\n"
    code = "import sys, time; print('started', flush=True); time.sleep(60)"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    with pytest.raises(WaitTimeout, match=r"(?s)without progress.*killed.*started"):
        procs.communicate(p, "a sleeper", stall=1.0, progress=procs.cpu_meter(p.pid, own=True, step=0.5))
    assert p.returncode is not None


def test_service_faults_travel_by_environment_and_refuse_a_bad_value():
    f = ServiceFaults(corrupt_apply_at=4, persist_full="/tmp/x")
    assert f and not ServiceFaults()
    assert f.env() == {"SHADOW_FAULT_CORRUPT_APPLY_AT": "4", "SHADOW_FAULT_PERSIST_FULL": "/tmp/x"}
    assert ServiceFaults.from_env(f.env()) == f
    with pytest.raises(ValueError, match="SHADOW_FAULT_PERSIST_DIE_AT='six' is not an iteration number"):
        ServiceFaults.from_env({"SHADOW_FAULT_PERSIST_DIE_AT": "six"})


def test_fault_wrappers_are_put_back():
    real = (shard.ShardState.apply, writer.ShardPersister._write, shardfile._write_all)
    with F.injected(ServiceFaults(corrupt_apply_at=1, persist_die_at=2, persist_full="/nonexistent")):
        assert (shard.ShardState.apply, writer.ShardPersister._write, shardfile._write_all) != real
        assert all(
            a is not b
            for a, b in zip(
                real, (shard.ShardState.apply, writer.ShardPersister._write, shardfile._write_all), strict=True
            )
        )
    assert (shard.ShardState.apply, writer.ShardPersister._write, shardfile._write_all) == real


def test_the_full_disk_wrapper_fails_only_while_its_file_exists(tmp_path):
    flag = tmp_path / "full"
    img = shardfile.ShardImage(1 << 16)
    img.layout([shardfile.Entry("param", "F32", 1000)], {"format": shardfile.FORMAT})
    with F.injected(ServiceFaults(persist_full=str(flag))):
        assert img.write(str(tmp_path / "a")) == img.size  # no flag yet
        flag.touch()
        with pytest.raises(OSError) as err:
            img.write(str(tmp_path / "b"))
        assert err.value.errno == errno.ENOSPC and not os.path.exists(tmp_path / "b")


def test_state_differences_are_bit_for_bit():
    a = {
        "model": {"w": torch.tensor([1.0, 2.0])},
        "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1}]},
        "scheduler": {"n": 1},
    }
    b = {
        "model": {"w": torch.tensor([1.0, np.nextafter(np.float32(2.0), np.float32(3.0)).item()])},
        "optimizer": {"state": {0: {"step": torch.tensor(3.0, dtype=torch.float64)}}, "param_groups": [{"lr": 0.1}]},
        "scheduler": {"n": 2},
    }
    assert state_differences(a, a) == []
    assert_same_state(a, a)
    got = state_differences(a, b)
    assert got[:2] == ["model w", "optimizer state 0 step"] and got[2].startswith("scheduler"), got
    with pytest.raises(AssertionError, match="model w"):
        assert_same_state(a, b)
    assert ulp_report(a["model"]["w"], b["model"]["w"]) == {"max_ulp": 1, "frac_diff": 0.5}


@pytest.mark.slow
def test_a_cluster_that_does_not_start_is_stopped_and_says_why(tmp_path):
    with pytest.raises(RuntimeError, match="shadow cluster did not start") as err:
        LocalCluster(tmp_path, args=("persist.local.every_n=-3",), start_timeout=30)
    assert "every_n" in str(err.value)
