"""Any exception while reading a checkpoint -- a manifest that parses but holds odd values,
a damaged plain or compressed shard, an error from the file system or a remote store --
makes ``ls``/``verify`` report that checkpoint and a restore fall back to the next
complete one with a warning naming it; the listing itself never crashes."""

from __future__ import annotations

import io
import json
import logging
import os
import struct

import fsspec
import pytest
import xxhash

from shadow.persist import checkpoints, zshard
from shadow.restore import find_checkpoint
from shadow.wire.frames import checksum
from tests.persist.test_checkpoints_closed import _bounded
from tests.persist.test_checkpoints_robust import shadow
from tests.persist.test_persist_units import LAYOUT, _write_checkpoint

SIX = "iteration-0000000006"


class StoreError(Exception):
    """What a remote store's client raises that is no OSError (an SDK's own error type)."""


def _root(tmp_path, kind: str) -> str:
    root = str(tmp_path / "ckpt") if kind == "local" else f"memory://errs-{os.getpid()}-{tmp_path.name}"
    for it in (3, 6):
        _write_checkpoint(root, "j", it, LAYOUT)
    return root


def _six(root: str) -> tuple[object, str]:
    fs, p = fsspec.core.url_to_fs(checkpoints.checkpoint_dir(root, "j", 6))
    return fs, p


def _manifest_text(root: str, text: str) -> None:
    fs, p = _six(root)
    fs.pipe_file(p + "/" + checkpoints.MANIFEST, text.encode())


def _edit_manifest(root: str, edit) -> None:
    fs, p = _six(root)
    m = json.loads(fs.cat_file(p + "/" + checkpoints.MANIFEST))
    edit(m)
    _manifest_text(root, json.dumps(m))  # Infinity / NaN are written as such


def _replace_shard(root: str, data: bytes, name: str | None = None) -> None:
    """Shard 1 of iteration 6 becomes ``data`` (under ``name``), and the manifest records
    its true size and checksum: only reading it can tell it is damaged."""
    fs, p = _six(root)
    old = checkpoints.shard_name(1, 2)
    name = name or old
    if name != old:
        fs.rm_file(p + "/" + old)
    fs.pipe_file(p + "/" + name, data)
    _edit_manifest(root, lambda m: m["shards"][1].update(file=name, bytes=len(data), checksum=f"{checksum(data):016x}"))


def _shard(root: str) -> bytes:
    fs, p = _six(root)
    return fs.cat_file(p + "/" + checkpoints.shard_name(1, 2))


def _plain_header(data: bytes, edit) -> bytes:
    """The shard with its JSON header edited, padded to the same length."""
    (hlen,) = struct.unpack_from("<Q", data)
    header = edit(json.loads(data[8 : 8 + hlen]))
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    assert len(raw) <= hlen
    return data[:8] + raw + b" " * (hlen - len(raw)) + data[8 + hlen :]


def _compressed(data: bytes) -> bytes:
    out = io.BytesIO()
    zshard.encode(data, out, 1, threads=1)
    return out.getvalue()


def _zst_index(data: bytes, edit) -> bytes:
    """A compressed shard whose index is edited, with a valid index checksum and trailer."""
    z = _compressed(data)
    trailer = struct.Struct("<QQ8s")
    ilen, _, magic = trailer.unpack_from(z, len(z) - trailer.size)
    end = len(z) - trailer.size - ilen
    index = edit(json.loads(z[end : end + ilen]))
    raw = json.dumps(index).encode()
    return z[:end] + raw + trailer.pack(len(raw), xxhash.xxh3_64_intdigest(raw), magic)


def _flip(data: bytes, lo: int, hi: int) -> bytes:
    return data[:lo] + bytes(b ^ 0x5A for b in data[lo:hi]) + data[hi:]


def _meta_start(h):
    h["__metadata__"]["start"] = "sixteen"
    return h


def _meta_gone(h):
    del h["__metadata__"]["stop"]
    return h


def _offsets_inf(h):
    name = next(k for k in h if not k.startswith("__"))
    h[name]["data_offsets"] = [0, 1e300]
    return h


