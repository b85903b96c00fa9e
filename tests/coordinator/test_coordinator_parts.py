"""The coordinator's sequences as unit tests: no processes, no sockets. A
:class:`~shadow.coordinator.server.Coordinator` is driven through ``on_message`` with
encoded messages, and what it sends is read back from a recording outbox."""

from __future__ import annotations

import dataclasses
import time

import pytest

from shadow.config import LocalTierConfig, PersistConfig
from shadow.config.tuning import Tuning
from shadow.coordinator.outbox import RecordingOutbox
from shadow.coordinator.queries import status_view
from shadow.coordinator.rebuild import rebuild_job
from shadow.coordinator.records import JobStatus, JoinStage, WorkerRec
from shadow.coordinator.routes import ROUTES
from shadow.coordinator.server import Coordinator
from shadow.core.layout import Layout, shard_bounds
from shadow.wire import messages as M

OPTIM = {"kind": "adam", "impl": "fused", "vec_width": 8, "tail_width": 1}
LAYOUT = Layout.build([(f"p{i}", (1000,), 0, True) for i in range(4)], 1)
BOUNDS = [tuple(b) for b in shard_bounds(LAYOUT.total, 2)]


class Sim:
    """A coordinator, its outbox, and helpers that speak for workers (``w<i>``) and trainer
    ranks (``t<r>``)."""

    def __init__(self, workers: int = 2, replicas: int = 1, persist=None, tuning=None) -> None:
        self.out = RecordingOutbox()
        self.coord = Coordinator(
            "tcp://127.0.0.1:1", workers=workers, replicas=replicas, outbox=self.out, persist=persist, tuning=tuning
        )
        self.state = self.coord.state

    def send(self, ident: bytes, kind: str, **fields) -> None:
        self.coord.on_message([ident, M.encode(kind, **fields)])

    def register(self, i: int, ident: bytes | None = None, pid: int | None = None) -> None:
        """Worker ``i`` registers (again: with the slot token it kept, as a restarted one does)."""
        held = [w.slot_token for w in self.state.workers if w.id == i and w.slot_token is not None]
        self.send(
            ident or b"w%d" % i,
            "register",
            data=f"tcp://127.0.0.1:{7000 + i}",
            serve=f"tcp://127.0.0.1:{8000 + i}",
            pid=pid or 100 + i,
            worker_id=i,
            memory=-1,
            **({"slot_token": held[0]} if held else {}),
        )

    def attach(self, world: int = 1, iteration: int = 0, ident: bytes = b"t", restored: dict | None = None) -> None:
        """Each of ``world`` ranks attaches (from ``<ident><rank>``), saying it ``restored``."""
        for r in range(world):
            self.send(
                ident + b"%d" % r,
                "attach",
                job="job",
                rank=r,
                world=world,
                layout_hash=LAYOUT.hash,
                layout=LAYOUT.to_dict() if r == 0 else None,
                optim=OPTIM,
                iteration=iteration,
                overwrite=False,
                restored=restored,
            )

    def configured(self, *idents: bytes) -> None:
        for ident in idents:
            self.send(ident, "configured", epoch=self.state.epoch)

    def prepared(self, ident: bytes, iteration: int) -> None:
        self.send(ident, "prepared", epoch=self.state.epoch, iteration=iteration, tokens=None)

    def heartbeat(self, ident: bytes) -> None:
        w = self.state.worker(ident)
        assert w is not None
        self.send(
            ident,
            "heartbeat",
            epoch=self.state.epoch,
            applied=w.applied,
            seen=w.prepared,
            rejected={},
            frames_in=0,
            bytes_in=0,
            stale="",
            seq=[],
            replay_s=0.0,
            replayed=0,
            memory=-1,
        )

    def running(self, workers: int = 2) -> None:
        """Register ``workers``, attach one rank and commit iteration 0."""
        for i in range(workers):
            self.register(i)
        self.attach()
        self.configured(*(b"w%d" % i for i in range(workers)))
        for i in range(workers):
            self.prepared(b"w%d" % i, 0)
        assert self.state.job is not None and self.state.job.cut == 0
        self.out.clear()


def test_routes_cover_what_the_coordinator_receives():
    sim = Sim()
    assert set(ROUTES) == set(M.RECEIVES["coordinator"])
    assert set(sim.coord.routes) == set(ROUTES) and all(callable(h) for h in sim.coord.routes.values())
    sim.send(b"x", "fetch", epoch=0, iteration=0)  # a message of another socket
    assert sim.state.rejected["unexpected"] == 1 and sim.out.kinds() == ["error"]
    sim.send(b"x", "prepared", epoch=0, iteration=0, tokens=None)  # a worker's message from no worker
    assert sim.state.rejected["not_a_worker"] == 1 and sim.out.kinds() == ["error"]


