"""The coordinator survives its input (issue 15 rows 2 and 5): a handler or periodic step
that raises is counted and the loop goes on; an attach the workers could not hold is
refused before anything changes; held attaches are bounded; a tier whose start-up scan
failed refuses attaches instead of passing for empty."""

from __future__ import annotations

import os
import threading
import time

import pytest
from torch.nn.parallel import DistributedDataParallel as DDP

import trainer_hooks
from shadow.config import PersistConfig
from shadow.config.tuning import Tuning
from shadow.coordinator.outbox import RecordingOutbox
from shadow.coordinator.persistence import Persistence
from shadow.coordinator.server import Coordinator
from shadow.core.layout import Layout
from shadow.testing import LocalCluster, free_port, pid_alive, rss_bytes, status
from shadow.transport import SocketFactory, fetch_limit
from shadow.wire import messages as M
from tests.helpers.loop import train_step
from tests.helpers.tiny_trainer import build

OPTIM = {"kind": "adam", "impl": "fused", "vec_width": 8, "tail_width": 1}


def _dealer(address: str):
    """A trainer's connection: this user's key set (as a default cluster admits), or none in a
    ``keyless`` test."""
    return SocketFactory().dealer(address, fetch_limit())


def _recv(sock, timeout: float = 10.0) -> dict:
    assert sock.poll(timeout * 1000), "no answer from the coordinator"
    return M.decode(sock.recv())


def _attach(job: str, layout: Layout, rank: int = 0, world: int = 1) -> bytes:
    return M.encode(
        "attach",
        job=job,
        rank=rank,
        world=world,
        layout_hash=layout.hash,
        layout=layout.to_dict() if rank == 0 else None,
        optim=OPTIM,
        iteration=0,
        overwrite=False,
        restored=None,
    )


def test_handler_and_periodic_failures_are_counted_and_the_loop_goes_on(keyless):
    address = f"tcp://127.0.0.1:{free_port()}"
    coord = Coordinator(address, workers=1)
    calls = {"status": 0}
    real_status = coord.routes["status"]

    def flaky_status(env, msg):  # the first status raises, as a bug meeting an input would
        calls["status"] += 1
        if calls["status"] == 1:
            raise KeyError("boom")
        real_status(env, msg)

    def broken_check():
        raise ZeroDivisionError("state built from a message")

    coord.routes["status"] = flaky_status
    coord.periodic["check_workers"] = broken_check
    thread = threading.Thread(target=coord.run, daemon=True)
    thread.start()
    try:
        s = _dealer(address)
        s.send(M.encode("status"))
        reply = _recv(s)
        assert (
            reply["t"] == "error"
            and reply["code"] == "internal"
            and "KeyError" in reply["message"]
            and "status" in reply["message"]
        )
        time.sleep(0.5)  # a few rounds of the failing periodic step
        assert thread.is_alive()
        st = status(address)
        assert st["rejected"]["handler_status"] == 1
        assert st["rejected"]["periodic_check_workers"] >= 2
        # what only a worker sends, from anyone else: counted and dropped
        s.send(
            M.encode("audited", epoch=0, iteration=1, ok=False, checked=1, max_ulp=0, first_param="p", detail="forged")
        )
        time.sleep(0.3)
        assert status(address)["rejected"]["not_a_worker"] == 1
        s.close(linger=0)
    finally:
        coord.stop()
        thread.join(timeout=5)


@pytest.mark.slow
def test_layout_beyond_the_workers_memory_is_refused_and_the_live_job_goes_on(world1, shared_cluster, job):
    """Row 2: an attach declaring a 10^13-element layout killed a worker and replaced the job."""
    model, opt, sched = build()
    ddp = DDP(model)
    session = trainer_hooks.attach(ddp, opt, coordinator=shared_cluster.address, scheduler=sched, job=job)
    for it in range(1, 4):
        train_step(ddp, opt, sched, it)
    before = shared_cluster.status()
    pids = [w["pid"] for w in before["workers"]]
    huge = Layout.build([("w", (10**13,), 0, True)], 1)
    s = _dealer(shared_cluster.address)
    for name in (f"{job}.other", job):  # another job, and the live job's own name
        t0 = time.monotonic()
        s.send(_attach(name, huge))
        reply = _recv(s)
        assert reply["t"] == "error", reply
        text = reply["message"]
        assert "not enough memory" in text and str(10**13) in text and "free" in text and "add workers" in text
        assert time.monotonic() - t0 < 5
    s.close(linger=0)
    for it in range(4, 8):
        train_step(ddp, opt, sched, it)
    assert session.close() == 7
    after = shared_cluster.status()
    assert after["job"]["name"] == job and after["job"]["epoch"] == before["job"]["epoch"]
    assert after["job"]["committed"] == 7 and after["job"]["status"] in ("running", "detached")
    assert [w["pid"] for w in after["workers"]] == pids
    assert all(w["ready"] and pid_alive(w["pid"]) for w in after["workers"])
    assert after["rejected"].get("attach_memory", 0) - before["rejected"].get("attach_memory", 0) == 2
    assert all(w["memory"] and w["memory"] > 0 for w in after["workers"])  # as the workers report it


