"""``shadow jobs`` and ``shadow drop``: a job whose trainers crashed never detaches, and the
coordinator (which holds one job) refused every other job name until it was restarted.

The units drive the coordinator through ``on_message`` with a recording outbox (no
processes): what ``jobs`` shows, when ``drop`` is refused and why, what it keeps, and what a
rank of a dropped job hears when it comes back. The end-to-end tests run a real cluster: a
trainer SIGKILLed, another job refused, ``shadow drop`` letting it attach, the dropped
job's checkpoints still listed by ``shadow ls``; and on a cluster with CURVE keys, drop
refused to a client key and taken from an admin key."""

from __future__ import annotations

import json
import time

import pytest

from shadow.coordinator.jobs import jobs_view
from shadow.coordinator.records import JobStatus
from shadow.coordinator.trainers import heard_window_s
from tests.coordinator.test_coordinator_parts import LAYOUT, OPTIM, Sim


def _attach(sim: Sim, name: str, ident: bytes = b"n0", overwrite: bool = False, world: int = 1, rank: int = 0) -> None:
    sim.send(
        ident,
        "attach",
        job=name,
        rank=rank,
        world=world,
        layout_hash=LAYOUT.hash,
        layout=LAYOUT.to_dict() if rank == 0 else None,
        optim=OPTIM,
        iteration=0,
        overwrite=overwrite,
        restored=None,
    )


def _hb(sim: Sim, ident: bytes = b"t0", epoch: int | None = None, rank: int = 0) -> None:
    job = sim.state.job
    assert job is not None
    sim.send(
        ident,
        "trainer_hb",
        epoch=job.epoch if epoch is None else epoch,
        rank=rank,
        world=1,
        job_id=job.job_id,
        seq=[0, 0],
    )


def _silent(sim: Sim) -> None:
    """Every rank of the held job last heard from longer ago than the liveness window (as a
    crashed trainer's would be), without waiting for it."""
    job = sim.state.job
    assert job is not None
    past = time.monotonic() - heard_window_s(sim.state.tuning) - 1.0
    job.created = past
    job.heard = dict.fromkeys(job.heard, past)


def _drop(sim: Sim, name: str = "job", force: bool = False, ident: bytes = b"op") -> None:
    sim.send(ident, "drop", job=name, force=force)


def _jobs(sim: Sim) -> dict:
    sim.send(b"op", "jobs")
    return sim.out.last("jobs_reply", b"op")


def test_drop_is_refused_while_the_trainers_are_heard_and_detaches_once_they_are_gone():
    sim = Sim()
    sim.running()
    job = sim.state.job
    assert job is not None
    _hb(sim)
    row = _jobs(sim)["jobs"][0]
    assert (row["name"], row["held"], row["status"], row["epoch"], row["world"]) == ("job", True, "running", 1, 1)
    assert (row["committed"], row["ranks_heard"], row["trainers_gone"]) == (0, 1, False)
    assert row["restorable"] == {"memory": 0} and row["last_heard_s"] < 1.0

    _drop(sim)
    err = sim.out.last("error", b"op")
    assert err["code"] == "refused"
    assert "job 'job' is still heard from: rank 0 of 1 sent a heartbeat within the last 5 s" in err["message"]
    assert "SHADOW_WORKER_LOST_S" in err["message"] and "force=true" in err["message"]
    assert job.status == JobStatus.RUNNING and not job.dropped

    _attach(sim, "other")  # the crash this is about: another job name is refused while the job is held
    assert "has not detached" in sim.out.last("error", b"n0")["message"]

    _silent(sim)
    row = _jobs(sim)["jobs"][0]
    assert row["ranks_heard"] == 0 and row["trainers_gone"] is True and row["last_heard_s"] > 5.0
    sim.out.clear()
    _drop(sim)
    reply = sim.out.last("drop_reply", b"op")
    assert (reply["job"], reply["epoch"], reply["committed"], reply["forced"]) == ("job", 1, 0, False)
    assert "another job may now attach without overwrite=True" in reply["message"]
    assert job.status == JobStatus.DETACHED and "was dropped" in job.dropped
    assert sim.out.last("degraded", b"t0")["reason"] == job.dropped  # were it alive, it would stop streaming
    assert "resync" not in sim.out.kinds()

    sim.send(b"r", "restore_info", job="job")  # memory still serves the dropped job's cut
    assert sim.out.last("restore_info_reply", b"r")["info"]["memory"]["iteration"] == 0
    row = _jobs(sim)["jobs"][0]
    assert row["status"] == "detached" and row["dropped"] and row["restorable"]["memory"] == 0

    _attach(sim, "other")  # without overwrite: the drop let it in
    assert sim.state.job.name == "other" and sim.out.last("configure", b"w0")["job"] == "other"
    assert sim.state.retired is not None and sim.state.retired["job"] == "job"  # answers until "other" bootstraps
    rows = {r["name"]: r for r in _jobs(sim)["jobs"]}
    assert rows["other"]["held"] and rows["other"]["status"] == "configuring"
    assert rows["job"]["status"] == "replaced" and rows["job"]["restorable"]["memory"] == 0


