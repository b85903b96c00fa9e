"""The catalog fails closed: a manifest can only name its own shard files, by their
expected names, as regular files inside the checkpoint directory; reads never go past
the recorded size; shard ranges must tile the flat space exactly. Anything else makes
``verify`` report the checkpoint and a restore fall back to the next complete one."""

from __future__ import annotations

import json
import os
import threading

import pytest

from shadow.persist import checkpoints
from shadow.restore import find_checkpoint
from tests.persist.test_persist_units import LAYOUT, _image, _write_checkpoint


def _setup(tmp_path) -> tuple[str, str]:
    root = str(tmp_path / "ckpt")
    for it in (3, 6):
        _write_checkpoint(root, "j", it, LAYOUT)
    return root, checkpoints.checkpoint_dir(root, "j", 6)


def _edit_manifest(d: str, edit) -> None:
    path = os.path.join(d, checkpoints.MANIFEST)
    m = json.load(open(path))
    edit(m)
    json.dump(m, open(path, "w"))


def _bounded(fn, seconds: float = 20.0):
    """Run ``fn`` on a thread; fail (instead of hanging the suite) if it does not return."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(seconds)
    assert not th.is_alive(), f"{fn} hung"
    if "error" in out:
        raise out["error"]
    return out["value"]


def _expect_fallback(root: str, why: str) -> None:
    """Iteration 6 is reported by verify (or not listed at all) and restores take 3."""
    info, snap = _bounded(lambda: find_checkpoint(root, "local", "j"))
    assert snap.iteration == 3
    six = [c for c in checkpoints.list_checkpoints(root, job="j") if c.iteration == 6]
    if six:
        problems = _bounded(lambda: checkpoints.verify(six[0]))
        assert problems and any(why in p for p in problems), problems


def test_a_shard_file_must_have_its_own_name(tmp_path):
    root, d = _setup(tmp_path)
    # a plain basename of this directory, but shard 0's: shard 1's range would be read from it
    _edit_manifest(d, lambda m: m["shards"][1].update(file=checkpoints.shard_name(0, 2)))
    skipped: list = []
    assert [c.iteration for c in checkpoints.list_checkpoints(root, job="j", skipped=skipped)] == [3]
    assert skipped and "shard-00001-of-00002" in skipped[0][1]
    _expect_fallback(root, "")


def test_a_fifo_in_place_of_a_shard_never_hangs(tmp_path):
    root, d = _setup(tmp_path)
    path = os.path.join(d, checkpoints.shard_name(1, 2))
    os.unlink(path)
    os.mkfifo(path)
    _expect_fallback(root, "not a regular file")


@pytest.mark.parametrize("target", ["/dev/zero", "outside"])
def test_a_link_out_of_the_checkpoint_is_not_followed(tmp_path, target):
    root, d = _setup(tmp_path)
    path = os.path.join(d, checkpoints.shard_name(1, 2))
    if target == "outside":  # a regular file elsewhere, with the very bytes the manifest expects
        target = str(tmp_path / "elsewhere.bin")
        os.replace(path, target)
    else:
        os.unlink(path)
    os.symlink(target, path)
    _expect_fallback(root, "")


def test_reads_never_go_past_the_recorded_size(tmp_path):
    root, d = _setup(tmp_path)
    path = os.path.join(d, checkpoints.shard_name(1, 2))
    with open(path, "ab") as f:
        f.write(b"\0" * (1 << 20))
    _expect_fallback(root, "bytes")


def test_shard_ranges_must_tile_the_flat_space(tmp_path):
    """Two entries whose lengths add up to the total but overlap: [0, 16) and [0, 20) of 36.
    Both files are genuine and pass their checksums; the elements [20, 36) would be
    uninitialised memory."""
    from shadow.wire.frames import checksum

    root, d = _setup(tmp_path)
    img = _image(0, 20, 6, 99)
    data = bytes(memoryview(img.buf)[: img.size])
    with open(os.path.join(d, checkpoints.shard_name(1, 2)), "wb") as f:
        f.write(data)
    _edit_manifest(
        d, lambda m: m["shards"][1].update(start=0, stop=20, bytes=len(data), checksum=f"{checksum(data):016x}")
    )
    _expect_fallback(root, "tile")
