"""Compressed shard files: byte planes, the blob and file codecs, and the writer ->
catalog path with each tier compressing or not (no processes)."""

from __future__ import annotations

import io
import os
import time
from types import SimpleNamespace

import fsspec
import numpy as np
import pytest

from shadow.config import PersistConfig
from shadow.config.tuning import Tuning
from shadow.core.layout import Layout
from shadow.persist import checkpoints, planes, retention, shardfile, zshard
from shadow.persist.writer import ShardPersister
from shadow.restore import find_checkpoint
from shadow.wire.frames import Field

pytest.importorskip("zstandard")


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and np.array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8))


def _specials_f32(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal(n) * rng.choice([1e-30, 1e-3, 1.0, 1e30], n)).astype(np.float32)
    bits = a.view(np.uint32)
    special = np.array(
        [
            0x7FC00000,
            0x7FC01234,
            0xFFBFFFFF,
            0x7F800001,  # NaNs with payloads, a signalling NaN
            0x7F800000,
            0xFF800000,  # +-inf
            0x00000001,
            0x807FFFFF,
            0x00400000,  # denormals
            0x80000000,
            0x00000000,
        ],
        dtype=np.uint32,
    )  # -0.0, +0.0
    idx = rng.choice(n, size=min(n, 4 * len(special)), replace=False)
    bits[idx] = np.resize(special, len(idx))
    return a


ARRAYS = {
    "f32_specials": _specials_f32(10_007, 0),
    "f64": np.random.default_rng(1).standard_normal(3_001),
    "f64_specials": np.array([np.nan, -np.nan, np.inf, -np.inf, -0.0, 5e-324, -5e-324, 1.0]),
    "i64": np.random.default_rng(2).integers(-(2**63), 2**63 - 1, 2_049, dtype=np.int64),
    "u8": np.random.default_rng(3).integers(0, 256, 777, dtype=np.uint8),
    "f16": np.random.default_rng(4).standard_normal(33).astype(np.float16),
    "i16": np.arange(-500, 501, dtype=np.int16),  # itemsize 2 kernel
    "c64": (np.arange(7) * (1 + 2j)).astype(np.complex64),  # itemsize 8, no kernel of its own width
    "u8x3": np.arange(30, dtype=np.uint8).view("V3"),  # itemsize 3: the numpy fallback
    "empty_f32": np.zeros(0, dtype=np.float32),
    "one_f32": np.array([np.float32(-0.0)]),
}


@pytest.mark.parametrize("name", sorted(ARRAYS))
def test_split_join_roundtrip_and_layout(name):
    a = ARRAYS[name]
    k = a.itemsize
    p = planes.split(a, k)
    assert p.shape == (k, a.size)
    raw = a.view(np.uint8)
    for j in range(k):  # plane j is byte j of every element
        assert np.array_equal(p[j], raw[j::k])
    out = np.empty_like(a)
    planes.join(p, out)
    assert _same_bytes(out, a)
    assert np.array_equal(planes.join(p), raw)


@pytest.mark.parametrize("name", sorted(ARRAYS))
@pytest.mark.parametrize("level", [1, 3])
def test_blob_roundtrip_is_bit_exact(name, level):
    a = ARRAYS[name]
    blob = planes.encode(a, a.itemsize, level)
    assert planes.peek(blob) == (a.itemsize, a.nbytes)
    assert np.array_equal(planes.decode(blob), a.view(np.uint8))
    into = np.full_like(a, 1) if a.dtype.kind != "V" else np.zeros_like(a)
    planes.decode(blob, into)
    assert _same_bytes(into, a)


def test_planes_compress_float_state():
    a = (np.random.default_rng(5).standard_normal(1 << 16) * 1e-3).astype(np.float32)
    plain = len(__import__("zstandard").ZstdCompressor(level=3).compress(a.tobytes()))
    assert len(planes.encode(a, 4, 3)) < 0.97 * plain  # the exponent plane is what compresses


def test_split_rejects_bad_shapes():
    with pytest.raises(ValueError, match="whole number of 4-byte elements"):
        planes.split(np.zeros(7, dtype=np.uint8), 4)
    with pytest.raises(ValueError, match="shape"):
        planes.split(np.zeros(8, dtype=np.uint8), 4, out=np.empty((4, 3), dtype=np.uint8))
    with pytest.raises(ValueError, match="destination"):
        planes.decode(planes.encode(np.zeros(4, np.float32), 4, 1), np.empty(3, np.float32))


