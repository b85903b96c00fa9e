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


def test_a_failed_resync_is_tried_again_and_the_run_is_protected_again(world1, shared_cluster, job, monkeypatch):
    """A resync whose re-attach fails (here: it raises once, as one that outlasts
    SHADOW_CONNECT_TIMEOUT_S does) leaves the rank training unprotected, but not for the rest
    of the run: it tries again every RETRY_STEPS steps, once its probe (a thread of its own)
    has found the coordinator answering with every worker ready, re-attaches at the iteration
    it reached, and the last iteration restores bit for bit."""
    from trainer_hooks.session import session as session_mod
    from trainer_hooks.session.retry import RESYNC_MIN_S

    monkeypatch.setattr(session_mod, "RETRY_STEPS", 3)
    model, opt, sched = build()
    ddp = DDP(model)
    session = trainer_hooks.attach(ddp, opt, coordinator=shared_cluster.address, scheduler=sched, job=job)
    for it in range(1, 4):
        train_step(ddp, opt, sched, it)
    real = session_mod.Session._attach
    failed = []

    def attach_once_failing(self, start, overwrite, carry, wait_s=None):
        if not failed:
            failed.append(wait_s)
            raise ConnectionError("no shadow coordinator answered within 20 s (a test's failure)")
        return real(self, start, overwrite, carry, wait_s)

    monkeypatch.setattr(session_mod.Session, "_attach", attach_once_failing)
    session.sender.q.put(NoticeItem("progress", {"epoch": session.epoch, "applied": 0}))  # degrade, then resync
    it = 3
    deadline = time.monotonic() + 60
    while not failed:
        assert time.monotonic() < deadline, session.degraded
        it += 1
        train_step(ddp, opt, sched, it)
        time.sleep(0.05)
    assert "resync at iteration" in session.degraded and "failed" in session.degraded
    tuning = session.options.tuning  # the resync (detach and handshake) held the step no longer than the block timeout
    budget = min(tuning.connect_timeout_s, tuning.block_timeout_s)
    assert len(failed) == 1 and RESYNC_MIN_S <= failed[0] <= budget, failed
    while session.degraded is not None or session.committed < it - 1:
        assert time.monotonic() < deadline, (session.degraded, session.committed)
        it += 1
        train_step(ddp, opt, sched, it)
        time.sleep(0.05)
    assert session.iteration == it and session.stats()["unprotected_steps_total"] >= 3
    assert session.close() == it
    fresh, fopt, fsched = build(seed=7)
    info = trainer_hooks.restore(fresh, fopt, source=shared_cluster.address, scheduler=fsched, job=job)
    assert info.iteration == it
    assert_same_state(live_state(fresh, fopt), live_state(model, opt))


def test_the_retry_probe_says_why_the_cluster_is_not_ready(shared_cluster):
    """What a rank asks before trying a resync again: a coordinator that answers with every
    worker ready (None), or why not, within a couple of seconds."""
    from shadow.config.tuning import Tuning
    from shadow.testing import free_port
    from trainer_hooks.session.retry import cluster_not_ready

    tuning = Tuning.load()
    assert cluster_not_ready(shared_cluster.address, tuning) is None
    t0 = time.monotonic()
    why = cluster_not_ready(f"tcp://127.0.0.1:{free_port()}", tuning)
    assert why is not None and "did not answer" in why and time.monotonic() - t0 < 10
