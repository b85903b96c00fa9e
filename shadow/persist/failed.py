"""What a failed checkpoint write leaves: the error reported for it (a full disk says so,
with the space left and what to do) and the torn directories (shards without a
manifest) it is cleaned up from."""

from __future__ import annotations

import errno
import posixpath

from shadow.persist.checkpoints import MANIFEST, dir_name
from shadow.storage import Storage, storage_for

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
    try:  # the free space where it can be known (a local disk)
        st = storage_for(path)
        free = st.free_space(st.base)
    except Exception:  # a remote back end that cannot even be loaded: the error says enough
        free = ""
    return (
        f"tier {tier}: {what} writing {path}{free}; free space or lower retention (persist.{tier}.keep); "
        "checkpoints resume once a write fits"
    )


def discard_torn(root: str | Storage, job: str, iteration: int, generation: int = 0) -> bool:
    """Delete the directory of a checkpoint of ``iteration`` that failed (some shard's
    write did), so its other shards do not hold on to space a full disk needs; never one
    with a manifest. Returns whether anything was deleted (nothing where the directory
    is not visible from here, e.g. node-local disks of other hosts)."""
    st = storage_for(root)
    d = st.join(job, dir_name(iteration, generation))
    if not st.isdir(d) or st.exists(posixpath.join(d, MANIFEST)):
        return False
    st.rm(d, recursive=True)
    return True
