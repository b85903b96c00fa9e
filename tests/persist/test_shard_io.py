"""Shard I/O in two levels and the typed commit messages: every source and encoding of a
shard goes through one checked read, and the commit protocol's messages keep the wire
format they replaced."""

from __future__ import annotations

import fnmatch
import os
import posixpath

import numpy as np
import pytest

from shadow.config import PersistConfig
from shadow.config.tuning import Tuning
from shadow.core.errors import CheckpointError, ShadowError
from shadow.core.layout import Layout
from shadow.core.snapshot import Assembly
from shadow.persist import checkpoints, retention, shardio
from shadow.persist.writer import ShardPersister
from shadow.storage import Storage, storage_for
from shadow.testing.wait import wait_until
from shadow.wire import messages as M
from shadow.wire.commit import ApplyCut, Forget, Persisted, Prepared, Upload
from shadow.worker.shard import ShardState

LAYOUT = Layout.build([("a", (3000,), 0, True), ("b", (700,), 0, True)], 1)
OPTIM = {"kind": "adam", "impl": "fused", "vec_width": 16, "tail_width": 8}


def _write_checkpoint(tmp_path, compress: str):
    """A one-shard checkpoint written by the persister, on a local directory."""
    root = str(tmp_path / compress)
    state = ShardState(LAYOUT, 0, LAYOUT.total, OPTIM)
    rng = np.random.default_rng(0)
    for f in state.fields():
        state.array(f)[:] = rng.standard_normal(state.size).astype(np.float32)
    p = ShardPersister(
        PersistConfig.from_dict({"local": {"dir": root, "compress": compress}}),
        "j",
        0,
        1,
        state,
        tuning=Tuning.load(persist_buffers=1),
    )
    try:
        p.snapshot(3, 1, 1, {0: b"rec"}, None)
        got = wait_until(p.results, timeout=60, what="the persister's report", period=0.02)
        (rep,) = got
    finally:
        p.close()
    assert rep.ok, rep.error
    return root, rep, LAYOUT, state


@pytest.mark.parametrize("compress", ["none", "zstd"])
def test_every_source_reads_the_same_checked_shard(tmp_path, compress):
    root, rep, layout, _ = _write_checkpoint(tmp_path, compress)
    directory = checkpoints.checkpoint_dir(root, "j", 3)
    shard = {
        "index": 0,
        "start": 0,
        "stop": layout.total,
        "file": rep.file,
        "bytes": rep.bytes,
        "checksum": rep.checksum,
    }

    def read(source):
        out: dict = {}

        def target(name, dtype, count):
            if name in ("param", "exp_avg", "exp_avg_sq"):
                out[name] = np.empty(count, dtype)
                return out[name]
            return None

        meta, tensors = shardio.read_shard(source, shard, 3, target, True, "shard 0")
        assert int(meta["iteration"]) == 3
        return {k: v.copy() for k, v in out.items()}

    local = read(shardio.StorageFile(storage_for(root), directory, rep.file, rep.bytes))
    # the same bytes behind an fsspec store that is not the local file system
    mem = storage_for(f"memory://shard-io-{compress}-{os.getpid()}")
    mem.makedirs(mem.join("j", "iteration-0000000003"))
    with open(os.path.join(directory, rep.file), "rb") as f:
        mem.write_atomic(mem.join("j", "iteration-0000000003", rep.file), f.read())
    remote = read(shardio.StorageFile(mem, mem.join("j", "iteration-0000000003"), rep.file, rep.bytes))
    assert local.keys() == remote.keys() == {"param", "exp_avg", "exp_avg_sq"}
    for k in local:
        assert np.array_equal(local[k], remote[k])

    # wrong size, wrong checksum, wrong iteration: each refused, naming the shard
    with pytest.raises(CheckpointError, match="bytes"):
        shardio.read_checked(
            shardio.StorageFile(mem, mem.join("j", "iteration-0000000003"), rep.file, rep.bytes),
            {**shard, "bytes": rep.bytes + 1},
            True,
            "shard 0",
        )
    with pytest.raises(CheckpointError, match="checksum|corrupt"):
        read_bad = shardio.StorageFile(mem, mem.join("j", "iteration-0000000003"), rep.file, rep.bytes)
        shardio.read_shard(read_bad, {**shard, "checksum": "0" * 16}, 3, lambda *a: None, True, "shard 0")
    with pytest.raises(CheckpointError, match="another range or iteration"):
        shardio.read_shard(
            shardio.StorageFile(mem, mem.join("j", "iteration-0000000003"), rep.file, rep.bytes),
            shard,
            4,
            lambda *a: None,
            True,
            "shard 0",
        )
    missing = shardio.StorageFile(storage_for(root), directory, "shard-00009-of-00010.safetensors", 10)
    with pytest.raises(CheckpointError, match="missing"):
        shardio.read_checked(missing, {**shard, "bytes": 10}, True, "shard 9")


