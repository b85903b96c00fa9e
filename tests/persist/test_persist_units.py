"""Shard files, manifests, the catalog and tier schedules, without processes."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import fsspec
import numpy as np
import pytest

from shadow.config import PersistConfig
from shadow.core.layout import Layout
from shadow.persist import checkpoints, retention, shardfile
from shadow.restore import find_checkpoint
from shadow.storage import Schedule
from shadow.wire.commit import ForgetDirs, Persisted
from shadow.wire.frames import Field, checksum


def _image(start: int, stop: int, iteration: int, seed: int) -> shardfile.ShardImage:
    rng = np.random.default_rng(seed)
    n = stop - start
    img = shardfile.ShardImage(1024)
    entries = [shardfile.Entry(name, "F32", n) for name in ("param", "exp_avg", "exp_avg_sq")]
    entries += [
        shardfile.Entry("param_index", "I64", 1),
        shardfile.Entry("steps", "F64", 1),
        shardfile.Entry("has_state", "U8", 1),
        shardfile.Entry("commit.rank0", "U8", 3),
    ]
    img.layout(
        entries, {"format": shardfile.FORMAT, "start": str(start), "stop": str(stop), "iteration": str(iteration)}
    )
    for name in ("param", "exp_avg", "exp_avg_sq"):
        img.fill(name, rng.standard_normal(n).astype(np.float32))
    img.fill("param_index", np.array([0 if start == 0 else 1], dtype=np.int64))
    img.fill("steps", np.array([float(iteration)]))
    img.fill("has_state", np.array([1], dtype=np.uint8))
    img.fill("commit.rank0", np.frombuffer(b"abc", dtype=np.uint8))
    return img


def test_shard_image_is_aligned_and_readable_by_safetensors(tmp_path):
    from safetensors.numpy import load_file

    img = _image(0, 1000, 5, 0)
    assert img.data_start % shardfile.PAGE == 0 and img.buf.ctypes.data % shardfile.PAGE == 0
    path = str(tmp_path / "s.safetensors")
    assert img.write(path) == img.size == os.path.getsize(path)
    loaded = load_file(path)
    assert np.array_equal(loaded["param"], img.view("param")) and loaded["commit.rank0"].tobytes() == b"abc"
    meta, tensors = shardfile.parse(open(path, "rb").read())
    assert meta["iteration"] == "5" and np.array_equal(tensors["exp_avg"], img.view("exp_avg"))
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def _write_checkpoint(root: str, job: str, iteration: int, layout: Layout) -> None:
    shards = []
    d = checkpoints.checkpoint_dir(root, job, iteration)
    fs, p = fsspec.core.url_to_fs(d)
    fs.makedirs(p, exist_ok=True)
    for i, (lo, hi) in enumerate([(0, 16), (16, layout.total)]):
        img = _image(lo, hi, iteration, iteration * 10 + i)
        data = bytes(memoryview(img.buf)[: img.size])
        fs.pipe_file(p + "/" + checkpoints.shard_name(i, 2), data)
        shards.append(
            {
                "index": i,
                "start": lo,
                "stop": hi,
                "file": checkpoints.shard_name(i, 2),
                "bytes": len(data),
                "checksum": f"{checksum(data):016x}",
                "blob_ranks": [0],
            }
        )
    m = checkpoints.new_manifest(
        job, iteration, 1, "local", layout.to_dict(), layout.hash, {"kind": "adam"}, 1, None, None, shards
    )
    checkpoints.write_manifest(root, job, iteration, m)


LAYOUT = Layout.build([("a", (16,), 0, True), ("b", (20,), 0, True)], 1)


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_catalog_roundtrip_corruption_and_fallback(tmp_path, kind):
    root = str(tmp_path / "ckpt") if kind == "local" else f"memory://ckpt-{os.getpid()}"
    for it in (3, 6):
        _write_checkpoint(root, "j", it, LAYOUT)
    # a torn write: shard files, no manifest
    fs, p = fsspec.core.url_to_fs(checkpoints.checkpoint_dir(root, "j", 9))
    fs.makedirs(p, exist_ok=True)
    fs.pipe_file(p + "/" + checkpoints.shard_name(0, 2), b"partial")
    assert [c.iteration for c in checkpoints.list_checkpoints(root)] == [3, 6]
    assert checkpoints.list_torn(root)[0].endswith("iteration-0000000009")
    info, snap = find_checkpoint(root, kind)
    assert snap.iteration == 6 and snap.steps[0] == 6.0 and snap.blobs == {0: b"abc"}
    assert snap.arrays[Field.PARAM].shape == (LAYOUT.total,)

    # corrupt one byte of iteration 6, shard 1
    shard_path = p.replace("iteration-0000000009", "iteration-0000000006") + "/" + checkpoints.shard_name(1, 2)
    data = bytearray(fs.cat_file(shard_path))
    data[-5] ^= 0xFF
    fs.pipe_file(shard_path, bytes(data))
    bad = [c for c in checkpoints.list_checkpoints(root) if c.iteration == 6][0]
    problems = checkpoints.verify(bad)
    assert len(problems) == 1 and "shard 1" in problems[0] and "checksum" in problems[0]
    info, snap = find_checkpoint(root, kind)  # newest: falls back to the older complete one
    assert snap.iteration == 3
    with pytest.raises(checkpoints.CheckpointError, match="shard 1 .*checksum"):
        find_checkpoint(root, kind, iteration=6)
    with pytest.raises(checkpoints.CheckpointError, match="no complete checkpoint of iteration 7"):
        find_checkpoint(root, kind, iteration=7)


def test_retention_keeps_newest_and_only_deletes_after_a_complete_one(tmp_path):
    root = str(tmp_path)
    os.makedirs(checkpoints.checkpoint_dir(root, "j", 1))  # torn, and nothing complete yet
    assert retention.retain(root, "j", 1) == []
    for it in (2, 4, 6):
        _write_checkpoint(root, "j", it, LAYOUT)
    os.makedirs(checkpoints.checkpoint_dir(root, "j", 8))  # a write in progress, newer than the newest complete
    removed = retention.retain(root, "j", 2)
    assert sorted(os.path.basename(r) for r in removed) == ["iteration-0000000001", "iteration-0000000002"]
    assert [c.iteration for c in checkpoints.list_checkpoints(root)] == [4, 6]
    assert os.path.isdir(checkpoints.checkpoint_dir(root, "j", 8))


def test_missing_root_and_unknown_manifest_format(tmp_path):
    with pytest.raises(checkpoints.CheckpointError, match="no complete checkpoint"):
        find_checkpoint(str(tmp_path / "nothing"), "local")
    _write_checkpoint(str(tmp_path), "j", 1, LAYOUT)
    mpath = os.path.join(checkpoints.checkpoint_dir(str(tmp_path), "j", 1), checkpoints.MANIFEST)
    m = json.load(open(mpath))
    m["format"] = "something-else/9"
    json.dump(m, open(mpath, "w"))
    assert checkpoints.list_checkpoints(str(tmp_path)) == []


def test_schedules():
    s = Schedule(every_n=5)
    assert not s.due(4, 0.0, None, (0, 0.0, None)) and s.due(5, 0.0, None, (0, 0.0, None))
    assert s.due(12, 0.0, None, (7, 0.0, None)) and not s.due(11, 0.0, None, (7, 0.0, None))
    s = Schedule(every_s=2.0)
    assert not s.due(100, 1.0, None, (0, 0.0, None)) and s.due(1, 2.5, None, (0, 0.0, None))
    s = Schedule(every_tokens=1000)
    assert not s.due(9, 0.0, 900, (0, 0.0, 0)) and s.due(9, 0.0, 1000, (0, 0.0, 0))
    assert not s.due(9, 0.0, None, (0, 0.0, 0))


def _coordinator(tmp_path, keep: int):
    """A coordinator's persistence with a local tier in ``tmp_path/manifests`` (every
    iteration, ``keep``), and a one-shard job for it."""
    from types import SimpleNamespace

    from shadow.coordinator.persistence import Persistence

    cfg = {"every_n": 1, "every_s": 0.0, "every_tokens": 0, "keep": keep, "compress": "none", "compress_level": 1}
    pers = Persistence(PersistConfig.from_dict({"local": dict(cfg, dir=str(tmp_path / "manifests"))}))
    job = SimpleNamespace(
        name="j", epoch=1, layout=LAYOUT.to_dict(), layout_hash=LAYOUT.hash, optim={}, world=1, generation=0
    )
    return pers, job, tmp_path / "manifests"


def _copy_report(it: int, worker: int, checksum: str = "00") -> Persisted:
    """Worker ``worker``'s report of its copy of the only shard at iteration ``it``, on its own disk."""
    return Persisted(
        tier="local",
        iteration=it,
        shard=0,
        ok=True,
        file="shard-00000-of-00001.safetensors",
        start=0,
        stop=LAYOUT.total,
        bytes=100,
        checksum=checksum,
        raw_bytes=100,
        seconds=0.1,
        blob_ranks=[0],
        epoch=1,
        worker=worker,
        disk={"id": f"{worker:032x}", "dir": f"/disk{worker}", "host": f"h{worker}"},
    )