def test_corrupt_or_truncated_blob_raises_a_clear_error():
    a = ARRAYS["f32_specials"]
    blob = planes.encode(a, 4, 3)
    with pytest.raises(planes.CorruptBlobError, match="exp_avg block 2: truncated"):
        planes.decode(blob[:-1], where="exp_avg block 2")
    with pytest.raises(planes.CorruptBlobError, match="trailing bytes"):
        planes.decode(blob + b"\0")
    with pytest.raises(planes.CorruptBlobError, match="truncated"):
        planes.decode(blob[:10])
    with pytest.raises(planes.CorruptBlobError, match="not a byte-plane blob"):
        planes.decode(b"XXXX" + blob[4:])
    bad = bytearray(blob)
    bad[-40] ^= 0x01  # inside the last (exponent) plane's frame
    with pytest.raises(planes.CorruptBlobError, match="plane 3|checksum"):
        planes.decode(bytes(bad))
    # any single flipped byte either fails or still decodes to exactly the original bytes
    # (e.g. a reserved bit of a zstd frame header): never to anything else
    rng = np.random.default_rng(0)
    ok = failed = 0
    for pos in rng.choice(len(blob), 300, replace=False):
        bad = bytearray(blob)
        bad[pos] ^= 1 << int(rng.integers(8))
        try:
            out = planes.decode(bytes(bad))
        except planes.CorruptBlobError:
            failed += 1
            continue
        assert np.array_equal(out, a.view(np.uint8)), f"a flip at byte {pos} decoded to other bytes"
        ok += 1
    assert ok + failed == 300 and failed > 250, (ok, failed)  # nearly every flip is caught


# ---- the compressed shard file ----


def _image(n: int, seed: int, iteration: int = 5, start: int = 0) -> shardfile.ShardImage:
    img = shardfile.ShardImage(1024)
    entries = [shardfile.Entry(k, "F32", n) for k in ("param", "exp_avg", "exp_avg_sq")]
    entries += [
        shardfile.Entry("param_index", "I64", 2),
        shardfile.Entry("steps", "F64", 2),
        shardfile.Entry("has_state", "U8", 2),
        shardfile.Entry("commit.rank0", "U8", 3),
    ]
    img.layout(
        entries, {"format": shardfile.FORMAT, "start": str(start), "stop": str(start + n), "iteration": str(iteration)}
    )
    for i, k in enumerate(("param", "exp_avg", "exp_avg_sq")):
        img.fill(k, _specials_f32(n, seed + i))
    img.fill("param_index", np.array([0, 1], dtype=np.int64))
    img.fill("steps", np.array([3.0, np.nan]))
    img.fill("has_state", np.array([1, 0], dtype=np.uint8))
    img.fill("commit.rank0", np.frombuffer(b"abc", dtype=np.uint8))
    return img