def test_force_drops_a_job_whose_trainers_are_heard_and_they_are_told():
    sim = Sim()
    sim.running()
    _hb(sim)
    _drop(sim, force=True)
    reply = sim.out.last("drop_reply", b"op")
    assert reply["forced"] is True and "although rank 0 of 1 still heartbeat" in reply["message"]
    assert "force=true" in sim.out.last("degraded", b"t0")["reason"]
    assert sim.state.job.status == JobStatus.DETACHED


def test_drop_refusals_name_the_cause():
    sim = Sim()
    for i in range(2):
        sim.register(i)
    _drop(sim, "nothing")
    assert (
        "the cluster holds no job, and knows no job 'nothing'; `shadow jobs` lists" in sim.out.last("error")["message"]
    )
    _drop(sim, "../escape")
    assert "job name '../escape' is not allowed" in sim.out.last("error")["message"]

    _attach(sim, "half", world=2)  # one of two ranks: held, not attached
    _drop(sim, "half")
    text = sim.out.last("error", b"op")["message"]
    assert "job 'half' is not attached: its attach waits for its ranks (1 of 2 arrived)" in text
    assert "SHADOW_CONNECT_TIMEOUT_S" in text
    row = next(r for r in _jobs(sim)["jobs"] if r["name"] == "half")
    assert (row["status"], row["held"], row["ranks_heard"], row["world"]) == ("attaching", False, 1, 2)

    sim.state.pending.clear()
    sim.attach()
    sim.configured(b"w0", b"w1")
    _drop(sim, "another")
    assert "the cluster holds job 'job' (bootstrapping), and knows no job 'another'" in sim.out.last("error")["message"]
    sim.send(b"t0", "detach", epoch=sim.state.epoch, rank=0)  # the ranks closed their sessions
    assert sim.state.job.status == JobStatus.DETACHED
    _drop(sim)
    reply = sim.out.last("drop_reply", b"op")
    assert "already detached (its ranks closed)" in reply["message"] and reply["committed"] is None


def test_jobs_known_only_from_the_tiers_are_listed_and_cannot_be_dropped(tmp_path):
    from tests.security.test_roles import _with_tier

    sim = _with_tier(tmp_path)
    tier = sim.coord.persist.tiers["local"]
    tier.complete.update({"job": 0, "old-run": 40, "older-run": 12})
    rows = _jobs(sim)["jobs"]
    assert [r["name"] for r in rows] == ["job", "old-run", "older-run"]
    assert rows[0]["restorable"] == {"memory": 0, "local": 0}
    assert rows[1]["status"] == "persisted" and rows[1]["restorable"] == {"memory": None, "local": 40}
    assert rows[1]["held"] is False and rows[1]["trainers_gone"] is None
    _drop(sim, "old-run")
    text = sim.out.last("error", b"op")["message"]
    assert "not job 'old-run': that one is known only from its checkpoints in the local tier" in text

    rows, left = jobs_view(sim.state, sim.coord.persist, budget=400)  # a reply that would not fit
    assert rows[0]["name"] == "job" and left == 3 - len(rows) and left > 0


