"""A job has one owner at a time (issue 52, item 2): a second launch with the job's name,
``overwrite=True`` or not, never takes over a run whose ranks still heartbeat. Its attach is
held (the ranks hear why) until the live run's ranks have been silent for the liveness
window, then takes over naming the old epoch and generation; or it is refused at the
attach deadline. The job's own ranks re-attaching (a resync, proved with their rank
tokens) and the next restart round of the same elastic launch go at once.

Units: the coordinator driven through ``on_message`` with a recording outbox."""

from __future__ import annotations

import time

from shadow.coordinator.records import JobStatus
from tests.coordinator.test_coordinator_parts import LAYOUT, OPTIM, Sim
from tests.coordinator.test_jobs_drop import _hb, _silent
from trainer_hooks.session.handshake import launch_round


def _attach(sim: Sim, ident: bytes, iteration: int = 0, overwrite: bool = True, **extra) -> None:
    sim.send(
        ident,
        "attach",
        job="job",
        rank=0,
        world=1,
        layout_hash=LAYOUT.hash,
        layout=LAYOUT.to_dict(),
        optim=OPTIM,
        iteration=iteration,
        overwrite=overwrite,
        restored=None,
        **extra,
    )


def _started(sim: Sim) -> bool:
    """The held attach went on: a new epoch, the workers configured for it."""
    return sim.state.epoch == 2 and "job" not in sim.state.pending


def test_a_second_launch_waits_for_the_live_owner_and_takes_over_once_it_is_silent():
    sim = Sim()
    sim.running()
    old = sim.state.job
    assert old is not None
    _hb(sim)
    _attach(sim, b"second0")  # overwrite=True: the flag that used to take over a live run
    held = sim.out.last("waiting", b"second0")["reason"]
    assert "job 'job' (epoch 1, generation 0, committed iteration 0) is owned by a live run" in held
    assert "1 of its 1 ranks sent a heartbeat within the last 5 s (SHADOW_WORKER_LOST_S)" in held
    assert "shadow drop job=job force=true" in held
    assert sim.state.job is old and old.status == JobStatus.RUNNING and not _started(sim)
    assert "degraded" not in sim.out.kinds(b"t0")  # the first run stays protected

    sim.coord.attach.start_attaches()  # the periodic check: still heard, still held
    _hb(sim)
    sim.coord.attach.start_attaches()
    assert sim.state.job is old and not _started(sim)

    _silent(sim)  # its ranks crashed: no heartbeat for longer than the window
    sim.coord.attach.start_attaches()
    assert _started(sim) and sim.state.job is not old
    assert "from its previous run (epoch 1, generation 0, committed iteration 0)" in sim.state.job.took_over
    sim.configured(b"w0", b"w1")
    attached = sim.out.last("attached", b"second0")
    assert "took over job 'job' from its previous run (epoch 1, generation 0" in attached["took_over"]
    assert "never detached" in attached["took_over"]


def test_a_held_attach_is_refused_at_its_deadline_naming_the_owner():
    sim = Sim()
    sim.running()
    _hb(sim)
    _attach(sim, b"second0")
    sim.state.pending["job"]["deadline"] = time.monotonic() - 1.0
    _hb(sim)
    sim.coord.attach.start_attaches()
    sim.coord.attach.expire_attaches()
    err = sim.out.last("error", b"second0")
    assert err["code"] == "timeout"
    assert "refused after" in err["message"] and "SHADOW_CONNECT_TIMEOUT_S" in err["message"]
    assert "owned by a live run" in err["message"]
    assert sim.state.epoch == 1 and sim.state.job is not None and sim.state.job.status == JobStatus.RUNNING


def test_a_detached_job_is_attached_at_once():
    sim = Sim()
    sim.running()
    sim.send(b"t0", "detach", epoch=1, rank=0)
    assert sim.state.job is not None and sim.state.job.status == JobStatus.DETACHED
    _attach(sim, b"next0", iteration=0, overwrite=True)
    assert _started(sim) and sim.state.job.took_over == ""


