"""The storage seam: every Storage through one harness (a local directory, a ``file://``
URL, fsspec's memory store), the one local-versus-remote decision, tiers built from the
typed config, and restore sources listing and picking through the same protocol."""

from __future__ import annotations

import glob
import os
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from shadow.config import LocalTierConfig, PersistConfig, RemoteTierConfig
from shadow.core.layout import Layout
from shadow.persist import checkpoints, shardfile
from shadow.persist.checkpoints import CheckpointError
from shadow.restore import TierSource, find_checkpoint, open_source, pick
from shadow.restore.memory import MemorySource
from shadow.storage import (
    Codec,
    FsspecStorage,
    LocalStorage,
    Schedule,
    Storage,
    source_tier,
    storage_for,
    tiers_for,
)
from shadow.wire.frames import checksum


@pytest.fixture(params=["path", "file-url", "memory"])
def storage(request, tmp_path) -> Iterator[Storage]:
    if request.param == "path":
        yield storage_for(str(tmp_path / "root[1]"))  # glob characters in the root are taken literally
    elif request.param == "file-url":
        yield storage_for(f"file://{tmp_path}/root")
    else:
        st = storage_for(f"memory://storage-{uuid.uuid4().hex}/root[1]")
        yield st
        if st.exists(st.base):
            st.rm(st.base, recursive=True)


def test_storage_for_is_the_one_decision(tmp_path):
    assert isinstance(storage_for(str(tmp_path)), LocalStorage)
    assert isinstance(storage_for(f"file://{tmp_path}"), LocalStorage)
    assert isinstance(storage_for("memory://x/y"), FsspecStorage)
    st = storage_for(str(tmp_path))
    assert storage_for(st) is st and st.os_path(st.base) == st.base == str(tmp_path)
    assert storage_for("memory://x/y").os_path("/x/y") is None
    # the tier a command-line source is reported under: a URL names the shared copy, a path a local dir
    assert (source_tier(str(tmp_path)), source_tier(f"file://{tmp_path}"), source_tier("s3://b/k")) == (
        "local",
        "remote",
        "remote",
    )


def test_one_harness_for_every_storage(storage):
    d = storage.join("job", "iteration-0000000001")
    storage.write_atomic(storage.join("job", "generation-000001.json"), b"{}", parents=True)
    storage.makedirs(d)
    img = shardfile.ShardImage(shardfile.PAGE * 2)
    img.layout([shardfile.Entry("param", "F32", 10)], {"format": shardfile.FORMAT})
    img.fill("param", np.arange(10, dtype=np.float32))
    path = storage.join("job", "iteration-0000000001", "shard-00000-of-00001.safetensors")
    assert storage.write_image(path, img) == img.size
    storage.write_atomic(storage.join("job", "iteration-0000000001", "manifest.json"), b'{"x": 1}')
    assert storage.cat(path) == bytes(img.buf[: img.size])
    assert checksum(storage.cat(path)) == img.checksum()
    out = bytearray(16)
    assert storage.read_into(path, memoryview(out), offset=8) == 16
    assert bytes(out) == storage.cat(path, 8, 24)
    assert storage.shard_file(d, "shard-00000-of-00001.safetensors", img.size) == path
    with pytest.raises(ValueError, match="manifest says"):
        storage.shard_file(d, "shard-00000-of-00001.safetensors", img.size + 1)
    with pytest.raises(FileNotFoundError):
        storage.shard_file(d, "missing", 1)
    assert storage.exists(path) and storage.isdir(d) and not storage.isdir(path)
    assert storage.info(path)["size"] == img.size
    names = sorted(os.path.basename(e["name"].rstrip("/")) for e in storage.ls(d))
    assert names == ["manifest.json", "shard-00000-of-00001.safetensors"]  # no .tmp left behind
    pattern = "/".join([glob.escape(storage.base), "job", "iteration-*", "manifest.json"])
    assert storage.list(pattern) == [storage.join("job", "iteration-0000000001", "manifest.json")]
    src = storage.join("job", "generation-000001.json")
    storage.move(src, storage.join("job", "moved.json"))
    assert not storage.exists(src) and storage.cat(storage.join("job", "moved.json")) == b"{}"
    storage.rm(d, recursive=True)
    assert not storage.exists(d) and storage.exists(storage.join("job", "moved.json"))


