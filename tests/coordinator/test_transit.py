"""The lost-in-transit check (``Trainers.check_transit``): frames a rank says it sent that a
worker never took are declared lost only on the worker's word, given after their grace, never
on its silence (a worker busy replaying, or starved of CPU, says nothing meanwhile)."""

from __future__ import annotations

import time
from collections import deque

from shadow.coordinator.records import JobStatus
from tests.coordinator.test_coordinator_parts import Sim

GRACE = 1.5


def _sent_long_ago(sim: Sim, now: float) -> None:
    """Rank 0 said, 2 graces ago, that it had sent 5 frames to each worker; each took 3."""
    job = sim.state.job
    assert job is not None
    job.sent[0] = deque([(now - 2 * GRACE, [5, 5])])
    for w in sim.state.workers:
        w.epoch, w.seq, w.busy_at, w.joined_at = job.epoch, [3], now - 3 * GRACE, now - 3 * GRACE


def _sim() -> Sim:
    from shadow.config.tuning import Tuning

    sim = Sim(workers=2, tuning=Tuning(worker_lost_s=GRACE))
    sim.running()
    return sim


def test_a_worker_that_reported_after_the_grace_is_judged():
    sim = _sim()
    now = time.monotonic()
    _sent_long_ago(sim, now)
    for w in sim.state.workers:
        w.last_seen = now - 0.1  # it reported after the frames' grace: it never took them
    sim.coord.trainers.check_transit(now)
    lost = [w for w in sim.state.workers if w.undelivered]
    assert len(lost) == 1 and "2 data messages from rank 0 never arrived" in lost[0].undelivered
    assert sim.state.job is not None and sim.state.job.status == JobStatus.DEGRADED


def test_a_worker_silent_since_before_the_grace_is_not_judged():
    sim = _sim()
    now = time.monotonic()
    _sent_long_ago(sim, now)
    for w in sim.state.workers:
        w.last_seen = now - 2 * GRACE + 0.5  # busy since: its seq is from before the grace ran out
    sim.coord.trainers.check_transit(now)
    assert not any(w.undelivered for w in sim.state.workers)
    assert sim.state.job is not None and sim.state.job.status == JobStatus.RUNNING
