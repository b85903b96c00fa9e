"""Tier schedules and the persister's lifetime, in process: the coordinator's
:class:`Persistence` fed with fabricated or real shard reports, and a worker's sessions
replaced over and over."""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from shadow.config import PersistConfig
from shadow.config.tuning import Tuning
from shadow.coordinator import catalog as tiers_mod
from shadow.coordinator import persistence as persistence_mod
from shadow.coordinator import settle as settle_mod
from shadow.coordinator.persistence import Persistence
from shadow.core.layout import Layout
from shadow.persist import checkpoints, shardfile
from shadow.persist.upload import Uploader
from shadow.persist.writer import ShardPersister
from shadow.restore import find_checkpoint
from shadow.wire.commit import ForgetDirs, Persisted, UploadCopies
from shadow.worker.shard import ShardState

LAYOUT = Layout.build([("a", (3000,), 0, True), ("b", (700,), 0, True)], 1)
OPTIM = {"kind": "adam", "impl": "fused", "vec_width": 16, "tail_width": 8}
RANGES = [(0, 2000), (2000, LAYOUT.total)]
TIER = {"every_n": 0, "every_s": 0.0, "every_tokens": 0, "keep": 3, "compress": "none", "compress_level": 1}
JOB = SimpleNamespace(
    name="j", epoch=1, layout=LAYOUT.to_dict(), layout_hash=LAYOUT.hash, optim=OPTIM, world=1, generation=0
)


class Clock:
    """Stands in for the ``time`` module of :mod:`shadow.coordinator.persistence` and
    :mod:`shadow.coordinator.settle`."""

    def __init__(self) -> None:
        self.now = 1000.0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(persistence_mod, "time", c)
    monkeypatch.setattr(settle_mod, "time", c)  # a commit's time
    monkeypatch.setattr(tiers_mod, "time", c)  # the skip log's
    return c


def _report(root: str, tier: str, iteration: int, shard: int, ok: bool = True, skipped: bool = False) -> Persisted:
    """A worker's ``persisted`` report; an OK one with its directory on ``root``."""
    if ok:
        os.makedirs(checkpoints.checkpoint_dir(root, "j", iteration), exist_ok=True)
    lo, hi = RANGES[shard]
    msg = {
        "epoch": 1,
        "iteration": iteration,
        "tier": tier,
        "shard": shard,
        "ok": ok,
        "error": "skipped: earlier checkpoint writes are still running" if skipped else ("" if ok else "boom"),
        "file": checkpoints.shard_name(shard, 2),
        "start": lo,
        "stop": hi,
        "bytes": 100,
        "checksum": "00",
        "raw_bytes": 100,
        "compress": "none",
        "seconds": 0.1,
        "commit": {"tokens": None} if shard == 0 else None,
        "blob_ranks": [0] if shard == 0 else [],
        "skipped": skipped,
    }
    return Persisted.from_msg(msg, worker=shard)


def _local(pers: Persistence, root: str, iteration: int, skip: bool = False) -> list:
    """Request ``iteration`` on the local tier and report it from both shards (shard 0
    skipping it when ``skip``); returns the follow-up requests."""
    assert pers.local_due(iteration, None)
    out = pers.on_report(JOB, _report(root, "local", iteration, 0, ok=not skip, skipped=skip), 2)
    return out + pers.on_report(JOB, _report(root, "local", iteration, 1), 2)