def test_the_owners_own_ranks_reattach_at_once_with_their_token():
    """A resync re-attaches from the live ranks themselves: they prove it."""
    sim = Sim()
    sim.running()
    job = sim.state.job
    assert job is not None
    _hb(sim)
    _attach(sim, b"t0-again", owner={"epoch": 1, "token": b"\0" * 16})  # a wrong token: held
    assert "owned by a live run" in sim.out.last("waiting", b"t0-again")["reason"]
    assert not _started(sim)
    sim.state.pending.clear()
    _attach(sim, b"t0-again", owner={"epoch": 0, "token": job.rank_token(0)})  # another epoch's: held
    assert not _started(sim)
    sim.state.pending.clear()
    _attach(sim, b"t0-again", owner={"epoch": 1, "token": job.rank_token(0)})
    assert _started(sim) and sim.state.job.took_over == ""


def test_the_next_restart_round_of_the_same_launch_takes_over_at_once():
    """torchrun --max-restarts: the agent ends every rank of a round before it starts the
    next, so a later round of the same run need not wait out the heartbeat window."""
    sim = Sim()
    for i in range(2):
        sim.register(i)
    first = {"run": "TORCHELASTIC_RUN_ID=abc", "restart": 0}
    _attach(sim, b"t0", overwrite=False, launch=first)
    sim.configured(b"w0", b"w1")
    sim.prepared(b"w0", 0)
    sim.prepared(b"w1", 0)
    job = sim.state.job
    assert job is not None and job.cut == 0 and job.launch == first
    _hb(sim)
    for launch in (first, {"run": "TORCHELASTIC_RUN_ID=other", "restart": 5}, {"run": "x", "restart": True}):
        sim.state.pending.clear()
        _attach(sim, b"r0", launch=launch)  # the same round again, another run, a malformed one: held
        assert not _started(sim), launch
    sim.state.pending.clear()
    _attach(sim, b"r0", overwrite=False, launch={"run": "TORCHELASTIC_RUN_ID=abc", "restart": 1})
    assert _started(sim) and sim.state.job.launch == {"run": "TORCHELASTIC_RUN_ID=abc", "restart": 1}
    assert "epoch 1, generation 0" in sim.state.job.took_over  # the new ranks are told whom they replaced


