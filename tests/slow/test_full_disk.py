"""A tier whose disk fills up: the error is clear in status, logs and metrics; training goes
on and the memory checkpoint keeps advancing; earlier complete checkpoints stay listed and
restore bit for bit; no partial checkpoint is listed or left behind; once there is space
again, checkpoints complete again.

The disk is a small tmpfs where this process may mount one (root, ``mount -t tmpfs``), and
always also a stand-in: ``ServiceFaults(persist_full=<file>)`` (shadow.testing.faults), while
which file exists every shard write stops half way with ``ENOSPC``."""

from __future__ import annotations

import errno
import os
import subprocess
import time

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import trainer_hooks
from shadow.config import PersistConfig
from shadow.persist import checkpoints, failed
from shadow.testing import LocalCluster, ServiceFaults, free_port_run
from shadow.testing.faults import injected
from tests.helpers.loop import train_step
from tests.helpers.tiny_trainer import build
from tests.slow.test_ops import scrape, value

pytestmark = pytest.mark.slow
JOB = "full"


class Tmpfs:
    """A 4 MiB tmpfs at ``path``, filled up by a file of zeros."""

    def __init__(self, path) -> None:
        self.path = path
        path.mkdir()
        res = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(path)], capture_output=True, text=True, check=False
        )
        if res.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({res.stderr.strip()}); the stand-in covers it")
        self.filler = path / "filler"

    def fill(self) -> None:
        chunk = b"\0" * 65536
        with open(self.filler, "wb", buffering=0) as f:
            while True:
                try:
                    f.write(chunk)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    break
        with pytest.raises(OSError):  # nothing more fits
            (self.path / "probe").write_bytes(b"x" * 8192)

    def free(self) -> None:
        self.filler.unlink()

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True, check=False)


class StandIn:
    """The writer's fault knob: the disk is full while a flag file exists."""

    def __init__(self, path) -> None:
        path.mkdir()
        self.path, self.flag = path, path.parent / "disk-is-full"
        self.faults = ServiceFaults(persist_full=str(self.flag))

    def fill(self) -> None:
        self.flag.touch()

    def free(self) -> None:
        self.flag.unlink()

    def close(self) -> None:
        pass


def _wait(what: str, pred, limit: float = 60.0):
    deadline = time.monotonic() + limit
    while True:
        got = pred()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _state(model, opt) -> dict:
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "optim": [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()],
    }


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True)) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        for x, y in zip(a["optim"], b["optim"], strict=True)
    )


def _complete_files(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]


@pytest.mark.parametrize("disk", ["tmpfs", "stand-in"])
def test_a_full_disk_is_reported_and_training_goes_on(world1, tmp_path, disk):
    store = (Tmpfs if disk == "tmpfs" else StandIn)(tmp_path / "disk")
    root = str(store.path / "ckpt")
    mport = free_port_run(3)  # the coordinator's, then one per worker
    cluster = LocalCluster(
        tmp_path,
        args=(f"persist.local.dir={root}", "persist.local.every_n=2", "persist.local.keep=2", f"metrics_port={mport}"),
        faults=getattr(store, "faults", None),
    )
    session = None
    try:
        model, opt, sched = build()
        ddp = DDP(model)
        session = trainer_hooks.attach(ddp, opt, coordinator=cluster.address, scheduler=sched, job=JOB)
        states = {}
        it = 0

        def train(n: int) -> None:
            nonlocal it
            for _ in range(n):
                it += 1
                train_step(ddp, opt, sched, it)
                states[it] = _state(model, opt)
                time.sleep(0.02)

        def settled(pred) -> dict:
            def ready():
                st = cluster.status()
                return (
                    st
                    if st["job"]["committed"] == it and not st["persist"]["local"]["in_flight"] and pred(st)
                    else None
                )

            return _wait("the cluster", ready)

        # 1. space: checkpoints complete
        train(6)
        st = settled(lambda st: st["persist"]["local"]["last_complete"])
        before = st["persist"]["local"]["last_complete"]["iteration"]
        assert before >= 2 and not st["persist"]["local"]["last_error"]

        # 2. the disk fills up: training and the memory cut go on, the tier reports why it fails
        store.fill()
        train(8)
        st = settled(lambda st: st["persist"]["local"]["failures"] >= 2)
        local = st["persist"]["local"]
        assert st["job"]["committed"] == it == 14 and session.degraded is None
        assert local["last_complete"]["iteration"] == before, local
        assert "no space left on device" in local["last_error"] and "persist.local.keep" in local["last_error"], local[
            "last_error"
        ]
        assert root in local["last_error"]
        assert value(scrape(mport), "shadow_persist_failures_total", tier="local") >= 2
        assert "no space left on device" in cluster.log.read_text()
        # nothing partial is listed, or left behind to hold the space
        done = checkpoints.list_checkpoints(root, job=JOB)
        assert done and done[-1].iteration == before and all(c.iteration <= before for c in done)
        assert all(checkpoints.verify(c) == [] for c in done)
        assert checkpoints.list_torn(root, JOB) == []
        assert not [f for f in _complete_files(root) if f.endswith(".tmp")]
        # the newest complete checkpoint from before the fill restores bit for bit, from the disk
        fresh, fopt, fsched = build(seed=7)
        info = trainer_hooks.restore(fresh, fopt, source=root, scheduler=fsched, job=JOB)
        assert info.iteration == before
        assert _same(_state(fresh, fopt), states[before])
        # and the memory checkpoint is intact at the cut
        fresh, fopt, fsched = build(seed=8)
        info = trainer_hooks.restore(fresh, fopt, source=cluster.address, scheduler=fsched, job=JOB)
        assert info.iteration == it and _same(_state(fresh, fopt), states[it])

        # 3. space again: the next checkpoints complete, the error clears
        store.free()
        train(6)
        st = settled(lambda st: (st["persist"]["local"]["last_complete"] or {}).get("iteration", 0) > 14)
        assert st["persist"]["local"]["last_error"] == ""
        newest = checkpoints.list_checkpoints(root, job=JOB)[-1]
        assert newest.iteration > 14 and checkpoints.verify(newest) == []
        snap = checkpoints.load(newest)
        assert snap.iteration == newest.iteration
        assert session.close() == it
        session = None
    finally:
        if session is not None:
            session.close(wait=False)
        cluster.stop()
        store.close()