def test_a_trainer_of_a_dropped_job_that_comes_back_corrupts_nothing():
    """Its heartbeats are answered ``degraded`` (it stops streaming) and never ``resync``
    (which would re-attach it with overwrite); what it says is ignored; once another job
    attached, its epoch is one the coordinator does not hold."""
    sim = Sim()
    sim.running()
    job = sim.state.job
    assert job is not None
    _silent(sim)
    _drop(sim)
    sim.out.clear()
    _hb(sim)
    assert sim.out.kinds(b"t0") == ["alive", "degraded"] and sim.out.last("degraded")["reason"] == job.dropped
    assert job.heard[0] > time.monotonic() - 1  # shadow jobs sees it heard again
    sim.send(b"t0", "paused", epoch=job.epoch, rank=0, reason="back")
    sim.send(b"t0", "lagging", epoch=job.epoch, rank=0, iteration=5, applied=0)
    assert job.status == JobStatus.DETACHED and "resync" not in sim.out.kinds()

    _attach(sim, "other")
    sim.configured(b"w0", b"w1")
    assert sim.state.job.name == "other"
    sim.out.clear()
    sim.send(b"t0", "trainer_hb", epoch=job.epoch, rank=0, world=1, job_id=job.job_id, seq=[5, 5])
    assert sim.out.kinds(b"t0") == ["alive", "degraded"]  # no resync: the new job is not replaced
    assert "does not hold this session" in sim.out.last("degraded", b"t0")["reason"]
    sim.send(b"w0", "prepared", epoch=job.epoch, iteration=3, tokens=None)  # a late frame of the old epoch
    assert sim.state.job.name == "other" and sim.state.job.cut == -1 and sim.state.workers[0].prepared == -1


# -- end to end: a real cluster, a real trainer killed, the CLI ----------------------------


def _jobs_of(address: str, keys=None, timeout: float = 5.0) -> dict:
    """The coordinator's ``jobs_reply`` at ``address``: one bounded request, as a client
    (``keys``, default this user's client pair, as ``shadow jobs`` asks a default cluster)."""
    from shadow.security import keyset
    from shadow.transport import SocketFactory, fetch_limit
    from shadow.wire import messages as M

    s = SocketFactory(keys=keys or keyset.ensure().client("client")).dealer(address, fetch_limit())
    try:
        s.send(M.encode("jobs"))
        if not s.poll(int(timeout * 1000)):
            raise TimeoutError(f"no jobs reply from {address} within {timeout:.1f} s")
        return M.decode(s.recv())
    finally:
        s.close(linger=0)


def _row(reply: dict, name: str) -> dict:
    return next(r for r in reply["jobs"] if r["name"] == name)


@pytest.mark.slow
def test_a_crashed_job_is_dropped_and_another_job_attaches_without_a_restart(world1, tmp_path):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import trainer_hooks
    from shadow.testing import LocalCluster, wait_until
    from tests.conftest import rank_logs, run_ranks
    from tests.helpers.cli import shadow_cli
    from tests.helpers.loop import train_step
    from tests.helpers.tiny_trainer import build

    tier = tmp_path / "tier"
    args = (f"persist.local.dir={tier}", "persist.local.every_n=2", "persist.local.keep=0")
    with LocalCluster(tmp_path, args=args) as cluster:
        at = f"address={cluster.address}"
        # a live trainer: drop is refused, and shadow jobs says it is heard from
        model, opt, sched = build()
        ddp = DDP(model)
        session = trainer_hooks.attach(ddp, opt, coordinator=cluster.address, scheduler=sched, job="alive")
        for it in range(1, 4):
            train_step(ddp, opt, sched, it)
        cluster.wait_caught_up(3)
        res = shadow_cli("drop", "job=alive", at)
        assert res.returncode == 1 and "job 'alive' is still heard from: rank 0 of 1" in res.stderr, res.stderr
        assert "force=true" in res.stderr
        row = _row(json.loads(shadow_cli("jobs", at, "--json").stdout), "alive")
        assert row["held"] and row["status"] == "running" and row["ranks_heard"] == 1 and not row["trainers_gone"]
        assert session.close() == 3

        # a trainer SIGKILLed mid-run: its job never detaches
        codes = run_ranks(
            tmp_path, "--coordinator", cluster.address, "--steps", "30", "--kill-at", "7", "--out",
            str(tmp_path / "crashed"), "--job", "crashed", world=1,
        )  # fmt: skip
        assert codes == [-9], rank_logs(tmp_path)
        quiet = cluster.wait_quiet()["job"]  # what it had sent when it died
        assert quiet["name"] == "crashed" and quiet["status"] == "running"
        committed = quiet["committed"]
        assert 4 <= committed <= 7

        def crashed_gone() -> dict | None:
            reply = _jobs_of(cluster.address)
            return reply if _row(reply, "crashed")["trainers_gone"] else None

        gone = wait_until(crashed_gone, 60, "shadow jobs seeing the trainers of job 'crashed' gone")
        row = _row(gone, "crashed")
        assert (row["held"], row["status"], row["committed"], row["ranks_heard"]) == (True, "running", committed, 0)
        assert row["restorable"]["memory"] == committed and row["last_heard_s"] >= gone["window_s"]
        assert _row(gone, "alive")["status"] == "persisted"  # known from the local tier only, now
        text = shadow_cli("jobs", at).stdout
        assert "gone" in text and f"shadow drop job=crashed {at}" in text, text

        res = shadow_cli("drop", "job=crashed", at)
        assert res.returncode == 0, res.stderr
        assert f"job 'crashed' epoch {quiet['epoch']} (running) detached" in res.stdout
        assert f"keeps iteration {committed} in memory" in res.stdout
        listed = json.loads(shadow_cli("ls", f"source={cluster.address}", "--json").stdout)
        assert {"job": "crashed", "iteration": committed, "tier": "memory"}.items() <= listed[0].items()

        # another job attaches, without overwrite and without a restart
        other, oopt, osched = build(seed=3)
        ddp = DDP(other)
        session = trainer_hooks.attach(ddp, oopt, coordinator=cluster.address, scheduler=osched, job="next")
        for it in range(1, 3):
            train_step(ddp, oopt, osched, it)
        assert session.close() == 2
        listed = json.loads(shadow_cli("ls", f"source={cluster.address}", "--json").stdout)
        kept = sorted(r["iteration"] for r in listed if r["job"] == "crashed" and r["tier"] == "local")
        # its checkpoints, untouched, and its last iteration, written before "next" took the memory
        assert kept and kept[-1] == committed, listed
        assert all(r["state"] == "complete" for r in listed if r["job"] == "crashed")
        assert [(r["job"], r["iteration"]) for r in listed if r["tier"] == "memory"] == [("next", 2)]
        reply = _jobs_of(cluster.address)
        assert _row(reply, "next")["held"] and _row(reply, "crashed")["status"] == "persisted"