def test_put_file_and_open(storage, tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(b"payload")
    storage.makedirs(storage.join("a"))
    storage.put_file(str(src), storage.join("a", "b.bin"))
    with storage.open(storage.join("a", "b.bin")) as f:
        assert f.read() == b"payload"
    with storage.open(storage.join("a", "c.bin"), "wb") as f:
        f.write(b"xyz")
    assert storage.cat(storage.join("a", "c.bin")) == b"xyz"


def test_free_space_only_where_it_can_be_known(tmp_path):
    assert "MiB free of" in storage_for(str(tmp_path)).free_space(str(tmp_path / "not" / "yet"))
    assert storage_for("memory://x").free_space("/x") == ""


def test_tiers_from_the_typed_config_nearest_first(tmp_path):
    cfg = PersistConfig(
        LocalTierConfig(dir=str(tmp_path), every_n=3, keep=2, compress="zstd", compress_level=5),
        RemoteTierConfig(url="memory://tiers/x", every_s=60.0),
    )
    local, remote = tiers_for(cfg)
    assert (local.name, remote.name) == ("local", "remote")
    assert isinstance(local.storage, LocalStorage) and isinstance(remote.storage, FsspecStorage)
    assert local.schedule == Schedule(3, 0.0, 0, 2) and local.codec == Codec("zstd", 5)
    assert remote.root == "memory://tiers/x" and remote.codec == Codec("none", 1)
    assert tiers_for(PersistConfig()) == []
    s = Schedule(every_n=3, every_tokens=100)
    assert not s.due(2, 0.0, None, (0, 0.0, None)) and s.due(3, 0.0, None, (0, 0.0, None))
    assert s.due(1, 0.0, 150, (0, 0.0, 40)) and not s.due(1, 0.0, 139, (0, 0.0, 40))
    with pytest.raises(ValueError, match=r"compress=.lz4. is not one of \(.none., .zstd.\)"):
        Codec("lz4")


def test_persist_config_travels_as_a_dict_and_is_rebuilt(tmp_path):
    cfg = PersistConfig(LocalTierConfig(dir=str(tmp_path), every_n=5, compress="zstd"), RemoteTierConfig())
    msg = {**cfg.to_dict(), "generation": 2}  # what the coordinator sends in "configure"
    assert PersistConfig.from_dict(msg) == cfg
    assert PersistConfig.from_dict({"local": {"dir": str(tmp_path)}}).local.every_n == 100  # defaults fill in
    with pytest.raises(ValueError, match="unexpected keyword"):
        PersistConfig.from_dict({"local": {"dir": str(tmp_path), "every": 3}})
    with pytest.raises(ValueError, match="needs persist.local.dir"):
        PersistConfig.from_dict({"remote": {"url": "memory://x"}})


LAYOUT = Layout.build([("w", (24,), 0, True)], 1)


def _checkpoint(st: Storage, job: str, iteration: int, damaged: bool = False) -> None:
    img = shardfile.ShardImage(1 << 16)
    n = LAYOUT.total
    img.layout(
        [shardfile.Entry(f, "F32", n) for f in ("param", "exp_avg", "exp_avg_sq")]
        + [
            shardfile.Entry("param_index", "I64", 1),
            shardfile.Entry("steps", "F64", 1),
            shardfile.Entry("has_state", "U8", 1),
            shardfile.Entry("commit.rank0", "U8", 1),
        ],
        {"format": shardfile.FORMAT, "start": "0", "stop": str(n), "iteration": str(iteration)},
    )
    img.fill("param", np.full(n, iteration, dtype=np.float32))
    img.fill("param_index", np.array([0], dtype=np.int64))
    img.fill("steps", np.array([float(iteration)]))
    img.fill("has_state", np.array([1], dtype=np.uint8))
    img.fill("commit.rank0", np.array([7], dtype=np.uint8))
    d = st.join(job, checkpoints.dir_name(iteration))
    st.makedirs(d)
    data = bytes(img.buf[: img.size])
    st.write_atomic(st.join(job, checkpoints.dir_name(iteration), checkpoints.shard_name(0, 1)), data)
    shard = {"index": 0, "start": 0, "stop": n, "file": checkpoints.shard_name(0, 1), "bytes": len(data)}
    shard["checksum"] = f"{checksum(data) ^ int(damaged):016x}"
    m = checkpoints.new_manifest(job, iteration, 1, "local", LAYOUT.to_dict(), LAYOUT.hash, {}, 1, None, None, [shard])
    checkpoints.write_manifest(st, job, iteration, m)


def test_a_tier_source_lists_every_state_and_pick_takes_the_newest_intact(storage):
    for it in (1, 2):
        _checkpoint(storage, "j", it)
    _checkpoint(storage, "j", 3, damaged=True)
    storage.makedirs(storage.join("j", checkpoints.dir_name(4)))  # torn: no manifest
    storage.write_atomic(storage.join("j", checkpoints.dir_name(5), "manifest.json"), b"{", parents=True)
    src = TierSource("local", storage)
    got = {(c.iteration, c.state) for c in src.candidates("j")}
    assert got == {(1, "complete"), (2, "complete"), (3, "complete"), (4, "incomplete"), (5, "unreadable")}
    c, snap = pick(src, "j")
    assert (c.iteration, snap.iteration, snap.tier) == (2, 2, "local")  # 3 fails its checksum: the next older
    assert float(snap.arrays[next(iter(snap.arrays))][0]) == 2.0
    with pytest.raises(CheckpointError, match="fails its checksum"):
        pick(src, "j", iteration=3)
    info, snap = find_checkpoint(storage, "remote", "j", iteration=1)
    assert (info.iteration, snap.tier) == (1, "remote")
    with pytest.raises(CheckpointError, match=r"no complete checkpoint under \S+$"):
        pick(src, "other")  # nothing of that job, and no torn one either (that is j's)
    storage.makedirs(storage.join("k", checkpoints.dir_name(9)))
    with pytest.raises(CheckpointError, match=r"\(1 incomplete, e.g. .*iteration-0000000009\)"):
        pick(src, "k")


def test_open_source_tells_a_cluster_from_a_directory(tmp_path):
    assert isinstance(open_source("tcp://127.0.0.1:1", 1.0), MemorySource)
    src = open_source(f"file://{tmp_path}")
    assert isinstance(src, TierSource) and src.name == "remote" and src.root == f"file://{tmp_path}"
    assert isinstance(src.storage, LocalStorage)


@pytest.mark.parametrize("cache", ["cached", "evicted", "second half evicted"])
def test_a_shard_file_reads_back_the_same_from_the_page_cache_or_past_it(tmp_path, cache, monkeypatch):
    """``read_into`` copies what the page cache holds (``mincore``) and reads the rest with
    ``O_DIRECT``: every mix gives the file's bytes and its checksum."""
    monkeypatch.setattr(shardfile, "READ_PIECE", 1 << 20)
    n = 700_001  # three pieces a tensor, a partial page at the end
    rng = np.random.default_rng(1)
    values = {"param": rng.standard_normal(n).astype(np.float32), "exp_avg": rng.standard_normal(n).astype(np.float32)}
    entries = [shardfile.Entry(name, "F32", n) for name in values]
    img = shardfile.ShardImage(sum(e.nbytes for e in entries) + (1 << 20))
    img.layout(entries, {"format": shardfile.FORMAT, "k": "v"})
    for name, v in values.items():
        img.fill(name, v)
    path = str(tmp_path / "s.safetensors")
    img.write(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        os.pread(fd, size, 0)  # in the page cache
        if cache != "cached":
            os.fsync(fd)
            start = 0 if cache == "evicted" else size // 2 // 4096 * 4096
            os.posix_fadvise(fd, start, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    copied = []  # bytes each aligned piece took from the page cache
    real = shardfile._cached_prefix
    monkeypatch.setattr(shardfile, "_cached_prefix", lambda *a: copied.append(real(*a)) or copied[-1])
    meta, tensors, csum, got_size = shardfile.read_into(
        path, lambda name, dt, count: shardfile.aligned_empty(count, dt)
    )
    assert meta["k"] == "v" and got_size == size and csum == img.checksum()
    body = sum(v.nbytes for v in values.values()) // 4096 * 4096
    if shardfile._LIBC is not None:  # Linux: which way each byte came
        if cache == "cached":
            assert sum(copied) >= body - 2 * 4096, (copied, body)
        elif cache == "evicted":  # (a buffered read's readahead may bring a neighbour's pages in)
            assert sum(copied) < body, (copied, body)
        else:
            assert 0 < sum(copied) < body, (copied, body)
    for name, v in values.items():
        assert np.array_equal(tensors[name], v)
