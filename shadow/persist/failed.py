"""What a failed checkpoint write leaves: the error reported for it (a full disk says so,
with the space left and what to do) and the torn directories (shards without a
manifest) it is cleaned up from."""

from __future__ import annotations

import errno
import os
import posixpath
import shutil

from shadow.persist import fsglob
from shadow.persist.checkpoints import MANIFEST, _fs, checkpoint_dir
from shadow.persist.paths import is_local, local_path

_FULL = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large for the file system",
}


def write_error(exc: BaseException, tier: str, path: str) -> str:
    """How a failed write of ``path`` on ``tier`` is reported (status, logs): a full disk
    or quota says so, with the free space left where it is a local path, and what to do;
    any other error as ``Type: message``."""
    what = _FULL.get(exc.errno) if isinstance(exc, OSError) and exc.errno is not None else None
    if what is None:
        return f"{type(exc).__name__}: {exc}"
    free = ""
    if is_local(path):
        try:
            d = local_path(path)
            while d and not os.path.isdir(d):
                d = os.path.dirname(d)
            usage = shutil.disk_usage(d or ".")
            free = f" ({usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB)"
        except OSError:
            pass
    return (
        f"tier {tier}: {what} writing {path}{free}; free space or lower retention (persist.{tier}.keep); "
        "checkpoints resume once a write fits"
    )


def discard_torn(root: str, job: str, iteration: int, generation: int = 0) -> bool:
    """Delete the directory of a checkpoint of ``iteration`` that failed (some shard's
    write did), so its other shards do not hold on to space a full disk needs; never one
    with a manifest. Returns whether anything was deleted (nothing where the directory
    is not visible from here, e.g. node-local disks of other hosts)."""
    d = checkpoint_dir(root, job, iteration, generation)
    fs, p = _fs(d)
    if not fs.isdir(p) or fs.exists(posixpath.join(p, MANIFEST)):
        return False
    fs.rm(fsglob.literal(fs, p), recursive=True)
    return True