def test_the_cut_waits_for_every_worker():
    sim = Sim(workers=2)
    sim.register(0)
    sim.attach()
    assert sim.out.kinds(b"t0") == ["waiting"]  # one of two workers ready: held, not refused
    sim.register(1)
    configures = [sim.out.last("configure", b"w%d" % i) for i in range(2)]
    assert [(c["start"], c["stop"]) for c in configures] == BOUNDS and BOUNDS[0][1] > 0
    assert sim.state.job is not None and sim.state.job.status == JobStatus.CONFIGURING
    sim.configured(b"w0")
    assert "attached" not in sim.out.kinds(b"t0")
    sim.configured(b"w1")
    assert sim.out.last("attached", b"t0")["workers"][1]["start"] == BOUNDS[1][0]
    assert sim.state.job.status == JobStatus.BOOTSTRAPPING
    sim.prepared(b"w0", 0)
    sim.prepared(b"w0", 1)
    assert "apply" not in sim.out.kinds()
    sim.prepared(b"w1", 0)
    assert sim.out.last("apply", b"w0") == {"epoch": 1, "iteration": 0, "persist": False}
    assert sim.out.last("apply", b"w1")["iteration"] == 0
    assert sim.out.last("progress", b"t0") == {"epoch": 1, "applied": 0}
    assert sim.state.job.status == JobStatus.RUNNING
    sim.prepared(b"w1", 1)
    assert sim.out.last("progress", b"t0")["applied"] == 1
    view = status_view(sim.state, sim.coord.persist)
    assert view["job"]["committed"] == 1 and view["job"]["status"] == "running"
    assert view["restorable"]["memory"] == 1


def test_degrade_freezes_the_cut_and_a_resync_follows_once_every_worker_answers():
    sim = Sim(workers=2)
    sim.running()
    sim.send(b"w1", "stale", epoch=1, reason="checksum mismatch")
    job = sim.state.job
    assert job is not None and job.status == JobStatus.DEGRADED
    assert "checkpoint frozen at 0" in sim.out.last("degraded", b"t0")["reason"]
    assert "resync" not in sim.out.kinds()  # no worker has answered since the failure
    sim.prepared(b"w0", 1)
    sim.prepared(b"w1", 1)
    assert job.cut == 1  # prepared still moves the cut: what was prepared before the failure is whole
    time.sleep(0.001)
    sim.heartbeat(b"w0")
    assert "resync" not in sim.out.kinds()
    sim.heartbeat(b"w1")
    assert sim.out.kinds(b"t0")[-1] == "resync" and sim.state.resyncs == {"job": 1}
    sim.heartbeat(b"w1")
    assert sim.out.kinds(b"t0").count("resync") == 1  # asked once


def test_a_restarted_replica_joins_from_its_peer():
    sim = Sim(workers=2, replicas=2)
    sim.running()
    sim.register(1, ident=b"w1-new", pid=999)  # another process asks for slot 1 while its holder is connected
    assert sim.out.last("error", b"w1-new")["code"] == "busy" and sim.state.refused == {("peer", "slot_taken"): 1}
    assert sim.out.last("error", b"w1")["message"].startswith("another process (pid 999)")  # the holder hears of it
    assert sim.state.workers[1].ident == b"w1" and sim.out.kinds(b"t0") == []
    sim.out.gone.add(b"w1")  # the process in slot 1 died: its connection is closed
    sim.register(1, ident=b"w1-new", pid=999)  # its restart takes the slot back
    registered = sim.out.last("registered", b"w1-new")
    assert registered == {"worker_id": 1, "awaiting_copy": True, "slot_token": registered["slot_token"]}
    assert sim.out.kinds(b"t0") == ["replica_out", "replica_in"]
    gen = sim.out.last("replica_in", b"t0")["gen"]
    join = sim.state.job.joining[1]
    assert join.stage is JoinStage.VOTING and join.gen == gen
    sim.send(b"t0", "replica_from", epoch=1, rank=0, worker=1, gen=gen - 1, iteration=2)  # an older join's vote
    assert join.starts == {} and "configure" not in sim.out.kinds(b"w1-new")
    sim.send(b"t0", "replica_from", epoch=1, rank=0, worker=1, gen=gen, iteration=2)
    assert join.stage is JoinStage.COPYING and join.at == 1 and join.starts == {0: 2}
    configure = sim.out.last("configure", b"w1-new")
    assert configure["iteration"] == 1 and configure["peer"] == {"id": 0, "serve": "tcp://127.0.0.1:8000"}
    sim.prepared(b"w0", 1)
    sim.prepared(b"w0", 2)
    job = sim.state.job
    assert job is not None and job.cut == 1  # held at the copied iteration while the copy runs
    assert sim.out.kinds(b"w1-new").count("apply") == 0  # the joining replica is out of service
    sim.send(b"w1-new", "copied", epoch=1, iteration=1, seconds=0.1)
    assert job.cut_ceiling is None and job.cut == 1
    assert status_view(sim.state, sim.coord.persist)["workers"][1]["health"] == "ok"
    sim.prepared(b"w1-new", 2)
    assert job.cut == 2 and sim.out.last("apply", b"w1-new")["iteration"] == 2


