"""A failure of the shadow never stops training; only the training loop's own mistakes do.

An ``error`` from the coordinator after attach used to be latched and raised at the next
``optimizer.step()``. Now the rank degrades, counts it, tells the coordinator (``paused``)
and the cluster resyncs; a bucket reduced twice without ``no_sync`` still raises.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import trainer_hooks
from shadow.testing import assert_same_state, live_state
from tests.helpers.loop import train_step
from tests.helpers.tiny_trainer import build
from trainer_hooks.session.items import NoticeItem

pytestmark = pytest.mark.slow


def test_a_coordinator_error_degrades_then_resyncs(world1, shared_cluster, job):
    model, opt, sched = build()
    ddp = DDP(model)
    session = trainer_hooks.attach(ddp, opt, coordinator=shared_cluster.address, scheduler=sched, job=job)
    epoch = session.epoch
    for it in range(1, 4):
        train_step(ddp, opt, sched, it)
    # a message the coordinator does not accept from anyone: it answers `error`
    session.sender.q.put(NoticeItem("progress", {"epoch": session.epoch, "applied": 0}))
    deadline = time.monotonic() + 10
    while session.stats()["shadow_errors"] == 0:
        assert time.monotonic() < deadline, "the coordinator's error never arrived"
        time.sleep(0.05)
    assert "does not accept 'progress'" in session.degraded
    it = 3
    deadline = time.monotonic() + 60
    while session.epoch == epoch or session.degraded is not None or session.committed < it - 1:
        assert time.monotonic() < deadline, (session.degraded, session.committed, shared_cluster.status()["job"])
        it += 1
        train_step(ddp, opt, sched, it)  # never raises
        time.sleep(0.1)
    assert session.close() == it
    st = shared_cluster.status()
    assert st["job"]["name"] == job and st["job"]["resyncs"] == 1 and st["job"]["committed"] == it
    fresh, fopt, fsched = build(seed=7)
    info = trainer_hooks.restore(fresh, fopt, source=shared_cluster.address, scheduler=fsched, job=job)
    assert info.iteration == it
    assert_same_state(live_state(fresh, fopt), live_state(model, opt))


def test_a_bucket_reduced_twice_is_still_raised(world1, shared_cluster, job):
    model, opt, sched = build()
    ddp = DDP(model)
    session = trainer_hooks.attach(ddp, opt, coordinator=shared_cluster.address, scheduler=sched, job=job)
    try:
        x = torch.randint(0, 37, (4, 6))
        for _ in range(2):  # accumulation without no_sync: every bucket is all-reduced twice
            ddp(x).sum().backward()
        with pytest.raises(trainer_hooks.ShadowUsageError, match="all-reduced twice"):
            opt.step()
        assert session.stats()["shadow_errors"] == 0
    finally:
        session.close(wait=False)
