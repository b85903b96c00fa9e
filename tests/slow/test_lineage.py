"""Going on from an older iteration than the cluster holds: after a restore that fell back
past a damaged checkpoint, and after an overwrite. What was newer is superseded (a new
generation), restores never return it again, and a normal resume of the new run works."""

from __future__ import annotations

import glob
import json
import os

import pytest
from torch.nn.parallel import DistributedDataParallel as DDP

import trainer_hooks
from shadow.persist import checkpoints
from shadow.testing import LocalCluster, assert_same_state, live_state
from tests.helpers.loop import train
from tests.helpers.tiny_trainer import build

pytestmark = pytest.mark.slow


def _args(local) -> tuple[str, ...]:
    return (f"persist.local.dir={local}", "persist.local.every_n=1", "persist.local.keep=0")


def _persisted(cluster: LocalCluster):
    """For :func:`train`'s ``after``: wait for each iteration's checkpoint (so none is skipped
    for a busy disk)."""
    return lambda it: _wait_persisted(cluster, it)


def _wait_persisted(cluster: LocalCluster, iteration: int) -> None:
    import time

    deadline = time.monotonic() + 30
    while True:
        st = cluster.status()
        last = (st["persist"]["local"]["last_complete"] or {}).get("iteration")
        if last == iteration and not st["persist"]["local"]["in_flight"]:
            return
        assert time.monotonic() < deadline, st["persist"]
        time.sleep(0.1)


def _same(model, opt, fresh, fopt) -> None:
    assert_same_state(live_state(fresh, fopt), live_state(model, opt))


def _flip_a_byte(local, job: str, iteration: int) -> None:
    (shard,) = glob.glob(os.path.join(local, job, f"iteration-{iteration:010d}", "shard-00000-*"))
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) - 4096 - 100)  # inside the last tensor's data
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x40]))


def test_resume_after_a_restore_that_fell_back(world1, tmp_path):
    local = tmp_path / "local"
    cluster = LocalCluster(tmp_path, workers=1, args=_args(local))
    try:
        model, opt, sched = build()
        ddp = DDP(model)
        session = trainer_hooks.attach(ddp, opt, coordinator=cluster.address, scheduler=sched, job="fb")
        train(ddp, opt, sched, 6, after=_persisted(cluster))
        session.close(wait=False)
    finally:
        cluster.kill_all()
    _flip_a_byte(local, "fb", 6)

    cluster = LocalCluster(tmp_path, workers=1, args=_args(local))
    try:
        model, opt, sched = build(seed=11)
        info = trainer_hooks.restore(model, opt, source=cluster.address, scheduler=sched, job="fb")
        assert (info.iteration, info.tier) == (5, "local")  # 6 fails its checksum
        ddp = DDP(model)
        # no overwrite=True: this rank restored iteration 5 from this cluster's own tier
        session = trainer_hooks.attach(ddp, opt, coordinator=cluster.address, scheduler=sched, job="fb")
        assert session.base == 5
        train(ddp, opt, sched, 3, start=5, after=_persisted(cluster))
        assert session.close() == 8
        st = cluster.status()
        assert st["restorable"]["local"] == 8
    finally:
        cluster.kill_all()
    # from the directory alone: the new run's newest, which equals the live trainer
    fresh, fopt, fsched = build(seed=12)
    info = trainer_hooks.restore(fresh, fopt, source=str(local), scheduler=fsched)
    assert info.iteration == 8
    _same(model, opt, fresh, fopt)
    manifests = [json.load(open(p)) for p in glob.glob(str(local / "fb" / "*" / checkpoints.MANIFEST))]
    assert {(m["generation"], m["iteration"]) for m in manifests} >= {(0, 6), (1, 6), (1, 8)}