DAMAGE = {
    # manifests that parse
    "manifest nested too deep": lambda root: _manifest_text(root, "[" * 200_000 + "]" * 200_000),
    "layout offset is Infinity": lambda root: _edit_manifest(
        root, lambda m: m["layout"]["params"][0].__setitem__(2, float("inf"))
    ),
    "layout shape is a number": lambda root: _edit_manifest(
        root, lambda m: m["layout"]["params"][0].__setitem__(1, 16)
    ),
    "layout num_groups is a list": lambda root: _edit_manifest(root, lambda m: m["layout"].update(num_groups=[])),
    "layout params hold strings": lambda root: _edit_manifest(root, lambda m: m["layout"].update(params="abc")),
    "world covers a rank with no record": lambda root: _edit_manifest(root, lambda m: m.update(world=3)),
    # plain shards
    "shard truncated": lambda root: _replace_shard(root, _shard(root)[: len(_shard(root)) // 2]),
    "shard empty": lambda root: _replace_shard(root, b""),
    "shard meta start not a number": lambda root: _replace_shard(root, _plain_header(_shard(root), _meta_start)),
    "shard meta without stop": lambda root: _replace_shard(root, _plain_header(_shard(root), _meta_gone)),
    "shard header not UTF-8": lambda root: _replace_shard(root, _plain_header(_shard(root), lambda h: b"\xff\xfe{")),
    "shard header nested too deep": lambda root: _replace_shard(
        root, _plain_header(_shard(root), lambda h: b"[" * 1000 + b"]" * 1000)
    ),
    "shard offsets huge": lambda root: _replace_shard(root, _plain_header(_shard(root), _offsets_inf)),
    "shard header length huge": lambda root: _replace_shard(root, b"\xff" * 8 + _shard(root)[8:]),
    # compressed shards
    "zst truncated": lambda root: _replace_shard(
        root, _compressed(_shard(root))[:-100], checkpoints.shard_name(1, 2, "zstd")
    ),
    "zst index image_bytes Infinity": lambda root: _replace_shard(
        root,
        _zst_index(_shard(root), lambda ix: dict(ix, image_bytes=float("inf"))),
        checkpoints.shard_name(1, 2, "zstd"),
    ),
    "zst index head not a pair": lambda root: _replace_shard(
        root, _zst_index(_shard(root), lambda ix: dict(ix, head={"a": 1})), checkpoints.shard_name(1, 2, "zstd")
    ),
    "zst index tensors a list": lambda root: _replace_shard(
        root, _zst_index(_shard(root), lambda ix: dict(ix, tensors=[1, 2])), checkpoints.shard_name(1, 2, "zstd")
    ),
    "zst blob garbage": lambda root: _replace_shard(
        root, _flip(_compressed(_shard(root)), 20, 60), checkpoints.shard_name(1, 2, "zstd")
    ),
}


def _assert_fails_closed(root: str, kind: str, caplog) -> None:
    """Iteration 6 is reported (not listed, or listed with verify/deep-load problems),
    the listing does not crash, and a restore of the newest falls back to 3 with a warning
    naming iteration 6."""
    skipped: list = []
    found = _bounded(lambda: checkpoints.list_checkpoints(root, kind, "j", skipped=skipped))
    assert 3 in [c.iteration for c in found]
    six = [c for c in found if c.iteration == 6]
    if six:
        problems = _bounded(lambda: checkpoints.verify(six[0]))
        if not problems:  # size and checksum hold: only decoding finds the damage
            with pytest.raises(checkpoints.CheckpointError, match="iteration 6"):
                _bounded(lambda: checkpoints.load(six[0]))
    else:
        assert any(SIX in path and why for path, why in skipped), skipped
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shadow.persist"):
        _info, snap = _bounded(lambda: find_checkpoint(root, kind, "j"))
    assert snap.iteration == 3
    assert any(("iteration 6" in r.getMessage() or SIX in r.getMessage()) for r in caplog.records), [
        r.getMessage() for r in caplog.records
    ]


@pytest.mark.parametrize("kind", ["local", "memory"])
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_any_damage_to_a_checkpoint_fails_closed(tmp_path, kind, damage, caplog):
    root = _root(tmp_path, kind)
    DAMAGE[damage](root)
    _assert_fails_closed(root, kind, caplog)


def test_a_manifest_without_a_creation_time_next_to_another_job_lists(tmp_path):
    """``created: null`` passes the manifest check; sorting it against another job's
    float time at the same iteration must not crash the listing."""
    root = str(tmp_path / "ckpt")
    for job in ("j", "k"):
        _write_checkpoint(root, job, 6, LAYOUT)
    path = os.path.join(checkpoints.checkpoint_dir(root, "k", 6), checkpoints.MANIFEST)
    with open(path) as f:
        m = json.load(f)
    m["created"] = None
    with open(path, "w") as f:
        json.dump(m, f)
    assert sorted(c.job for c in checkpoints.list_checkpoints(root)) == ["j", "k"]


@pytest.mark.parametrize("where", ["manifest", "shard"])
def test_a_remote_store_error_fails_closed(tmp_path, where, monkeypatch, caplog):
    """A store client raising its own error type (not an OSError) reading iteration 6."""
    from fsspec.implementations.memory import MemoryFileSystem

    root = _root(tmp_path, "memory")
    real_cat, real_info = MemoryFileSystem.cat_file, MemoryFileSystem.info

    def broken(path: str) -> bool:
        return SIX in path and (path.endswith(checkpoints.MANIFEST) == (where == "manifest"))

    def cat_file(self, path, *a, **kw):
        if broken(path):
            raise StoreError(f"503 Slow Down reading {path}")
        return real_cat(self, path, *a, **kw)

    def info(self, path, *a, **kw):
        if broken(path):
            raise StoreError(f"503 Slow Down reading {path}")
        return real_info(self, path, *a, **kw)

    monkeypatch.setattr(MemoryFileSystem, "cat_file", cat_file)
    monkeypatch.setattr(MemoryFileSystem, "info", info)
    _assert_fails_closed(root, "memory", caplog)
    skipped: list = []
    found = checkpoints.list_checkpoints(root, "memory", "j", skipped=skipped)
    reasons = [why for _p, why in skipped] + [p for c in found if c.iteration == 6 for p in checkpoints.verify(c)]
    assert any("StoreError" in r and "503" in r for r in reasons), reasons


def test_ls_and_verify_report_a_damaged_checkpoint_and_exit_cleanly(tmp_path):
    """The CLI: a manifest whose layout holds Infinity makes ``verify`` report iteration 6
    (exit 1, no traceback); ``ls`` lists both; a manifest nested too deep is unreadable."""
    root = _root(tmp_path, "local")
    DAMAGE["layout offset is Infinity"](root)
    res = shadow("verify", f"source={root}")
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert "iteration 6: CORRUPT" in res.stdout and "iteration 3: OK" in res.stdout, res.stdout
    DAMAGE["manifest nested too deep"](root)
    res = shadow("ls", f"source={root}", "json=true")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    rows = {r["iteration"]: r for r in json.loads(res.stdout)}
    assert rows[3]["state"] == "complete" and rows[6]["state"] == "unreadable" and "RecursionError" in rows[6]["error"]
