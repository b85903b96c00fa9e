"""Frames forged with the live job, epoch, layout and sequence numbers: a malformed
commit at the next valid sequence number, a frame far ahead of the expected sequence
number or iteration. None of them may kill a worker, make a healthy replica stale or
change what a restore returns."""

from __future__ import annotations

import time

import msgpack
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import trainer_hooks
from shadow.testing import pid_alive
from shadow.wire import frames as F
from tests.conftest import capture_commits
from tests.helpers import doors
from tests.helpers.doors import rank_door
from tests.helpers.loop import train_step
from tests.helpers.tiny_trainer import build

pytestmark = pytest.mark.slow


def _push(endpoint: str, frames: list, door) -> None:
    """``frames`` at a worker's data socket, through its door with ``door`` (a rank's)."""
    s = doors.push(endpoint, door)
    s.send_multipart(frames)
    s.close()


def _commit_frame(session, worker: int, iteration: int, seq: int, body: bytes) -> list:
    """A COMMIT frame tagged as the rank tags its own (a default cluster's data socket takes
    frames under the rank's MAC keys only: this is a rank gone rogue)."""
    tagger = session.sender.tags[worker]
    nonce = tagger.nonce()
    h = F.Header(
        F.Kind.COMMIT,
        F.Field.GRAD,
        session.job_id,
        session.epoch,
        0,
        1,
        session.layout.hash,
        iteration,
        seq,
        ((0, len(body), tagger.tag(nonce, 1, body)),),
        nonce,
    )
    return [h.pack(tagger), body]


def _worker_rejected(cluster, worker: int, reason: str, at_least: int = 1, limit: float = 10.0) -> dict:
    deadline = time.monotonic() + limit
    while True:
        w = cluster.status()["workers"][worker]
        if w["rejected"].get(reason, 0) >= at_least or time.monotonic() > deadline:
            return w
        time.sleep(0.1)


def test_malformed_audit_at_the_next_sequence_number_is_rejected(world1, shared_cluster, job, monkeypatch):
    """Row 1: a COMMIT whose audit ``values`` is ``[]``, at the next valid sequence number,
    for a step that would otherwise be complete (every parameter skipped, nothing sent).
    It used to pass decoding, be prepared and applied, and kill the worker in the audit."""
    commits = capture_commits(monkeypatch)
    model, opt, sched = build()
    ddp = DDP(model)
    session = trainer_hooks.attach(ddp, opt, coordinator=shared_cluster.address, scheduler=sched, job=job)
    for it in range(1, 4):
        train_step(ddp, opt, sched, it)
    assert session.close() == 3
    seq = list(session.sender.seq)  # after close: the last commit has been sent
    before = shared_cluster.wait_caught_up(3)
    k, bodies = commits[-1]
    assert k == 3
    for w, body in enumerate(bodies):
        rec = msgpack.unpackb(body, raw=False, strict_map_key=False)
        replay = rec["replay"]
        replay.update(
            iteration=4,
            sent=0,
            extras=0,
            skipped=list(range(len(session.layout.params))),
            audit={"positions": [before["workers"][w]["start"]], "values": []},
        )
        forged = msgpack.packb({"replay": replay, "blob": rec.get("blob")}, use_bin_type=True)
        _push(before["workers"][w]["data"], _commit_frame(session, w, 4, seq[w], forged), rank_door(session, w))
    for w in range(len(bodies)):
        _worker_rejected(
            shared_cluster, w, "bad_commit", at_least=before["workers"][w]["rejected"].get("bad_commit", 0) + 1
        )
    time.sleep(1.0)  # an apply, had the commit been taken, would have run by now
    after = shared_cluster.status()
    for w0, w1 in zip(before["workers"], after["workers"], strict=True):
        assert pid_alive(w0["pid"]) and w1["pid"] == w0["pid"] and w1["health"] == "ok", w1
        assert w1["rejected"].get("bad_commit", 0) > w0["rejected"].get("bad_commit", 0) and w1["applied"] == 3, w1
    assert after["job"]["committed"] == 3
    fresh, fopt, _ = build(seed=8)
    assert trainer_hooks.restore(fresh, fopt, source=shared_cluster.address, job=job).iteration == 3
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_frames_far_ahead_do_not_make_a_healthy_replica_stale(world1, shared_cluster, job):
    """Row 11: a GRAD frame with ``seq=2**40`` (and one with an iteration far ahead) for the
    live epoch, sent while the job trains. They used to make the worker stale, the job
    degraded and the trainers resync; now they are dropped and counted."""
    model, opt, sched = build()
    ddp = DDP(model)
    session = trainer_hooks.attach(ddp, opt, coordinator=shared_cluster.address, scheduler=sched, job=job)
    for it in range(1, 4):
        train_step(ddp, opt, sched, it)
    st = shared_cluster.status()
    epoch = st["job"]["epoch"]
    w = st["workers"][0]
    payload = torch.zeros(4).numpy()
    tagger = session.sender.tags[0]  # tagged as the rank tags its own: a rank gone rogue
    for seq, iteration in ((2**40, 4), (2**40 + 1, 5), (session.sender.seq[0] + 10**6, 4), (0, 2**40)):
        nonce = tagger.nonce()
        h = F.Header(
            F.Kind.GRAD,
            F.Field.GRAD,
            session.job_id,
            session.epoch,
            0,
            1,
            session.layout.hash,
            iteration,
            seq,
            ((w["start"], 4, tagger.tag(nonce, 1, payload.tobytes())),),
            nonce,
        )
        _push(w["data"], [h.pack(tagger), payload.tobytes()], rank_door(session, 0))
    far = w["rejected"].get("out_of_window", 0)  # the counters are the worker's, since it started
    w1 = _worker_rejected(shared_cluster, 0, "out_of_window", at_least=far + 4)
    assert w1["rejected"].get("out_of_window", 0) - far >= 4, w1
    for it in range(4, 8):
        train_step(ddp, opt, sched, it)
    assert session.close() == 7
    after = shared_cluster.wait_caught_up(7)
    assert after["job"]["epoch"] == epoch and after["job"]["resyncs"] == 0, after["job"]
    assert all(x["health"] == "ok" and not x["stale"] for x in after["workers"]), after["workers"]
    fresh, fopt, _ = build(seed=8)
    assert trainer_hooks.restore(fresh, fopt, source=shared_cluster.address, job=job).iteration == 7
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