def test_remote_copies_the_newest_complete_local_checkpoint_once_due(tmp_path, clock):
    local, remote = str(tmp_path / "local"), str(tmp_path / "remote")
    pers = Persistence(
        PersistConfig.from_dict(
            {"local": dict(TIER, every_n=1, dir=local), "remote": dict(TIER, every_n=4, url=remote)}
        )
    )
    pers.reset(0)
    asked, forgot = [], []
    for it in range(1, 11):  # complete at 1, 2, 9, 10; skipped at 3-8 (every image still being written)
        follow = _local(pers, local, it, skip=3 <= it <= 8)
        asked += [("upload", f.iteration) for f in follow if isinstance(f, UploadCopies)]
        forgot += [f.dirs for f in follow if isinstance(f, ForgetDirs)]
    assert asked == [("upload", 9)]  # due since 0 by 9, not at a multiple of 4; 10 is 1 after the copy of 9
    # shard 1's copies of the skipped checkpoints go from its worker's disk, and so does what retention drops
    assert forgot[:6] == [[f"iteration-{it:010d}"] for it in range(3, 9)]
    assert all(all(checkpoints.dir_key(d)[1] < 9 for d in what) for what in forgot[6:])
    t = pers.tiers["local"]
    assert (t.failures, t.skipped, t.last_error, t.count) == (0, 6, "", 4)
    assert t.status()["skipped"] == 6 and t.status()["failures"] == 0
    for shard in (0, 1):
        pers.on_report(JOB, _report(remote, "remote", 9, shard), 2)
    assert pers.tiers["remote"].complete == {"j": 9}

    # by time: local 21 completes before 20; when the remote tier is due, the newest goes up
    pers = Persistence(
        PersistConfig.from_dict(
            {"local": dict(TIER, every_n=1, dir=local), "remote": dict(TIER, every_s=10.0, url=remote)}
        )
    )
    pers.reset(19)
    assert pers.local_due(20, None) and pers.local_due(21, None)
    clock.now += 5
    # (retention of the first run's)
    follow = [pers.on_report(JOB, _report(local, "local", 21, s), 2) for s in (0, 1)]
    assert [[f for f in out if not isinstance(f, ForgetDirs)] for out in follow] == [
        [],
        [],
    ]  # (retention of the first run's)
    clock.now += 6
    assert pers.on_report(JOB, _report(local, "local", 20, 0), 2) == []
    (up,) = [f for f in pers.on_report(JOB, _report(local, "local", 20, 1), 2) if not isinstance(f, ForgetDirs)]
    assert isinstance(up, UploadCopies) and (up.iteration, sorted(up.copies)) == (21, [0, 1])
    # a real failure is still one
    assert pers.local_due(22, None)
    pers.on_report(JOB, _report(local, "local", 22, 0, ok=False), 2)
    pers.on_report(JOB, _report(local, "local", 22, 1), 2)
    t = pers.tiers["local"]
    assert t.failures == 1 and t.skipped == 0 and "boom" in t.last_error


def test_skips_are_one_summed_warning_and_a_metric(tmp_path, clock, caplog):
    from shadow.coordinator.metrics import samples

    local = str(tmp_path / "local")
    pers = Persistence(PersistConfig.from_dict({"local": dict(TIER, every_n=1, dir=local)}))
    pers.reset(0)
    caplog.set_level(logging.INFO, logger="shadow.coordinator")
    for it in range(1, 7):
        clock.now += 1
        _local(pers, local, it, skip=True)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(warnings) == 1 and "1 checkpoint request skipped (iteration 1; 1 in all)" in warnings[0].getMessage()
    clock.now += pers.tuning.persist_skip_log_s
    _local(pers, local, 7)  # the next complete checkpoint sums up the rest
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "5 checkpoint requests skipped (iterations 2-6; 6 in all)" in warnings[1]
    from shadow.coordinator.cluster import ClusterState

    got = samples(ClusterState(expected=1), pers)
    assert got["shadow_persist_skipped"] == [(("local",), 6)] and got["shadow_persist_failures"] == [(("local",), 0)]