# ---- the pieces, in process ------------------------------------------------------------------


def test_a_failed_shard_write_leaves_no_partial_file_and_says_what_to_do(tmp_path, monkeypatch):
    """The plain writer on a disk that fills half way: ENOSPC, no ``.tmp`` left, and the
    report text names the tier, the path, the free space and the retention setting."""
    from tests.persist.test_persist_units import _image

    flag = tmp_path / "full"
    flag.touch()
    path = str(tmp_path / "j" / "iteration-0000000004" / checkpoints.shard_name(0, 2))
    img = _image(0, 3000, 4, 0)
    with injected(ServiceFaults(persist_full=str(flag))), pytest.raises(OSError) as err:
        img.write(path)
    assert err.value.errno == errno.ENOSPC
    assert os.listdir(os.path.dirname(path)) == []
    text = failed.write_error(err.value, "local", path)
    assert text.startswith(f"tier local: no space left on device writing {path} (")
    assert "MiB free of" in text and "persist.local.keep" in text
    assert failed.write_error(ValueError("x"), "local", path) == "ValueError: x"
    assert img.write(path) == img.size and os.listdir(os.path.dirname(path)) == [checkpoints.shard_name(0, 2)]


def test_the_coordinator_removes_a_failed_checkpoint_and_backs_off(tmp_path):
    """A checkpoint some shard failed: the shards the others wrote are removed (a complete
    checkpoint never is); after two failures in a row the tier retries on its schedule,
    not at every cut; a success resets that."""
    from shadow.coordinator.persistence import Persistence
    from tests.persist.test_persist_schedule import JOB, TIER, _report

    root = str(tmp_path / "local")
    pers = Persistence(PersistConfig.from_dict({"local": dict(TIER, every_n=4, dir=root)}))
    pers.reset(0)
    t = pers.tiers["local"]

    def attempt(it: int, ok0: bool) -> None:
        assert pers.local_due(it, None), it
        pers.on_report(JOB, _report(root, "local", it, 0, ok=ok0), 2)
        pers.on_report(JOB, _report(root, "local", it, 1), 2)  # shard 1 wrote its file

    attempt(4, True)
    assert t.complete == {"j": 4} and os.path.exists(
        os.path.join(checkpoints.checkpoint_dir(root, "j", 4), checkpoints.MANIFEST)
    )
    attempt(8, False)
    assert not os.path.exists(checkpoints.checkpoint_dir(root, "j", 8)) and t.failures == 1
    attempt(9, False)  # the first failure is retried at the next cut
    assert t.failures == 2 and checkpoints.list_torn(root, "j") == []
    assert not pers.local_due(10, None) and not pers.local_due(12, None)  # then on the schedule (every 4)
    attempt(13, True)
    assert t.complete == {"j": 13} and t.last_error == "" and t.failing == 0
    assert [c.iteration for c in checkpoints.list_checkpoints(root, job="j")] == [4, 13]
    # a failure reported for an iteration whose checkpoint is complete never deletes it
    assert failed.discard_torn(root, "j", 13) is False and failed.discard_torn(root, "j", 4) is False