@pytest.mark.parametrize("threads", [1, 3])
def test_shard_file_roundtrip_rebuild_and_corruption(tmp_path, threads):
    img = _image(5_000, 0)
    image = img.buf[: img.size]
    path = str(tmp_path / ("s" + zshard.SUFFIX))
    nbytes, csum = zshard.write(image, path, 3, threads=threads, block_bytes=4096)  # many blocks per tensor
    with open(path, "rb") as f:
        data = f.read()
    assert nbytes == len(data) < img.size and csum == xxh3(data)
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    assert zshard.image_bytes(data) == img.size
    meta, got = zshard.decode(data, threads=threads)
    _, want = shardfile.parse(bytes(image))
    assert meta["iteration"] == "5" and set(got) == set(want)
    assert all(_same_bytes(got[k], want[k]) for k in want)
    out = io.BytesIO()  # the plain file back, byte for byte (safetensors-readable)
    assert zshard.decode_to(data, out) == (img.size, img.checksum())
    assert out.getvalue() == bytes(image)

    with pytest.raises(zshard.CorruptBlobError, match="no end marker"):
        zshard.decode(data[:-100], where=path)
    with pytest.raises(zshard.CorruptBlobError, match=r"s\.shard\.zst.*truncated"):
        zshard.decode(data[:20], where=path)
    bad = bytearray(data)
    bad[len(data) // 2] ^= 0xFF
    with pytest.raises(zshard.CorruptBlobError, match=r"s\.shard\.zst: tensor '\w+' block \d+"):
        zshard.decode(bytes(bad), where=path)
    with pytest.raises(zshard.CorruptBlobError):
        zshard.decode_to(bytes(bad), io.BytesIO())


def test_shard_file_any_flip_fails_or_decodes_exactly():
    img = _image(300, 7)
    buf = io.BytesIO()
    zshard.encode(img.buf[: img.size], buf, 1, block_bytes=512)
    data = buf.getvalue()
    _, want = shardfile.parse(bytes(img.buf[: img.size]))
    rng = np.random.default_rng(1)
    ok = failed = 0
    for pos in rng.choice(len(data), 400, replace=False):
        bad = bytearray(data)
        bad[pos] ^= 1 << int(rng.integers(8))
        try:
            _, got = zshard.decode(bytes(bad))
        except ValueError:
            failed += 1
            continue
        assert all(_same_bytes(got[k], want[k]) for k in want), f"a flip at byte {pos} decoded to other bytes"
        ok += 1
    assert ok + failed == 400 and failed > 350, (ok, failed)  # nearly every flip is caught


def test_encoder_refuses_a_non_shard_image():
    with pytest.raises(ValueError, match="cannot compress"):
        zshard.encode(np.zeros(64, dtype=np.uint8), io.BytesIO(), 3)


def xxh3(data: bytes) -> int:
    import xxhash

    return xxhash.xxh3_64_intdigest(data)


# ---- writer -> manifest -> catalog, per tier ----

LAYOUT = Layout.build([("a", (3, 1000), 0, True), ("b", (5000,), 0, True), ("c", (7,), 0, True)], 1)
RANGES = [(0, 3000), (3000, LAYOUT.total)]


def _state(lo: int, hi: int, seed: int) -> SimpleNamespace:
    in_range = np.array([p.offset < hi and p.offset + p.numel > lo for p in LAYOUT.params])
    arrays = {f: _specials_f32(hi - lo, seed + i) for i, f in enumerate((Field.PARAM, Field.EXP_AVG, Field.EXP_AVG_SQ))}
    return SimpleNamespace(
        size=hi - lo,
        start=lo,
        stop=hi,
        layout=LAYOUT,
        in_range=in_range,
        steps=np.arange(len(LAYOUT.params), dtype=np.float64) + 1,
        has_state=np.ones(len(LAYOUT.params), dtype=bool),
        fields=lambda: (Field.PARAM, Field.EXP_AVG, Field.EXP_AVG_SQ),
        array=arrays.__getitem__,
    )


def _wait(p: ShardPersister, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = p.results()
        if got:
            assert len(got) == 1
            return got[0].fields()
        time.sleep(0.01)
    raise TimeoutError(f"no persistence report within {timeout} s")


def _commit(root: str, tier: str, reports: list[dict], iteration: int) -> None:
    shards = [
        {
            "index": r["shard"],
            "start": r["start"],
            "stop": r["stop"],
            "file": r["file"],
            "bytes": r["bytes"],
            "checksum": r["checksum"],
            "blob_ranks": r["blob_ranks"],
        }
        for r in reports
    ]
    m = checkpoints.new_manifest(
        "j", iteration, 1, tier, LAYOUT.to_dict(), LAYOUT.hash, {"kind": "adam"}, 1, None, None, shards
    )
    checkpoints.write_manifest(root, "j", iteration, m)


@pytest.mark.parametrize("local,remote", [("zstd", "none"), ("none", "zstd"), ("zstd", "zstd")])
def test_writer_to_catalog_per_tier(tmp_path, local, remote):
    local_root, remote_root = str(tmp_path / "local"), f"memory://compress-{local}-{remote}-{os.getpid()}"
    persist = {
        "local": {"dir": local_root, "compress": local, "compress_level": 1},
        "remote": {"url": remote_root, "compress": remote, "compress_level": 3},
    }
    states = [_state(lo, hi, 10 * i) for i, (lo, hi) in enumerate(RANGES)]
    tuning = Tuning.load(compress_block_bytes=4096, persist_buffers=1)
    ps = [ShardPersister(PersistConfig.from_dict(persist), "j", i, 2, st, tuning=tuning) for i, st in enumerate(states)]
    for p in ps:
        p.snapshot(7, 1, 1, {0: b"commit-record"}, {"tokens": None})
    reports = [_wait(p) for p in ps]
    assert all(r["ok"] for r in reports), reports
    _commit(local_root, "local", reports, 7)
    for p, r in zip(ps, reports, strict=True):
        p.upload(7, 1, r["bytes"], r["checksum"])
    uploads = [_wait(p) for p in ps]
    assert all(r["ok"] and r["tier"] == "remote" for r in uploads), uploads
    for p in ps:  # their threads end here, not whenever they are collected
        assert p.close()
    _commit(remote_root, "remote", uploads, 7)
    suffix = {"zstd": zshard.SUFFIX, "none": ".safetensors"}
    for root, tier, reps, codec in ((local_root, "local", reports, local), (remote_root, "remote", uploads, remote)):
        assert all(r["file"].endswith(suffix[codec]) and r["compress"] == codec for r in reps)
        assert all(r["raw_bytes"] >= r["bytes"] for r in reps)
        info, snap = find_checkpoint(root, tier)
        assert checkpoints.verify(info) == []
        for f in (Field.PARAM, Field.EXP_AVG, Field.EXP_AVG_SQ):
            want = np.concatenate([st.array(f) for st in states])
            assert _same_bytes(snap.arrays[f], want), (tier, f)
        assert np.array_equal(snap.steps, states[0].steps) and snap.blobs == {0: b"commit-record"}

    # a flipped byte on storage: verify names the shard, a restore refuses it
    info = checkpoints.list_checkpoints(local_root)[0]
    path = os.path.join(info.path, reports[1]["file"])
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    problems = checkpoints.verify(info)
    assert len(problems) == 1 and "shard 1" in problems[0] and "checksum" in problems[0]
    with pytest.raises(checkpoints.CheckpointError, match="shard 1"):
        checkpoints.load(info)
    if local == "zstd":  # without the file checksum, the blocks' own checksums still refuse it
        with pytest.raises(checkpoints.CheckpointError, match=r"shard 1 .*tensor '\w+' block \d+"):
            checkpoints.load(info, check=False)
        # a manifest that vouches for the damaged file (a writer bug): only `shadow verify deep=true` sees it
        from shadow.cli._commands import cmd_verify
        from shadow.config import VerifyConfig
        from shadow.wire.frames import checksum

        with open(path, "rb") as f:
            damaged = f.read()
        m = dict(info.manifest)
        m["shards"] = [dict(sh, checksum=f"{checksum(damaged):016x}") if sh["index"] == 1 else sh for sh in m["shards"]]
        checkpoints.write_manifest(local_root, "j", 7, m)
        assert cmd_verify(VerifyConfig(source=local_root)) == 0
        assert cmd_verify(VerifyConfig(source=local_root, deep=True)) == 1
    fs, p = fsspec.core.url_to_fs(remote_root)
    fs.rm(p, recursive=True)


def test_retention_removes_compressed_checkpoints(tmp_path):
    root = str(tmp_path)
    persist = {"local": {"dir": root, "compress": "zstd", "compress_level": 1}, "remote": {"url": ""}}
    st = _state(0, LAYOUT.total, 0)
    p = ShardPersister(PersistConfig.from_dict(persist), "j", 0, 1, st)
    for it in (1, 2, 3):
        p.snapshot(it, 1, 1, {0: b"x"}, None)
        rep = _wait(p)
        m = checkpoints.new_manifest(
            "j",
            it,
            1,
            "local",
            LAYOUT.to_dict(),
            LAYOUT.hash,
            {"kind": "adam"},
            1,
            None,
            None,
            [
                {
                    "index": 0,
                    "start": 0,
                    "stop": LAYOUT.total,
                    "file": rep["file"],
                    "bytes": rep["bytes"],
                    "checksum": rep["checksum"],
                    "blob_ranks": [0],
                }
            ],
        )
        checkpoints.write_manifest(root, "j", it, m)
    assert len(retention.retain(root, "j", 1)) == 2
    assert [c.iteration for c in checkpoints.list_checkpoints(root)] == [3]
    assert checkpoints.list_checkpoints(root)[0].bytes == rep["bytes"] < rep["raw_bytes"]
