"""The coordinator is SIGKILLed and restarted: the workers keep their state, the new
coordinator rebuilds the cluster view from them, the trainer reconnects, nothing is lost."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import trainer_hooks
from shadow.testing import assert_same_state, free_port, live_state, status
from tests.conftest import ROOT
from tests.helpers.loop import train_step
from tests.helpers.tiny_trainer import build

pytestmark = pytest.mark.slow


def _spawn(tmp, name: str, *args: str) -> subprocess.Popen:
    log = open(tmp / f"{name}.log", "a")
    return subprocess.Popen(
        [sys.executable, "-m", "shadow", *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env=dict(os.environ, SHADOW_WORKER_LOST_S="3"),
    )


def _wait(cond, what: str, limit: float = 60.0):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            got = cond()
        except TimeoutError:
            got = None
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_coordinator_restart_rebuilds_from_workers(world1, tmp_path):
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    coord = _spawn(tmp_path, "coord", "coordinator", "workers=2", f"port={port}")
    workers = [
        _spawn(tmp_path, f"worker{i}", "worker", f"coordinator={address}", f"worker_id={i}", "threads=1")
        for i in range(2)
    ]
    try:
        _wait(lambda: len(status(address, 1.0)["workers"]) == 2, "the workers")
        model, opt, sched = build()
        ddp = DDP(model)
        session = trainer_hooks.attach(ddp, opt, coordinator=address, scheduler=sched, job="phoenix")
        epoch = session.epoch
        it = 0
        for _ in range(4):
            it += 1
            train_step(ddp, opt, sched, it)
        _wait(lambda: status(address, 1.0)["job"]["committed"] == it, "the first commits")
        coord.kill()
        coord.wait()
        for _ in range(2):  # within SHADOW_MAX_LAG: training does not notice
            it += 1
            train_step(ddp, opt, sched, it)
        t0 = time.monotonic()
        coord = _spawn(tmp_path, "coord", "coordinator", "workers=2", f"port={port}")
        st = _wait(lambda: (s := status(address, 1.0))["job"] and s["job"]["committed"] == it and s, "the rebuild")
        rebuilt_s = time.monotonic() - t0
        assert st["job"]["name"] == "phoenix" and st["job"]["epoch"] == epoch and st["job"]["status"] == "running"
        for _ in range(6):  # more than SHADOW_MAX_LAG: the trainer needs the new coordinator's credit
            it += 1
            train_step(ddp, opt, sched, it)
        assert session.close() == it and session.degraded is None and session.epoch == epoch
        st = status(address)
        assert st["job"]["committed"] == it and st["job"]["trainers"] == [0]
        assert rebuilt_s < 30
        fresh, fopt, fsched = build(seed=5)
        info = trainer_hooks.restore(fresh, fopt, source=address, scheduler=fsched)
        assert info.iteration == it and info.tier == "memory"
        for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
            assert torch.equal(a, b)
        sa, sb = opt.state_dict(), fopt.state_dict()
        assert all(torch.equal(sa["state"][i][k], sb["state"][i][k]) for i in sa["state"] for k in sa["state"][i])
    finally:
        for p in [coord, *workers]:
            p.send_signal(signal.SIGKILL)
            p.wait()


def test_losing_the_whole_cluster_never_stops_training(world1, tmp_path):
    """Coordinator and every worker SIGKILLed under policy block: the trainer stops waiting
    once the coordinator has been silent for tuning.coordinator_lost_s and trains on; a new
    cluster on the same address is found by the trainer's heartbeats, the ranks re-attach
    by themselves, and what the new cluster holds equals the trainer bit for bit."""
    from shadow.config.tuning import Tuning
    from shadow.testing import LocalCluster

    cluster = LocalCluster(tmp_path)
    # the trainer gives the coordinator up after 2 s of silence
    model, opt, sched = build()
    ddp = DDP(model)
    tuning = Tuning(coordinator_lost_s=2.0)
    session = trainer_hooks.attach(ddp, opt, coordinator=cluster.address, scheduler=sched, job="whole", tuning=tuning)
    for it in range(1, 4):
        train_step(ddp, opt, sched, it)
    cluster.kill_all()
    t0 = time.monotonic()
    for it in range(4, 10):  # would wait BLOCK_TIMEOUT_S (120 s) and raise without the coordinator check
        train_step(ddp, opt, sched, it)
    assert time.monotonic() - t0 < 30
    assert session.degraded and "no answer from the shadow coordinator" in session.degraded
    again = LocalCluster(tmp_path, port=cluster.port)
    try:
        it = 9
        deadline = time.monotonic() + 60
        while session.degraded is not None or session.committed < it - 1:
            assert time.monotonic() < deadline, (session.degraded, session.committed, again.status())
            it += 1
            train_step(ddp, opt, sched, it)
            time.sleep(0.2)
        assert session.close() == it
        fresh, fopt, fsched = build(seed=3)
        info = trainer_hooks.restore(fresh, fopt, source=again.address, scheduler=fsched, job="whole")
        assert info.iteration == it
        assert_same_state(live_state(fresh, fopt), live_state(model, opt))
    finally:
        again.stop()