@pytest.mark.slow
def test_drop_on_a_keyed_cluster_takes_an_admin_key_not_a_client_key(world1, tmp_path):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import trainer_hooks
    from shadow import security
    from shadow.testing import LocalCluster, wait_until
    from tests.helpers.cli import shadow_cli
    from tests.helpers.loop import train_step
    from tests.helpers.tiny_trainer import build
    from tests.slow.test_curve_cluster import role_keys

    root = tmp_path / "keys"
    keys = role_keys(root)
    client = (
        f"security.server_public={root / 'server.key'}",
        f"security.client_key={root / 'clients/client.key_secret'}",
    )
    admin = (f"security.server_public={root / 'server.key'}", f"security.client_key={root / 'admins/admin.key_secret'}")
    cluster = LocalCluster(tmp_path, args=keys["args"], keys=keys["admin"])
    security.set_client(keys["trainer"])
    try:
        at = f"address={cluster.address}"
        model, opt, sched = build()
        ddp = DDP(model)
        session = trainer_hooks.attach(ddp, opt, coordinator=cluster.address, scheduler=sched, job="keyed")
        for it in range(1, 4):
            train_step(ddp, opt, sched, it)
        cluster.wait_caught_up(3)

        res = shadow_cli("jobs", at, *client, "--json")  # a client may list
        assert res.returncode == 0, res.stderr
        assert _row(json.loads(res.stdout), "keyed")["ranks_heard"] == 1
        res = shadow_cli("drop", "job=keyed", "force=true", at, *client)
        assert res.returncode == 1 and "a client may not send 'drop' messages" in res.stderr, res.stderr
        assert "security.allow_admins" in res.stderr
        res = shadow_cli("drop", "job=keyed", at, *admin)  # an admin, but its trainer is alive
        assert res.returncode == 1 and "still heard from" in res.stderr, res.stderr
        assert cluster.status()["job"]["status"] == "running"
        assert cluster.status()["security"]["refused_by_role"] == {"client/role": 1}

        res = shadow_cli("drop", "job=keyed", "force=true", at, *admin, "--json")
        assert res.returncode == 0, res.stderr
        reply = json.loads(res.stdout)
        assert (reply["job"], reply["committed"], reply["forced"]) == ("keyed", 3, True)
        assert cluster.status()["job"]["status"] == "detached"
        # the live trainer of the dropped job is told, stops streaming and trains on; nothing moves
        wait_until(lambda: session.degraded, 30, "the dropped job's trainer hearing it was dropped")
        assert "was dropped from the shadow cluster" in session.degraded
        for it in range(4, 6):
            train_step(ddp, opt, sched, it)
        fresh, fopt, fsched = build(seed=3)
        info = trainer_hooks.restore(fresh, fopt, source=cluster.address, scheduler=fsched, job="keyed")
        assert info.iteration == 3 and info.tier == "memory"
        session.close()
        assert cluster.status()["job"]["committed"] == 3
    finally:
        security.reset_client()
        cluster.stop()
