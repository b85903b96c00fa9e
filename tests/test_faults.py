"""Failures of the shadow itself: training never stops, the cluster heals, restores stay exact."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import trainer_hooks
from tests.conftest import Cluster
from tests.helpers.tiny_trainer import build

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _step(ddp, opt, sched, it):
    g = torch.Generator().manual_seed(it)
    x, y = torch.randint(0, 37, (4, 6), generator=g), torch.randint(0, 37, (4,), generator=g)
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def test_killed_worker_is_restarted_and_resynced(world1, tmp_path):
    cluster = Cluster(tmp_path, env={"SHADOW_WORKER_LOST_S": "1.5"})
    try:
        model, opt, sched = build()
        ddp = DDP(model)
        session = trainer_hooks.attach(ddp, opt, coordinator=cluster.address, scheduler=sched, job="heal")
        first_epoch = session.epoch
        it = 0
        for _ in range(3):
            it += 1
            _step(ddp, opt, sched, it)
        victim = cluster.status()["workers"][1]["pid"]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while session.epoch == first_epoch:  # training goes on while the worker comes back
            assert time.monotonic() < deadline, "the cluster never asked for a resync"
            it += 1
            _step(ddp, opt, sched, it)
            time.sleep(0.05)
        assert session.degraded is None and session.iteration == it
        for _ in range(3):
            it += 1
            _step(ddp, opt, sched, it)
        assert session.close() == it
        st = cluster.settled()
        assert st["workers"][1]["pid"] != victim and all(w["health"] == "ok" for w in st["workers"])
        assert st["job"]["committed"] == it and st["job"]["status"] in ("running", "detached")
        fresh, fopt, fsched = build(seed=9)
        info = trainer_hooks.restore(fresh, fopt, source=cluster.address, scheduler=fsched)
        assert info.iteration == it
        for a, b in zip(model.parameters(), fresh.parameters()):
            assert torch.equal(a, b)
        sa, sb = opt.state_dict(), fopt.state_dict()
        assert all(torch.equal(sa["state"][i][k], sb["state"][i][k]) for i in sa["state"] for k in sa["state"][i])
        assert sched.state_dict() == fsched.state_dict()
    finally:
        cluster.stop()