@pytest.mark.slow
def test_held_attaches_are_bounded_by_bytes(tmp_path):
    """Row 5: 8 attaches with 20 MB layouts held +200 MB until they timed out."""
    cluster = LocalCluster(tmp_path, workers=1, env={"SHADOW_ATTACH_PENDING_BYTES": str(48 << 20)})
    try:
        big = Layout.build([(f"p{i}-" + "x" * 60000, (1,), 0, True) for i in range(340)], 1)
        raw = [_attach(f"held{i}", big, world=2) for i in range(8)]  # rank 1 never comes: held
        assert all(19 << 20 < len(r) < 21 << 20 for r in raw)
        rss0 = rss_bytes(cluster.proc.pid)
        socks = [_dealer(cluster.address) for _ in raw]
        answers, grown = [], []
        for s, r in zip(socks, raw, strict=True):
            s.send(r)
            answers.append(_recv(s, 5.0) if s.poll(3000) else None)
            grown.append(rss_bytes(cluster.proc.pid) - rss0)
        # the first two fit under 48 MiB and wait (their ranks hear nothing yet); the rest are refused at once
        assert answers[:2] == [None, None]
        for a in answers[2:]:
            assert a is not None and a["t"] == "error"
            assert "SHADOW_ATTACH_PENDING_BYTES" in a["message"] and "pending attaches" in a["message"]
            assert a["code"] == "busy"
        # a rank attaching again replaces its entry (no double count)
        socks[0].send(raw[0])
        assert not socks[0].poll(1000)
        st = cluster.status()
        assert st["attach_pending"]["jobs"] == 2 and st["attach_pending"]["bytes"] == len(raw[0]) + len(raw[1])
        assert st["rejected"]["attach_full"] == 6
        # what is held stops growing at the bound (unbounded: about +20 MiB per attach, +195 MiB after 8).
        # A refused message is still received and decoded, and the allocator keeps some of what that
        # freed for a while (CI saw one more 20 MiB message kept during the second round, then a plateau),
        # so the bound is judged on a second round of six refusals: held, they would add about 120 MiB;
        # refused, no more than the 48 MiB cap's worth of freed messages the allocator may keep.
        grown.append(rss_bytes(cluster.proc.pid) - rss0)
        for s, r in zip(socks[2:], raw[2:], strict=True):
            s.send(r)
            assert s.poll(5000) and _recv(s, 5.0)["t"] == "error"
            grown.append(rss_bytes(cluster.proc.pid) - rss0)
        assert cluster.status()["rejected"]["attach_full"] == 12
        assert grown[-1] - grown[-7] < 48 << 20 and grown[-1] < 160 << 20, (
            f"coordinator RSS grew by {[g >> 20 for g in grown]} MiB"
        )
        for s in socks:
            s.close(linger=0)
    finally:
        cluster.stop()


@pytest.mark.slow
def test_a_tier_that_cannot_be_scanned_is_held_not_taken_for_empty(world1, tmp_path):
    """A failed start-up scan must not pass for an empty tier (no overwrite protection), and
    must not stop training either: the attach goes on with memory, the tier is held (not
    written for that attach) and counted as failing; once fixed, the next attach reads it."""
    root = tmp_path / "tier"
    root.symlink_to(root)  # a symlink loop: unreadable for root too (chmod 000 is not, for root)
    cluster = LocalCluster(tmp_path, workers=1, args=(f"persist.local.dir={root}", "persist.local.every_n=1"))
    try:
        model, opt, sched = build()
        ddp = DDP(model)
        session = trainer_hooks.attach(ddp, opt, coordinator=cluster.address, scheduler=sched, job="scan")
        for it in range(1, 3):
            train_step(ddp, opt, sched, it)
        assert session.close() == 2 and session.degraded is None
        st = cluster.status()
        local = st["persist"]["local"]
        assert "symbolic links" in local["scan_error"] and "not written until an attach reads it" in local["held"]
        assert local["failures"] == 1 and local["count"] == 0 and local["in_flight"] == []
        assert st["job"]["committed"] == 2 and st["rejected"]["attach_tier_unreadable"] == 1

        root.unlink()  # fixed: the next attach reads the tier again, no restart
        root.mkdir()
        session = trainer_hooks.attach(ddp, opt, coordinator=cluster.address, scheduler=sched, job="scan", iteration=2)
        for it in range(3, 5):
            train_step(ddp, opt, sched, it)
        assert session.close() == 4
        st = cluster.wait_status(lambda st: st["persist"]["local"]["count"] >= 1, what="a checkpoint on the tier")
        assert st["persist"]["local"]["scan_error"] == "" and st["persist"]["local"]["held"] == ""
    finally:
        cluster.stop()