def test_a_node_local_tier_commits_on_the_coordinators_own_disk(tmp_path):
    """Workers on other hosts wrote their shards to their own disks, none of which the
    coordinator sees: it makes the checkpoint's directory on its own disk, writes the
    manifest there, and the manifest names both copies of the shard (two replicas, two
    disks); a copy whose bytes differ from its replica's fails the checkpoint instead."""
    from shadow.persist import checkpoints

    pers, job, root = _coordinator(tmp_path, keep=3)
    report = _copy_report
    assert pers.local_due(1, None, {0: 0, 1: 0})
    assert pers.on_report(job, report(1, 0), nshards=1) == []  # the other replica's copy is still due
    assert pers.on_report(job, report(1, 1), nshards=1) == []
    tier = pers.tiers["local"]
    assert tier.count == 1 and tier.failures == 0, tier.last_error
    (info,) = checkpoints.list_checkpoints(str(root), job="j")
    (shard,) = info.manifest["shards"]
    assert [(h["worker"], h["disk"], h["dir"]) for h in shard["holders"]] == [
        (0, f"{0:032x}", "/disk0"),
        (1, f"{1:032x}", "/disk1"),
    ]
    assert not (root / "j" / "iteration-0000000001" / "shard-00000-of-00001.safetensors").exists()
    assert pers.local_due(2, None, {0: 0, 1: 0})
    pers.on_report(job, report(2, 0), nshards=1)
    follow = pers.on_report(job, report(2, 1, checksum="01"), nshards=1)
    assert tier.count == 1 and tier.failures == 1 and "replicas of shard 0 wrote different files" in tier.last_error
    assert follow == [ForgetDirs(2, ["iteration-0000000002"])]  # the workers delete their copies
    assert [c.iteration for c in checkpoints.list_checkpoints(str(root), job="j")] == [1]