def test_the_newest_cut_skipped_is_asked_again_when_an_older_skip_settles_after_it(tmp_path, clock):
    """Cuts 3 and 4 in flight at once: shard 0 skips 4 at once (its image is busy with 3) and
    shard 1 writes it, so 4 settles first; 3 settles (skipped by shard 1) after it. The cut
    is 4: it is the one asked again, and a new epoch's lower cuts are asked again as well."""
    local = str(tmp_path / "local")
    pers = Persistence(PersistConfig.from_dict({"local": dict(TIER, every_n=1, dir=local)}))
    pers.reset(0)
    writers = {0: 0, 1: 1}
    for it in (1, 2):
        assert pers.local_due(it, None, writers)
        for shard in (0, 1):
            pers.on_report(JOB, _report(local, "local", it, shard), 2)
    assert pers.local_due(3, None, writers) and pers.local_due(4, None, writers)
    pers.on_report(JOB, _report(local, "local", 4, 0, ok=False, skipped=True), 2)
    pers.on_report(JOB, _report(local, "local", 4, 1), 2)
    pers.on_report(JOB, _report(local, "local", 3, 0), 2)
    pers.on_report(JOB, _report(local, "local", 3, 1, ok=False, skipped=True), 2)
    t = pers.tiers["local"]
    assert t.skipped == 2 and not t.in_flight and t.complete == {"j": 2}
    clock.now += 5.0
    assert pers.retry_skipped(4, writers, 1.0)
    assert sorted(t.in_flight) == [4]
    # a new epoch from an earlier base: its skipped cut is asked again too
    pers.reset(2)
    assert pers.local_due(3, None, writers)
    pers.on_report(JOB, _report(local, "local", 3, 0, ok=False, skipped=True), 2)
    pers.on_report(JOB, _report(local, "local", 3, 1), 2)
    clock.now += 5.0
    assert pers.retry_skipped(3, writers, 1.0)


def _state(lo: int, hi: int, layout: Layout = LAYOUT) -> ShardState:
    st = ShardState(layout, lo, hi, OPTIM)
    rng = np.random.default_rng(lo)
    for f in st.fields():
        st.array(f)[:] = rng.standard_normal(st.size).astype(np.float32)
    return st


def test_a_skipping_local_tier_still_feeds_the_remote_tier(tmp_path, monkeypatch):
    """Real persisters, one image each: shard 0's write of iteration 3 hangs, so it skips
    4-8; the copy of 9 to the remote tier is slow while 10-12 complete locally (keep=3)."""
    local, remote = str(tmp_path / "local"), str(tmp_path / "remote")
    persist = {"local": dict(TIER, every_n=1, dir=local), "remote": dict(TIER, every_n=4, keep=0, url=remote)}
    release_write, release_copy = threading.Event(), threading.Event()
    write, copy = shardfile.ShardImage.write, Uploader._copy

    def slow_write(img, path, **modes):
        if "iteration-0000000003" in path and "shard-00000" in path:
            assert release_write.wait(20)
        return write(img, path, **modes)

    def slow_copy(self, *args):
        assert release_copy.wait(20)
        return copy(self, *args)

    monkeypatch.setattr(shardfile.ShardImage, "write", slow_write)
    monkeypatch.setattr(Uploader, "_copy", slow_copy)
    pers = Persistence(PersistConfig.from_dict(persist))
    pers.reset(0)
    ps = [
        ShardPersister(
            PersistConfig.from_dict(persist), "j", i, 2, _state(lo, hi), tuning=Tuning.load(persist_buffers=1)
        )
        for i, (lo, hi) in enumerate(RANGES)
    ]
    reports, uploads = [], []
    lt, rt = pers.tiers["local"], pers.tiers["remote"]

    def pump(until) -> None:
        deadline = time.monotonic() + 20
        while not until():
            assert time.monotonic() < deadline, (lt.in_flight, rt.in_flight, reports)
            for p in ps:
                for r in p.results():
                    reports.append(r.fields())
                    for f in pers.on_report(JOB, r, 2):
                        if not isinstance(f, UploadCopies):
                            continue
                        uploads.append(f.iteration)
                        for shard, rep in f.copies.items():
                            ps[shard].upload(f.iteration, 1, rep.bytes, rep.checksum)
            time.sleep(0.002)

    for it in range(1, 13):
        assert pers.local_due(it, None)
        for p in ps:
            p.snapshot(it, 1, 1, {0: b"rec"}, {"tokens": None})
        if it == 8:
            release_write.set()
        # every report in, but shard 0's of 3 while it hangs
        pump(lambda it=it: set(lt.in_flight) <= ({3} if 3 <= it < 8 else set()) and 1 in lt.in_flight.get(3, {1: 0}))
    assert uploads == [9]
    assert os.path.isdir(checkpoints.checkpoint_dir(local, "j", 9)), "local retention removed a copy's source"
    release_copy.set()
    pump(lambda: not rt.in_flight)
    assert rt.complete == {"j": 9} and rt.failures == 0, rt.last_error
    assert find_checkpoint(remote, "remote")[1].iteration == 9
    assert [c.iteration for c in checkpoints.list_checkpoints(local)] == [10, 11, 12]  # retention caught up
    skips = [(r["iteration"], r["skipped"]) for r in reports if not r["ok"]]
    assert skips == [(it, True) for it in range(4, 9)]  # one report each, marked as skips
    assert (lt.failures, lt.skipped, lt.last_error) == (0, 5, "")
    for p in ps:
        assert p.close()