def test_a_lost_replica_is_taken_out_and_the_shard_goes_on():
    sim = Sim(workers=2, replicas=2)
    sim.running()
    w1 = sim.state.workers[1]
    w1.last_seen -= 60  # silent for a minute
    sim.coord.tick()
    assert w1.lost and w1.out_of_service and sim.out.last("replica_out", b"t0") == {"epoch": 1, "worker": 1}
    job = sim.state.job
    assert job is not None and job.status == JobStatus.RUNNING
    sim.prepared(b"w0", 1)
    assert job.cut == 1  # the cut no longer waits for the lost replica


def _assignment(epoch: int, worker: int, applied: int, prepared: int, stale: str = "") -> dict:
    return {
        "configure": {
            "epoch": epoch,
            "job": "job",
            "job_id": 7,
            "layout": LAYOUT.to_dict(),
            "start": BOUNDS[worker][0],
            "stop": BOUNDS[worker][1],
            "world": 1,
            "optim": OPTIM,
            "iteration": 0,
            "persist": {"generation": 2},
            "shard": worker,
            "shards": 2,
            "peer": None,
        },
        "prepared": prepared,
        "applied": applied,
        "stale": stale,
    }


def test_a_restarted_coordinator_rebuilds_the_job_from_its_workers():
    sim = Sim(workers=2)
    for i, (applied, prepared) in enumerate([(5, 7), (4, 6)]):
        sim.send(
            b"w%d" % i,
            "rejoin",
            data=f"tcp://127.0.0.1:{7000 + i}",
            serve=f"tcp://127.0.0.1:{8000 + i}",
            pid=100 + i,
            worker_id=i,
            assignment=_assignment(3, i, applied, prepared),
            memory=-1,
        )
    job = sim.state.job
    assert job is not None and job.epoch == 3 and job.generation == 2 and sim.state.epoch == 3
    # the committed cut is the newest any worker applied; the next is what both prepared
    assert sim.out.last("apply", b"w1") == {"epoch": 3, "iteration": 6, "persist": False}
    assert job.cut == 6 and job.status == JobStatus.RUNNING


def test_rebuild_job_marks_workers_of_an_older_epoch_stale():
    workers = [WorkerRec(b"w%d" % i, i, "d", "s", 1, 0.0) for i in range(2)]
    workers[0].assignment = _assignment(3, 0, 5, 5)
    workers[1].assignment = _assignment(2, 1, 9, 9)
    job, stale = rebuild_job(workers, nshards=2)
    assert job is not None and job.epoch == 3 and job.cut == 5
    assert list(stale) == [1] and "holds no state of the current epoch" in stale[1]
    assert [tuple(r) for r in job.ranges] == BOUNDS
    assert rebuild_job([WorkerRec(b"w", 0, "d", "s", 1, 0.0)], nshards=1) == (None, {})


def test_status_view_only_reads():
    sim = Sim(workers=2)
    sim.running()
    before = (repr(sim.state.job), repr(sim.state.workers), sim.state.retired)
    assert status_view(sim.state, sim.coord.persist)["job"]["committed"] == 0
    assert (repr(sim.state.job), repr(sim.state.workers), sim.state.retired) == before
    assert sim.out.sent == []


@pytest.mark.parametrize("workers,replicas", [(0, 1), (3, 2)])
def test_cluster_shape_is_checked(workers, replicas):
    with pytest.raises(ValueError, match="worker"):
        Coordinator("tcp://127.0.0.1:1", workers=workers, replicas=replicas, outbox=RecordingOutbox())


def test_a_skipped_last_checkpoint_is_asked_for_again_once_nothing_newer_comes(tmp_path):
    """Every image busy when the last cut of a run was due: the workers skip it (not a
    failure) and no next cut comes to be due instead; the coordinator asks again for that
    very cut, which the workers still hold, rather than leaving the tier behind memory."""
    tuning = dataclasses.replace(Tuning.load(), heartbeat_s=0.0)
    sim = Sim(persist=PersistConfig(LocalTierConfig(dir=str(tmp_path), every_n=1)), tuning=tuning)
    sim.running()
    for i in range(2):
        sim.prepared(b"w%d" % i, 1)
    assert [sim.out.last("apply", b"w%d" % i)["persist"] for i in range(2)] == [True, True]
    sim.coord.cut.retry_persist()
    assert sim.out.kinds().count("apply") == 2  # nothing skipped yet: nothing asked again
    for i, (start, stop) in enumerate(BOUNDS):
        sim.send(
            b"w%d" % i,
            "persisted",
            epoch=sim.state.epoch,
            iteration=1,
            tier="local",
            shard=i,
            ok=False,
            error="skipped: earlier checkpoint writes are still running",
            file="",
            start=start,
            stop=stop,
            bytes=0,
            checksum="",
            seconds=0.0,
            commit=None,
            blob_ranks=[],
            skipped=True,
        )
    sim.out.clear()
    sim.coord.cut.retry_persist()
    assert [sim.out.last("apply", b"w%d" % i) for i in range(2)] == [{"epoch": 1, "iteration": 1, "persist": True}] * 2
    sim.out.clear()
    sim.coord.cut.retry_persist()  # asked, in flight: not again
    assert sim.out.kinds() == []