def test_overwrite_supersedes_the_abandoned_iterations(world1, tmp_path):
    local = tmp_path / "local"
    cluster = LocalCluster(tmp_path, workers=1, args=_args(local))
    try:
        model, opt, sched = build()
        ddp = DDP(model)
        session = trainer_hooks.attach(ddp, opt, coordinator=cluster.address, scheduler=sched, job="ow")
        train(ddp, opt, sched, 12, after=_persisted(cluster))
        assert session.close() == 12

        # go back to 8 and train on: 9..12 of the first run are abandoned
        model, opt, sched = build(seed=21)
        info = trainer_hooks.restore(model, opt, source=cluster.address, scheduler=sched, job="ow", iteration=8)
        assert info.iteration == 8
        ddp = DDP(model)
        session = trainer_hooks.attach(ddp, opt, coordinator=cluster.address, scheduler=sched, job="ow", overwrite=True)
        train(ddp, opt, sched, 2, start=8, after=_persisted(cluster))
        assert session.close() == 10
        assert cluster.status()["restorable"]["local"] == 10
    finally:
        cluster.kill_all()

    fresh, fopt, fsched = build(seed=22)
    info = trainer_hooks.restore(fresh, fopt, source=str(local), scheduler=fsched, job="ow")
    assert info.iteration == 10  # not the abandoned 12
    _same(model, opt, fresh, fopt)

    # a restarted cluster knows it too, and the new run resumes normally (no overwrite)
    cluster = LocalCluster(tmp_path, workers=1, args=_args(local))
    try:
        again, aopt, asched = build(seed=23)
        info = trainer_hooks.restore(again, aopt, source=cluster.address, scheduler=asched, job="ow")
        assert info.iteration == 10
        _same(model, opt, again, aopt)
        ddp = DDP(again)
        session = trainer_hooks.attach(ddp, aopt, coordinator=cluster.address, scheduler=asched, job="ow")
        train(ddp, aopt, asched, 2, start=10, after=_persisted(cluster))
        assert session.close() == 12
    finally:
        cluster.kill_all()
    last, lopt, lsched = build(seed=24)
    info = trainer_hooks.restore(last, lopt, source=str(local), scheduler=lsched, job="ow")
    assert info.iteration == 12
    _same(again, aopt, last, lopt)
    ls = {(c.generation, c.iteration): c for c in checkpoints.list_checkpoints(str(local), job="ow")}
    assert ls[(0, 12)].superseded and not ls[(1, 12)].superseded and not ls[(0, 8)].superseded


def test_ls_shows_superseded_checkpoints(tmp_path):
    """Hand-made catalog: generation 1 went on from iteration 2; 3 of generation 0 is superseded,
    a torn directory of generation 1 is listed, and the newest-pick is generation 1's 3."""
    import subprocess
    import sys

    from shadow.core.layout import Layout
    from tests.conftest import ROOT

    layout = Layout.build([("w", (4,), 0, True)], 1)
    root = str(tmp_path)
    for gen, it in ((0, 2), (0, 3), (1, 3)):
        d = checkpoints.checkpoint_dir(root, "j", it, gen)
        os.makedirs(d)
        shard = {
            "index": 0,
            "start": 0,
            "stop": 4,
            "file": "shard-00000-of-00001.safetensors",
            "bytes": 0,
            "checksum": "0",
            "blob_ranks": [0],
        }
        m = checkpoints.new_manifest(
            "j", it, 1, "local", layout.to_dict(), layout.hash, {"kind": "adam"}, 1, None, None, [shard], gen
        )
        checkpoints.write_manifest(root, "j", it, m)
    checkpoints.write_generation(root, "j", 1, 2)
    os.makedirs(checkpoints.checkpoint_dir(root, "j", 4, 1))  # torn: no manifest
    found = checkpoints.list_checkpoints(root, job="j")
    assert [(c.generation, c.iteration, c.superseded) for c in found] == [(0, 3, True), (0, 2, False), (1, 3, False)]
    res = subprocess.run(
        [sys.executable, "-m", "shadow", "ls", f"source={root}", "json=true"], capture_output=True, text=True, cwd=ROOT
    )
    assert res.returncode == 0, res.stderr
    rows = {(r["generation"], r["iteration"]): r["state"] for r in json.loads(res.stdout)}
    assert rows == {(0, 2): "complete", (0, 3): "superseded", (1, 3): "complete", (1, 4): "incomplete"}