def test_a_cut_skipped_in_its_apply_pass_is_written_when_asked_again(tmp_path, monkeypatch):
    """The apply pass of the cut found every image busy (begin() reported it skipped); the
    coordinator asks again once nothing newer comes (Cut.retry_persist): that request is
    written and reported, not taken for the skip already reported."""
    persist = {"local": dict(TIER, every_n=1, dir=str(tmp_path / "local"))}
    release = threading.Event()
    write = shardfile.ShardImage.write

    def slow_write(img, path, **modes):
        if "iteration-0000000001" in path:
            assert release.wait(20)
        return write(img, path, **modes)

    monkeypatch.setattr(shardfile.ShardImage, "write", slow_write)
    tuning = Tuning.load(persist_buffers=1)
    p = ShardPersister(PersistConfig.from_dict(persist), "j", 0, 1, _state(0, LAYOUT.total), tuning=tuning)
    reports: list = []

    def wait_for(pred) -> None:
        deadline = time.monotonic() + 20
        while not pred():
            assert time.monotonic() < deadline, reports
            reports.extend(r.fields() for r in p.results())
            time.sleep(0.002)

    try:
        p.snapshot(1, 1, 1, {0: b"rec"}, None)  # the only image, its write held
        assert p.begin(2, 1, 1, {0: b"rec"}) is None  # the apply pass of cut 2: skipped, reported
        wait_for(lambda: any(r["iteration"] == 2 and r["skipped"] for r in reports))
        release.set()
        wait_for(lambda: any(r["iteration"] == 1 and r["ok"] for r in reports))
        p.snapshot(2, 1, 1, {0: b"rec"}, None)  # asked again
        wait_for(lambda: any(r["iteration"] == 2 and r["ok"] for r in reports))
    finally:
        release.set()
        assert p.close()