def test_a_writer_lost_mid_checkpoint(tmp_path):
    """A replica lost while writing: its shard's other copy completes the checkpoint (one
    holder); the last writer of a shard lost: the checkpoint fails, says why, and its copies
    are deleted from the disks. Nothing stays in flight either way."""
    from shadow.persist import checkpoints

    pers, job, root = _coordinator(tmp_path, keep=0)
    rep = _copy_report(0, 0)
    tier = pers.tiers["local"]
    assert pers.local_due(1, None, {0: 0, 1: 0})
    assert pers.writer_lost(job, 1, 1) == [] and tier.in_flight == {1: {}}
    pers.on_report(job, replace(rep, iteration=1, worker=0), 1)
    (info,) = checkpoints.list_checkpoints(str(root), job="j")
    assert [h["worker"] for h in info.manifest["shards"][0]["holders"]] == [0] and tier.count == 1

    assert pers.local_due(2, None, {0: 0, 1: 0})
    pers.on_report(job, replace(rep, iteration=2, worker=1), 1)  # one copy is in
    follow = pers.writer_lost(job, 0, 1)  # the other replica goes: its copy still stands
    assert tier.count == 2 and tier.in_flight == {} and follow == []

    assert pers.local_due(3, None, {0: 0})
    assert pers.writer_lost(job, 0, 1) == []  # no copy was made: nothing to delete
    assert tier.count == 2 and tier.failures == 1 and "the last writer of this shard, was lost" in tier.last_error
    assert tier.in_flight == {} and tier.asked == {}