def test_scan_failure_of_a_job_directory_is_not_an_empty_tier(tmp_path, monkeypatch):
    """Persistence alone: any listing error at start-up is kept, reported, and retried."""
    (tmp_path / "job").mkdir()
    from shadow.coordinator import catalog as tiers

    real = tiers._probe
    monkeypatch.setattr(tiers, "_probe", lambda root: (_ for _ in ()).throw(PermissionError(13, "denied")))
    p = Persistence(
        PersistConfig.from_dict(
            {"local": {"dir": str(tmp_path), "every_n": 1, "every_s": 0, "every_tokens": 0, "keep": 0}}
        )
    )
    assert "denied" in p.tiers["local"].scan_error
    assert "cannot read tier local" in p.unscanned() and "denied" in p.unscanned()
    monkeypatch.setattr(tiers, "_probe", real)
    assert p.unscanned() is None and p.tiers["local"].scan_error == "" and p.tiers["local"].last_error == ""


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a directory whatever its mode")
def test_an_unreadable_job_directory_fails_the_scan(tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    job.chmod(0)
    try:
        p = Persistence(
            PersistConfig.from_dict(
                {"local": {"dir": str(tmp_path), "every_n": 1, "every_s": 0, "every_tokens": 0, "keep": 0}}
            )
        )
        assert "Permission" in p.unscanned()
    finally:
        job.chmod(0o755)


def test_held_attaches_keep_one_layout_and_are_bounded_by_count():
    out = RecordingOutbox()
    tuning = Tuning.load(attach_pending_jobs=2, attach_pending_ranks=4)
    coord = Coordinator("tcp://127.0.0.1:1", workers=1, outbox=out, tuning=tuning)
    layout = Layout.build([(f"p{i}", (4,), 0, True) for i in range(2000)], 1)
    with_layout = M.encode(
        "attach",
        job="a",
        rank=1,
        world=4,
        layout_hash=layout.hash,
        layout=layout.to_dict(),
        optim=OPTIM,
        iteration=0,
        overwrite=False,
        restored=None,
    )
    coord.on_message([b"r1", with_layout])
    kept = coord.state.pending["a"]["ranks"][1][1]
    assert kept["layout"] is None and kept["layout_hash"] == layout.hash  # only rank 0's layout is held
    assert coord.state.pending_view()["bytes"] < len(with_layout) // 10
    coord.on_message([b"r0", _attach("a", layout, world=4)])
    coord.on_message([b"r0", _attach("a", layout, world=4)])  # sent again: replaces, not counted twice
    assert coord.state.pending_view() == {
        "jobs": 1,
        "ranks": 2,
        "bytes": coord.state.pending["a"]["bytes"][0] + coord.state.pending["a"]["bytes"][1],
    }
    # the bounds: 2 jobs, 4 ranks
    coord.on_message([b"b0", _attach("b", layout, world=2)])
    coord.on_message([b"c0", _attach("c", layout, world=2)])  # a third job
    ident, kind, reply = out.sent[-1]
    assert ident == b"c0" and kind == "error" and "SHADOW_ATTACH_PENDING_JOBS" in reply["message"]
    coord.on_message([b"a2", _attach("a", layout, rank=2, world=4)])
    coord.on_message([b"a3", _attach("a", layout, rank=3, world=4)])  # a fifth rank
    ident, kind, reply = out.sent[-1]
    assert ident == b"a3" and kind == "error" and "SHADOW_ATTACH_PENDING_RANKS" in reply["message"]
    assert coord.state.rejected["attach_full"] == 2 and "c" not in coord.state.pending


def test_a_control_message_of_more_frames_than_one_is_dropped_unread(keyless):
    """Issue 53, item 1: a keyed peer's message of 48 frames of 32 MiB was copied whole
    into the coordinator's loop (peak 120 -> 4,729 MB, status stalled 16.9 s). A control
    message is one frame after the sender's identity: one of more is dropped without being
    copied or decoded, counted ``multipart``, and the loop answers on."""
    address = f"tcp://127.0.0.1:{free_port()}"
    coord = Coordinator(address, workers=1)
    seen: list[int] = []
    on_message = coord.on_message
    coord.on_message = lambda parts, *who: seen.append(len(parts)) or on_message(parts, *who)
    thread = threading.Thread(target=coord.run, daemon=True)
    thread.start()
    try:
        s = _dealer(address)
        chunk = bytes(4 << 20)
        s.send_multipart([M.encode("status"), *([chunk] * 8)])  # a status with 32 MiB behind it
        s.send(M.encode("status"))
        assert _recv(s)["t"] == "status_reply"
        assert seen == [2]  # the identity and the one body: the bulk never reached the handler
        assert status(address)["rejected"]["multipart"] == 1
        assert not s.poll(200)  # and it was not answered
        s.close(linger=0)
    finally:
        coord.stop()
        thread.join(timeout=5)