def _rss() -> int:
    """Resident bytes of this process, after handing freed heap memory back to the system
    (so that what the allocator caches does not count as held)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _persister_threads(before: frozenset = frozenset()) -> list[str]:
    """The persisters' threads alive now but for those in ``before`` (other tests' persisters
    not yet collected)."""
    return [
        t.name
        for t in threading.enumerate()
        if t.name.startswith(("shadow-upload", "shadow-persist")) and t not in before
    ]


def test_replaced_sessions_release_their_persisters(tmp_path):
    """Every resync, peer copy or re-attach replaces the worker's session: the old
    persister's threads end and its images and state are freed."""
    from shadow.worker.server import Worker

    n = 1 << 19  # 6 MiB of state, 2 images of as much again
    layout = Layout.build([("w", (n,), 0, True)], 1)
    persist = {
        "local": dict(TIER, every_n=1, dir=str(tmp_path / "local")),
        "remote": dict(TIER, every_n=1, url=f"memory://leak-{os.getpid()}"),
    }
    before = frozenset(threading.enumerate())
    w = Worker("tcp://127.0.0.1:1")
    sent = []
    w.outbox.to_coord = lambda kind, **fields: sent.append(kind)
    rss = []
    for epoch in range(1, 11):
        w._on_configure(
            {
                "epoch": epoch,
                "job": "j",
                "job_id": 1,
                "layout": layout.to_dict(),
                "start": 0,
                "stop": n,
                "world": 1,
                "optim": OPTIM,
                "iteration": 1,
                "persist": persist,
                "shard": 0,
                "shards": 1,
                "peer": None,
            }
        )
        s = w.state.assignment
        for f in s.state.fields():  # as a bootstrap would
            s.state.array(f)[:] = 1.0
        s.persister.snapshot(1, epoch, 1, {0: b"rec"}, None)
        deadline = time.monotonic() + 20
        while not s.persister.results():
            assert time.monotonic() < deadline
            time.sleep(0.002)
        s.applied = 1  # the next configure retires it (served to restores meanwhile)
        assert _persister_threads(before).count("shadow-upload") == 1, _persister_threads(before)
        rss.append(_rss())
    grew = rss[-1] - rss[1]
    assert grew < 20 << 20, f"RSS grew {grew / 2**20:.0f} MiB over 8 resyncs: {[r >> 20 for r in rss]} MiB"
    w._close()  # the worker stops
    deadline = time.monotonic() + 5
    while _persister_threads(before):
        assert time.monotonic() < deadline, _persister_threads(before)
        time.sleep(0.01)
    assert sent.count("configured") == 10


def test_verify_of_an_empty_tier_says_so_plainly(tmp_path, capsys):
    from shadow.cli._commands import cmd_verify
    from shadow.config import VerifyConfig

    assert cmd_verify(VerifyConfig(source=str(tmp_path))) == 1
    assert capsys.readouterr().err.strip() == f"shadow verify: no complete checkpoint under {tmp_path}"
    assert cmd_verify(VerifyConfig(source=str(tmp_path), iteration=7)) == 1
    assert capsys.readouterr().err.strip() == f"shadow verify: no complete checkpoint of iteration 7 under {tmp_path}"


def test_an_older_checkpoint_completing_after_a_newer_one_is_kept_and_counted(tmp_path):
    """Iterations 3 and 6 written at once (two images): 6 completes first. Retention after
    6 used to delete 3's directory as torn while 3 was still being written, so 3's manifest
    failed with FileNotFoundError and counted as a failure. Now 3 completes too."""
    root = str(tmp_path / "local")
    pers = Persistence(PersistConfig.from_dict({"local": dict(TIER, every_n=3, keep=2, dir=root)}))
    pers.reset(0)
    t = pers.tiers["local"]
    assert pers.local_due(3, None)
    late = _report(root, "local", 3, 1)  # shard 1 has written 3; its report comes last
    pers.on_report(JOB, _report(root, "local", 3, 0), 2)
    assert pers.local_due(6, None)
    for shard in (0, 1):
        pers.on_report(JOB, _report(root, "local", 6, shard), 2)
    assert t.complete == {"j": 6} and os.path.isdir(checkpoints.checkpoint_dir(root, "j", 3))
    pers.on_report(JOB, late, 2)
    assert t.count == 2 and t.failures == 0 and t.last_error == "", t.last_error
    assert [c.iteration for c in checkpoints.list_checkpoints(root, job="j")] == [3, 6]
    assert t.last_complete["iteration"] == 6 and t.last_ok[0] == 6  # the newest stays the newest
    assert checkpoints.list_torn(root, "j") == []