def test_an_assembly_refuses_gaps_and_missing_ranks():
    layout = Layout.build([("a", (6,), 0, True), ("b", (4,), 0, True)], 1)
    arrays = {}
    parts = Assembly(layout, 2, CheckpointError)
    parts.add(0, 6, [(0, 5.0)], [(0, True)], [(0, b"r0")], {})
    with pytest.raises(CheckpointError, match="cover 6 of 10"):
        parts.snapshot("j", 1, {}, arrays, "here")
    parts.add(6, 10, [(1, 5.0), (0, 9.0)], [(1, True)], [], {})  # param 0's step is the first shard's
    with pytest.raises(CheckpointError, match=r"ranks \[1\] are missing"):
        parts.snapshot("j", 1, {}, arrays, "here")
    parts.add(10, 10, [], [], [(1, b"r1")], {})
    snap = parts.snapshot("j", 1, {}, arrays, "here", tier="local")
    assert list(snap.steps) == [5.0, 5.0] and snap.has_state.all() and snap.blobs == {0: b"r0", 1: b"r1"}
    assert snap.tier == "local"
    with pytest.raises(ShadowError):
        Assembly(layout, 1, ShadowError).snapshot("j", 1, {}, arrays, "here")


def test_the_commit_messages_keep_the_wire_format():
    rep = Persisted(epoch=2, iteration=7, tier="local", shard=1, ok=True, file="f", bytes=10, checksum="ab", worker=3)
    wire = M.decode(M.encode(rep.kind, **rep.fields()))  # checked against the persisted schema
    assert "worker" not in wire and "disk" not in wire  # the writer is known from the connection
    back = Persisted.from_msg(wire, worker=3)
    assert back == rep
    for m in (Prepared(2, 7, None), ApplyCut(2, 7, True), Upload(2, 7, 10, "ab"), Forget("j", ["iteration-7"])):
        got = M.decode(M.encode(m.kind, **m.fields()))
        assert {k: v for k, v in got.items() if k not in ("t", "v")} == m.fields()
    # an older worker's report without raw_bytes counts its stored bytes
    old = {k: v for k, v in wire.items() if k != "raw_bytes"}
    assert Persisted.from_msg(old, 0).raw_bytes == 10


class _Keys(Storage):
    """A back end of the five operations only: keys in a dict, directories implied."""

    def __init__(self) -> None:
        self.url, self.base, self.keys = "keys://", "/k", {}

    def read_into(self, path, out, offset=0):
        data = self.keys[path][offset : offset + len(out)]
        out[: len(data)] = data
        return len(data)

    def write_atomic(self, path, data, parents=False):
        self.keys[path] = bytes(data)

    def list(self, pattern):
        names = (
            set(self.keys)
            | {posixpath.dirname(k) for k in self.keys}
            | {posixpath.dirname(posixpath.dirname(k)) for k in self.keys}
        )
        return sorted(n for n in names if fnmatch.fnmatchcase(n, pattern) and n.count("/") == pattern.count("/"))

    def rm(self, path, recursive=True):
        gone = [k for k in self.keys if k == path or (recursive and k.startswith(path.rstrip("/") + "/"))]
        if not gone:
            raise FileNotFoundError(path)
        for k in gone:
            del self.keys[k]

    def info(self, path):
        if path in self.keys:
            return {"name": path, "type": "file", "size": len(self.keys[path])}
        if any(k.startswith(path.rstrip("/") + "/") for k in self.keys):
            return {"name": path, "type": "directory", "size": 0}
        raise FileNotFoundError(path)


@pytest.mark.parametrize("compress", ["none", "zstd"])
def test_a_back_end_of_the_five_operations_holds_whole_checkpoints(tmp_path, compress):
    """Listing, loading (bit for bit), verifying and retention all run on the five
    operations of the storage interface alone."""
    root, rep, layout, state = _write_checkpoint(tmp_path, compress)
    keys = _Keys()
    for it in (3, 5):
        src = checkpoints.checkpoint_dir(root, "j", 3)
        with open(os.path.join(src, rep.file), "rb") as f:
            keys.write_atomic(keys.join("j", checkpoints.dir_name(it), rep.file), f.read())
        shard = {"index": 0, "start": 0, "stop": layout.total, "file": rep.file, "bytes": rep.bytes}
        shard.update(checksum=rep.checksum, blob_ranks=[0], raw_bytes=rep.raw_bytes, compress=compress)
        m = checkpoints.new_manifest("j", 3, 1, "local", layout.to_dict(), layout.hash, {}, 1, None, None, [shard])
        m["iteration"] = it
        checkpoints.write_manifest(keys, "j", it, m)
    found = checkpoints.list_checkpoints(keys, "local", "j")
    assert [c.iteration for c in found] == [3, 5]
    assert checkpoints.verify(found[0]) == []  # iteration 3: the file says 3
    snap = checkpoints.load(found[0])
    assert snap.arrays.keys() == set(state.fields())
    for f, arr in snap.arrays.items():
        assert np.array_equal(arr, state.array(f))
    with pytest.raises(CheckpointError, match="another range or iteration"):
        checkpoints.load(found[1])  # a manifest of 5 over a file of 3 is refused
    assert len(retention.retain(keys, "j", 1)) == 1
    assert [c.iteration for c in checkpoints.list_checkpoints(keys, "local", "j")] == [5]