def test_launch_round_reads_the_launchers_environment():
    assert launch_round({}) is None
    assert launch_round({"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "2"}) is None
    assert launch_round({"TORCHELASTIC_RUN_ID": "u1", "TORCHELASTIC_RESTART_COUNT": "2"}) == {
        "run": "TORCHELASTIC_RUN_ID=u1",
        "restart": 2,
    }
    assert launch_round({"SLURM_JOB_ID": "77"}) == {"run": "SLURM_JOB_ID=77", "restart": 0}
    assert launch_round({"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "x"}) is None
    assert launch_round({"SHADOW_LAUNCH_ID": "k8s-uid", "SHADOW_LAUNCH_RESTART": "3"}) == {
        "run": "SHADOW_LAUNCH_ID=k8s-uid",
        "restart": 3 * 10**8,
    }
    # torchrun under Slurm: a requeue's first round comes after the last round before it
    before = launch_round({"SLURM_JOB_ID": "77", "TORCHELASTIC_RUN_ID": "77", "TORCHELASTIC_RESTART_COUNT": "3"})
    after = launch_round(
        {
            "SLURM_JOB_ID": "77",
            "SLURM_RESTART_COUNT": "1",
            "TORCHELASTIC_RUN_ID": "77",
            "TORCHELASTIC_RESTART_COUNT": "0",
        }
    )
    assert before is not None and after is not None and before["run"] == after["run"]
    assert after["restart"] > before["restart"]


def test_a_rank_that_gives_up_withdraws_its_held_attach():
    """The second launch's rank timed out and left: once the live run detaches, its
    attach must not start an epoch for ranks that are gone."""
    from shadow.coordinator.attach import WITHDRAW

    sim = Sim()
    sim.running()
    _hb(sim)
    _attach(sim, b"second0")
    assert "job" in sim.state.pending
    sim.send(b"someone-else", "detach", epoch=WITHDRAW, rank=0)  # only from the rank's own connection
    assert "job" in sim.state.pending
    sim.send(b"second0", "detach", epoch=WITHDRAW, rank=0)
    assert "job" not in sim.state.pending
    sim.send(b"t0", "detach", epoch=1, rank=0)  # the first run ends
    sim.coord.attach.start_attaches()
    assert sim.state.epoch == 1 and sim.state.job is not None and sim.state.job.status == JobStatus.DETACHED


def test_resume_auto_starts_fresh_only_for_a_job_with_nothing_to_resume():
    """``jobs_hold`` (what ``resume='auto'`` decides on): a checkpoint anywhere, or a held job
    past its start, is resumed (a restore that cannot be done then fails saying why); a job
    held from iteration 0 that never committed one starts fresh."""
    from shadow.restore.resolve import jobs_hold

    sim = Sim()
    for i in range(2):
        sim.register(i)
    sim.attach()  # held, bootstrapping from iteration 0: nothing committed yet
    sim.send(b"op", "jobs")
    rows = sim.out.last("jobs_reply", b"op")["jobs"]
    assert rows[0]["base"] == 0 and rows[0]["committed"] is None
    assert not jobs_hold(rows, "job") and not jobs_hold(rows, None)
    sim.configured(b"w0", b"w1")
    sim.prepared(b"w0", 0)
    sim.prepared(b"w1", 0)
    sim.send(b"op", "jobs")
    rows = sim.out.last("jobs_reply", b"op")["jobs"]
    assert jobs_hold(rows, "job") and not jobs_hold(rows, "other")
    # a re-attach at 54 whose bootstrap did not finish, nothing restorable: held, never fresh
    resync = [{**rows[0], "committed": None, "base": 54, "restorable": {"memory": None}}]
    assert jobs_hold(resync, "job")
    assert jobs_hold([{"name": "gone", "held": False, "restorable": {"local": 8}}], "gone")
    assert jobs_hold([], "job", left_out=True) and not jobs_hold([], "job")


def _two_ranks_disagreeing(sim: Sim, prefix: bytes) -> None:
    """A launch of 2 ranks whose attaches name iterations 3 and 4."""
    for rank, iteration in ((0, 3), (1, 4)):
        sim.send(
            b"%s%d" % (prefix, rank),
            "attach",
            job="job",
            rank=rank,
            world=2,
            layout_hash=LAYOUT.hash,
            layout=LAYOUT.to_dict() if rank == 0 else None,
            optim=OPTIM,
            iteration=iteration,
            overwrite=False,
            restored=None,
        )


def test_ranks_disagreeing_while_a_live_run_owns_the_job_are_refused_naming_that_run():
    """A second launch's ranks each restored from the live job's memory while it trained on,
    so they name different iterations: refused at once, and the message names the live run
    (the cause to fix), not only the disagreement."""
    sim = Sim()
    sim.running()
    _hb(sim)
    _two_ranks_disagreeing(sim, b"second")
    for rank in range(2):
        err = sim.out.last("error", b"second%d" % rank)["message"]
        assert err.startswith("ranks disagree on world size, layout or start iteration; ")
        assert "is owned by a live run" in err and "overwrite=True neither" in err
        assert "shadow drop job=job force=true" in err
    assert sim.state.epoch == 1 and sim.state.job is not None and sim.state.job.status == JobStatus.RUNNING

    _silent(sim)  # no live owner: the disagreement alone
    _two_ranks_disagreeing(sim, b"third")
    assert sim.out.last("error", b"third0")["message"] == "ranks disagree on world size, layout or start iteration"
