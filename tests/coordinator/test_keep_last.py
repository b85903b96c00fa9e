"""Before a new job takes the cluster's memory from a job that ended (or is replaced with
``overwrite``), the old job's last committed iteration is written to the local tier, so a
relaunch of it loses nothing; the new attach waits for that write (told why), and goes on
once it is there, once it failed, or once its own deadline is near."""

from __future__ import annotations

import time

from shadow.config import LocalTierConfig, PersistConfig
from tests.coordinator.test_coordinator_parts import LAYOUT, OPTIM, Sim


def _ended_job(tmp_path) -> Sim:
    """Job ``job`` committed iteration 3 (the tier's schedule, every 100, took none) and detached."""
    sim = Sim(persist=PersistConfig(LocalTierConfig(dir=str(tmp_path), every_n=100)))
    sim.running()
    for it in (1, 2, 3):
        for i in range(2):
            sim.prepared(b"w%d" % i, it)
    assert sim.state.job is not None and sim.state.job.cut == 3
    assert not any(f["persist"] for _, k, f in sim.out.sent if k == "apply")
    sim.send(b"t0", "detach", epoch=sim.state.epoch, rank=0)
    sim.out.clear()
    return sim


def _attach_other(sim: Sim, overwrite: bool = False) -> None:
    sim.send(
        b"u0",
        "attach",
        job="other",
        rank=0,
        world=1,
        layout_hash=LAYOUT.hash,
        layout=LAYOUT.to_dict(),
        optim=OPTIM,
        iteration=0,
        overwrite=overwrite,
        restored=None,
    )


def test_a_new_job_waits_for_the_ended_jobs_last_iteration_on_the_tier(tmp_path):
    sim = _ended_job(tmp_path)
    _attach_other(sim)
    asked = [sim.out.last("apply", b"w%d" % i) for i in range(2)]
    assert asked == [{"epoch": 1, "iteration": 3, "persist": True}] * 2  # its writers still hold it
    waiting = sim.out.last("waiting", b"u0")
    assert "writing job 'job''s last iteration 3" in waiting["reason"]
    assert "configure" not in sim.out.kinds() and sim.state.job is not None and sim.state.job.name == "job"
    sim.out.clear()
    sim.coord.attach.start_attaches()  # in flight: asked once, still waiting
    assert "apply" not in sim.out.kinds() and "configure" not in sim.out.kinds()
    tier = sim.coord.persist.tiers["local"]
    tier.in_flight.clear()  # the checkpoint settles complete (persistence's own tests cover how)
    tier.complete["job"] = 3
    sim.coord.attach.start_attaches()
    assert sim.state.job is not None and sim.state.job.name == "other"
    assert [sim.out.last("configure", b"w%d" % i)["job"] for i in range(2)] == ["other", "other"]


def test_the_new_job_goes_on_when_the_write_failed_or_its_deadline_is_near(tmp_path):
    sim = _ended_job(tmp_path)
    _attach_other(sim)
    assert "waiting" in sim.out.kinds(b"u0")
    sim.coord.persist.tiers["local"].in_flight.clear()  # the request failed: nothing completed
    sim.coord.attach.start_attaches()
    assert sim.state.job is not None and sim.state.job.name == "other"  # asked once; not forever

    sim = _ended_job(tmp_path / "again")
    _attach_other(sim)
    assert sim.state.job is not None and sim.state.job.name == "job"
    sim.state.pending["other"]["deadline"] = time.monotonic() + 0.5  # its attach deadline has come
    sim.coord.attach.start_attaches()
    assert sim.state.job is not None and sim.state.job.name == "other"


def test_nothing_waits_when_the_tier_has_it_or_the_job_is_not_replaced(tmp_path):
    sim = _ended_job(tmp_path)
    sim.coord.persist.tiers["local"].complete["job"] = 3
    _attach_other(sim)
    assert "apply" not in sim.out.kinds() and sim.state.job is not None and sim.state.job.name == "other"

    sim = Sim(persist=PersistConfig(LocalTierConfig(dir=str(tmp_path / "live"), every_n=100)))
    sim.running()
    for i in range(2):
        sim.prepared(b"w%d" % i, 1)
    sim.out.clear()
    _attach_other(sim)  # the held job has not detached and no overwrite: refused, nothing written
    assert "apply" not in sim.out.kinds() and sim.out.last("error", b"u0")["code"] == "refused"

    sim = Sim()  # no local tier: nothing to write, the memory goes to the new job at once
    sim.running()
    sim.send(b"t0", "detach", epoch=sim.state.epoch, rank=0)
    _attach_other(sim)
    assert sim.state.job is not None and sim.state.job.name == "other"


def test_a_crashed_job_blocks_no_other_job(tmp_path):
    """A job whose ranks crashed never detaches. While they are still heard from, another
    job name is refused (without overwrite); once they are silent past the liveness window,
    the next job takes the memory over: the crashed job's last iteration is written to the
    local tier first, and the new job's ranks are told whose memory they took."""
    from tests.coordinator.test_jobs_drop import _silent

    sim = Sim(persist=PersistConfig(LocalTierConfig(dir=str(tmp_path), every_n=100)))
    sim.running()
    for it in (1, 2):
        for i in range(2):
            sim.prepared(b"w%d" % i, it)
    sim.out.clear()
    _attach_other(sim)
    assert "whose ranks are still heard from" in sim.out.last("error", b"u0")["message"]
    assert sim.state.job is not None and sim.state.job.name == "job"
    _silent(sim)
    sim.out.clear()
    _attach_other(sim)
    assert [sim.out.last("apply", b"w%d" % i) for i in range(2)] == [{"epoch": 1, "iteration": 2, "persist": True}] * 2
    assert "last iteration 2" in sim.out.last("waiting", b"u0")["reason"]
    tier = sim.coord.persist.tiers["local"]
    tier.in_flight.clear()
    tier.complete["job"] = 2
    sim.coord.attach.start_attaches()
    job = sim.state.job
    assert job is not None and job.name == "other"
    assert "took the cluster's memory over from job 'job'" in job.took_over
